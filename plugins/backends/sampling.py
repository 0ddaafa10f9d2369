"""The sampling loop every timer shares: min_runs first, then more while the budget lasts."""
from __future__ import annotations

import time
from typing import Callable

from cbtrace.replay.timer.contract import Timing, TimingConfig

from cbtrace.replay.timer.stats import converged, percentile, plan_runs, settled, summarize


def collect(sample: Callable[[int, int], list[float]], cfg: TimingConfig,
            floor_ms: float = 0.0) -> list[float]:
    """Call ``sample(first_index, n)`` (times n runs, returns n per-call ms) until out of budget,
    or until the samples have converged.

    The first round takes ``cfg.min_runs``; later rounds are sized from the measured wall time per
    run (flush, spin and sync included), so the loop ends close to ``cfg.budget_s``. With
    ``cfg.converge_spread``, it ends as soon as p10 and p90 are within that share of the median:
    more runs of a call that repeats itself to 1 % would not move its median (a CUDA graph
    replay of most modules; the replay wall is then set by the call, not the budget). A spread
    under ``floor_ms`` (the timer's own jitter per sample) also counts as converged: an empty
    call's replays (a Dropout at p = 0) never come within 1 % of their sub-microsecond median,
    and took the whole budget. With ``cfg.converge_ci``, it also ends once the median's 95 %
    confidence interval is within that share of it: a call whose runs never agree to 1 % (an
    embedding lookup rotating over table and id copies) stops when its median is known; its
    rounds then at most double the runs taken, so that the check comes often enough to matter.
    """
    samples: list[float] = []
    t0 = time.perf_counter()
    n = cfg.min_runs
    while n > 0:
        got = sample(len(samples), n)
        assert len(got) == n, f"sample returned {len(got)} values for {n} runs"
        samples.extend(got)
        if (cfg.converge_spread or cfg.converge_ci) and converged(
                samples, cfg.converge_spread, floor_ms, cfg.converge_ci, cfg.converge_ci_floor):
            break
        elapsed = time.perf_counter() - t0
        n = plan_runs(per_run_s=elapsed / len(samples), left_s=cfg.budget_s - elapsed,
                      done=len(samples), min_runs=cfg.min_runs, max_runs=cfg.max_runs)
        if cfg.converge_ci:  # rounds at most double the runs: the interval is checked often
            n = min(n, max(len(samples), cfg.min_runs))
    return samples


def warm_for(sample: Callable[[int, int], list[float]], seconds: float, n: int = 5) -> None:
    """Run ``sample`` (results discarded) for at least ``seconds``: the device settles at the
    clock the timed runs will see, as do_bench's 25 ms warm-up does. No-op for 0."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        sample(0, n)


def warm_until_settled(sample: Callable[[int, int], list[float]], cfg: TimingConfig,
                       n: int = 5) -> str | None:
    """Warm up for ``cfg.warmup_s``; with ``cfg.settle_tol`` also until the median of one
    ``cfg.settle_window_s`` window of runs is within that tolerance of the median
    ``cfg.settle_lag`` windows before, for at most ``cfg.settle_max_s``. Heavy GEMMs run back
    to back lower the SM clock for a fraction of a second, so a fixed warm-up leaves the timed
    runs wherever the clock happens to be. Runs per round are sized so a window holds several
    rounds. Returns a note for the row (None when nothing to say)."""
    if not cfg.settle_tol:
        warm_for(sample, cfg.warmup_s, n)
        return None
    t0 = time.perf_counter()
    first = sample(0, 1)  # one run sizes the rounds: a slow call must still fill windows
    per_run_s = time.perf_counter() - t0
    n = max(1, min(n, int(cfg.settle_window_s / 4 / max(per_run_s, 1e-9))))
    medians: list[float] = []  # one per window; compared settle_lag windows apart, since a
    while True:                # clock sliding ~1 % per window never looks unsettled next door
        w_end, got = time.perf_counter() + cfg.settle_window_s, []
        while not got or time.perf_counter() < w_end:
            runs = sample(0, n)
            if len(runs) != n:
                raise ValueError(f"sample returned {len(runs)} values for {n} runs")
            got.extend(runs)
        medians.append(percentile(got, 50))
        spent = time.perf_counter() - t0
        before = medians[-1 - cfg.settle_lag] if len(medians) > cfg.settle_lag else None
        if spent >= cfg.warmup_s and settled(before, medians[-1], cfg.settle_tol):
            quick = len(medians) <= 2 * (cfg.settle_lag + 1)
            return None if quick else f"settled in {spent * 1e3:.0f} ms"
        if spent >= cfg.settle_max_s:
            if before is None:
                return (f"settling not checked: {len(medians)} warm-up windows in "
                        f"{spent:.1f} s ({first[0]:.3g} ms per call)")
            return f"still drifting after {spent:.1f} s of warm-up"


def timing_from_samples(samples_ms: list[float], timer: str, notes: str | None = None,
                        calls_per_run: int = 1) -> Timing:
    """Summarise per-call samples (each the mean of ``calls_per_run`` calls) into a Timing."""
    median, p10, p90 = summarize(samples_ms)
    return Timing(median_ms=median, p10_ms=p10, p90_ms=p90, runs=len(samples_ms), timer=timer,
                  samples_ms=list(samples_ms), notes=notes,
                  timed_ms=sum(samples_ms) * calls_per_run)
