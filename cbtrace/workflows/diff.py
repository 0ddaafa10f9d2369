"""``cbtrace diff RUN_A RUN_B``: the two runs compared call by call, regressions flagged.

Calls are aligned by name, else by tree position (``workflows/align.py``); when a change
counts is ``workflows/regress.py``. A call regressed when it does more work (FLOPs, bytes,
kernels, parameter or buffer bytes: counted, so exact on any device), holds more peak memory,
or is slower beyond the runs' own spread and noise; every call that encloses a regressed one
regressed with it. Improvements are the same tests the other way round, reported and never
flagged.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from cbtrace.errors import CbtraceError, RunDirError
from cbtrace.rundir.files import atomic_path
from cbtrace.rundir.read import load_run
from cbtrace.workflows import regress
from cbtrace.workflows.align import ONLY_A, ONLY_B, align

# compared figures: column -> metric name in ``regressed`` / ``improved`` (None: reported only)
VALUES = {"isolated_ms": "time", "peak_mem_bytes": "memory", "flops": "work", "bytes": "work",
          "mfu": None, "mbu": None}
# counted, not timed: a change beyond rounding is the code's on any device ("work")
WORK = ("flops", "flops_executed", "bytes", "kernel_count", "param_bytes", "buffer_bytes",
        "bwd_flops", "bwd_bytes", "grad_bytes", "saved_bytes")
CONTEXT = ("isolated_ms_p10", "isolated_ms_p90", "status", "noisy", "timer")
METRICS = ("work", "time", "memory")  # the order they are named in ``regressed``


@dataclass(kw_only=True)
class DiffConfig:
    min_time_rel: float = 0.05
    """A time change counts from this much (relative: B / A - 1, or A / B - 1 for a gain),
    raised to the runs' own spread and noise (``spread_q``, ``noise_k``, ``tail_k``)."""
    min_time_ms: float = 0.001
    """... and from this much (ms)."""
    spread_q: float = 0.5
    """The relative time threshold is at least the p90 / p10 - 1 of the call at this
    quantile of both runs' calls: how far one call's own samples lie apart on this machine."""
    noise_k: float = 3.0
    """... and at least exp(noise_k * sigma) - 1, sigma the robust standard deviation of
    log(B / A) over the calls timed in both runs: their run-to-run drift, which one replay's
    p10-p90 does not show; 0: off."""
    tail_k: float = 2.5
    """... and at least exp(tail_k * d) - 1, d the 90th percentile of |log(B / A) - median|
    over the leaf calls timed in both runs: how far a busy machine threw its worst calls;
    0: off."""
    min_mem_rel: float = 0.01
    """A peak-memory change counts from this much (relative)."""
    min_mem_bytes: int = 4096
    """... and from this much (bytes)."""
    min_work_rel: float = 1e-6
    """A work count (FLOPs, bytes, kernels, parameter and buffer bytes) changed when it moved
    by more than this (relative) and by at least one unit: rounding, not noise."""

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if v < 0}
        if bad or self.spread_q > 1:
            raise ValueError(f"diff thresholds must be >= 0 (spread_q <= 1): "
                             f"{bad or {'spread_q': self.spread_q}}")


class DiffError(CbtraceError):
    """Two runs cannot be compared, or the comparison cannot be written."""


def diff_runs(a, b, **options):
    """Compare run B against run A, call by call; a pandas DataFrame, one row per call.

    Args:
        a, b: run directories (A the baseline, B the candidate), replayed for figures.
        **options: fields of ``DiffConfig``.
    Returns:
        Columns fqn, call_index, module_type, depth, match (name | position | only_a |
        only_b), fqn_a, fqn_b, call_id_a, call_id_b; per figure X of isolated_ms,
        peak_mem_bytes, mfu, mbu and the work counts (``WORK``): X_a, X_b, X_delta (B - A),
        X_rel (B / A - 1); isolated_ms_p10/_p90, status and noisy of each run;
        work_changed (the work counts that changed, "" for none); regression (bool),
        regressed and improved ("work,time,memory", "" for none; a call's regressed includes
        what regressed in the calls it encloses), time_contradicted_by (the enclosing call
        whose time did not move with the call's, "(children)" for a top call whose children
        did not, which dropped its time change), verdict
        (regressed | improved | unchanged | no figures | only_a | only_b). ``attrs`` holds
        the settings and the time threshold applied (``time_threshold``).
    Raises:
        DiffError: a run holds no replayed figures, or no call of B matches one of A.
    """
    frames = []
    for run in (a, b):
        _, df = load_run(run)
        if df.empty:
            raise RunDirError(f"{run}: modules.parquet holds no module calls")
        if not _has_figures(df):
            raise DiffError(f"{run}: no replayed figures (never replayed, or no call ended "
                            f"ok); run cbtrace replay {run} first")
        frames.append(df)
    out = diff_frames(*frames, DiffConfig(**options))
    if not _matched(out):
        raise DiffError(f"{b}: no call matches one of {a} by name or tree position "
                        f"(another model?)")
    return out


