"""``cbtrace diff RUN_A RUN_B``: the two runs compared call by call, regressions flagged.

Calls are aligned by name, else by tree position (``workflows/align.py``); when a change
counts is ``workflows/regress.py``. Improvements are the same tests the other way round,
reported and never flagged.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from cbtrace.errors import CbtraceError, RunDirError
from cbtrace.workflows import regress
from cbtrace.workflows.align import ONLY_A, ONLY_B, align

# compared figures: column -> metric name in ``regressed`` / ``improved`` (None: reported only)
VALUES = {"isolated_ms": "time", "peak_mem_bytes": "memory", "flops": None, "bytes": None,
          "mfu": None, "mbu": None}
CONTEXT = ("isolated_ms_p10", "isolated_ms_p90", "status", "noisy")


# time thresholds by where the runs were replayed (min_time_rel, min_time_ms). On the shared
# 2-core CPU, replays of one run put single calls up to 2.8x apart: at the GPU's thresholds 90+
# of 110 pairs of identical replays flagged calls, at these none (tests/test_diff.py)
TIME_THRESHOLDS = {"gpu": (0.05, 0.001), "cpu": (1.5, 0.05)}


@dataclass(kw_only=True)
class DiffConfig:
    min_time_rel: float | None = None
    """A time change counts from this much (relative: B / A - 1, or A / B - 1 for a gain);
    None: by device, 5 % where both runs were replayed on a GPU, 150 % where one was on a CPU."""
    min_time_ms: float | None = None
    """... and from this much (ms); None: by device, 1 µs on a GPU, 50 µs on a CPU."""
    min_mem_rel: float = 0.10
    """A peak-memory change counts from this much (relative)."""
    min_mem_bytes: int = 1 << 20
    """... and from this much (bytes: 1 MiB)."""
    noise_k: float = 3.0
    """The relative time threshold is at least exp(noise_k * sigma) - 1, sigma the robust
    standard deviation of log(B / A) over the calls timed in both runs: their run-to-run
    drift, which one replay's p10-p90 does not show; 0: off."""

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if v is not None and v < 0}
        if bad:
            raise ValueError(f"diff thresholds must be >= 0: {bad}")


class DiffError(CbtraceError):
    """Two runs cannot be compared, or the comparison cannot be written."""


def diff_runs(a, b, **options):
    """Compare run B against run A, call by call; a pandas DataFrame, one row per call.

    Args:
        a, b: run directories (A the baseline, B the candidate), replayed for figures.
        **options: fields of ``DiffConfig`` (min_time_rel, min_time_ms, min_mem_rel,
            min_mem_bytes, noise_k).
    Returns:
        Columns fqn, call_index, module_type, depth, match (name | position | only_a |
        only_b), fqn_a, fqn_b, call_id_a, call_id_b; per figure X of isolated_ms,
        peak_mem_bytes, flops, bytes, mfu, mbu: X_a, X_b, X_delta (B - A), X_rel (B / A - 1);
        isolated_ms_p10/_p90, status and noisy of each run; regression (bool), regressed and
        improved ("time,memory", "" for none), time_contradicted_by (the enclosing call
        whose time did not move with the call's, which dropped its time change), verdict
        (regressed | improved | unchanged | no figures | only_a | only_b). ``attrs`` holds
        the settings and the time threshold applied (time_noise_sigma, time_threshold_rel).
    """
    from cbtrace.rundir.read import load_run

    cfg = DiffConfig(**options)
    frames, devices = [], []
    for run in (a, b):
        manifest, df = load_run(run)
        if df.empty:
            raise RunDirError(f"{run}: modules.parquet holds no module calls")
        frames.append(df)
        devices.append(manifest.replay.device if manifest.replay else manifest.device)
    return diff_frames(*frames, with_device_thresholds(cfg, devices))


def with_device_thresholds(cfg: DiffConfig, devices) -> DiffConfig:
    """``cfg`` with its unset time thresholds taken from where the runs were replayed: the
    CPU's where either run was replayed on one, else the GPU's."""
    from dataclasses import replace

    kind = "cpu" if any(not str(d).startswith("cuda") for d in devices) else "gpu"
    rel, ms = TIME_THRESHOLDS[kind]
    return replace(cfg, min_time_rel=rel if cfg.min_time_rel is None else cfg.min_time_rel,
                   min_time_ms=ms if cfg.min_time_ms is None else cfg.min_time_ms)


def _rows(df) -> dict[int, dict]:
    clean = df.astype(object).where(df.notna(), None)
    return {int(r["call_id"]): r for r in clean.to_dict("records")}


