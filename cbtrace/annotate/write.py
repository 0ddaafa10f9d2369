"""``annotated_<trace>``: a Kineto trace with cbtrace's per-module figures, for Perfetto,
TensorBoard's profiler tab and HTA.

The original is streamed through (see ``rewrite_json``) and never modified; module slices
(``cbtrace::<fqn>`` ranges or ``nn.Module: ...`` events) get the module's figures as args, and a
``cbtrace`` process with the isolated replay, counter tracks and metadata is appended.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

from cbtrace._version import __version__
from cbtrace.annotate import pftrace as proto
from cbtrace.annotate.figures import Figures, SliceAnnotator
from cbtrace.annotate.appended import appended_events, metadata
from cbtrace.annotate.rewrite_json import rewrite
from cbtrace.attribution.attribute import attribute
from cbtrace.cost.peaks import PeakLookup
from cbtrace.errors import TraceError
from cbtrace.rundir.files import atomic_paths
from cbtrace.rundir.lock import RunLock
from cbtrace.rundir.read import find_trace, load_run
from cbtrace.trace_io import TraceLimitError

PREFIX = "annotated_"


def output_path(trace: Path, out=None) -> Path:
    """``annotated_<name>`` beside the input, unless ``out`` is given."""
    return Path(out) if out is not None else trace.with_name(PREFIX + trace.name)


def pftrace_path(out: Path) -> Path:
    name = out.name
    for suffix in (".json.gz", ".json", ".gz"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return out.with_name(name + ".pftrace")


def _resolve(run, trace) -> tuple[Path, bool]:
    """(trace path, whether it is the run's own capture trace)."""
    own = find_trace(run) if run is not None else None
    if trace is None:
        if run is None:
            raise ValueError("annotate: give a run directory, a trace, or both")
        if own is None:
            raise TraceError(f"{run}: the run has no capture trace (*.pt.trace.json[.gz])")
        return own, True
    trace = Path(trace)
    if not trace.is_file():
        raise TraceError(f"{trace}: no such trace file")
    return trace, own is not None and own.resolve() == trace.resolve()


def _attribution(trace: Path, run=None):
    """Per-slice in-situ table from cbtrace.attribution, or None if unavailable for this trace.

    A trace attribution cannot read is annotated with slice durations (a warning says so); a
    run that does not match the trace (RunDirError) is refused.
    """
    try:
        df = attribute(trace, capture_run=run, aggregate=False)
    except TraceLimitError:
        raise  # a hostile trace is refused, not annotated
    except TraceError as e:
        warnings.warn(f"{trace}: no in-situ attribution ({e}); annotating with slice durations")
        return None
    if isinstance(df, tuple):
        df = df[0]
    return df[df["ts_us"].notna()] if "ts_us" in df.columns else None


def annotate(run=None, trace=None, out=None, force: bool = False, pftrace: bool = True,
             insitu=None) -> Path:
    """Write an annotated copy of a trace; returns its path.

    Both outputs are written to temp files beside them (created first, so a folder that cannot
    be written fails before any work) and renamed into place at the end: a failure leaves no
    half-made output behind. Without the ``perfetto`` package the .pftrace is skipped with a
    warning (``cbtrace.annotate.pftrace.unavailable_reason``).

    Args:
        run: run directory; its modules.parquet gives the isolated figures (and its capture
            trace is annotated when ``trace`` is None).
        trace: a Kineto trace (.json / .json.gz) to annotate instead of the run's own.
        out: output path (default ``annotated_<name>`` beside the trace).
        force: overwrite existing outputs.
        pftrace: also write the Perfetto protobuf ``annotated_<stem>.pftrace``.
        insitu: per-slice attribution table to use (default: computed with cbtrace.attribute;
            False: none).
    """
    trace, own = _resolve(run, trace)
    dst = output_path(trace, out)
    if dst.resolve() == trace.resolve():
        raise TraceError(f"{dst}: the output would overwrite the original trace")
    if pftrace and (why := proto.unavailable_reason()) is not None:
        warnings.warn(f"{pftrace_path(dst)}: skipped ({why})")
        pftrace = False
    outputs = [dst, pftrace_path(dst)] if pftrace else [dst]
    for path in outputs:
        if path.exists() and not force:
            raise TraceError(f"{path}: already exists (pass force=True to overwrite)",
                             retry="force")
    with _lock(run, dst), atomic_paths(*outputs) as tmps:
        _write(run, trace, own, insitu, dst, tmps)
    for path in outputs:
        _readable(path)
    return dst


def _write(run, trace: Path, own: bool, insitu, dst: Path, tmps: list[Path]) -> None:
    """The annotated trace into ``tmps[0]`` and, if asked, the .pftrace into ``tmps[1]``."""
    manifest, modules = load_run(run) if run is not None else (None, None)
    if insitu is None:
        insitu = _attribution(trace, run)
    fig = Figures(modules, insitu if insitu is not False else None, own_trace=own)
    ann = SliceAnnotator(fig)
    device = _device_name(manifest)
    meta = metadata(trace.name, __version__, device=device,
                    run_id=_run_id(run, manifest), peaks=_peaks_used(device, modules))
    rows = list(fig.calls.values())
    extra: list[dict] = []

    def tail() -> list[dict]:
        extra[:] = appended_events(rows=rows, slices=ann.module_slices(), is_leaf=fig.is_leaf,
                                   t0=ann.first_ts, meta=meta)
        return extra

    head = b'"cbtrace": ' + json.dumps(meta, sort_keys=True).encode() + b",\n"
    with open(tmps[0], "wb") as f:
        rewrite(trace, f, on_event=ann, head=head, tail=tail, gz=dst.name.endswith(".gz"))
    if len(tmps) > 1:
        tmps[1].write_bytes(proto.build(ann.slices["cbtrace"] + ann.slices["nn.Module"], extra))


def _lock(run, dst: Path):
    """The run's lock while the output is written into the run (not while it goes elsewhere)."""
    if run is None or not dst.resolve().is_relative_to(Path(run).resolve()):
        return contextlib.nullcontext()
    return RunLock(run, "annotate", mark=False)


def _run_id(run, manifest) -> str | None:
    """The run directory's name and creation time (manifests carry no id of their own)."""
    if run is None:
        return None
    return f"{Path(run).resolve().name}@{manifest.created}"


def _device_name(manifest) -> str | None:
    """The device whose figures the run holds: the replay's, else the capture's."""
    if manifest is None:
        return None
    return manifest.replay.device_name if manifest.replay is not None else manifest.device_name


def _peaks_used(device: str | None, modules) -> dict | None:
    """{dtype: {flops_per_s, bytes_per_s, source}}: the peaks the run's MFU/MBU divide by."""
    if not device or modules is None:
        return None
    out = {}
    peaks = PeakLookup(device)
    for dtype in sorted(set(modules["compute_dtype"].dropna())):
        peak = peaks(dtype)
        if peak is not None:
            out[str(dtype)] = {"flops_per_s": peak.flops_per_s,
                               "bytes_per_s": peak.bytes_per_s, "source": peak.source}
    return out or None


def _readable(path: Path) -> None:
    """Temp files are created 0600; give the output the usual umask-based mode."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)

