"""Attribution of a trace larger than memory: a window of profiler steps at a time.

The one-pass path (``loader.load`` then ``forest.build``) streams the JSON chunk by chunk but keeps
every complete event as ~64 bytes of columns (plus ~100 bytes of working arrays while
attributing): about half the trace's JSON size. Here memory is bounded by one window instead:

1. One pass reads only the ``ProfilerStep#N`` ranges (a ``keep`` filter drops the rest per
   chunk, so this pass holds a chunk at a time).
2. One pass per window of ``steps_per_window`` consecutive steps keeps its host events (ts
   inside one of its steps) and the device events and flow ends from its first step's start
   to the end of the next window (kernels run behind their launches). A device event counts in
   the window of the op that launched it; one with no launcher there counts only in the window
   whose steps contain it, and only if the previous window did not count it (its late kernels).
3. A last pass takes the host events outside every step, and the device events outside every
   step that no window counted.

Each pass holds a window's events plus one chunk; the file is read ``windows + 2`` times.
The table equals the one-pass table (rows in window order) except where events of a step nest
in, or launch device work from, events outside every step: those lose that parent or launcher.
"""
from __future__ import annotations

import numpy as np

from cbtrace.attribution import forest, loader
from cbtrace.errors import TraceError


def step_windows(path, coster) -> tuple[np.ndarray, np.ndarray, dict]:
    """(start, end) µs of every ProfilerStep#N range, by start; and the trace metadata."""
    names: dict = {}

    def keep(ts, cats, nms):  # host ranges only, as forest.build: not GPU-side annotations
        return np.fromiter((names.setdefault(n, forest.STEP_NAME.match(n) is not None)
                            and c not in forest.SKIP_CATS and c not in forest.DEVICE_CATS
                            for n, c in zip(nms, cats)), bool, len(nms))

    cols = loader.load(path, on_op=coster, keep=keep)
    if cols.n_events == 0:
        raise TraceError(f"{path}: the trace has no events")
    ids = [isinstance(forest.norm_id(v), int) for v in cols.ids]
    host = np.flatnonzero([ids[p] and ids[t] for p, t in zip(cols.pid, cols.tid)])
    ts, end = cols.ts[host], (cols.ts + cols.dur)[host]
    order = np.argsort(ts, kind="stable")
    return ts[order], end[order], cols.meta


def step_position(starts: np.ndarray, ends: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Index of the step window holding each ts (as forest.step_index), -1 outside all."""
    i = np.searchsorted(starts, ts, side="right") - 1
    ok = (i >= 0) & (ts < ends[np.maximum(i, 0)]) if len(starts) else np.zeros(len(ts), bool)
    return np.where(ok, i, -1)


def window_loads(path, coster, steps_per_window: int):
    """(trace metadata, the loads to attribute in turn): each load is (columns, device filter
    or None, whether it is a part of the trace), for ``filetable.table``. A window's device
    filter learns what it counted while its table is made, so the loads come one at a time."""
    starts, ends, meta = step_windows(path, coster)
    return meta, _loads(path, coster, steps_per_window, starts, ends)


def _loads(path, coster, steps_per_window, starts, ends):
    k = len(starts)
    if k == 0:  # no steps: nothing to window by
        yield loader.load(path, on_op=coster), None, False
        return
    bounds = list(range(0, k, steps_per_window)) + [k]
    late, no_step = np.zeros(0, np.int64), []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        nxt = min(hi + steps_per_window, k)
        keep = _WindowKeep(starts, ends, lo, hi, starts[lo], starts[nxt] if nxt < k else np.inf)
        counted = _Counted(starts, ends, lo, hi, late)
        yield loader.load(path, on_op=coster, keep=keep), counted, True
        late = counted.late
        no_step.append(counted.no_step)
    done = np.concatenate(no_step)
    cols = loader.load(path, on_op=coster,
                       keep=lambda ts, cats, names: step_position(starts, ends, ts) < 0)
    if len(cols):
        yield cols, lambda f: ~np.isin(f.d_idx, done), True


class _WindowKeep:
    """Loader filter of one window: its steps' host events, device events in [dev_lo, dev_hi)."""

    def __init__(self, starts, ends, lo, hi, dev_lo, dev_hi):
        self.starts, self.ends, self.lo, self.hi = starts, ends, lo, hi
        self.dev_lo, self.dev_hi = dev_lo, dev_hi

    def __call__(self, ts, cats, names):
        dev = np.fromiter((c in forest.DEVICE_CATS or c == loader.FLOW for c in cats), bool,
                          len(cats))
        pos = step_position(self.starts, self.ends, ts)
        return np.where(dev, (ts >= self.dev_lo) & (ts < self.dev_hi),
                        (pos >= self.lo) & (pos < self.hi))


class _Counted:
    """Device filter of one window; remembers what it counted outside the window's steps.

    ``late``: counted device events inside a later step (the next window skips them);
    ``no_step``: counted ones outside every step (the last pass skips them).
    """

    def __init__(self, starts, ends, lo, hi, prev_late):
        self.starts, self.ends, self.lo, self.hi, self.prev = starts, ends, lo, hi, prev_late

    def __call__(self, f) -> np.ndarray:
        pos = step_position(self.starts, self.ends, f.d_ts)
        m = ~np.isin(f.d_idx, self.prev) & ((f.launcher >= 0) | ((pos >= self.lo)
                                                                  & (pos < self.hi)))
        self.late, self.no_step = f.d_idx[m & (pos >= self.hi)], f.d_idx[m & (pos < 0)]
        return m
