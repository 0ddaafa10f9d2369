"""Why a call's isolated figure misses its in-situ one, from what was measured on both sides.

The replay's profiled pass gives the call's kernels alone (``kernel_count``, ``device_ms``: the
time the device was busy with them); the step's trace gives the same of the step
(``insitu_kernel_count``, ``insitu_ms``); both count kernels overlapping on several streams
once. Comparing those like with like separates a miss in the kernels
themselves (other kernels, or the same kernels slower or faster: cache or clock state) from a
miss between them (launch gaps and the timer), which is what a call of a few microseconds
mostly has. The SM clock is read on both sides (``device.sm_clock_mhz``: right after the plain
step, and right after each call's timing): a step whose GEMMs pulled the clock down runs every
kernel slower than a call timed alone, which no cache state undoes.
"""
from __future__ import annotations

import math

from cbtrace.cost import metrics

WITHIN_PCT = 5.0  # a call within this of in situ has nothing to explain
# Two clock readings closer than this are the same clock: each reading's own spread (CUDA events
# around spin kernels) stays below it.
CLOCK_MIN_PCT = 1.0
# Error bases (``metrics.error_basis``) whose two figures are both the device busy with the
# call's kernels, so that both follow the SM clock: the busy time, and the eager figure of a call
# the step ran compiled against the captured (eager) step's busy time. The host's pace does not.
CLOCKED_BASES = (None, "busy", "eager")


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def kernel_error_pct(device_ms, insitu_ms) -> float | None:
    """The call's kernels alone against its kernels in the step, both device-busy (%)."""
    return metrics.error_pct(_num(device_ms), _num(insitu_ms))


def clock_error_pct(step_mhz, timed_mhz) -> float | None:
    """100 * (step_mhz / timed_mhz - 1): what a call whose time follows the SM clock reads
    alone against the step from the two clocks alone (negative: timed at a higher clock)."""
    step, timed = _num(step_mhz), _num(timed_mhz)
    return None if step is None or not timed else 100.0 * (step / timed - 1.0)


def miss_cause(row: dict, insitu_kernels, kernel_err: float | None) -> str | None:
    """What the measurements say about a call outside +-WITHIN_PCT of in situ (None inside it,
    or without an error): the first that holds of other kernels, the SM clock, kernels slower
    or faster alone, the host's pace, another timer, noisy samples, else the gaps between
    kernels."""
    err = _num(row.get("error_pct"))
    if err is None or abs(err) <= WITHIN_PCT:
        return None
    alone, step = _num(row.get("kernel_count")), _num(insitu_kernels)
    if alone is not None and step is not None and step > 0 and round(alone) != round(step):
        return f"other kernels: {round(alone)} alone, {round(step)} in the step"
    clock = _num(row.get("clock_error_pct"))
    if (clock is not None and abs(clock) >= CLOCK_MIN_PCT and clock * err > 0
            and abs(err - clock) <= WITHIN_PCT and row.get("error_basis") in CLOCKED_BASES):
        return (f"SM clock: timed at {_num(row.get('timed_clock_mhz')):.0f} MHz, the step's "
                f"{_num(row.get('step_clock_mhz')):.0f} MHz ({clock:+.1f} % from the clocks; "
                f"{err - clock:+.1f} % besides)")
    if kernel_err is not None and abs(kernel_err) > WITHIN_PCT:
        side = "slower" if kernel_err > 0 else "faster"
        return (f"its kernels ran {abs(kernel_err):.0f} % {side} alone than in the step "
                f"(cache or clock state)")
    if row.get("error_basis") == "host":
        return ("host-paced: timed back to back against its host issue time in an unprofiled "
                "step (or its device time, if longer)")
    if row.get("error_basis") == "span":
        return "host-paced: timed back to back against its span in the step"
    if row.get("error_basis") == "step":
        return "timed back to back or compiled, against the step repeated as the user runs it"
    timer = row.get("timer")
    if isinstance(timer, str) and timer not in ("graph", "cpu"):
        return f"timed by the {timer} timer ({row.get('timer_fallback') or 'asked for'})"
    if row.get("noisy"):
        return "noisy samples (a busy machine)"
    if kernel_err is not None:
        return (f"between its kernels: they match the step within {abs(kernel_err):.0f} %, "
                f"the gaps and launches around them do not")
    return None


def bwd_miss_cause(row: dict, insitu_kernels) -> str | None:
    """``miss_cause`` of a call's backward (None inside +-WITHIN_PCT): its own kernels alone,
    profiled as timed, against its backward's kernels in the step, and its timer. The SM clock
    is read around forward timing only, so it is not among the causes here."""
    kernel_err = kernel_error_pct(row.get("bwd_device_ms"), row.get("bwd_insitu_ms"))
    return miss_cause({"error_pct": row.get("bwd_error_pct"),
                       "kernel_count": row.get("bwd_kernel_count"),
                       "timer": row.get("bwd_timer"),
                       "timer_fallback": row.get("bwd_timer_fallback")},
                      insitu_kernels, kernel_err)
