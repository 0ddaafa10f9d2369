"""The profiled call: kernel count, device time, launch overhead, aten op count, peak memory.

``profile_call`` runs a call a few times under ``torch.profiler`` and reads the Kineto events
directly (no trace file). Wall time is measured outside the profiler, whose per-op bookkeeping
would inflate it. Peak memory is the CUDA allocator's high-water mark over its baseline; on CPU
it is an estimate: the peak of live bytes from the profiler's memory events during the calls.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch.autograd import profiler as autograd_profiler
from torch.profiler import ProfilerActivity, profile

from cbtrace.attribution import intervals
from cbtrace.console import quiet_kineto
from cbtrace.device import cupti_torn_down


DEVICE_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})  # Kineto activity names
CUPTI_HOST_ACTIVITIES = frozenset({"cuda_runtime", "cuda_driver"})  # host calls CUPTI records
MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel: marks where a call's own runs begin


@dataclass
class CallStats:
    """What the profiler saw for one call (per call, averaged over ``runs``)."""

    kernel_count: int            # device kernels + memcpy + memset
    device_ms: float             # the time the device was busy with them (overlaps count once)
    wall_ms: float               # median host wall time, synchronized, outside the profiler
    launch_overhead_ms: float    # max(wall - device, 0)
    peak_mem_bytes: int          # CUDA: max_memory_allocated - baseline; CPU: estimate
    peak_mem_source: str         # "cuda_allocator" | "estimate"
    op_count: int                # aten:: ops the profiler recorded, nested ones included
    runs: int


class Row(NamedTuple):
    """One Kineto event, reduced to what the summaries need."""

    activity: str      # "cpu_op", "kernel", "gpu_memcpy", "[memory]", ...
    name: str
    start_ns: int
    dur_ns: int
    nbytes: int        # memory events: + allocated, - freed
    on_cpu: bool       # memory events: the allocation is host memory


def rows_from_kineto(events) -> list[Row]:
    """Reduce ``_KinetoEvent``s to Rows (older torch lacks ``activity_type``: infer it)."""
    cpu = torch.autograd.DeviceType.CPU
    rows = []
    for e in events:
        name = e.name()
        on_cpu = e.device_type() == cpu
        if name == "[memory]":
            activity = "[memory]"
        elif hasattr(e, "activity_type"):
            activity = str(e.activity_type())
        elif on_cpu:
            activity = "cpu_op"
        else:
            activity = "gpu_user_annotation" if e.is_user_annotation() else "kernel"
        rows.append(Row(activity, name, e.start_ns(), e.duration_ns(), e.nbytes(), on_cpu))
    return rows


def device_totals(rows: list[Row]) -> tuple[int, float]:
    """(count, busy ms) of device activity (kernels, memcpys, memsets): the length of the union
    of their intervals, so that kernels overlapping on several streams (cuDNN's grouped
    convolutions) count once, as attribution's in-situ figure does (``gpu_busy_ms``)."""
    dev = [r for r in rows if r.activity in DEVICE_ACTIVITIES]
    if not dev:
        return 0, 0.0
    # epoch nanoseconds (~1.8e18) are integers a float64 rounds to 256 ns: relative first
    start = np.array([r.start_ns for r in dev], np.int64)
    start = (start - start.min()).astype(np.float64)
    lo, hi = intervals.union(start, start + np.array([r.dur_ns for r in dev], np.float64))
    return len(dev), float((hi - lo).sum()) / 1e6


def own_device_work(rows: list[Row], runs: int) -> tuple[int, list[float]] | None:
    """(count, busy ms of each run) of the device work between each pair of marker kernels
    (the call's own, ``MARKER_KERNEL``), over ``runs`` runs each between two markers; None
    unless exactly ``2 * runs`` markers are found and every run holds as many kernels (a run
    whose kernels the profiler lost would read 0 ms). A marker is queued after a device sync,
    so everything the call's run does starts after its first marker and ends before its
    second."""
    dev = sorted((r for r in rows if r.activity in DEVICE_ACTIVITIES), key=lambda r: r.start_ns)
    marks = [k for k, r in enumerate(dev) if MARKER_KERNEL in r.name]
    if len(marks) != 2 * runs:
        return None
    each = [device_totals(dev[a + 1:b]) for a, b in zip(marks[::2], marks[1::2])]
    if len({n for n, _ in each}) > 1:
        return None
    return sum(n for n, _ in each), [ms for _, ms in each]


def aten_op_count(rows: list[Row]) -> int:
    """Number of aten:: CPU ops."""
    return sum(1 for r in rows if r.activity == "cpu_op" and r.name.startswith("aten::"))


