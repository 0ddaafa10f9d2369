"""The one check of a device the user asked for (cpu, cuda, cuda:N or auto), how much memory a
CUDA device has free for torch, and handing memory back after an attempt ran out of it."""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cbtrace.errors import CbtraceError


class DeviceError(CbtraceError):
    """A device name that is not a device, or not on this machine."""


_profiler_warm = False


def warm_profiler(device) -> None:
    """Pay the process's first CUDA profiler start (CUPTI's set-up, seconds) now, before the
    caller loads a model's kernels: it costs less then than after them. Once per process;
    nothing on a CPU."""
    global _profiler_warm
    if _profiler_warm or torch.device(device).type != "cuda":
        return
    _profiler_warm = True
    with torch.cuda.device(device), cupti_torn_down(), profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        torch.cuda.synchronize()


# Kineto tears CUPTI down at a profiler session's stop only if TEARDOWN_CUPTI is "1" then; left
# subscribed, CUPTI's callbacks stay on every later launch of the process, and a host-bound
# call issues slower, more so after each session, than in a process never profiled (the
# teardown's A/B: benchmarks/RESULTS.md, "CUPTI left subscribed"). torch keeps CUPTI up
# where CUDA graphs and a re-initialisation after teardown crashed: CUDA before 12.6, or lazy
# re-initialisation off.
TEARDOWN_MIN_CUDA = (12, 6)


def _cuda_version() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (torch.version.cuda or "0").split(".")[:2])
    except ValueError:
        return (0,)


@contextlib.contextmanager
def cupti_torn_down():
    """Wrap a profiler session, start to stop, in TEARDOWN_CUPTI=1 (taken away after, unless
    the session changed it): Kineto then sets CUPTI up lazily at its start and tears it down at
    its stop. Every session of cbtrace's runs so, as they were measured. Nothing is set where
    the user or torch has a say already (either variable set) or CUDA is older than
    ``TEARDOWN_MIN_CUDA``."""
    if (not torch.cuda.is_available() or _cuda_version() < TEARDOWN_MIN_CUDA
            or "TEARDOWN_CUPTI" in os.environ or "DISABLE_CUPTI_LAZY_REINIT" in os.environ):
        yield
        return
    os.environ["TEARDOWN_CUPTI"] = "1"
    try:
        yield
    finally:
        if os.environ.get("TEARDOWN_CUPTI") == "1":
            del os.environ["TEARDOWN_CUPTI"]


def waited_off_cpu(wall_ms: float, cpu_ms: float, min_off_ms: float = 0.0) -> bool:
    """Whether a thread spent most of ``wall_ms`` off the CPU (and at least ``min_off_ms``):
    descheduled by a busy machine, or waiting for an intra-op worker that was."""
    off = wall_ms - cpu_ms
    return off > min_off_ms and off > 0.5 * wall_ms


@contextlib.contextmanager
def one_thread():
    """One intra-op thread inside (a CPU figure on a busy machine, whose parallel ops would wait
    for workers that are not running); torch's count back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def resolve_device(device=None, *, default: str = "auto"):
    """A torch.device: ``device`` if valid here, else ``default`` ("auto": cuda if available,
    else cpu); a bare "cuda" becomes the current CUDA device."""
    want = default if device is None else device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(want)
    except (RuntimeError, TypeError):
        raise DeviceError("not a device (cpu, cuda, cuda:N)", param="device", value=want) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("CUDA is not available on this machine", param="device", value=want)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise DeviceError(f"this machine has {torch.cuda.device_count()} CUDA device(s)",
                              param="device", value=want)
    elif dev.type != "cpu":
        raise DeviceError("cbtrace runs on cpu and cuda devices", param="device", value=want)
    return dev


# timer_notes of a call (bwd_timer_notes of a backward) that ran out of memory once and ran
# after ``hand_back``
OOM_RETRIED = "out of memory once; ran after torch's cache went back to the driver"


def hand_back(device) -> None:
    """What a failed attempt left behind collected, and on a GPU torch's cached blocks handed
    back to the driver: before a call runs again after running out of memory."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def free_memory(device, exact: bool = False) -> int:
    """Bytes a CUDA device can still give torch: the driver's free memory and the whole blocks
    torch caches but does not use (its allocator returns those to the driver when an allocation
    would fail; free parts of split segments do not count). The driver's figure alone shrinks
    as replay's CUDA graphs leave their private pools to torch's cache, until replay would skip
    calls for want of memory it has. Free blocks in the pool of a graph still alive (a compiled mode's) count too, though only
    that graph can use them: ``exact`` hands every cached block back first (empty_cache) and
    returns the driver's figure."""
    if exact:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    stats = torch.cuda.memory_stats(device)
    cached = (stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
              - stats.get("inactive_split_bytes.all.current", 0))
    return torch.cuda.mem_get_info(device)[0] + max(cached, 0)


def window_ms(step, device, k: int) -> float:
    """One step's time in ``k`` steps run back to back (the host runs ahead as in training):
    CUDA events around the k steps on a GPU (the host's gaps included where it sets the pace),
    perf_counter on a CPU."""
    if torch.device(device).type == "cuda":
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(k):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / k
    t0 = time.perf_counter()
    for _ in range(k):
        step()
    return (time.perf_counter() - t0) * 1e3 / k


def steps_ms(step, device, *, k: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Median over ``repeats`` windows of ``window_ms``, after ``warmup`` steps (lazy init, a
    compiled model's compile)."""
    for _ in range(warmup):
        step()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(window_ms(step, device, k) for _ in range(repeats))


# Spin cycles of the clock reading's shorter kernel: long enough that a CUDA event's resolution
# is small beside it, short enough that the clock has no time to move while it spins.
CLOCK_CYCLES = 200_000
# Cycles of the spin queued first (a quarter of a millisecond): it keeps the device busy while
# the host queues the rest, so that no launch gap falls between the events, and is short beside
# the time the clock takes to move. A gap shows as the longer spin taking other than twice the
# shorter; such a reading is taken again, and dropped after three.
CLOCK_LEAD_CYCLES = 500_000
CLOCK_RATIO_TOL = 0.02


def sm_clock_mhz(device) -> float | None:
    """The SM clock (MHz) the device runs at once the work already queued on it is done; None on
    a CPU, or where no reading holds together. Two spin kernels of N and 2N cycles between CUDA
    events: the difference of their times is N cycles alone, without the launch and event
    costs both carry."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        return _read_clock(device)
    except RuntimeError:  # no spin kernel on this build (a figure beside the row, never its error)
        return None


def _read_clock(device) -> float | None:
    with torch.cuda.device(device):
        for _ in range(3):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            torch.cuda._sleep(CLOCK_LEAD_CYCLES)
            events[0].record()
            torch.cuda._sleep(CLOCK_CYCLES)
            events[1].record()
            torch.cuda._sleep(2 * CLOCK_CYCLES)
            events[2].record()
            events[2].synchronize()
            one, two = events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])
            if one > 0 and abs(two / one - 2) <= 2 * CLOCK_RATIO_TOL and two > one:
                return CLOCK_CYCLES / (two - one) / 1e3
    return None
