"""The sampling loop every timer shares: min_runs first, then more while the budget lasts."""
from __future__ import annotations

import time
from typing import Callable

from .base import TimingConfig
from .stats import plan_runs


def collect(sample: Callable[[int, int], list[float]], cfg: TimingConfig) -> list[float]:
    """Call ``sample(first_index, n)`` (times n runs, returns n per-call ms) until out of budget.

    The first round takes ``cfg.min_runs``; later rounds are sized from the measured wall time per
    run (flush, spin and sync included), so the loop ends close to ``cfg.budget_s``.
    """
    samples: list[float] = []
    t0 = time.perf_counter()
    n = cfg.min_runs
    while n > 0:
        got = sample(len(samples), n)
        assert len(got) == n, f"sample returned {len(got)} values for {n} runs"
        samples.extend(got)
        elapsed = time.perf_counter() - t0
        n = plan_runs(per_run_s=elapsed / len(samples), left_s=cfg.budget_s - elapsed,
                      done=len(samples), min_runs=cfg.min_runs, max_runs=cfg.max_runs)
    return samples


def warm_for(sample: Callable[[int, int], list[float]], seconds: float, n: int = 5) -> None:
    """Run ``sample`` (results discarded) for at least ``seconds``: the device settles at the
    clock the timed runs will see, as do_bench's 25 ms warm-up does. No-op for 0."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        sample(0, n)
