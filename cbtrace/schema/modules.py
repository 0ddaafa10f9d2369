"""One dataclass per record: a captured module call, and what replay adds to it.

``modules.parquet`` holds one row per ``ModuleRecord``; capture fills the first block,
replay the second, attribution (``profile``) the third. Units are in the field names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ModuleRecord:
    # --- capture ---
    fqn: str                    # "transformer.h.3.attn", as in named_modules(); "" is the root
    call_index: int             # n-th call of this module (fqn) in the step
    call_id: int                # global order of entry into the module in the step (0 = first)
    parent_call_id: int         # call_id of the enclosing captured call, -1 for a root
    parent_fqn: str | None      # fqn of that enclosing call, None for a root
    depth: int                  # 0 for a root call, parent's depth + 1 otherwise
    module_type: str            # class name, e.g. "Linear"
    module_class: str           # "torch.nn.modules.linear.Linear"
    param_bytes: int            # bytes of this module's parameters (recursive)
    buffer_bytes: int           # bytes of its buffers (recursive)
    input_bytes: int            # bytes of the tensors among its inputs (unique storage spans)
    input_shapes: str           # JSON list of the input tensors' shapes, in argument order
    input_meta: str             # JSON: per input tensor shape, dtype, stride, device, requires_grad
    output_meta: str            # JSON: the same for output tensors
    training: bool              # module.training at call time
    grad_enabled: bool          # torch.is_grad_enabled() at call time
    autocast_dtype: str | None  # e.g. "bfloat16" when the call ran under autocast, else None
    inputs_ref: str             # JSON tree of the call's (args, kwargs), tensors by reference
    synthesized: bool = False   # True if some inputs were stored as metadata only
    capture_error: str | None = None  # message if the module raised during capture
    insitu_host_ms: float | None = None  # CPU runs: host wall time of this call in an unprofiled
                                         # repeat of the captured step (the CPU in-situ time)

    # --- replay ---
    status: str | None = None          # ok | skipped | error
    status_reason: str | None = None
    timer: str | None = None           # graph | events | cpu (the backend that produced isolated_ms)
    timer_fallback: str | None = None  # why the preferred timer was not used
    timer_notes: str | None = None     # how it timed: "K=20" calls per graph, spin, "cold", ...
    isolated_ms: float | None = None   # median of the timed runs
    isolated_ms_p10: float | None = None
    isolated_ms_p90: float | None = None
    runs: int | None = None            # number of timed calls
    kernel_count: int | None = None    # device kernels (incl. memcpy/memset) per call
    device_ms: float | None = None     # sum of device activity per call, from the profiler
    wall_ms: float | None = None       # host wall time per call, from the profiler
    launch_overhead_ms: float | None = None  # wall_ms - device_ms, floored at 0
    host_ms: float | None = None       # host time to issue one call without a sync (GPU only)
    flops: float | None = None         # dense-convention FLOPs (used for mfu)
    flops_executed: float | None = None  # FLOPs actually executed (causal attention halves; hfu)
    bytes: float | None = None         # bytes moved: unique inputs + outputs + params touched
    unknown_ops: int | None = None     # aten ops with no FLOP/byte formula
    compute_dtype: str | None = None   # dtype whose peak was used for mfu
    mfu: float | None = None           # flops / time / datasheet peak
    hfu: float | None = None           # flops_executed / time / datasheet peak
    mbu: float | None = None           # bytes / time / datasheet bandwidth
    mfu_calibrated: float | None = None  # against the measured (calibrated) peak, if any
    mbu_calibrated: float | None = None
    bound: str | None = None           # compute | memory | launch
    peak_mem_bytes: int | None = None  # allocated-memory delta at peak (GPU) / estimate (CPU)
    peak_mem_source: str | None = None  # "cuda_allocator" or "estimate"
    residual_ms: float | None = None   # parent isolated - sum(children isolated)
    aggregated: bool = False           # row filled from children (parent skipped)
    replay_wall_s: float | None = None  # host wall time spent replaying this call (all runs)

    # --- attribution join (cbtrace profile) ---
    insitu_ms: float | None = None     # in-situ time of this call in the capture trace
    error_pct: float | None = None     # 100 * (isolated / in-situ - 1)

    @property
    def key(self) -> tuple[str, int]:
        return (self.fqn, self.call_index)



COPY_FAILED = "copying its inputs failed"  # capture_error prefix: the stored inputs are zeros


def capture_fields() -> tuple[str, ...]:
    """The fields capture fills (everything before ``status``); replay starts from these."""
    names = field_names()
    return tuple(names[:names.index("status")])


def required_fields() -> tuple[str, ...]:
    """Fields without a default: a modules table lacking one is not a capture."""
    return tuple(f.name for f in dataclasses.fields(ModuleRecord)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def field_names() -> list[str]:
    """All column names of modules.parquet, in order."""
    return [f.name for f in dataclasses.fields(ModuleRecord)]


def records_to_frame(records):
    """ModuleRecords -> pandas DataFrame with every column (pandas imported lazily)."""
    import pandas as pd

    rows = [dataclasses.asdict(r) for r in records]
    return pd.DataFrame(rows, columns=field_names())


def records_to_table(records):
    """ModuleRecords -> pyarrow Table with every column, without pandas (capture's writer)."""
    import pyarrow as pa

    names = field_names()
    return pa.Table.from_pydict({n: [getattr(r, n) for r in records] for n in names})


def frame_to_records(df) -> list[ModuleRecord]:
    """pandas DataFrame -> ModuleRecords; unknown columns are ignored, NaN becomes None."""
    import math

    names = set(field_names())
    out = []
    for row in df.to_dict("records"):
        kw = {}
        for k, v in row.items():
            if k not in names:
                continue
            if isinstance(v, float) and math.isnan(v):
                v = None
            kw[k] = v
        out.append(ModuleRecord(**kw))
    return out
