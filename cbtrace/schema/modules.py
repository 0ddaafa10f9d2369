"""``modules.parquet``: one row per captured module call, its columns declared once.

Each column is a field of ``ModuleRecord`` declared with ``column(stage, unit, doc)``: its name
and type (the annotation: str, int, float, bool, optional or not), its unit, and the stage
that produces it. Stages, in pipeline order:

- ``capture``: the call tree and inputs (``cbtrace.capture``), every row at once;
- ``host_insitu``: CPU runs, each call's host time in an unprofiled repeat of the step;
- ``replay``: the isolated figures (``cbtrace.replay``);
- ``insitu``: the in-situ time from the plain step's trace (else the capture trace), and the
  isolation error.

A stage returns its columns; ``cbtrace.rundir.writer`` merges them and refuses a column that
is not declared for that stage.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

CAPTURE, HOST_INSITU, REPLAY, INSITU = "capture", "host_insitu", "replay", "insitu"
STAGES = (CAPTURE, HOST_INSITU, REPLAY, INSITU)
# Writing a stage clears the stages computed from it (a new replay makes the old error stale).
DERIVED = {REPLAY: (INSITU,), HOST_INSITU: (INSITU,)}

_MISSING = dataclasses.MISSING


def column(stage: str, unit: str | None = None, doc: str = "", default=_MISSING):
    """A ModuleRecord field: a modules.parquet column produced by ``stage``."""
    assert stage in STAGES, stage
    return dataclasses.field(default=default, metadata={"stage": stage, "unit": unit, "doc": doc})


@dataclass
class ModuleRecord:
    fqn: str = column(CAPTURE, doc='"transformer.h.3.attn", as in named_modules(); "" is the root')
    call_index: int = column(CAPTURE, doc="n-th call of this module (fqn) in the step")
    call_id: int = column(CAPTURE, doc="global order of entry into the module (0 = first)")
    parent_call_id: int = column(CAPTURE, doc="call_id of the enclosing captured call, -1 for a root")
    parent_fqn: str | None = column(CAPTURE, doc="fqn of that enclosing call, None for a root")
    depth: int = column(CAPTURE, doc="0 for a root call, parent's depth + 1 otherwise")
    module_type: str = column(CAPTURE, doc='class name, e.g. "Linear"')
    module_class: str = column(CAPTURE, doc='"torch.nn.modules.linear.Linear"')
    param_bytes: int = column(CAPTURE, "bytes", "this module's parameters (recursive)")
    buffer_bytes: int = column(CAPTURE, "bytes", "its buffers (recursive)")
    input_bytes: int = column(CAPTURE, "bytes", "tensors among its inputs (unique storage spans)")
    input_shapes: str = column(CAPTURE, "JSON", "the input tensors' shapes, in argument order")
    input_meta: str = column(CAPTURE, "JSON", "per input tensor: shape, dtype, stride, device, "
                                              "requires_grad")
    output_meta: str = column(CAPTURE, "JSON", "the same for output tensors")
    training: bool = column(CAPTURE, doc="module.training at call time")
    grad_enabled: bool = column(CAPTURE, doc="torch.is_grad_enabled() at call time")
    autocast_dtype: str | None = column(CAPTURE, doc='"bfloat16" when the call ran under autocast')
    inputs_ref: str = column(CAPTURE, "JSON", "tree of the call's (args, kwargs), tensors by "
                                              "reference to inputs/ (cbtrace.store.snapshot)")
    synthesized: bool = column(CAPTURE, doc="some inputs stored as statistics only", default=False)
    capture_error: str | None = column(CAPTURE, doc="message if the module raised during capture",
                                       default=None)
    grads_ref: str | None = column(CAPTURE, "JSON", "--step train: the gradients that reached the "
                                                    "call's outputs in the backward, stored like "
                                                    "its inputs", default=None)
    recomputed: bool = column(CAPTURE, doc="activation checkpointing recomputed the call in the "
                                           "backward (not a call of its own)", default=False)
    boundary: str | None = column(CAPTURE, doc="why the call was recorded at its boundary, its "
                                               "submodules not hooked (TorchScript, a fast path "
                                               "hooks would switch off)", default=None)

    step_compiled: bool = column(CAPTURE, doc="the call ran under torch.compile in the step (the "
                                              "model, or a block of it, compiled)", default=False)

    insitu_host_ms: float | None = column(
        HOST_INSITU, "ms", "host time of the call in unprofiled repeats of the step's forward "
        "(CPU: its in-situ time; GPU: its host issue time, compared with a call timed back to "
        "back)", default=None)
    insitu_step_ms: float | None = column(
        HOST_INSITU, "ms", "the root of a step captured from a spec: its forward run as "
        "the user runs it, in a loop (no hooks, no profiler, compiled parts compiled), CUDA events around "
        "it on a GPU, wall time on a CPU", default=None)
    step_clock_mhz: float | None = column(
        HOST_INSITU, "MHz", "the SM clock right after the plain step (a GPU step captured from a "
        "spec; the same on every row)", default=None)

    status: str | None = column(REPLAY, doc="ok | skipped | error", default=None)
    status_reason: str | None = column(REPLAY, doc="why skipped or failed", default=None)
    timer: str | None = column(REPLAY, doc="the timer behind isolated_ms (graph | stream | events "
                                           "| cpu | a plugin's | aggregated)", default=None)
    timer_fallback: str | None = column(REPLAY, doc="why timers before it were not used",
                                        default=None)
    timer_notes: str | None = column(REPLAY, doc='how it timed: "K=20", spin, "cold", ...',
                                     default=None)
    timing_copied_from: str | None = column(REPLAY, doc="--reuse-timing: the fqn whose timing "
                                            "this call copied (\"\" for the root), else None",
                                            default=None)
    isolated_ms: float | None = column(REPLAY, "ms", "median of the timed runs (a step_compiled "
                                       "row: of the call compiled, as the step ran it)",
                                       default=None)
    eager_ms: float | None = column(REPLAY, "ms", "a step_compiled row timed compiled: the same "
                                    "call run eagerly, timed alike (else None)", default=None)
    isolated_ms_p10: float | None = column(REPLAY, "ms", "10th percentile", default=None)
    isolated_ms_p90: float | None = column(REPLAY, "ms", "90th percentile", default=None)
    runs: int | None = column(REPLAY, doc="number of timed samples", default=None)
    timed_ms: float | None = column(REPLAY, "ms", "the timed work over all runs: the sum of the "
                                    "samples times the calls each covers (K per graph replay)",
                                    default=None)
    noisy: bool = column(REPLAY, doc="the samples say the machine was busy (waits off the CPU, "
                                     "a wide spread, or a child slower than its parent)",
                         default=False)
    kernel_count: int | None = column(REPLAY, doc="device kernels (incl. memcpy/memset) per call",
                                      default=None)
    device_ms: float | None = column(REPLAY, "ms", "the time the device was busy per call, from "
                                     "the profiler (kernels overlapping on several streams count "
                                     "once)", default=None)
    timed_clock_mhz: float | None = column(REPLAY, "MHz", "the SM clock right after the call was "
                                           "timed (GPU)", default=None)
    wall_ms: float | None = column(REPLAY, "ms", "synchronised host wall time per call",
                                   default=None)
    launch_overhead_ms: float | None = column(REPLAY, "ms", "wall_ms - device_ms, floored at 0",
                                              default=None)
    host_ms: float | None = column(REPLAY, "ms", "host time to issue one call, no sync (GPU)",
                                   default=None)
    flops: float | None = column(REPLAY, "FLOP", "dense convention (for mfu)", default=None)
    flops_executed: float | None = column(REPLAY, "FLOP", "actually executed (causal attention "
                                                          "halves; for hfu)", default=None)
    bytes: float | None = column(REPLAY, "bytes", "unique inputs + outputs + parameters touched",
                                 default=None)
    unknown_ops: int | None = column(REPLAY, doc="aten ops with no FLOP/byte formula",
                                     default=None)
    compute_dtype: str | None = column(REPLAY, doc="dtype whose peak mfu/mbu use", default=None)
    mfu: float | None = column(REPLAY, "fraction", "flops / time / datasheet peak", default=None)
    hfu: float | None = column(REPLAY, "fraction", "flops_executed / time / datasheet peak",
                               default=None)
    mbu: float | None = column(REPLAY, "fraction", "bytes / time / datasheet bandwidth",
                               default=None)
    mfu_calibrated: float | None = column(REPLAY, "fraction", "against the calibrated peak",
                                          default=None)
    mbu_calibrated: float | None = column(REPLAY, "fraction", "against the calibrated bandwidth",
                                          default=None)
    bound: str | None = column(REPLAY, doc="compute | memory | launch | host (its host's issue "
                                           "time sets the pace)", default=None)
    host_syncs: int | None = column(REPLAY, doc="host synchronisations in one call (GPU: the "
                                                "device waited for, e.g. .item(), nonzero)",
                                    default=None)
    nonfinite_outputs: bool = column(REPLAY, doc="the replayed call's outputs hold NaN or Inf",
                                     default=False)
    figures_suspect: bool = column(REPLAY, doc="mfu, hfu or mbu above 1: a bug in what they "
                                               "divide, flagged and never capped", default=False)
    peak_mem_bytes: int | None = column(REPLAY, "bytes", "allocated-memory delta at peak (GPU) "
                                                         "or an estimate (CPU)", default=None)
    peak_mem_source: str | None = column(REPLAY, doc='"cuda_allocator" or "estimate"',
                                         default=None)
    residual_ms: float | None = column(REPLAY, "ms", "parent isolated - sum(children isolated)",
                                       default=None)
    aggregated: bool = column(REPLAY, doc="row filled from its children (the parent was skipped)",
                              default=False)
    # --modes: the same call compiled, and from a CUDA graph; the best against eager
    compile_ms: float | None = column(REPLAY, "ms", "the call's module under torch.compile, timed "
                                                    "as isolated_ms", default=None)
    compile_status: str | None = column(REPLAY, doc="ok, or why the compiled call was not timed",
                                        default=None)
    compile_s: float | None = column(REPLAY, "s", "compiling it (never inside the timed runs)",
                                     default=None)
    compile_graphs: int | None = column(REPLAY, doc="graphs compiled for it (more than 1: graph "
                                                    "breaks or recompiles)", default=None)
    compile_host_ms: float | None = column(REPLAY, "ms", "host time to issue the compiled call "
                                                         "(guards and launches; None on CPU)",
                                           default=None)
    compile_host_steady_ms: float | None = column(
        REPLAY, "ms", "with cold_host_issue: the compiled call's issue time back to back, what "
                      "compile_host_ms is without it (A/B of the two in one run)", default=None)
    cudagraph_ms: float | None = column(REPLAY, "ms", "the eager call replayed from a one-call "
                                                      "CUDA graph, launch included", default=None)
    cudagraph_status: str | None = column(REPLAY, doc="ok, or why it was not timed", default=None)
    eager_step_ms: float | None = column(REPLAY, "ms", "what the eager call costs a step: the "
                                                       "larger of isolated_ms and host_ms",
                                         default=None)
    best_mode: str | None = column(REPLAY, doc="eager | compile | cudagraph: the fastest",
                                   default=None)
    speedup: float | None = column(REPLAY, "x", "eager_step_ms / the best mode's ms", default=None)
    opportunity_ms: float | None = column(REPLAY, "ms", "time the step saves with the best mode "
                                                        "(each captured call once per step)",
                                          default=None)
    # --backward: the call's backward on its output gradients
    bwd_status: str | None = column(REPLAY, doc="ok | error | skipped: the backward", default=None)
    bwd_status_reason: str | None = column(REPLAY, doc="why it was not ok", default=None)
    grad_source: str | None = column(REPLAY, doc="captured | random: the output gradients used",
                                     default=None)
    bwd_timer: str | None = column(REPLAY, doc="the timer behind bwd_ms", default=None)
    bwd_timer_fallback: str | None = column(REPLAY, doc="why timers before bwd_timer were not "
                                                        "used", default=None)
    bwd_timer_notes: str | None = column(REPLAY, doc="how it timed", default=None)
    bwd_ms: float | None = column(REPLAY, "ms", "median of the timed backward runs", default=None)
    bwd_ms_p10: float | None = column(REPLAY, "ms", "10th percentile", default=None)
    bwd_ms_p90: float | None = column(REPLAY, "ms", "90th percentile", default=None)
    bwd_flops: float | None = column(REPLAY, "FLOP", "counted as they run: grad-input and "
                                                     "grad-weight", default=None)
    bwd_bytes: float | None = column(REPLAY, "bytes", "moved by the backward", default=None)
    bwd_compute_dtype: str | None = column(REPLAY, doc="dtype whose peak bwd_mfu/mbu use",
                                           default=None)
    bwd_kernel_count: int | None = column(REPLAY, doc="the backward's own kernels, profiled as "
                                                      "timed (after its untimed forward)",
                                          default=None)
    bwd_device_ms: float | None = column(REPLAY, "ms", "the time the device was busy with them",
                                         default=None)
    bwd_grad_sums: int | None = column(REPLAY, doc="gradient sums the autograd engine makes in "
                                                   "the call's backward (a tensor the call uses "
                                                   "n times: n - 1), its children's included",
                                       default=None)
    bwd_mfu: float | None = column(REPLAY, "fraction", "bwd_flops / bwd time / peak", default=None)
    bwd_mbu: float | None = column(REPLAY, "fraction", "bwd_bytes / bwd time / bandwidth",
                                   default=None)
    # memory per call (the split torch's MemTracker reports), on the real inputs
    bwd_peak_mem_bytes: int | None = column(REPLAY, "bytes", "allocated-memory delta at the "
                                                             "backward's peak", default=None)
    saved_bytes: int | None = column(REPLAY, "bytes", "tensors the forward saved for backward "
                                                      "(saved_tensors_hooks)", default=None)
    grad_bytes: int | None = column(REPLAY, "bytes",
                                    "gradients of the parameters the backward reaches",
                                    default=None)
    replay_wall_s: float | None = column(REPLAY, "s", "host wall time spent replaying this call",
                                         default=None)
    rank: int | None = column(REPLAY, doc="the rank that replayed it (sharded replay; else 0)",
                              default=None)

    insitu_ms: float | None = column(INSITU, "ms", "the call's own time in the step (on a GPU: "
                                     "its kernels' device-busy time in the plain step, else in "
                                     "the captured step)", default=None)
    insitu_span_ms: float | None = column(INSITU, "ms", "the call's span in the step: its first "
                                          "kernel's start to its last's end, gaps included",
                                          default=None)
    insitu_hooked_ms: float | None = column(
        INSITU, "ms", "the call's busy time in the captured step itself (input copies and hooks "
        "around it), where insitu_ms comes from the plain step", default=None)
    error_basis: str | None = column(INSITU, doc="busy | span | step | eager: the in-situ figure "
                                                 "error_pct compares with (docs/timers.md)",
                                     default=None)
    error_pct: float | None = column(INSITU, "%", "100 * (isolated / in-situ - 1)", default=None)
    insitu_kernel_count: int | None = column(INSITU, doc="the call's own kernels in the step",
                                             default=None)
    kernel_error_pct: float | None = column(INSITU, "%", "100 * (device_ms / insitu_ms - 1): its "
                                            "kernels alone against in the step, both "
                                            "device-busy", default=None)
    clock_error_pct: float | None = column(INSITU, "%", "100 * (step_clock_mhz / timed_clock_mhz "
                                           "- 1): the error a call whose time follows the SM "
                                           "clock reads from the clocks alone", default=None)
    miss_cause: str | None = column(INSITU, doc="outside +-5 % of in situ: what the "
                                                "measurements say it comes from", default=None)
    bwd_insitu_ms: float | None = column(INSITU, "ms", "the call's backward in the step (the "
                                         "plain step's, else the captured step's)",
                                         default=None)
    bwd_error_pct: float | None = column(INSITU, "%", "100 * (bwd_ms / bwd_insitu_ms - 1)",
                                         default=None)
    bwd_insitu_kernel_count: int | None = column(INSITU, doc="the call's own backward kernels "
                                                 "in the step", default=None)
    bwd_kernel_error_pct: float | None = column(INSITU, "%", "100 * (bwd_device_ms / "
                                                "bwd_insitu_ms - 1)", default=None)
    bwd_miss_cause: str | None = column(INSITU, doc="the backward outside +-5 % of in situ: "
                                                    "what the measurements say it comes from",
                                        default=None)
    bwd_insitu_hooked_ms: float | None = column(
        INSITU, "ms", "the call's backward in the captured step itself, where bwd_insitu_ms "
        "comes from the plain step", default=None)
    recompute_insitu_ms: float | None = column(
        INSITU, "ms", "activation checkpointing: the call recomputed in the step's backward "
        "(backward work, not in insitu_ms)", default=None)

    @property
    def key(self) -> tuple[str, int]:
        return (self.fqn, self.call_index)


COPY_FAILED = "copying its inputs failed"  # capture_error prefix: the stored inputs are zeros


@dataclass(frozen=True)
class Column:
    name: str
    type: type            # str, int, float or bool
    nullable: bool
    unit: str | None
    stage: str
    doc: str


def _column(f: dataclasses.Field, hints: dict) -> Column:
    hint = hints[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    nullable = len(args) < len(typing.get_args(hint))  # "X | None"
    return Column(f.name, base, nullable, f.metadata["unit"], f.metadata["stage"],
                  f.metadata["doc"])


_HINTS = typing.get_type_hints(ModuleRecord)  # once: per field it was most of --help's time
COLUMNS: dict[str, Column] = {f.name: _column(f, _HINTS) for f in dataclasses.fields(ModuleRecord)}


def stage_columns(stage: str) -> tuple[str, ...]:
    """The columns ``stage`` produces, in table order."""
    if stage not in STAGES:
        raise ValueError(f"stage: {stage!r} is not one of {STAGES}")
    return tuple(n for n, c in COLUMNS.items() if c.stage == stage)


def required_fields() -> tuple[str, ...]:
    """Columns without a default: a modules table lacking one is not a capture."""
    return tuple(f.name for f in dataclasses.fields(ModuleRecord)
                 if f.default is _MISSING and f.default_factory is _MISSING)


def arrow_schema():
    """The pyarrow schema of modules.parquet (pyarrow imported lazily)."""
    import pyarrow as pa

    types = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
    return pa.schema([pa.field(c.name, types[c.type], nullable=c.nullable)
                      for c in COLUMNS.values()])


def records_to_table(records):
    """ModuleRecords -> pyarrow Table with every column, without pandas (capture's writer)."""
    import pyarrow as pa

    return pa.Table.from_pydict({n: [getattr(r, n) for r in records] for n in COLUMNS},
                                schema=arrow_schema())


def records_to_frame(records):
    """ModuleRecords -> pandas DataFrame with every column (pandas imported lazily)."""
    import pandas as pd

    return pd.DataFrame([dataclasses.asdict(r) for r in records], columns=list(COLUMNS))


def frame_to_records(df) -> list[ModuleRecord]:
    """pandas DataFrame -> ModuleRecords; unknown columns are ignored, NaN becomes None."""
    out = []
    for row in df.to_dict("records"):
        kw = {}
        for k, v in row.items():
            if k not in COLUMNS:
                continue
            if isinstance(v, float) and math.isnan(v):
                v = None
            kw[k] = v
        out.append(ModuleRecord(**kw))
    return out
