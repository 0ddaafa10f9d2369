"""``cbtrace.attribute``: in-situ time per module from existing Kineto traces.

One row per (rank, step, module call, phase). Columns (times in ms, from µs in the trace):

- ``rank``, ``step`` (N of ``ProfilerStep#N``; -1 for a trace without steps or an event outside
  every step), ``fqn`` (best path known; ``<unattributed>`` for time no module claims,
  ``<cbtrace-overhead>`` for cbtrace's input copies), ``source`` (cbtrace | nn.Module |
  record_function | module_hierarchy | unattributed), ``call_index`` (n-th call of that fqn in
  the step), ``depth``, ``parent_fqn``, ``phase`` (fwd | bwd).
- ``cpu_ms`` / ``cpu_self_ms``: host time inclusive / minus child modules (cbtrace overhead
  excluded); for bwd rows, the autograd ops mapped to the module (self) and its subtree.
- ``gpu_ms`` / ``gpu_self_ms``: sum of device event durations (kernels, memcpy, memset)
  launched inside; ``gpu_busy_ms``: the time the device was busy with them (inclusive; the
  union of their intervals per device: less than gpu_ms where they overlap on several
  streams); ``gpu_span_ms``: first device event start to last end (inclusive);
  ``kernel_count`` (inclusive).
- ``comm_ms``: device time of communication (NCCL) kernels launched inside (inclusive; part of
  gpu_ms); ``comm_exposed_ms``: the part of it that no non-communication kernel on another
  stream of the same device overlaps (comm.py).
- ``flops``, ``flops_executed``, ``bytes``, ``ops_without_formula``, ``compute_dtype``, ``mfu``,
  ``mbu``: from op shapes (``record_shapes=True``), cbtrace.cost.flops formulas and replay's
  peak (cost.peaks.PeakLookup: datasheet, else calibrated); inclusive; mfu/mbu use
  ``gpu_busy_ms`` and the trace's device (NaN on CPU-only traces and devices without a
  peak). Each op's FLOPs and bytes count once, at the op that did the work (an autocast
  ``aten::linear`` on fp32 weights only casts and calls the bf16 ``aten::addmm``:
  insitu.working_ops), and ``compute_dtype`` (whose peak mfu/mbu divide by) is the dtype with the
  most FLOPs (else bytes) over those ops, each op's dtype its first floating operand's
  (cost.compute_dtype).
- ``figures_suspect``: mfu, mbu or hfu (flops_executed / gpu time / peak) is above 1, which no
  call can reach: a bug in a count, flagged, not capped (cost.metrics.suspect); summary_text
  names such rows.
- Slice identity: ``pid``, ``tid``, ``ts_us``, ``dur_us`` (as in the trace), ``ev_index`` (position
  in ``traceEvents`` = HTA's ``index`` column: join with
  ``df.merge(hta_df, left_on="ev_index", right_on="index")``), ``module_label`` ("Linear_3"),
  ``trace`` (file).

Aggregation over steps (``aggregate=True``): every row also carries ``<col>_median``,
``<col>_min``, ``<col>_max`` for cpu_ms, cpu_self_ms, gpu_ms, gpu_self_ms, gpu_busy_ms,
gpu_span_ms, comm_ms, comm_exposed_ms over the steps >= 0 of its (rank, fqn, call_index, phase);
``summarize(df)`` keeps one row per group.

Many ranks (ranks.py): files are attributed in worker processes (``workers=``, default one per
core), one file at a time each, and ``across_ranks(df)`` gives per (fqn, call_index, phase)
the min / median / max over ranks of each rank's median time, the slowest rank and the spread.
Names without a capture run: ``model=SPEC`` builds the model on the meta device and names
``nn.Module: Class_N`` events by the order its forward first calls its modules
(model_names.py).

Speed and memory: the trace is decoded chunk by chunk (trace_io.stream_trace) by a typed
decoder that skips what attribution does not read (loader.py), straight into numpy columns
(~64 bytes per complete event, no Python object per event); nesting, owners and sums are array
operations (forest.py, insitu.py): faster than HTA's TraceAnalysis at a fraction of its peak
RSS (benchmarks/RESULTS.md, bench_trace_load.py). A trace whose
columns do not fit in memory is attributed with ``steps_per_window=N``: the file is read once
per window of N profiler steps and only that window's events are kept (windows.py).
"""
from __future__ import annotations

import warnings
from importlib import metadata
from pathlib import Path

import pandas as pd

