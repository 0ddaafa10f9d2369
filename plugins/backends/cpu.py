"""``cpu`` timer: perf_counter_ns around each call; on CUDA, synchronize before and after.

Works everywhere and is the last fallback. On a GPU it includes host launch latency (it
overstates small modules), which is why ``graph`` and ``events`` come first.
"""
from __future__ import annotations

import time

import torch

from cbtrace.replay.timing import Timing, TimerUnavailable, TimingConfig, join_notes

from .l2 import L2Flusher
from .sampling import collect, timing_from_samples, warm_toucher


class CpuTimer:
    name = "cpu"
    fallback_rank = 10  # cbtrace.replay.timers: auto order and fallbacks

    def unavailable_reason(self, device) -> str | None:
        device = torch.device(device)
        if device.type == "cpu":
            return None
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "cpu timer: CUDA is not available"
        return f"cpu timer supports cpu and cuda devices, not {device.type}"

    def measure(self, call, n_copies: int, device, cfg: TimingConfig) -> Timing:
        reason = self.unavailable_reason(device)
        if reason:
            raise TimerUnavailable(reason)
        device = torch.device(device)
        cuda = device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        warm, t_end = 0, time.perf_counter() + cfg.warmup_min_s
        while warm < cfg.warmup_runs or (time.perf_counter() < t_end and warm < 10_000):
            call(warm % n_copies)
            warm += 1
        sync()
        flusher = L2Flusher(device, cfg.flush_bytes, cfg.flush_l2)
        touch = warm_toucher(call, cfg)

        def sample(first: int, n: int) -> list[float]:
            out = []
            for i in range(first, first + n):
                j = (warm + i) % n_copies  # continue the warm-up's rotation
                flusher.flush()
                if touch is not None:
                    touch(j)
                sync()
                if cfg.gap_s > 0:
                    time.sleep(cfg.gap_s)
                t0 = time.perf_counter_ns()
                call(j)
                sync()
                out.append((time.perf_counter_ns() - t0) / 1e6)
            return out

        samples = collect(sample, cfg)
        return timing_from_samples(samples, self.name,
                                   join_notes("synchronized" if cuda else None, flusher.note,
                                              "warm inputs" if touch else None))