def _has_figures(df) -> bool:
    ok = df["status"] == "ok" if "status" in df else df["isolated_ms"].notna()
    return bool((ok & df["isolated_ms"].notna()).any())


def _matched(df) -> bool:
    """Some call is in both runs; two roots of different classes are no match."""
    both = df[df["match"].isin(("name", "position"))]
    same = (both["depth"] > 0) | (both["module_type_a"] == both["module_type"])
    return bool(same.any())


def _rows(df) -> dict[int, dict]:
    clean = df.astype(object).where(df.notna(), None)
    return {int(r["call_id"]): r for r in clean.to_dict("records")}


def diff_frames(df_a, df_b, cfg: DiffConfig | None = None):
    """``diff_runs`` on two modules DataFrames (columns of ``ModuleRecord``)."""
    import pandas as pd  # here: `cbtrace diff --help` imports this module and must stay light

    cfg = cfg or DiffConfig()
    ra, rb = _rows(df_a), _rows(df_b)
    out = [_pair(ra.get(ca, {}), rb.get(cb, {}), how)
           for ca, cb, how in align(list(ra.values()), list(rb.values()))]
    timed = [r for r in out if _timed(r)]
    leaves = {c for c in rb} - {x["parent_call_id"] for x in rb.values()}
    figures = time_threshold(timed, leaves, cfg)
    min_time_rel, shift = figures["time_threshold_rel"], figures["time_shift"]
    for r in out:
        _judge(r, cfg, min_time_rel, shift)
    by_b = {r["call_id_b"]: r for r in out if r["call_id_b"] is not None}
    parent_b = {c: x["parent_call_id"] for c, x in rb.items()}
    children_b: dict[int, list[dict]] = {}
    for r in out:
        if r["call_id_b"] is not None and parent_b[r["call_id_b"]] in by_b:
            children_b.setdefault(parent_b[r["call_id_b"]], []).append(r)
    for r in out:
        _check_tree(r, by_b, parent_b, children_b)
    _enclose(out, by_b, parent_b)
    for r in out:
        _verdict(r)
    df = pd.DataFrame(out)
    for c in ("call_id_a", "call_id_b"):
        df[c] = df[c].astype("Int64")
    df.attrs.update(asdict(cfg), **figures, noise_calls=len(timed))
    return df


def time_threshold(timed: list[dict], leaves: set[int], cfg: DiffConfig) -> dict:
    """The relative time threshold the two runs set, and its parts: the largest of
    ``min_time_rel``, the calls' own spread (time_spread_rel), their run-to-run noise
    (time_noise_sigma) and how far the worst leaf calls strayed (time_tail_rel); and how much
    slower all of B ran (time_shift), which B's times are divided by before judging, where
    that hides a change (``_judge``)."""
    pairs = [(r["isolated_ms_a"], r["isolated_ms_b"]) for r in timed]
    sigma = regress.time_noise(pairs)
    # leaves only: a slower call slows every call above it, which would raise its own bar
    tail = math.expm1(cfg.tail_k * regress.time_tail(
        [(r["isolated_ms_a"], r["isolated_ms_b"]) for r in timed if r["call_id_b"] in leaves],
        0.9))
    spread = regress.spread_floor(
        [(r[f"isolated_ms_p10_{s}"], r[f"isolated_ms_p90_{s}"]) for r in timed for s in "ab"
         if r[f"isolated_ms_p10_{s}"] is not None and r[f"isolated_ms_p90_{s}"] is not None],
        cfg.spread_q)
    rel = max(cfg.min_time_rel, math.expm1(cfg.noise_k * sigma), spread, tail)
    # B's times are divided by its overall shift only where both replays ran on a CPU timer:
    # there a busier machine slows every call; on a GPU every call slower is a regression
    on_cpu = bool(timed) and all(r["timer_a"] == "cpu" and r["timer_b"] == "cpu" for r in timed)
    return {"time_threshold_rel": rel, "time_spread_rel": spread, "time_noise_sigma": sigma,
            "time_tail_rel": tail, "time_shift": regress.time_shift(pairs) if on_cpu else 1.0}


