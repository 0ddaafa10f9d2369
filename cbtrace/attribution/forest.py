"""Host events nested per thread, device events, launches and profiler steps of one trace.

Everything is numpy arrays over the loader's columns; no per-event Python objects. Host events
are sorted by (pid, tid, ts, -dur, idx), so a parent always precedes its children.

Format drift handled here: torch 1.9 categories (Operator / Runtime / Kernel / Memcpy / Memset)
and string tids ("25738", "stream 7"), float sub-µs timestamps (kept as µs floats;
``displayTimeUnit: ns`` only changes how viewers display them), MTIA device events
(``mtia_ccp_events``) and AMD traces (same categories as CUDA).
"""
from __future__ import annotations

import re
import numpy as np

from cbtrace.attribution import comm
from cbtrace.attribution.loader import Columns

# Device activity whose durations make up "device time". GPU-side annotations
# (gpu_user_annotation) and sync markers (cuda_sync) span other activity and are not counted.
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset",
                         "mtia_ccp_events"})
# Host-side X events that are not code ranges of the profiled process.
SKIP_CATS = frozenset({"Trace", "gpu_user_annotation", "cuda_profiler_range", "critical_path",
                       "cuda_sync"})
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
_INT = re.compile(r"-?\d+$")


def norm_id(v):
    """pid/tid as an int where it is one ("25738" -> 25738, "stream 7" -> 7)."""
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        if _INT.match(v):
            return int(v)
        if v.startswith("stream "):
            tail = v[7:].split()[0] if v[7:].split() else ""
            return int(tail) if _INT.match(tail) else v
    return v


def string_mask(strings: list, pred) -> np.ndarray:
    """Boolean per string code: ``pred(string)``; index with a code array."""
    return np.fromiter((bool(pred(s)) for s in strings), bool, len(strings))


class Forest:
    """Host events of one trace in nesting order, and its device events.

    Per host event (sorted by pid, tid, ts, -dur, idx; a parent precedes its children):
    ``ts``, ``dur``, ``idx``, ``name``, ``cat``, ``seq``, ``hier``, ``cost`` (the loader's
    columns), ``pid`` / ``tid`` (ints), ``parent`` (host index, -1 at the top), ``depth``,
    ``step_of_host`` (N of the enclosing ProfilerStep#N window, -1). Per device event (file
    order): ``d_ts``, ``d_dur``, ``d_idx``, ``d_dev`` (the device: its pid code), ``launcher``
    (host index of the launching op, -1),
    ``d_comm`` (a communication kernel), ``d_exposed`` (µs of it no compute kernel overlaps;
    comm.py).
    """

    def __init__(self, cols: Columns, host: np.ndarray, device: np.ndarray, norm: list):
        self.strings = cols.strings
        self.d_ts, self.d_dur, self.d_idx = cols.ts[device], cols.dur[device], cols.idx[device]
        d_corr, d_pid, d_tid = cols.corr[device], cols.pid[device], cols.tid[device]
        self.d_comm, self.d_exposed = _comm(cols, device, d_pid, d_tid)
        self.d_dev = np.asarray(d_pid, np.int64)
        self.host = host
        for k in ("ts", "dur", "idx", "name", "cat", "seq", "hier", "cost", "corr", "pid",
                  "tid"):
            setattr(self, k, getattr(cols, k)[host])
            setattr(cols, k, None)  # one copy at a time: the file-order column is dropped
        self.pid = _norm_values(norm)[self.pid]
        self.tid = _norm_values(norm)[self.tid]
        self.parent, self.depth = nest(self.ts, self.dur, self.pid, self.tid)
        self.steps = _steps(self)
        self.step_of_host = step_index(self.steps, self.ts)
        self.launcher = _launchers(self, cols.flows, d_corr, d_pid, d_tid, norm)
        del self.corr

    def __len__(self):
        return len(self.host)

    def keep_device(self, mask: np.ndarray) -> None:
        """Drop the device events where ``mask`` is False (another window counts them)."""
        self.d_ts, self.d_dur, self.d_idx = self.d_ts[mask], self.d_dur[mask], self.d_idx[mask]
        self.d_comm, self.d_exposed = self.d_comm[mask], self.d_exposed[mask]
        self.d_dev, self.launcher = self.d_dev[mask], self.launcher[mask]

    def step_at(self, ts: np.ndarray) -> np.ndarray:
        """Profiler step whose window contains each ``ts``, -1 outside every step."""
        return step_index(self.steps, ts)

    def levels(self) -> list[np.ndarray]:
        """Host indices grouped by depth, shallowest first (each group in host order)."""
        if not hasattr(self, "_levels"):
            self._levels = by_level(self.depth)
        return self._levels

    def nearest(self, mark: np.ndarray) -> np.ndarray:
        """Per host event: its innermost ancestor-or-self with ``mark``, else -1."""
        out = np.full(len(self) + 1, -1, np.int64)  # out[-1]: the sentinel for "no parent"
        for idx in self.levels():
            out[idx] = np.where(mark[idx], idx, out[self.parent[idx]])
        return out[:-1]

    def outermost(self, mark: np.ndarray) -> np.ndarray:
        """Per host event: its outermost ancestor-or-self with ``mark``, else -1."""
        out = np.full(len(self) + 1, -1, np.int64)
        for idx in self.levels():
            up = out[self.parent[idx]]
            out[idx] = np.where(up >= 0, up, np.where(mark[idx], idx, -1))
        return out[:-1]

    def strict_any(self, mark: np.ndarray) -> np.ndarray:
        """Per host event: does a strict ancestor have ``mark``?"""
        out, m = np.zeros(len(self) + 1, bool), np.r_[mark, False]
        for idx in self.levels():
            p = self.parent[idx]
            out[idx] = out[p] | m[p]
        return out[:-1]

    def subtree_any(self, mark: np.ndarray) -> np.ndarray:
        """Per host event: does it or a descendant have ``mark``?"""
        out = np.r_[mark, False]
        for idx in reversed(self.levels()):
            out[self.parent[idx[out[idx]]]] = True
        return out[:-1]


