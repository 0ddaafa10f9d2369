"""The in-situ stage of a run: each captured call's time in the real step, and the isolation
error ``error_pct`` = 100 * (isolated / in-situ - 1); for a train step replayed with
``--backward``, the same for its backward (``bwd_insitu_ms``, ``bwd_error_pct``).

GPU runs: the call's own device time in the run's plain step (``capture.plain_step``: a range per
call and nothing else) where capture profiled one, else in the capture trace, whose input copies
and hooks change the cache state and the host's pace around each call (the capture trace's
figure stays beside it: ``insitu_hooked_ms``); and, for a call timed back to back, its host issue
time in an unprofiled repeat of the step, ``insitu_host_ms``. CPU runs: its host
time in an unprofiled repeat of the step (``insitu_host_ms``), when capture recorded one.
"""
from __future__ import annotations

import math
from pathlib import Path

from cbtrace.attribution import miss
from cbtrace.attribution.attribute import attribute_file
from cbtrace.cost import metrics
from cbtrace.console import announce
from cbtrace.errors import CbtraceError, RunDirError, one_line
from cbtrace.rundir.lock import locked
from cbtrace.rundir.layout import PLAIN_TRACE
from cbtrace.rundir.read import find_trace, load_run
from cbtrace.rundir.writer import write_stage
from cbtrace.schema.modules import INSITU


