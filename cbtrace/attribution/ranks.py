"""Many ranks: their traces attributed in worker processes, and the across-rank view.

Workers: ``attribute(paths, workers=N)`` attributes the files in N spawned processes
(``concurrent.futures`` with multiprocessing's spawn context; default: one per usable core).
A worker attributes one file at a time and sends back only its table (a few hundred bytes per
row), so a worker's memory is that of the largest single file, whatever the number of ranks,
and the parent holds the tables only. Results come back in file order: the table is the same
for any number of workers. As with any spawn-based pool, a script calling ``attribute`` with
more than one worker needs the ``if __name__ == "__main__":`` guard (a spawned worker imports
the main script); the CLI, ``python -c``, notebooks and pytest need nothing.

Across ranks (``across_ranks(df)``): per (fqn, call_index, phase), each rank's median over steps of
its time (``gpu_busy_ms``, the time its device was busy with its kernels, where the call has device
events on some rank, else ``cpu_ms``), then the min, median and max of those over ranks, the slowest
rank, and ``spread`` = max / median - 1 (0.25: the slowest rank takes 25 % longer than the median
one). Rows are sorted by max - median: the time the slowest rank holds the others up by.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pandas as pd

from cbtrace.attribution.filetable import file_columns, summarize
from cbtrace.errors import TraceError

KEY = ["fqn", "call_index", "phase"]
ACROSS_COLUMNS = ["fqn", "call_index", "phase", "metric", "ranks", "min_ms", "median_ms",
                  "max_ms", "slowest_rank", "spread"]


def default_workers() -> int:
    """One per core this process may run on."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def attribute_files(files: list, *, workers: int | None = None, **kwargs) -> list:
    """``attribute_file(f, **kwargs)`` of each file, in file order, in ``workers`` processes
    (None: ``default_workers()``; 1: here, in this process)."""
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    n = min(default_workers() if workers is None else workers, len(files))
    one = functools.partial(file_columns, **kwargs)  # columns: a worker never imports pandas
    if n <= 1:
        return [pd.DataFrame(one(f)) for f in files]
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
    try:
        results = pool.map(one, files)  # the workers start here
        return [pd.DataFrame(c) for c in results]
    except BrokenProcessPool:
        raise TraceError(f"a worker process died while attributing {len(files)} traces: out "
                         "of memory (use fewer --workers, or --steps-per-window), or a script "
                         "that calls cbtrace.attribute outside `if __name__ == \"__main__\":` "
                         "(workers are spawned and import it; or pass workers=1)") from None
    finally:
        pool.shutdown(cancel_futures=True)


def across_ranks(df):
    """One row per (fqn, call_index, phase) over ranks (see the module docstring).

    Columns: fqn, call_index, phase, metric ("gpu_busy_ms" | "cpu_ms"), ranks (how many have the
    call), min_ms, median_ms, max_ms (over ranks of each rank's median over steps),
    slowest_rank, spread (max / median - 1; NaN where the median is 0).
    """
    if not len(df):
        return pd.DataFrame(columns=ACROSS_COLUMNS)
    on_device = df.groupby(KEY, sort=False)["kernel_count"].max() > 0
    s = summarize(df).sort_values("rank", kind="stable").reset_index(drop=True)
    dev = on_device.reindex(pd.MultiIndex.from_frame(s[KEY])).to_numpy(bool)
    s["time_ms"] = np.where(dev, s["gpu_busy_ms_median"], s["cpu_ms_median"])
    s["metric"] = np.where(dev, "gpu_busy_ms", "cpu_ms")
    g = s.groupby(KEY, sort=False)
    out = g.agg(metric=("metric", "first"), ranks=("rank", "nunique"),
                min_ms=("time_ms", "min"), median_ms=("time_ms", "median"),
                max_ms=("time_ms", "max"))
    out["slowest_rank"] = s.loc[g["time_ms"].idxmax(), "rank"].to_numpy()
    med = out["median_ms"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["spread"] = np.where(med > 0, out["max_ms"].to_numpy(float) / med - 1, np.nan)
    out = out.reset_index()
    order = np.argsort(-(out["max_ms"] - out["median_ms"]).to_numpy(float), kind="stable")
    return out.iloc[order][ACROSS_COLUMNS].reset_index(drop=True)


def across_text(df, *, top: int = 15) -> str:
    """The across-rank view as a short table: the calls whose slowest rank lags the most."""
    a = across_ranks(df)
    head = (f"across {df['rank'].nunique()} ranks: each rank's median over steps (gpu_busy_ms "
            "with device events, else cpu_ms); spread = max / median - 1")
    return "\n".join([head, a.head(top).to_string(
        index=False, float_format=lambda v: f"{v:.4g}")])