def _pair(a: dict, b: dict, how: str) -> dict:
    one = b or a
    row = {"fqn": one["fqn"], "call_index": one["call_index"], "module_type": one["module_type"],
           "module_type_a": a.get("module_type"), "depth": one["depth"], "match": how,
           "fqn_a": a.get("fqn"), "fqn_b": b.get("fqn"), "call_id_a": a.get("call_id"),
           "call_id_b": b.get("call_id")}
    for col in dict.fromkeys([*VALUES, *WORK]):
        x, y = a.get(col), b.get(col)
        both = x is not None and y is not None
        row.update({f"{col}_a": x, f"{col}_b": y, f"{col}_delta": y - x if both else None,
                    f"{col}_rel": regress.rel(x, y) if both else None})
    for col in CONTEXT:
        row[f"{col}_a"], row[f"{col}_b"] = a.get(col), b.get(col)
    return row


def _ok(r: dict, side: str) -> bool:
    return r[f"status_{side}"] in (None, "ok")


def _compared(r: dict) -> bool:
    return r["match"] not in (ONLY_A, ONLY_B) and _ok(r, "a") and _ok(r, "b")


def _timed(r: dict) -> bool:
    return (_compared(r) and r["isolated_ms_a"] is not None
            and r["isolated_ms_b"] is not None)


def _judge(r: dict, cfg: DiffConfig, min_time_rel: float, shift: float) -> None:
    """The row's own work, time and memory changes (+1, -1, 0; absent without figures)."""
    r["_changes"] = changes = {}
    moved = {}
    if _compared(r):
        for col in WORK:
            if r[f"{col}_delta"] is not None:
                moved[col] = regress.work_change(r[f"{col}_a"], r[f"{col}_b"],
                                                 min_rel=cfg.min_work_rel)
    r["work_changed"] = ",".join(c for c, m in moved.items() if m)
    if moved:
        ups = set(moved.values())
        changes["work"] = 1 if 1 in ups else -1 if -1 in ups else 0
    if _timed(r):
        # B against A at the whole run's shift, where it hides a change, never where it would
        # make one: a machine busier for all of B is no slowdown, and one busier for all of A
        # (a shift below 1) must not lift B's calls into one; the same the other way round.
        # The call tree checks a change at the shift itself: the machine's, every call's.
        a, b = ([r[f"isolated_ms{s}_{side}"] for s in ("", "_p10", "_p90")] for side in "ab")
        a = tuple(a)
        r["_dt"] = b[0] / shift - a[0]
        up, down = (tuple(None if x is None else x / f for x in b)
                    for f in (max(shift, 1.0), min(shift, 1.0)))
        slower = regress.time_change(a, up, min_rel=min_time_rel, min_ms=cfg.min_time_ms) > 0
        faster = regress.time_change(a, down, min_rel=min_time_rel, min_ms=cfg.min_time_ms) < 0
        changes["time"] = 1 if slower else -1 if faster else 0
    if r["peak_mem_bytes_delta"] is not None and _compared(r):
        changes["memory"] = regress.memory_change(
            r["peak_mem_bytes_a"], r["peak_mem_bytes_b"], min_rel=cfg.min_mem_rel,
            min_bytes=cfg.min_mem_bytes)


