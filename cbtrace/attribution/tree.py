"""Host events nested per thread, device events, launches and profiler steps of one trace.

Format drift handled here: torch 1.9 categories (Operator / Runtime / Kernel / Memcpy / Memset)
and string tids ("25738", "stream 7"), lowercase ``external id``, float sub-µs timestamps (kept
as µs floats; ``displayTimeUnit: ns`` only changes how viewers display them), MTIA device
events (``mtia_ccp_events``) and AMD traces (same categories as CUDA).
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from cbtrace.attribution.loader import Event, LoadedTrace

# Device activity whose durations make up "device time". GPU-side annotations
# (gpu_user_annotation) and sync markers (cuda_sync) span other activity and are not counted.
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset",
                         "mtia_ccp_events"})
# Host-side X events that are not code ranges of the profiled process.
SKIP_CATS = frozenset({"Trace", "gpu_user_annotation", "cuda_profiler_range", "critical_path",
                       "cuda_sync"})
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
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


@dataclass
class Forest:
    host: list[Event]                  # host events sorted by (pid, tid, ts, -dur)
    parent: list[int]                  # index into host of the enclosing event, -1 at top
    device: list[Event]                # device events, in file order
    launcher: list[int]                # host index of the launching event per device event, -1
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (N, start, end) µs
    step_of_host: list[int] = field(default_factory=list)  # step N per host event, -1 outside

    def step_at(self, ts: float) -> int:
        """Profiler step whose window contains ``ts``, -1 outside every step (or no steps)."""
        starts = [s[1] for s in self.steps]
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts < self.steps[i][2]:
            return self.steps[i][0]
        return -1


def build(trace: LoadedTrace) -> Forest:
    device = [e for e in trace.events if e.cat in DEVICE_CATS]
    device_pids = {e.pid for e in device}
    host = []
    for e in trace.events:
        if e.cat in DEVICE_CATS or e.cat in SKIP_CATS or e.pid in device_pids:
            continue
        pid, tid = norm_id(e.pid), norm_id(e.tid)
        if not isinstance(pid, int) or not isinstance(tid, int):
            continue  # "Spans" / "Traces" pseudo-processes
        e.pid, e.tid = pid, tid
        host.append(e)
    host.sort(key=lambda e: (e.pid, e.tid, e.ts, -e.dur, e.idx))
    forest = Forest(host, _nest(host), device, [])
    forest.steps = _steps(host)
    starts = [s[1] for s in forest.steps]
    forest.step_of_host = [_step_index(forest.steps, starts, e.ts) for e in host]
    forest.launcher = _launchers(trace, host, device)
    return forest


def _nest(host: list[Event]) -> list[int]:
    """Parent per event: the innermost earlier event on the thread that is still open."""
    parent = [-1] * len(host)
    stack: list[tuple[float, int]] = []  # (end, index)
    thread = None
    for i, e in enumerate(host):
        if (e.pid, e.tid) != thread:
            thread, stack = (e.pid, e.tid), []
        while stack and stack[-1][0] <= e.ts:
            stack.pop()
        if stack:
            parent[i] = stack[-1][1]
        stack.append((e.ts + e.dur, i))
    return parent


def _steps(host: list[Event]) -> list[tuple[int, float, float]]:
    steps = []
    for e in host:
        m = _STEP.match(e.name)
        if m:
            steps.append((int(m.group(1)), e.ts, e.ts + e.dur))
    steps.sort(key=lambda s: s[1])
    return steps


def _step_index(steps, starts, ts) -> int:
    i = bisect.bisect_right(starts, ts) - 1
    return steps[i][0] if i >= 0 and ts < steps[i][2] else -1


def correlation(e: Event):
    a = e.args
    return None if a is None else a.corr


def _launchers(trace: LoadedTrace, host: list[Event], device: list[Event]) -> list[int]:
    """Host event that launched each device event: same ``correlation``, else an ac2g flow."""
    by_corr = {}
    for i, e in enumerate(host):
        c = correlation(e)
        if c is not None:
            by_corr[c] = i
    flow_at = {(norm_id(p), norm_id(t), ts): fid for fid, (p, t, ts) in trace.flow_ends.items()}
    out = []
    for e in device:
        c = correlation(e)
        if c is None or c not in by_corr:
            c = flow_at.get((norm_id(e.pid), norm_id(e.tid), e.ts), c)
        out.append(by_corr.get(c, -1) if c is not None else -1)
    return out