from cbtrace.attribution import identity
from cbtrace.attribution.filetable import (  # noqa: F401 - cbtrace.attribute's public names
    AGG_COLUMNS, COLUMNS, GROUP, add_aggregates, device_name_of, file_columns, rank_of,
    summarize, table)
from cbtrace.attribution.model_names import model_calls
from cbtrace.attribution.ranks import attribute_files
from cbtrace.errors import ProviderError, TraceError
from cbtrace.rundir.layout import MANIFEST
from cbtrace.rundir.read import find_trace, read_modules

_SUFFIXES = (".json", ".json.gz")
ANNOTATED = "annotated_"


def trace_files(paths) -> list[Path]:
    """Trace files named by ``paths``: files, directories of traces, or cbtrace run directories
    (their capture trace; a distributed run's ``rank-N/`` shards each give theirs).

    An ``annotated_<name>`` trace is cbtrace's copy of ``<name>`` with figures added: beside
    its original it would count one rank twice, so it is skipped then, with one warning.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(_dir_traces(p))
        elif p.is_file():
            out.append(p)
        else:
            raise TraceError(f"{p}: no such trace file or directory")
    return _skip_annotated(out)


def _dir_traces(d: Path) -> list[Path]:
    if (d / MANIFEST).is_file():
        return [_run_trace(d)]
    shards = [s for s in d.glob("rank-*") if s.name[5:].isdigit() and (s / MANIFEST).is_file()]
    if shards:
        return [_run_trace(s) for s in sorted(shards, key=lambda s: int(s.name[5:]))]
    found = sorted(f for f in d.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES))
    if not found:
        raise TraceError(f"{d}: no .json or .json.gz traces in this directory")
    return found


def _run_trace(run: Path) -> Path:
    """A run directory's capture trace (never a path outside the run)."""
    trace = find_trace(run)
    if trace is None:
        raise TraceError(f"{run}: a cbtrace run without its capture trace")
    return trace


def _skip_annotated(files: list[Path]) -> list[Path]:
    given = set(files)
    skipped = [f for f in files if f.name.startswith(ANNOTATED)
               and f.with_name(f.name[len(ANNOTATED):]) in given]
    if skipped:
        warnings.warn(f"skipped {len(skipped)} annotated_* trace{'s' * (len(skipped) > 1)} "
                      f"(cbtrace's copies of traces also given; e.g. {skipped[0]})", stacklevel=3)
    return [f for f in files if f not in skipped]


def attribute_file(path, *, rank: int | None = None, class_map: dict | None = None,
                   steps_per_window: int | None = None, grad_sums: dict | None = None):
    """Rows of one trace file (one rank) as a DataFrame, no aggregation.

    ``steps_per_window``: load and attribute that many profiler steps at a time (memory
    bounded by a window, for traces larger than memory; see windows.py), else all at once.
    ``grad_sums``: (fqn, call_index) -> the gradient sums that are the call's own, from a
    replay of its backward (``insitu.rows``).
    """
    return pd.DataFrame(file_columns(path, rank=rank, class_map=class_map,
                                     steps_per_window=steps_per_window, grad_sums=grad_sums))


def attribute(paths, *, capture_run=None, model: str | None = None,
              model_options: dict | None = None, hta: bool = False, aggregate: bool = True,
              steps_per_window: int | None = None, workers: int | None = None):
    """In-situ time per module, per rank and profiler step, from Kineto traces.

    Args:
        paths: a trace file, a directory of per-rank traces, or a list of them.
        capture_run: a cbtrace run directory of the same model, captured whole: names
            ``nn.Module: Class_N`` events by their real attribute paths; a run whose modules do
            not match the trace's events is refused (identity.check_capture_run).
        model: a model spec (``nanogpt:tiny``, ``pkg.module:fn``): names ``nn.Module`` events
            like ``capture_run`` does, from the model built on the meta device, without weights
            or a capture (model_names.py); a model that does not match is refused.
        model_options: the provider's options for ``model`` (as ``cbtrace capture -o``).
        hta: also return HTA's ``TraceAnalysis`` over the same files: ``(df, analysis)``.
        aggregate: add ``*_median`` / ``*_min`` / ``*_max`` columns over steps.
        steps_per_window: for traces larger than memory: read each file once per window of
            this many profiler steps and keep only that window's events (see windows.py).
        workers: processes attributing files in parallel, one file at a time each (None: one
            per core; 1: none, all here); the table is the same for any number (ranks.py).

    Returns:
        pandas DataFrame (columns: see the module docstring), or ``(df, TraceAnalysis)``.
        ``ranks.across_ranks(df)`` compares the ranks.
    """
    if capture_run is not None and model is not None:
        raise ValueError("capture_run and model: give one of them, not both")
    files = trace_files(paths)
    check, class_map = _namer(capture_run, model, model_options)
    frames = attribute_files(files, workers=workers, class_map=class_map,
                             steps_per_window=steps_per_window)
    seen = set()
    for i, (f, df) in enumerate(zip(files, frames)):
        check(df, f)
        r = int(df["rank"].iloc[0]) if len(df) else i
        if r in seen:  # two files claim one rank (e.g. no rank info): number them by order
            df["rank"] = r = max(seen) + 1
        seen.add(r)
    df = pd.concat(frames, ignore_index=True)
    if aggregate:
        df = add_aggregates(df)
    if hta:
        return df, _hta_analysis(files)
    return df