def peak_live_bytes(rows: list[Row], *, on_cpu: bool = True) -> int:
    """Highest running sum of allocations minus frees, from zero at the first event."""
    live = peak = 0
    for r in sorted((r for r in rows if r.activity == "[memory]" and r.on_cpu == on_cpu),
                    key=lambda r: r.start_ns):
        live += r.nbytes
        peak = max(peak, live)
    return peak


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_ms(call, device, runs: int) -> float:
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter_ns()
        call()
        _sync(device)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(times)


def _cuda_peak(call, device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    call()
    torch.cuda.synchronize(device)
    return max(torch.cuda.max_memory_allocated(device) - base, 0)


def lost_device_events(rows: list[Row]) -> bool:
    """Whether a CUDA session lost what CUPTI records: its host launched kernels (or graphs) and
    it recorded no device event, or it ran ops and CUPTI recorded nothing at all, neither a
    device event nor a runtime call. CUPTI, set up afresh for each session, now and then
    misses a session's events (an H100's and an H200's pytest processes lost every kernel of
    one); a call that only views its input is then profiled once more, at a session's cost."""
    if any(r.activity in DEVICE_ACTIVITIES for r in rows):
        return False
    runtime = [r for r in rows if r.activity in CUPTI_HOST_ACTIVITIES]
    if not runtime:
        return any(r.activity == "cpu_op" for r in rows)
    return any("LaunchKernel" in r.name or "GraphLaunch" in r.name for r in runtime)


def _profile_rows(call, device, runs: int) -> list[Row]:
    if device.type == "cuda":
        # torch.profiler on a GPU: autograd's profiler as set up below once read no kernel there
        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        for _ in range(2):  # a session that lost every kernel is taken once more
            with quiet_kineto(), cupti_torn_down(), profile(activities=acts) as prof:
                for _ in range(runs):
                    call()
                    _sync(device)
            rows = rows_from_kineto(prof.profiler.kineto_results.events())
            if not lost_device_events(rows):
                break
        return rows
    # autograd's profiler, which torch.profiler.profile drives: the latter's start asks
    # hasattr(torch, "_inductor") and so imports inductor and dynamo (a second, fresh process)
    with quiet_kineto(), autograd_profiler.profile(use_kineto=True, profile_memory=True) as prof:
        for _ in range(runs):
            call()
    return rows_from_kineto(prof.kineto_results.events())


class AsTimed(NamedTuple):
    """A call's own kernels, run as its timer runs it (``profile_as_timed``)."""

    kernel_count: int              # per run
    device_ms: float               # device-busy ms, the mean of the runs
    run_ms: tuple[float, ...]      # each run's
    clock_mhz: float | None = None  # the SM clock right after them (the caller's reading)


def profile_as_timed(runner, device, runs: int = 3) -> AsTimed | None:
    """The kernels and device-busy time of a call as its timer runs it: run j after its
    ``before(j)`` (its context, or its inputs' rewrite) on ``runner.run(j)``'s copies. Only the
    call's own device work counts: each run sits between two marker kernels queued after a
    device sync, the untimed work before the first. None on a CPU, or if the markers are not
    where they should be (``own_device_work``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None

    def slot(j: int) -> None:
        if runner.before is not None:
            runner.before(j)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(1)
        runner.run(j)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(1)

    slot(0)  # the first run of this runner (its context's, its copies') is not the call's
    # runs 1..runs again where the session is taken once more (``_profile_rows``)
    slots = itertools.cycle(range(1, runs + 1))
    got = own_device_work(_profile_rows(lambda: slot(next(slots)), device, runs), runs)
    if got is None:
        return None
    count, each = got
    return AsTimed(round(count / runs), sum(each) / runs, tuple(each))


def profile_call(call: Callable[[], object], device, runs: int = 3) -> CallStats:
    """Profile ``call()`` (one warm-up, then ``runs`` profiled and ``runs`` wall-timed runs).

    Args:
        call: runs the module once on prepared inputs; its result is dropped.
        device: where it runs ("cpu", "cuda", "cuda:1" or a torch.device).
        runs: profiled runs; per-call figures are totals divided by this.
    Returns:
        CallStats with per-call kernel count, device ms, wall ms, launch overhead, peak memory.
    """
    if runs < 1:
        raise ValueError(f"profile_call: runs must be >= 1, got {runs}")
    device = torch.device(device)
    call()
    _sync(device)
    wall = _wall_ms(call, device, runs)
    cuda = device.type == "cuda"
    peak = _cuda_peak(call, device) if cuda else None
    rows = _profile_rows(call, device, runs)
    count, dev_ms = device_totals(rows)
    if not cuda:
        peak = peak_live_bytes(rows, on_cpu=True)
    return CallStats(
        kernel_count=round(count / runs), device_ms=dev_ms / runs, wall_ms=wall,
        launch_overhead_ms=max(wall - dev_ms / runs, 0.0), peak_mem_bytes=int(peak),
        peak_mem_source="cuda_allocator" if cuda else "estimate",
        op_count=round(aten_op_count(rows) / runs), runs=runs)