def insitu_columns(run, manifest, df) -> dict[int, dict]:
    """call_id -> {insitu_ms, insitu_span_ms, error_basis, error_pct, insitu_kernel_count,
    kernel_error_pct, clock_error_pct, miss_cause, bwd_insitu_ms, bwd_error_pct,
    bwd_insitu_kernel_count, bwd_kernel_error_pct, bwd_miss_cause, recompute_insitu_ms} for
    every row of the modules table ``df`` (the backward's only where replay measured it);
    miss_cause and bwd_miss_cause from ``attribution.miss``. error_pct compares the isolated
    figure with the in-situ figure ``error_basis`` names (``metrics.error_basis``): the plain
    repeat of the step for a root timed back to back or run compiled, the eager figure against the
    step (run eagerly by capture) for a call the step ran compiled, for a call timed back to back
    the larger of its host issue time and its busy time (else its span), else the busy time."""
    on_gpu = manifest.device.startswith("cuda")
    # on a CPU the forward's in-situ times are the host times; a backward's, the plain step's
    plain = plain_trace(run, manifest) if on_gpu or df["bwd_ms"].notna().any() else None
    hooked, bwd_hooked = {}, {}
    # the backward's own gradient sums; the forward's rows do not depend on them, so each trace
    # is attributed once for both phases (``_attributed``)
    sums = {"grad_sums": own_grad_sums(df)} if df["bwd_ms"].notna().any() else {}
    if not on_gpu and df["insitu_host_ms"].notna().all():
        insitu = dict(zip(df["call_id"], df["insitu_host_ms"]))  # CPU: unprofiled repeats
        span, kernels = {}, {}
    else:
        table = insitu_for_run(run, manifest, **sums)
        insitu, span = _by_call(df, table), _by_call(df, table, "gpu_span_ms")
        kernels = _by_call(df, table, "kernel_count")
        ptable = _plain_table(run, manifest, plain, table, **sums)
        if ptable is not None:  # the plain step's figures, the captured step's where it has none
            hooked = insitu
            use = {cid: _number(v) is not None for cid, v in _by_call(df, ptable).items()}
            insitu, span, kernels = (_either(use, _by_call(df, ptable, c), d) for c, d in (
                ("insitu_ms", insitu), ("gpu_span_ms", span), ("kernel_count", kernels)))
    bwd, bwd_kernels = {}, {}
    if df["bwd_ms"].notna().any():
        btable = insitu_for_run(run, manifest, phase="bwd", **sums)
        bwd, bwd_kernels = _by_call(df, btable), _by_call(df, btable, "kernel_count")
        # a checkpointed step's recomputation has ranges only in the captured step's trace: the
        # plain step's would count it in the backward of the call whose node ran it
        recomputed = "recomputed" in df and df["recomputed"].fillna(False).astype(bool).any()
        ptable = None if recomputed else _plain_table(run, manifest, plain, btable, phase="bwd",
                                                      **sums)
        if ptable is not None:
            bwd_hooked, pb = bwd, _by_call(df, ptable)
            use = {cid: _number(v) is not None for cid, v in pb.items()}
            bwd = _either(use, pb, bwd)
            bwd_kernels = _either(use, _by_call(df, ptable, "kernel_count"), bwd_kernels)
    recompute = _recompute(run, manifest, df)
    out = {}
    for row in df.reindex(columns=["call_id", "timer", "timer_fallback", "isolated_ms", "bwd_ms",
                                   "kernel_count", "device_ms", "noisy", "step_compiled",
                                   "eager_ms", "insitu_step_ms", "host_ms",
                                   "insitu_host_ms", "step_clock_mhz",
                                   "timed_clock_mhz", "bwd_timer", "bwd_timer_fallback",
                                   "bwd_kernel_count", "bwd_device_ms"]).to_dict("records"):
        cid, timer = row["call_id"], row["timer"]
        ins, spn, bwd_ins = (_number(d.get(cid)) for d in (insitu, span, bwd))
        spn = spn if spn else None  # 0: no kernel of its own in the step
        basis = metrics.error_basis(timer if isinstance(timer, str) else None, spn,
                                    step_ms=_number(row["insitu_step_ms"]),
                                    compiled=_flag(row["step_compiled"]),
                                    host_ms=_number(row["insitu_host_ms"]) if on_gpu else None)
        err = metrics.error_pct(*_compared(basis, row, ins, spn))
        kerr = miss.kernel_error_pct(row["device_ms"], ins) if on_gpu else None
        clock = miss.clock_error_pct(row["step_clock_mhz"], row["timed_clock_mhz"])
        bwd_err = metrics.error_pct(_number(row["bwd_ms"]), bwd_ins)
        cause = miss.miss_cause({**row, "error_pct": err, "error_basis": basis,
                                 "clock_error_pct": clock}, kernels.get(cid), kerr)
        out[int(cid)] = {"insitu_ms": ins, "insitu_span_ms": spn,
                         "insitu_hooked_ms": _number(hooked.get(cid)),
                         "bwd_insitu_hooked_ms": _number(bwd_hooked.get(cid)),
                         "error_basis": basis if err is not None else None, "error_pct": err,
                         "insitu_kernel_count": _int(kernels.get(cid)), "kernel_error_pct": kerr,
                         "clock_error_pct": clock,
                         "miss_cause": cause,
                         "bwd_insitu_ms": bwd_ins, "bwd_error_pct": bwd_err,
                         "bwd_insitu_kernel_count": _int(bwd_kernels.get(cid)),
                         "bwd_kernel_error_pct": miss.kernel_error_pct(row["bwd_device_ms"],
                                                                       bwd_ins),
                         "bwd_miss_cause": miss.bwd_miss_cause(
                             {**row, "bwd_insitu_ms": bwd_ins, "bwd_error_pct": bwd_err},
                             bwd_kernels.get(cid)),
                         "recompute_insitu_ms": _number(recompute.get(cid))}
    return out


def plain_trace(run, manifest) -> Path | None:
    """The run's plain step trace (``capture.plain_step``), if this capture profiled one: a file
    of that name the manifest lists (not one another capture left, or one put there since)."""
    path = Path(run) / PLAIN_TRACE
    ok = PLAIN_TRACE in manifest.files and path.is_file() and not path.is_symlink()
    return path if ok else None


