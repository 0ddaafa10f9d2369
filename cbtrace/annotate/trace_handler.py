"""``cbtrace.annotate.trace_handler``: a drop-in for ``torch.profiler.tensorboard_trace_handler`` that also
writes ``annotated_<trace>`` (in-situ time, FLOPs and MFU per module) beside each trace.

    with torch.profiler.profile(schedule=..., on_trace_ready=cbtrace.trace_handler("./log")) as p:
        for batch in loader:
            train_step(batch)
            p.step()

Both files match ``*.pt.trace.json[.gz]``, so TensorBoard's profiler plugin lists the annotated
one as its own worker (``annotated_<worker>``).
"""
from __future__ import annotations

import warnings
from pathlib import Path

from torch.profiler import tensorboard_trace_handler

from cbtrace.annotate import write
from cbtrace.errors import CbtraceError


def trace_handler(dir_name, worker_name=None, use_gzip: bool = True, *, run=None,
                  pftrace: bool = False):
    """Return an ``on_trace_ready`` callable.

    Args:
        dir_name: directory for the traces (created if missing), as tensorboard_trace_handler.
        worker_name: trace name prefix (default: ``<hostname>_<pid>``, as torch does).
        use_gzip: write ``.pt.trace.json.gz``.
        run: optional cbtrace run directory of the same model, for isolated figures too.
        pftrace: also write the Perfetto protobuf.
    """
    inner = tensorboard_trace_handler(str(dir_name), worker_name, use_gzip)
    out_dir = Path(dir_name)

    def handler(prof) -> None:
        before = _traces(out_dir)
        inner(prof)
        for trace in sorted(_traces(out_dir) - before):
            _annotate_one(trace, run, pftrace)

    return handler


def _traces(d: Path) -> set[Path]:
    if not d.is_dir():
        return set()
    return {p for p in d.glob("*.pt.trace.json*") if not p.name.startswith("annotated_")}


def _annotate_one(trace: Path, run, pftrace: bool) -> None:
    """Annotate; a failure warns and never breaks the user's training loop."""
    try:
        write.annotate(run=run, trace=trace, pftrace=pftrace)
    except (CbtraceError, OSError, ValueError) as e:
        warnings.warn(f"cbtrace.trace_handler: {trace.name} was not annotated ({e})")

