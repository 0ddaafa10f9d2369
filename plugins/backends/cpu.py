"""``cpu`` timer: perf_counter_ns around each call; on CUDA, synchronize before and after.

Works everywhere and is the last fallback. On a GPU it includes host launch latency (it
overstates small modules), which is why ``graph`` and ``events`` come first. On a CPU each
sample's thread CPU time is read beside its wall time: samples whose thread was mostly off the
CPU (a busy machine) are counted, a call with many is timed again on one intra-op thread, and a
call that stays so is flagged ``noisy`` (``stats.noisy``). It spends its budget whatever
``converge_ci`` says: a shared CPU's samples come in bursts, not independently, so a median's
interval says less of them, and the regression gate reads their p10 and p90 (a CPU suite under
load flagged a time regression that was not there with it on).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from cbtrace.device import one_thread, waited_off_cpu
from cbtrace.replay.timer.contract import (CallRunner, Timing, TimerUnavailable, TimingConfig,
                                           as_runner, join_notes)
from cbtrace.replay.timer.stats import NOISY_SHARE, OFF_CPU_MS, noisy

from .l2 import L2Flusher
from .sampling import collect, timing_from_samples

RETRY_PAUSE_S = 0.02  # lets a busy neighbour's time slice pass before the retry


class CpuTimer:
    name = "cpu"
    fallback_rank = 10  # cbtrace.replay.timer.choice: auto order and fallbacks

    def unavailable_reason(self, device) -> str | None:
        device = torch.device(device)
        if device.type == "cpu":
            return None
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "cpu timer: CUDA is not available"
        return f"cpu timer supports cpu and cuda devices, not {device.type}"

    def measure(self, call: CallRunner, n_copies: int, device, cfg: TimingConfig) -> Timing:
        reason = self.unavailable_reason(device)
        if reason:
            raise TimerUnavailable(reason)
        call = as_runner(call, n_copies)
        cfg = dataclasses.replace(cfg, converge_ci=0.0)  # see the module docstring
        n_copies, before = call.n_copies, call.before  # before: untimed, in order
        device = torch.device(device)
        cuda = device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        warm, t_end = 0, time.perf_counter() + cfg.warmup_min_s
        while warm < cfg.warmup_runs or (time.perf_counter() < t_end and warm < 10_000):
            if before is not None and not call.warms_inputs:
                before(warm % n_copies)
            call.run(warm % n_copies)
            warm += 1
        sync()
        flusher = L2Flusher(device, cfg.flush_bytes, cfg.flush_l2)
        waits: list[bool] = []  # per sample: its thread was mostly off the CPU

        def sample(first: int, n: int) -> list[float]:
            out = []
            for i in range(first, first + n):
                j = (warm + i) % n_copies  # continue the warm-up's rotation
                flusher.flush()
                if before is not None:
                    before(j)
                sync()
                if cfg.gap_s > 0:
                    time.sleep(cfg.gap_s)
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                call.run(j)
                sync()
                wall, cpu = (time.perf_counter_ns() - t0) / 1e6, (time.thread_time_ns() - c0) / 1e6
                out.append(wall)
                waits.append(not cuda and waited_off_cpu(wall, cpu, OFF_CPU_MS))
            return out

        samples = collect(sample, cfg)
        notes = [None if not cuda else "synchronized", flusher.note,
                 "warm inputs" if before is not None and call.warms_inputs else None]
        waited = sum(waits)
        if not cuda and waited > NOISY_SHARE * len(samples):
            # A CPU-bound neighbour kept this thread, or a thread-pool worker it waits for, off
            # the CPU (a small call then reads many times its time): once more on one thread, which
            # waits for no worker, and keep whichever waited less.
            again, why = self._one_thread(sample, cfg, waits)
            if again is not None:
                samples, waited = again
                notes.append(why)
        timing = timing_from_samples(samples, self.name, join_notes(*notes))
        timing.noisy = not cuda and noisy(samples, waited)
        if timing.noisy:
            timing.notes = join_notes(timing.notes, f"machine busy: {waited} of {len(samples)} "
                                                    "samples waited off the CPU")
        return timing

    @staticmethod
    def _one_thread(sample, cfg: TimingConfig, waits: list[bool]):
        """(samples, waited) of a retry with one intra-op thread after a short pause, if it
        waited less than the first try; else (None, None)."""
        first = sum(waits)
        time.sleep(RETRY_PAUSE_S)
        with one_thread():
            sample(0, 1)  # untimed: a compiled call guards on the thread count and recompiles here
            start = len(waits)
            samples = collect(sample, cfg)
        waited = sum(waits[start:])
        if waited >= first:
            return None, None
        return (samples, waited), f"timed on 1 thread: {first} samples had waited off the CPU"
