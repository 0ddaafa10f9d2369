"""``stream`` timer: K eager calls issued back to back between one pair of CUDA events.

For calls a CUDA graph cannot hold (they refuse capture or synchronise the host): as in the
step, the host runs ahead between the call's syncs and its issue gaps stay in the figure, so a
call whose host sets the pace reads its host time, and one whose device does reads its device
time. Per-call time = the window / K, K sized so a window lasts about ``WINDOW_MS``.
"""
from __future__ import annotations

import time

import torch

from cbtrace.replay.timer.contract import (CallRunner, Timing, TimerUnavailable, TimingConfig,
                                           as_runner, host_paced, join_notes)
from cbtrace.replay.timer.stats import EVENT_JITTER_MS, graph_calls

from .events import CudaTimer, event_pairs
from .l2 import L2Flusher
from .sampling import collect, timing_from_samples, warm_until_settled

WINDOW_MS = 3.0  # a few ms: one launch latency per window is lost in it, the clock stays put
K_MAX = 200      # past this a window of tiny calls is long enough already
# long calls too run K_MIN a window (as capture times the step's loop), unless that passes this
K_MIN, K_MIN_WINDOW_MS = 5, 500.0


def window_calls(one_ms: float) -> int:
    """Calls a window: enough to fill ``WINDOW_MS`` (at most ``K_MAX``), and at least ``K_MIN``
    while those take under ``K_MIN_WINDOW_MS``: a window from an idle device also holds the tail
    of work queued after the host is done, which a loop hides behind the next call's issue."""
    k = graph_calls(per_call_ms=one_ms, k_max=K_MAX, max_replay_ms=WINDOW_MS)
    return max(k, graph_calls(per_call_ms=one_ms, k_max=K_MIN, max_replay_ms=K_MIN_WINDOW_MS))


def one_call_ms(run, n_copies: int, runs: int) -> float:
    """Shortest synchronised wall time of one call (ms): a bound on both its host and device
    time, to size K (these runs double as warm-up)."""
    best = float("inf")
    for i in range(max(runs, 1)):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        run(i % n_copies)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter_ns() - t0) / 1e6)
    return best


def window_sampler(run, k: int, n_copies: int, *, flush, sync, pairs, stream=None):
    """``sample(first, n)`` for the sampling loop: n windows, each ``flush()``, ``sync()``, the
    start event, k calls on rotating copies with nothing between them, the end event; returns
    each window's time / k. ``pairs(n)``: n (start, end) events."""

    def sample(first: int, n: int) -> list[float]:
        windows = pairs(n)
        for w, (start, end) in enumerate(windows):
            flush()
            sync()  # the window opens on an idle device, the host's queue empty
            start.record(stream)
            for j in range(k):  # no sync, no spin: the host runs ahead as in the step
                run(((first + w) * k + j) % n_copies)
            end.record(stream)
        sync()
        return [start.elapsed_time(end) / k for start, end in windows]

    return sample


class StreamTimer(CudaTimer):
    name = "stream"
    fallback_rank = 25  # cbtrace.replay.timer.choice: after graph (30), before events (20)

    def measure(self, call: CallRunner, n_copies: int, device, cfg: TimingConfig) -> Timing:
        call = as_runner(call, n_copies)
        if call.before is not None or call.stage is not None:
            # its untimed work (context, inputs' rewrite, a backward's forward) would land in
            # the window between the calls; events times it after that work instead
            raise TimerUnavailable("untimed work before each run cannot leave a back-to-back "
                                   "window")
        device = self._device(device)
        n_copies, run = call.n_copies, call.run
        # the host's pace is the figure: the replay's background reads wait
        with torch.cuda.device(device), host_paced():
            one_ms = one_call_ms(run, n_copies, max(cfg.warmup_runs, 2))
            k = window_calls(one_ms)
            flusher = L2Flusher(device, cfg.flush_bytes, cfg.flush_l2)
            sample = window_sampler(run, k, n_copies, flush=flusher.flush,
                                    sync=torch.cuda.synchronize, pairs=event_pairs,
                                    stream=torch.cuda.current_stream(device))
            settle = warm_until_settled(sample, cfg)
            samples = collect(sample, cfg, floor_ms=EVENT_JITTER_MS / k)
        notes = join_notes(f"K={k} back to back", flusher.note, settle)
        return timing_from_samples(samples, self.name, notes, calls_per_run=k)