def _plain_table(run, manifest, plain, hooked, phase: str = "fwd", grad_sums=None):
    """The plain step's in-situ table, or None where there is none to trust: no plain step, a
    trace that cannot be read (said, and the captured step's figures stand), or a forward with
    no device events where the captured step had some (the profiler's second session missed
    the GPU)."""
    if plain is None:
        return None
    try:
        table = insitu_for_run(run, manifest, phase=phase, grad_sums=grad_sums, trace=plain,
                               median_steps=True)
    except (CbtraceError, OSError, ValueError) as e:
        announce(f"{plain}: not read ({one_line(e)}); in-situ times from the captured step")
        return None
    if hooked is not None and table["kernel_count"].sum() == 0 < hooked["kernel_count"].sum():
        announce(f"{plain}: no device events; in-situ times from the captured step")
        return None
    return table


def _either(use: dict, first: dict, then: dict) -> dict:
    """Per call, ``first``'s figure where ``use`` says so, else ``then``'s: each call's figures
    from one step."""
    return {cid: first.get(cid) if use.get(cid) else then.get(cid) for cid in then.keys() | use}


def own_grad_sums(df) -> dict:
    """(fqn, call_index) -> the gradient sums a call's replayed backward made at its own level
    (``bwd_grad_sums`` less its children's), where it and all its children have one and it is
    above 0: the engine's adds the in-situ attribution leaves with the call."""
    if "bwd_grad_sums" not in df:
        return {}
    sums = dict(zip(df["call_id"], df["bwd_grad_sums"]))
    below: dict = {}
    for cid, parent in zip(df["call_id"], df["parent_call_id"]):
        below.setdefault(parent, []).append(sums.get(cid))
    out = {}
    for cid, fqn, i in zip(df["call_id"], df["fqn"], df["call_index"]):
        own = [_number(sums.get(cid))] + [_number(v) for v in below.get(cid, [])]
        if None not in own and own[0] - sum(own[1:]) > 0:
            out[(fqn, int(i))] = int(own[0] - sum(own[1:]))
    return out


def _compared(basis: str, row: dict, busy, span) -> tuple:
    """(isolated figure, in-situ figure) that error_pct compares on ``basis``."""
    iso = _number(row["isolated_ms"])
    if basis == "step":  # what the call costs a loop of steps: its host may set the pace
        return metrics.step_ms(iso, _number(row["host_ms"])), _number(row["insitu_step_ms"])
    if basis == "host":  # a loop's pace of the call: its host issue time or its device time
        return iso, metrics.step_ms(busy, _number(row["insitu_host_ms"]))
    if basis == "eager":  # the captured step ran it eagerly: its eager figure, if taken
        eager = _number(row["eager_ms"])
        return (iso if eager is None else eager), busy
    return iso, (span if basis == "span" else busy)


def _recompute(run, manifest, df) -> dict:
    """call_id -> ms of its recomputation in the backward (activation checkpointing), from the
    capture trace; empty where nothing was recomputed or the run has no trace."""
    if "recomputed" not in df or not df["recomputed"].fillna(False).astype(bool).any():
        return {}  # no trace read where capture saw no recomputation
    try:
        return {c: v for c, v in _by_call(df, insitu_for_run(run, manifest,
                                                               phase="recompute")).items()
                if v is not None}
    except RunDirError:
        return {}


def _by_call(df, ins, column: str = "insitu_ms") -> dict:
    """call_id -> the attribution's ``column``, matching its rows by (fqn, call_index)."""
    by_key = dict(zip(zip(ins["fqn"], ins["call_index"]), ins[column]))
    return {cid: by_key.get((f, int(i))) for cid, f, i in
            zip(df["call_id"], df["fqn"], df["call_index"])}


