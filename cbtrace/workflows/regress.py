"""When a call's change between two runs counts: pure functions of numbers.

Work (``work_change``): FLOPs, bytes, kernels, parameter and buffer bytes are counted, not
timed, so two runs of one model agree on them to the last unit on any machine; a change beyond
rounding is the code's, and more work is a regression on any device.

Time (``time_change``): B's median at least ``min_rel`` and ``min_ms`` above A's, and B's p10
above A's p90 (the intervals do not overlap), A's p90 counted at most ``min_rel`` above its
median: a longer tail is the machine's (preempted samples), not the call's. ``min_rel`` is
measured from the two runs themselves: the largest of the calls' own p10-p90 spread
(``spread_floor``), the run-to-run noise between them (``time_noise``), which one replay's
p10-p90 cannot see, and how far their worst calls strayed (``time_tail``); B is first divided
by how much slower all of it ran (``time_shift``). A busy machine can slow all of one call's
samples together, so a change must also show where the call tree says it must: a change that
an enclosing call does not show is dropped (``contradicts``), and so is a top call's change
that its children do not show (``unexplained``). Peak memory has no spread
(``memory_change``).
"""
from __future__ import annotations

import math
import statistics

MIN_NOISE_CALLS = 8  # fewer calls timed in both runs: no noise estimate (thresholds only)


def rel(x: float, y: float) -> float:
    """y / x - 1 (inf where x is 0 and y is not)."""
    return y / x - 1 if x else (math.inf if y else 0.0)


def work_change(a: float, b: float, *, min_rel: float) -> int:
    """+1 more work, -1 less, 0 equal within rounding (``min_rel`` of the larger, and at
    least half a unit: counts are integers)."""
    tol = max(0.5, min_rel * max(abs(a), abs(b)))
    return 0 if abs(b - a) <= tol else (1 if b > a else -1)


def time_noise(pairs: list[tuple[float, float]]) -> float:
    """sigma = 1.4826 * MAD of log(b / a) over (a, b) times: the robust standard deviation of
    the runs' call-by-call ratios; 0 below MIN_NOISE_CALLS pairs. The MAD is centred, so a
    shift of the whole run (everything slower) is not counted as noise."""
    logs = [math.log(b / a) for a, b in pairs if a > 0 and b > 0]
    if len(logs) < MIN_NOISE_CALLS:
        return 0.0
    mid = statistics.median(logs)
    return 1.4826 * statistics.median(abs(x - mid) for x in logs)


def time_shift(pairs: list[tuple[float, float]]) -> float:
    """exp(median log(b / a)) over (a, b) times: how much slower the whole of run B ran (the
    machine's load or clock, the same for every call); 1 below MIN_NOISE_CALLS pairs."""
    logs = [math.log(b / a) for a, b in pairs if a > 0 and b > 0]
    return math.exp(statistics.median(logs)) if len(logs) >= MIN_NOISE_CALLS else 1.0


def time_tail(pairs: list[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile of |log(b / a) - median| over (a, b) times: how far the runs' worst
    calls strayed from their shift (a busy machine slows some calls' whole sampling window);
    0 below MIN_NOISE_CALLS pairs."""
    logs = [math.log(b / a) for a, b in pairs if a > 0 and b > 0]
    if len(logs) < MIN_NOISE_CALLS:
        return 0.0
    mid = statistics.median(logs)
    dev = sorted(abs(x - mid) for x in logs)
    return dev[min(len(dev) - 1, int(q * len(dev)))]


def spread_floor(spreads: list[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile of p90 / p10 - 1 over (p10, p90) pairs of both runs' calls: how far
    apart one call's own samples lie on this machine; 0 below MIN_NOISE_CALLS pairs."""
    logs = sorted(math.log(p90 / p10) for p10, p90 in spreads if p10 > 0 and p90 >= p10)
    if len(logs) < MIN_NOISE_CALLS:
        return 0.0
    return math.expm1(logs[min(len(logs) - 1, int(q * len(logs)))])


def time_change(a: tuple, b: tuple, *, min_rel: float, min_ms: float) -> int:
    """+1 slower, -1 faster, 0 neither; a, b = (median, p10, p90) ms (p10/p90 may be None)."""
    if _slower(a, b, min_rel, min_ms):
        return 1
    return -1 if _slower(b, a, min_rel, min_ms) else 0


def _slower(x: tuple, y: tuple, min_rel: float, min_ms: float) -> bool:
    """y slower than x: y's p10 beyond x's (capped) p90, by both thresholds."""
    (xm, _, x90), (ym, y10, _) = x, y
    edge = min(xm if x90 is None else x90, xm * (1 + min_rel))
    low = ym if y10 is None else y10
    return low > edge and ym - xm >= min_ms and rel(xm, ym) >= min_rel


def memory_change(a: float, b: float, *, min_rel: float, min_bytes: float) -> int:
    """+1 more, -1 less, 0 neither: peak bytes of A and B."""
    if b - a >= min_bytes and rel(a, b) >= min_rel:
        return 1
    if a - b >= min_bytes and rel(b, a) >= min_rel:
        return -1
    return 0


def contradicts(delta_ms: float, ancestor_delta_ms: float, ancestor_band_ms: float) -> bool:
    """Whether an enclosing call's change rules out a call's change of ``delta_ms``.

    A replayed parent runs its children, so a child's real change moves every ancestor by as
    much. One that moved less than half as much (in the same direction), where half is more
    than its own samples' spread (``ancestor_band_ms``: median - p10, the larger of the two
    runs) could hide, says the child's figure is the measurement's, not the code's: e.g. a
    replay that read 8 ms for a 20 µs GELU on a busy machine while its MLP read 0.15 ms.
    """
    half = delta_ms / 2
    if abs(half) <= ancestor_band_ms:
        return False
    return ancestor_delta_ms < half if half > 0 else ancestor_delta_ms > half


def unexplained(delta_ms: float, children_delta_ms: float) -> bool:
    """Whether a top call's change of ``delta_ms`` is missing from its children, whose
    changes sum to ``children_delta_ms``: less than half of it (in the same direction) says
    the whole call's samples were slowed or sped by the machine, as no call above can tell."""
    half = delta_ms / 2
    return children_delta_ms < half if half > 0 else children_delta_ms > half