def _namer(capture_run, model, model_options):
    """(check(rows, trace), class_map): how ``nn.Module: Class_N`` events get their fqns."""
    if capture_run is not None:
        modules = read_modules(capture_run)
        return (lambda rows, trace: identity.check_capture_run(modules, rows, run=capture_run,
                                                               trace=trace),
                identity.class_index_map(modules))
    if model is not None:
        calls, strict, how = model_calls(model, options=model_options)

        def check(rows, trace):
            identity.check_labels(calls, rows, trace=trace, error=ProviderError, strict=strict,
                                  what=f"{model}: its modules ({how})", who="the model",
                                  hint="give the spec and options of the model the trace "
                                       "profiled, or --capture-run")
        return check, dict(calls)
    return (lambda rows, trace: None), None


# Holistic Trace Analysis is published as traceinsight since 0.6; holistictraceanalysis stops
# at 0.5.0. Both install the same ``hta`` package, so either serves.
HTA_DISTRIBUTIONS = ("traceinsight", "HolisticTraceAnalysis")


def hta_distribution() -> tuple[str, str] | None:
    """(distribution, version) of the installed Holistic Trace Analysis, or None."""
    for name in HTA_DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def _hta_analysis(files):
    """HTA's TraceAnalysis over the files' directory (HTA wants one directory of traces)."""
    try:  # an optional extra, imported only when asked for
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        raise TraceError("hta=True needs Holistic Trace Analysis: pip install 'cbtrace[hta]' "
                         "(traceinsight; holistictraceanalysis 0.5 serves too)") from None
    dirs = {str(f.parent) for f in files}
    if len(dirs) != 1:
        raise TraceError("hta=True needs all traces in one directory (HTA reads a directory)")
    return TraceAnalysis(trace_dir=dirs.pop())


def summary_text(df, *, top: int = 15) -> str:
    """A short table: the calls with the most median in-situ time (device, else host)."""
    s = summarize(df)
    key = "gpu_busy_ms_median" if s["kernel_count"].sum() > 0 else "cpu_ms_median"
    s = s.sort_values(key, ascending=False).head(top)
    cols = ["rank", "fqn", "call_index", "phase", "cpu_ms_median", "gpu_busy_ms_median",
            "kernel_count", "mfu"]
    if "comm_ms" in df and df["comm_ms"].sum() > 0:  # communication kernels: NCCL time too
        cols[6:6] = ["comm_ms_median", "comm_exposed_ms_median"]
    steps = sorted(set(df["step"]))
    head = f"{len(df)} rows, ranks {sorted(set(df['rank']))}, steps {steps[:6]}{' ...' if len(steps) > 6 else ''}"
    warn = suspect_line(df)
    return "\n".join([head] + ([warn] if warn else []) +
                     [s[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")])


def suspect_line(df, *, names: int = 3) -> str | None:
    """One line naming the rows whose mfu, hfu or mbu is above 1 (figures_suspect), or None."""
    bad = df[df["figures_suspect"].astype(bool)] if "figures_suspect" in df else df.iloc[:0]
    if not len(bad):
        return None
    worst = {}  # (fqn, phase) -> its largest mfu or mbu, in row order
    for fqn, phase, v in zip(bad["fqn"], bad["phase"], bad[["mfu", "mbu"]].max(axis=1)):
        worst[(fqn, phase)] = max(v, worst.get((fqn, phase), v))
    shown = ", ".join(f"{f or '<root>'} {p}" + ("" if v != v else f" ({v:.3g}x peak)")
                      for (f, p), v in list(worst.items())[:names])
    more = f" and {len(worst) - names} more calls" if len(worst) > names else ""
    return (f"SUSPECT: {len(bad)} rows with mfu, hfu or mbu above 1 (no call beats its peak: "
            f"a FLOP or byte miscounted; column figures_suspect): {shown}{more}")
