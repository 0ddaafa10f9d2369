"""Interval arithmetic on sorted arrays: merged intervals, covered length, device-busy time.

A call's device events may overlap: kernels on several streams (cuDNN's grouped convolutions,
a copy beside a kernel, a collective beside compute). Their summed durations then count the
same wall time more than once; the time the device was busy with them is the length of their
union (``busy``), per device.
"""
from __future__ import annotations

import numpy as np


def union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The intervals [start, end) merged into sorted disjoint ones: (lo, hi)."""
    if not len(start):
        return np.zeros(0), np.zeros(0)
    o = np.argsort(start, kind="stable")
    s, e = start[o], end[o]
    reach = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > reach[:-1]]
    last = np.r_[np.flatnonzero(new)[1:] - 1, len(s) - 1]
    return s[new], reach[last]


def covered(lo: np.ndarray, hi: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per query [a, b): its length inside the disjoint sorted intervals [lo, hi)."""
    if not len(lo):
        return np.zeros(len(a))
    cum = np.r_[0.0, np.cumsum(hi - lo)]

    def upto(t):  # covered length in (-inf, t)
        i = np.searchsorted(lo, t, side="right")
        j = np.maximum(i - 1, 0)
        return np.where(i > 0, cum[j] + np.clip(t - lo[j], 0.0, hi[j] - lo[j]), 0.0)

    return np.maximum(upto(b) - upto(a), 0.0)


def overlapping(device: np.ndarray, start: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Per interval: does another interval of the same ``device`` overlap it (by a positive
    length)? Those are the only ones whose busy time differs from their duration."""
    n = len(start)
    out = np.zeros(n, bool)
    o = np.flatnonzero(dur > 0)  # an empty interval overlaps nothing
    if len(o) < 2:
        return out
    o = o[np.lexsort((start[o], device[o]))]
    g, s, e = device[o], start[o], start[o] + dur[o]
    reach = _segmented_max(g, e)
    after_prev = np.r_[False, (g[1:] == g[:-1]) & (s[1:] < reach[:-1])]  # an earlier one reaches
    before_next = np.r_[(g[1:] == g[:-1]) & (s[1:] < e[:-1]), False]  # the next one starts in
    # i overlaps a later one iff the next one starts inside it (later ones start later still)
    out[o] = after_prev | before_next
    return out


def busy(group: np.ndarray, start: np.ndarray, dur: np.ndarray, ngroups: int) -> np.ndarray:
    """Per group id in [0, ngroups): the length of the union of its intervals [start,
    start + dur), by a segmented running maximum over the intervals sorted by group and start
    (timestamps taken relative to the earliest, so that a trace clock's ~1e12 keeps its
    precision)."""
    out = np.zeros(ngroups)
    if not len(start):
        return out
    o = np.lexsort((start, group))
    g, s = group[o], start[o] - start.min()  # small numbers: trace clocks are ~1e12 us
    e = s + dur[o]
    reach = _segmented_max(g, e)
    first = np.r_[True, g[1:] != g[:-1]]
    prev = np.where(first, -np.inf, np.r_[-np.inf, reach[:-1]])
    np.add.at(out, g, np.maximum(e - np.maximum(s, prev), 0.0))
    return out


def _segmented_max(g: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Running maximum of ``v`` that restarts where ``g`` (sorted) changes; log2(n) passes."""
    out = v.astype(np.float64, copy=True)
    k, n = 1, len(v)
    while k < n:
        same = g[k:] == g[:-k]
        np.maximum(out[k:], np.where(same, out[:-k], -np.inf), out=out[k:])
        k *= 2
    return out