def insitu_for_run(run_dir, manifest, phase: str = "fwd", grad_sums: dict | None = None,
                   trace: Path | None = None, median_steps: bool = False):
    """In-situ time per captured call from the run's own capture trace (or ``trace``, another
    trace of the run: its plain steps); of a trace of several profiler steps, the first step's,
    or with ``median_steps`` each figure's median over the steps (the plain steps').

    Returns a DataFrame[fqn, call_index, cpu_ms, gpu_ms, gpu_busy_ms, gpu_span_ms, kernel_count,
    insitu_ms] of the module rows of ``phase`` (fwd, or bwd: the autograd ops attribution maps
    to each call by sequence number); ``insitu_ms`` is gpu_busy_ms (the time the device was
    busy with the call's own kernels: kernels overlapping on several streams count once;
    cbtrace's input copies excluded) when the trace has device events, else cpu_ms. Not the
    span, except where the isolated figure holds the host's gaps too (``insitu_columns``): during
    capture the host is slowed by hooks and copies, so the device idles inside a parent's span
    for reasons that are cbtrace's, not the model's. ``grad_sums``: (fqn, call_index) -> the
    gradient sums that are the call's own (``own_grad_sums``).
    """
    trace = trace or find_trace(run_dir, manifest)
    if trace is None:
        raise RunDirError(f"{run_dir}: no capture trace (*.pt.trace.json*) in the run")
    df = _attributed(Path(trace), grad_sums)
    df = df[(df["phase"] == phase) & (df["depth"] >= 0)]
    figures = ["cpu_ms", "gpu_ms", "gpu_busy_ms", "gpu_span_ms", "kernel_count"]
    if (df["step"] >= 0).any():
        df = df[df["step"] >= 0]
        if median_steps:  # per call, the median of its steps' figures
            df = df.groupby(["fqn", "call_index"], sort=False, as_index=False)[figures].median()
            df["kernel_count"] = df["kernel_count"].round().astype(int)
        else:
            df = df[df["step"] == df["step"].min()]
    has_device = df["kernel_count"].sum() > 0
    out = df[["fqn", "call_index", *figures]].copy()
    out["insitu_ms"] = out["gpu_busy_ms"] if has_device else out["cpu_ms"]
    return out.reset_index(drop=True)


def _attributed(trace: Path, grad_sums: dict | None):
    """``attribute_file(trace, grad_sums=...)``, kept for the next call with the same file (by
    path, size and mtime) and sums: the in-situ stage reads each trace for the forward and the
    backward (a GPT-2 train step's traces are tens of MB of JSON). Callers filter, never
    change, the frame."""
    st = trace.stat()
    key = (str(trace), st.st_size, st.st_mtime_ns, tuple(sorted((grad_sums or {}).items())))
    df = _ATTRIBUTED.pop(key, None)
    if df is None:
        df = attribute_file(trace, grad_sums=grad_sums)
    _ATTRIBUTED[key] = df  # the newest last
    while len(_ATTRIBUTED) > 2:  # a run's capture trace and its plain step's
        _ATTRIBUTED.pop(next(iter(_ATTRIBUTED)))
    return df


_ATTRIBUTED: dict = {}  # (path, size, mtime_ns, sums) -> its attribution; the oldest first


@locked("attribute", mark=False)  # rewrites modules.parquet: not while a replay writes it
def join_insitu(run):
    """Write the in-situ stage of ``run``; returns the modules DataFrame."""
    manifest, df = load_run(Path(run))
    return write_stage(run, INSITU, insitu_columns(run, manifest, df), manifest=manifest)


def error_table(df, *, min_insitu_ms: float = 0.010):
    """Per module class: count, median/min/max error_pct over calls with in-situ >= threshold."""
    d = df[(df["status"] == "ok") & (df["insitu_ms"] >= min_insitu_ms)]
    g = d.groupby("module_type")["error_pct"]
    out = g.agg(["count", "median", "min", "max"])
    out["insitu_ms_median"] = d.groupby("module_type")["insitu_ms"].median()
    return out.sort_values("insitu_ms_median", ascending=False)


def _number(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def _flag(v) -> bool:
    return v is not None and v == v and bool(v)  # NaN (a column absent from the table): False


def _int(v) -> int | None:
    v = _number(v)
    return None if v is None else int(v)
