"""``events`` timer: one call between events behind a spin kernel (hides its launch latency)."""
from __future__ import annotations

import time

import torch

from cbtrace.replay.timer.contract import (CallRunner, Timing, TimerUnavailable, TimingConfig,
                                           as_runner, join_notes)
from cbtrace.replay.timer.stats import percentile, spin_for

from .l2 import L2Flusher, spin
from .sampling import collect, timing_from_samples, warm_until_settled


def cuda_reason(device, timer: str) -> str | None:
    """Why a CUDA-only timer cannot run on ``device`` (None if it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{timer} timer needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return f"{timer} timer: CUDA is not available"
    return None


class CudaTimer:
    """What the CUDA-only timers share: availability and the checked device."""

    name = ""

    def unavailable_reason(self, device) -> str | None:
        return cuda_reason(device, self.name)

    def _device(self, device) -> torch.device:
        reason = self.unavailable_reason(device)
        if reason:
            raise TimerUnavailable(reason)
        return torch.device(device)


def event_pairs(n: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """n (start, end) pairs of timing CUDA events."""
    return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)]


def host_enqueue_ms(call, n_copies: int, runs: int) -> float:
    """Median host time to enqueue one call (these runs double as warm-up)."""
    times = []
    for i in range(max(runs, 1)):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        call(i % n_copies)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    torch.cuda.synchronize()
    return percentile(times, 50)


class EventsTimer(CudaTimer):
    name = "events"
    fallback_rank = 20  # cbtrace.replay.timer.choice: auto order and fallbacks

    def measure(self, call: CallRunner, n_copies: int, device, cfg: TimingConfig) -> Timing:
        device = self._device(device)
        call = as_runner(call, n_copies)
        n_copies, run, before = call.n_copies, call.run, call.before  # before: untimed, in order
        with torch.cuda.device(device):
            warm = max(cfg.warmup_runs, 3)  # the host time's median needs a few
            host_ms = host_enqueue_ms(run, n_copies, warm)
            spin_ms = spin_for(host_ms=host_ms, lo_ms=cfg.spin_min_ms, hi_ms=cfg.spin_max_ms)
            flusher = L2Flusher(device, cfg.flush_bytes, cfg.flush_l2)
            stream = torch.cuda.current_stream(device)

            def sample(first: int, n: int) -> list[float]:
                pairs = event_pairs(n)
                for k, (start, end) in enumerate(pairs):
                    j = (warm + first + k) % n_copies
                    flusher.flush()
                    spin(device, cfg.gap_s * 1e3 + spin_ms)
                    if before is not None:  # queued behind the spin, before the start event
                        before(j)
                    start.record(stream)
                    run(j)
                    end.record(stream)
                torch.cuda.synchronize()
                return [start.elapsed_time(end) for start, end in pairs]

            settle = warm_until_settled(sample, cfg)
            samples = collect(sample, cfg)  # one call a sample: its own jitter is the call's spread
        notes = join_notes(f"spin={spin_ms:.3f}ms host={host_ms:.3f}ms", flusher.note, settle,
                           "warm inputs" if before is not None and call.warms_inputs else None)
        return timing_from_samples(samples, self.name, notes)