def diff_frames(df_a, df_b, cfg: DiffConfig | None = None):
    """``diff_runs`` on two modules DataFrames (columns of ``ModuleRecord``)."""
    import pandas as pd

    cfg = with_device_thresholds(cfg or DiffConfig(), ["cuda"])  # unset: the GPU's
    ra, rb = _rows(df_a), _rows(df_b)
    out = [_pair(ra.get(ca, {}), rb.get(cb, {}), how)
           for ca, cb, how in align(list(ra.values()), list(rb.values()))]
    timed = [(r["isolated_ms_a"], r["isolated_ms_b"]) for r in out if _timed(r)]
    sigma = regress.time_noise(timed)
    min_time_rel = max(cfg.min_time_rel, math.expm1(cfg.noise_k * sigma))
    visible_rel = max(cfg.min_time_rel, math.expm1(2 * sigma))
    for r in out:
        _judge(r, cfg, min_time_rel)
    by_b = {r["call_id_b"]: r for r in out if r["call_id_b"] is not None}
    parent_b = {c: x["parent_call_id"] for c, x in rb.items()}
    for r in out:
        _check_ancestors(r, by_b, parent_b, visible_rel)
        _verdict(r)
    df = pd.DataFrame(out)
    for c in ("call_id_a", "call_id_b"):
        df[c] = df[c].astype("Int64")
    df.attrs.update(asdict(cfg), time_noise_sigma=sigma, time_threshold_rel=min_time_rel,
                    noise_calls=len(timed))
    return df


def _pair(a: dict, b: dict, how: str) -> dict:
    one = b or a
    row = {"fqn": one["fqn"], "call_index": one["call_index"], "module_type": one["module_type"],
           "depth": one["depth"], "match": how, "fqn_a": a.get("fqn"), "fqn_b": b.get("fqn"),
           "call_id_a": a.get("call_id"), "call_id_b": b.get("call_id")}
    for col in VALUES:
        x, y = a.get(col), b.get(col)
        both = x is not None and y is not None
        row.update({f"{col}_a": x, f"{col}_b": y, f"{col}_delta": y - x if both else None,
                    f"{col}_rel": regress.rel(x, y) if both else None})
    for col in CONTEXT:
        row[f"{col}_a"], row[f"{col}_b"] = a.get(col), b.get(col)
    return row


def _ok(r: dict, side: str) -> bool:
    return r[f"status_{side}"] in (None, "ok")


def _timed(r: dict) -> bool:
    return (r["match"] not in (ONLY_A, ONLY_B) and _ok(r, "a") and _ok(r, "b")
            and r["isolated_ms_a"] is not None and r["isolated_ms_b"] is not None)


def _judge(r: dict, cfg: DiffConfig, min_time_rel: float) -> None:
    """The row's time and memory changes (+1, -1, 0; absent without figures)."""
    r["_changes"] = changes = {}
    if _timed(r):
        spread = [tuple(r[f"isolated_ms{s}_{side}"] for s in ("", "_p10", "_p90"))
                  for side in "ab"]
        changes["time"] = regress.time_change(*spread, min_rel=min_time_rel,
                                              min_ms=cfg.min_time_ms)
    if r["peak_mem_bytes_delta"] is not None:
        changes["memory"] = regress.memory_change(
            r["peak_mem_bytes_a"], r["peak_mem_bytes_b"], min_rel=cfg.min_mem_rel,
            min_bytes=cfg.min_mem_bytes)


def _check_ancestors(r: dict, by_b: dict, parent_b: dict, visible_rel: float) -> None:
    """Drop a time change that an enclosing call does not show (``regress.contradicts``);
    ``time_contradicted_by`` names that call."""
    r["time_contradicted_by"] = None
    if not r["_changes"].get("time"):
        return
    c = parent_b.get(r["call_id_b"], -1)
    while c in by_b:
        up = by_b[c]
        if _timed(up) and regress.contradicts(r["isolated_ms_delta"], up["isolated_ms_a"],
                                              up["isolated_ms_delta"], visible_rel):
            r["_changes"]["time"] = 0
            r["time_contradicted_by"] = up["fqn"]
            return
        c = parent_b.get(c, -1)


def _verdict(r: dict) -> None:
    """Fill regression, regressed, improved and verdict of one row."""
    changes = r.pop("_changes")
    r["regressed"] = ",".join(m for m, c in changes.items() if c > 0)
    r["improved"] = ",".join(m for m, c in changes.items() if c < 0)
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
        raise DiffError(f"{path} exists; pass --force to overwrite it")
    if not path.parent.is_dir():
        raise DiffError(f"{path}: no folder {path.parent}")
    return path


def write_diff(df, path, *, force: bool = False) -> Path:
    """Write the diff table to ``path`` (.parquet or .csv), atomically; an existing file only
    with ``force``."""
    from cbtrace.rundir.files import atomic_path

    path = check_out_path(path, force=force)
    with atomic_path(path) as tmp:
        if path.suffix == ".csv":
            df.to_csv(tmp, index=False)
        else:
            df.to_parquet(tmp, index=False)
    return path