def _band(r: dict) -> float:
    """How much change a call can hide: its median above its p10, the larger of the two runs
    (ms); none where either replay says the machine was busy (noisy), whose spread is the
    machine's, so the call must show the change to confirm it."""
    if r["noisy_a"] or r["noisy_b"]:
        return 0.0
    return max((r[f"isolated_ms_{s}"] - r[f"isolated_ms_p10_{s}"]
                for s in "ab" if r[f"isolated_ms_p10_{s}"] is not None), default=0.0)


def _check_tree(r: dict, by_b: dict, parent_b: dict, children_b: dict) -> None:
    """Drop a time change that an enclosing call does not show (``regress.contradicts``), or,
    for a call with none timed above it, that its children do not show
    (``regress.unexplained``); ``time_contradicted_by`` names that call ("(children)").

    An enclosing call shows what is left of its change once its other children that changed
    work take theirs: in a diff with a planted wider layer, every call above it is slower by
    the plant, which must not confirm a sibling that a busy machine slowed in B's replay."""
    r["time_contradicted_by"] = None
    if not r["_changes"].get("time"):
        return
    delta, above = r["_dt"], False
    via, c = r["call_id_b"], parent_b.get(r["call_id_b"], -1)
    while c in by_b:
        up = by_b[c]
        if _timed(up):
            above = True
            explained = sum(k["_dt"] for k in children_b.get(c, [])
                            if k["call_id_b"] != via and _timed(k) and k["_changes"].get("work"))
            if regress.contradicts(delta, up["_dt"] - explained, _band(up)):
                r["_changes"]["time"] = 0
                r["time_contradicted_by"] = up["fqn"]
                return
        via, c = c, parent_b.get(c, -1)
    kids = [k for k in children_b.get(r["call_id_b"], []) if _timed(k)]
    if not above and kids and regress.unexplained(delta, sum(k["_dt"] for k in kids)):
        r["_changes"]["time"] = 0
        r["time_contradicted_by"] = "(children)"


def _enclose(out: list[dict], by_b: dict, parent_b: dict) -> None:
    """A call's regression is every enclosing call's too (a replayed parent runs it): its
    metrics go up B's call tree to the root, so a regression names the path down to it."""
    for r in out:
        r.setdefault("_held", set())
    for r in out:
        up = {m for m, c in r["_changes"].items() if c > 0}
        c = parent_b.get(r["call_id_b"], -1) if up else -1
        while c in by_b:
            by_b[c]["_held"] |= up
            c = parent_b.get(c, -1)


def _verdict(r: dict) -> None:
    """Fill regression, regressed, improved and verdict of one row."""
    changes, held = r.pop("_changes"), r.pop("_held")
    r.pop("_dt", None)
    if r["match"] in (ONLY_A, ONLY_B):
        held = set()
    up = {m for m, c in changes.items() if c > 0} | held
    r["regressed"] = ",".join(m for m in METRICS if m in up)
    r["improved"] = ",".join(m for m in METRICS if changes.get(m, 0) < 0 and m not in up)
    r["regression"] = bool(r["regressed"])
    r["verdict"] = (r["match"] if r["match"] in (ONLY_A, ONLY_B) else
                    "regressed" if r["regressed"] else "improved" if r["improved"] else
                    "unchanged" if changes else "no figures")


def check_out_path(path, *, force: bool = False) -> Path:
    """``path`` as a Path if the table may be written there (.parquet or .csv; an existing
    file only with ``force``); else DiffError. Callers check before the work, too."""
    path = Path(path)
    if path.suffix not in (".parquet", ".csv"):
        raise DiffError(f"{path}: the table is written as .parquet or .csv, not "
                        f"'{path.suffix or '(no suffix)'}'")
    if path.exists() and not force:
        raise DiffError(f"{path} exists; pass force=True to overwrite it", retry="force")
    if not path.parent.is_dir():
        raise DiffError(f"{path}: no folder {path.parent}")
    return path


def write_diff(df, path, *, force: bool = False) -> Path:
    """Write the diff table to ``path`` (.parquet or .csv), atomically; an existing file only
    with ``force``."""
    path = check_out_path(path, force=force)
    with atomic_path(path) as tmp:
        if path.suffix == ".csv":
            df.to_csv(tmp, index=False)
        else:
            df.to_parquet(tmp, index=False)
    return path