def _comm(cols: Columns, device: np.ndarray, d_pid, d_tid) -> tuple[np.ndarray, np.ndarray]:
    """Per device event: is it a communication kernel, and its exposed µs (comm.exposed)."""
    if not len(device):
        return np.zeros(0, bool), np.zeros(0)
    is_comm = string_mask(cols.strings, comm.is_comm_kernel)[cols.name[device]]
    compute = string_mask(cols.strings, comm.COMPUTE_CATS.__contains__)[cols.cat[device]]
    return is_comm, comm.exposed(cols.ts[device], cols.dur[device], is_comm, compute, d_pid,
                                 d_tid)


def by_level(depth: np.ndarray) -> list[np.ndarray]:
    order = np.argsort(depth, kind="stable")
    counts = np.bincount(depth) if len(depth) else np.zeros(0, np.int64)
    return [g for g in np.split(order, np.cumsum(counts)[:-1]) if len(g)]


def _norm_values(norm: list) -> np.ndarray:
    return np.array([v if isinstance(v, int) else 0 for v in norm], np.int64)


def build(cols: Columns) -> Forest:
    """The forest of a loaded trace; takes over (and empties) ``cols``'s event columns."""
    strings, n = cols.strings, len(cols)
    norm = [norm_id(v) for v in cols.ids]
    is_int = np.fromiter((isinstance(v, int) for v in norm), bool, len(norm))
    norm_val = _norm_values(norm)
    dev_cat = string_mask(strings, DEVICE_CATS.__contains__)
    skip_cat = string_mask(strings, SKIP_CATS.__contains__)
    is_dev = dev_cat[cols.cat] if n else np.zeros(0, bool)
    device = np.flatnonzero(is_dev)
    host_mask = ~is_dev
    if n:
        host_mask &= ~skip_cat[cols.cat] & ~np.isin(cols.pid, np.unique(cols.pid[device]))
        host_mask &= is_int[cols.pid] & is_int[cols.tid]
    rows = np.flatnonzero(host_mask)
    del is_dev, host_mask
    order = np.lexsort((cols.idx[rows], -cols.dur[rows], cols.ts[rows],
                        norm_val[cols.tid[rows]], norm_val[cols.pid[rows]]))
    return Forest(cols, rows[order], device, norm)


_SEGMENT = 1 << 16  # events nested at a time per thread (bounds the sparse table: ~10 MB)


def nest(ts, dur, pid, tid) -> tuple[np.ndarray, np.ndarray]:
    """Parent and depth per event (sorted by thread, ts, -dur): the innermost enclosing event.

    The parent of i is the last earlier event on its thread that ends after ``ts[i]``: exactly
    what a stack of open events gives, also where events partly overlap (real traces have
    such), but found for all events at once by binary lifting over a sparse table of running
    maxima of the end times. A thread is done in segments; the events still open at a segment's
    start are carried into the next one.
    """
    n = len(ts)
    parent = np.full(n, -1, np.int64)
    cut = np.flatnonzero((np.diff(pid) != 0) | (np.diff(tid) != 0)) + 1
    for a, b in zip(np.r_[0, cut], np.r_[cut, n]):
        p = _nest_thread(ts[a:b], ts[a:b] + dur[a:b])
        parent[a:b] = np.where(p >= 0, p + a, -1)
    return parent, _depth(parent)


