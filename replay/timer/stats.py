"""Pure statistics for timers: percentiles of samples and how many more runs fit a budget."""
from __future__ import annotations

import math


def percentile(samples: list[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between order statistics (numpy's default)."""
    if not samples:
        raise ValueError("percentile: samples is empty")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of the samples."""
    return percentile(samples, 50), percentile(samples, 10), percentile(samples, 90)


def plan_runs(*, per_run_s: float, left_s: float, done: int, min_runs: int, max_runs: int) -> int:
    """How many more timed runs to take now.

    Half of what still fits in ``left_s`` (rounded up), so the estimate of ``per_run_s`` is refined
    before the budget is spent; but always enough to reach ``min_runs`` and never past ``max_runs``.
    """
    if per_run_s < 0:
        raise ValueError(f"plan_runs: per_run_s must be >= 0, got {per_run_s}")
    fit = max_runs if per_run_s == 0 else int(max(left_s, 0.0) / per_run_s)
    n = max((fit + 1) // 2, min_runs - done, 0)
    return max(min(n, max_runs - done), 0)


# The events' own jitter per timed run (ms; twice an empty graph's p10..p90): a spread under it
# is not the call's. Timers of K calls a run divide it by K, so only short calls whose K runs
# agree stop early; the events timer (one call a run) does not use it, where it would stop a
# short call of wide spread.
EVENT_JITTER_MS = 2e-3


def converged(samples_ms: list[float], spread: float, floor_ms: float = 0.0,
              ci: float = 0.0, ci_floor: bool = False) -> bool:
    """Whether (``spread`` > 0) p10 and p90 of the samples lie within ``spread`` (relative) of
    their median, or within ``floor_ms`` of each other (the timer's own jitter per sample), or
    (``ci`` > 0) the median's 95 % confidence interval lies within +-``ci`` of it
    (``median_ci``): a call whose runs differ by more than ``spread`` then stops once more runs
    would not move its median. ``ci_floor``: the interval's half-width may also be up to
    ``floor_ms`` (a call of a few microseconds timed in its context: 1 % of it is finer than
    the events resolve a sample, and its runs went on to the budget)."""
    median, p10, p90 = summarize(samples_ms)
    if spread > 0 and ((median > 0 and (p90 - p10) <= spread * median) or (p90 - p10) < floor_ms):
        return True
    if ci <= 0 or median <= 0:
        return False
    lo, hi = median_ci(samples_ms)
    return (hi - lo) / 2 <= max(ci * median, floor_ms if ci_floor else 0.0)


def median_ci(samples: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval of the median (95 % for z = 1.96): the order
    statistics of ranks floor(n/2 - z * sqrt(n) / 2) and ceil(1 + n/2 + z * sqrt(n) / 2) of the n
    samples, at least 1 and at most n (the binomial's normal approximation, rounded outward;
    no assumption on the samples' distribution, which for timings is skewed and often
    bimodal). Few samples give the extremes."""
    if not samples:
        raise ValueError("median_ci: samples is empty")
    xs, n = sorted(samples), len(samples)
    half = z * math.sqrt(n) / 2
    lo = max(math.floor(n / 2 - half), 1)  # 1-based ranks
    hi = min(math.ceil(n / 2 + half) + 1, n)
    return xs[lo - 1], xs[hi - 1]


def graph_calls(*, per_call_ms: float, k_max: int, max_replay_ms: float) -> int:
    """Calls per timed window (a CUDA graph, or the stream timer's run back to back): ``k_max``,
    fewer if K calls would run longer than ``max_replay_ms``."""
    if per_call_ms <= 0:
        return k_max
    return max(1, min(k_max, int(max_replay_ms / per_call_ms)))


def spin_for(*, host_ms: float, lo_ms: float, hi_ms: float) -> float:
    """Spin before a start event: twice the host enqueue time plus 20 us, within [lo_ms, hi_ms]."""
    return min(max(2 * host_ms + 0.02, lo_ms), hi_ms)


def settled(previous_ms: float | None, current_ms: float, tol: float) -> bool:
    """Whether a call's time stopped drifting: this window's median is within ``tol``
    (relative) of an earlier window's. False without an earlier window."""
    if previous_ms is None or previous_ms <= 0:
        return False
    return abs(current_ms / previous_ms - 1) <= tol


# A sample waited off-CPU when its thread was off the CPU for over half its wall time and for at
# least this long (ms): descheduled by a busy machine, or waiting for a thread-pool worker that was.
OFF_CPU_MS = 0.5
NOISY_SHARE = 0.25    # this share of waited samples makes a measurement noisy
NOISY_SPREAD = 2.0    # as does p90 above twice p10 (and by more than OFF_CPU_MS)


def noisy(samples_ms: list[float], waited: int) -> bool:
    """Whether a call's samples say the machine was busy: many waited off-CPU, or a wide spread."""
    if not samples_ms:
        return False
    _, p10, p90 = summarize(samples_ms)
    wide = p90 > NOISY_SPREAD * p10 and p90 - p10 > OFF_CPU_MS
    return waited > NOISY_SHARE * len(samples_ms) or wide
