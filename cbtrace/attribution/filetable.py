"""One trace file's rows: the table's columns, the rows of loaded events (all of a trace or a
window of it), a file's columns, and aggregates over steps.

Under ``attribute`` (the entry point) and ``ranks`` (files in worker processes), over
``windows`` (a trace larger than memory): the modules import one way. No pandas import: a
worker process imports this module to attribute its file and sends columns back.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from cbtrace.attribution import forest as forest_mod
from cbtrace.attribution import insitu, loader, windows
from cbtrace.attribution.op_costs import OpCoster
from cbtrace.errors import TraceError

AGG_COLUMNS = ("cpu_ms", "cpu_self_ms", "gpu_ms", "gpu_self_ms", "gpu_busy_ms", "gpu_span_ms",
               "comm_ms", "comm_exposed_ms")
GROUP = ["rank", "fqn", "call_index", "phase"]
_RANK_IN_NAME = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)
COLUMNS = ["rank", "step", "fqn", "source", "call_index", "depth", "parent_fqn", "phase",
           "cpu_ms", "cpu_self_ms", "gpu_ms", "gpu_self_ms", "gpu_busy_ms", "gpu_span_ms",
           "kernel_count", "comm_ms", "comm_exposed_ms", "flops", "flops_executed", "bytes",
           "ops_without_formula", "compute_dtype", "mfu", "mbu", "figures_suspect",
           "module_label", "pid", "tid", "ts_us", "dur_us", "ev_index", "trace"]


def rank_of(meta: dict, path: Path, default: int) -> int:
    """distributedInfo.rank, else a rank/worker number in the file name, else ``default``."""
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else default


def device_name_of(meta: dict) -> str | None:
    props = meta.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        return props[0].get("name")
    return None


def file_columns(path, *, rank: int | None = None, class_map: dict | None = None,
                 steps_per_window: int | None = None, grad_sums: dict | None = None) -> dict:
    """``attribute_file``'s columns (COLUMNS, in order) as arrays and lists, without pandas:
    what a worker process sends back (ranks.py). ``grad_sums``: see ``insitu.rows``."""
    path = Path(path)
    coster = OpCoster()
    if steps_per_window:
        meta, loads = windows.window_loads(path, coster, steps_per_window)
        parts = [table(path, cols, coster, class_map=class_map, device_filter=keep, part=part,
                       grad_sums=grad_sums)
                 for cols, keep, part in loads]
    else:
        cols = loader.load(path, on_op=coster)
        parts = [table(path, cols, coster, class_map=class_map, grad_sums=grad_sums)]
        meta = cols.meta
    with_shapes = any(p.pop("~with_shapes") for p in parts)
    out = {k: _concat([p[k] for p in parts]) for k in parts[0]}
    n = len(out["step"])
    if not with_shapes:  # no op shapes anywhere: no FLOPs known
        for k in ("flops", "flops_executed", "bytes", "mbu", "mfu"):
            out[k] = np.full(n, np.nan)
        out["figures_suspect"] = np.zeros(n, bool)
    out["rank"] = np.full(n, rank_of(meta, path, 0) if rank is None else rank, np.int64)
    out["trace"] = [str(path)] * n
    return {k: out[k] for k in COLUMNS}


def _concat(cols: list):
    if len(cols) == 1:
        return cols[0]
    if any(isinstance(c, list) for c in cols):
        return [v for c in cols for v in c]
    return np.concatenate([np.atleast_1d(c) for c in cols])


def table(path, cols, coster, *, class_map=None, device_filter=None, part=False,
          grad_sums=None) -> dict:
    """Columns of the rows of loaded events (all of a trace, or one window of it).

    ``device_filter(forest) -> bool mask`` drops device events that another window counts;
    ``part``: the events are a window of the trace (it may be empty; see windows.py).
    """
    if cols.n_events == 0:
        raise TraceError(f"{path}: the trace has no events")
    forest = forest_mod.build(cols)
    if device_filter is not None:
        forest.keep_device(device_filter(forest))
    if not len(forest.host) and not len(forest.d_ts) and not part:
        raise TraceError(f"{path}: no host or device duration events to attribute")
    data = insitu.rows(forest, costs=coster.costs, class_map=class_map,
                       device_name=device_name_of(cols.meta), with_shapes=True,
                       every_step=not part or bool(forest.steps), grad_sums=grad_sums)
    data["~with_shapes"] = bool((forest.cost >= 0).any())
    return data


def add_aggregates(df):
    """``<col>_median/_min/_max`` over steps >= 0 of each (rank, fqn, call_index, phase)."""
    steps = df[df["step"] >= 0] if (df["step"] >= 0).any() else df
    stats = steps.groupby(GROUP)[list(AGG_COLUMNS)].agg(["median", "min", "max"])
    stats.columns = [f"{c}_{s}" for c, s in stats.columns]
    return df.merge(stats.reset_index(), on=GROUP, how="left")


def summarize(df):
    """One row per (rank, fqn, call_index, phase): the first step's row with its aggregates."""
    if "cpu_ms_median" not in df.columns:
        df = add_aggregates(df)
    return df.sort_values(["rank", "step"]).drop_duplicates(GROUP).reset_index(drop=True)