def _nest_thread(ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    m = len(ts)
    parent = np.full(m, -1, np.int64)
    alive = np.zeros(0, np.int64)  # earlier events still open at the segment's start
    for s in range(0, m, _SEGMENT):
        seg = np.arange(s, min(s + _SEGMENT, m))
        xs = np.r_[alive, seg]
        e = end[xs]
        p = _first_closed_run(e, np.arange(len(alive), len(xs)), ts[seg])
        parent[seg] = np.where(p >= 1, xs[np.maximum(p - 1, 0)], -1)
        if seg[-1] + 1 < m:
            alive = xs[e > ts[seg[-1] + 1]]
    return parent


def _first_closed_run(e: np.ndarray, q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per query k: the smallest p <= q[k] with max(e[p:q[k]]) <= x[k]."""
    tables = [e]  # tables[k][j] = max(e[j : j + 2**k])
    while (1 << len(tables)) <= len(e):
        prev, h = tables[-1], 1 << (len(tables) - 1)
        tables.append(np.maximum(prev[:-h], prev[h:]))
    pos = q.copy()
    for k in range(len(tables) - 1, -1, -1):
        cand = pos - (1 << k)
        move = (cand >= 0) & (tables[k][np.maximum(cand, 0)] <= x)
        pos = np.where(move, cand, pos)
    return pos


def _depth(parent: np.ndarray) -> np.ndarray:
    """Number of ancestors per node, by pointer jumping (log of the depth rounds)."""
    depth = (parent >= 0).astype(np.int64)
    up = parent.copy()
    while (up >= 0).any():
        has = up >= 0
        u = np.maximum(up, 0)
        depth = depth + np.where(has, depth[u], 0)
        up = np.where(has, up[u], -1)
    return depth


def _steps(f: Forest) -> list:
    nums = np.array([int(m.group(1)) if (m := STEP_NAME.match(x)) else -1 for x in f.strings],
                    np.int64)
    if not len(f.host) or not (nums >= 0).any():
        return []
    at = np.flatnonzero(nums[f.name] >= 0)
    out = [(int(nums[f.name[i]]), float(f.ts[i]), float(f.ts[i] + f.dur[i])) for i in at]
    return sorted(out, key=lambda s: s[1])


def step_index(steps: list, ts: np.ndarray) -> np.ndarray:
    if not steps:
        return np.full(len(ts), -1, np.int64)
    num = np.array([s[0] for s in steps], np.int64)
    start = np.array([s[1] for s in steps])
    end = np.array([s[2] for s in steps])
    i = np.searchsorted(start, ts, side="right") - 1
    ok = (i >= 0) & (ts < end[np.maximum(i, 0)])
    return np.where(ok, num[np.maximum(i, 0)], -1)


def _launchers(f: Forest, flows: list, d_corr, d_pid, d_tid, norm: list) -> np.ndarray:
    """Host event that launched each device event: same ``correlation``, else an ac2g flow."""
    hc = f.corr
    sel = np.flatnonzero(hc >= 0)
    o = sel[np.argsort(hc[sel], kind="stable")]
    v = hc[o]
    last = np.r_[v[1:] != v[:-1], True] if len(v) else np.zeros(0, bool)
    keys, owners = v[last], o[last]  # per correlation id: the last host event with it

    def lookup(c: np.ndarray) -> np.ndarray:
        if not len(keys):
            return np.full(len(c), -1, np.int64)
        pos = np.minimum(np.searchsorted(keys, c), len(keys) - 1)
        return np.where((c >= 0) & (keys[pos] == c), owners[pos], -1)

    out = lookup(d_corr)
    miss = np.flatnonzero(out < 0)
    if len(miss) and flows:
        ends = {fid: (norm[p], norm[t], ts) for fid, p, t, ts in flows}
        flow_at = {k: fid for fid, k in ends.items()}
        for j in miss.tolist():
            fid = flow_at.get((norm[d_pid[j]], norm[d_tid[j]], f.d_ts[j]))
            if isinstance(fid, int):
                out[j] = lookup(np.array([fid], np.int64))[0]
    return out
