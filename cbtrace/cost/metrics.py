"""Metrics: pure functions of numbers (no tensors, modules or files).

Each returns None when an input it needs is missing (None) or meaningless (time <= 0, no peak),
so callers can pass record fields straight through. mfu, hfu and mbu also take numpy arrays
(attribution's rows), so replay and attribution share one formula.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

# A kernel costs at least this much device+host time however little work it does (launch
# latency of an eager CUDA launch is ~4-6 us; a CUDA-graph node ~2-3 us).
KERNEL_FLOOR_S = 5e-6


def _ok(*values) -> bool:
    return all(v is not None for v in values)


def _rate(amount, seconds, peak_per_s):
    """amount / seconds / peak: a float, or None where an input is missing or NaN or the time
    or peak is not > 0; on arrays (attribution's rows) the same elementwise, NaN for None."""
    if not _ok(amount, seconds, peak_per_s):
        return None
    a, s, p = (np.asarray(x, np.float64) for x in (amount, seconds, peak_per_s))
    ok = (s > 0) & (p > 0) & ~np.isnan(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(ok, a / s / p, np.nan)
    if out.ndim:
        return out
    return float(out) if ok else None


def mfu(flops, seconds, peak_flops_per_s):
    """Model FLOPs utilisation: dense-convention FLOPs / time / peak FLOP/s (0.4 = 40%)."""
    return _rate(flops, seconds, peak_flops_per_s)


def hfu(flops_executed, seconds, peak_flops_per_s):
    """Hardware FLOPs utilisation: FLOPs actually executed (causal attention ~halved) / time / peak."""
    return _rate(flops_executed, seconds, peak_flops_per_s)


def mbu(bytes_moved, seconds, peak_bytes_per_s):
    """Memory-bandwidth utilisation: bytes moved / time / peak bandwidth."""
    return _rate(bytes_moved, seconds, peak_bytes_per_s)


def suspect(*fractions) -> bool:
    """True when a utilisation (mfu, hfu, mbu; 1.0 = the device's peak) is above 1.

    No call runs faster than its device's peak, so such a figure is a bug in what it divides
    (a FLOP or byte counted twice, the wrong dtype's peak, device time missed): flag it, never
    cap it. None and NaN (no figure) are not suspect.
    """
    return any(f is not None and not math.isnan(f) and f > 1.0 for f in fractions)


def bound(flops, bytes_moved, seconds, peak_flops_per_s, peak_bytes_per_s,
          kernel_count=None, *, host_s=None, device_s=None) -> str | None:
    """"host", "launch", "compute" or "memory": what limits a call that took ``seconds``.

    Rule, in order:
    1. "host" if the host's time to issue the call is at least its device time
       (``host_s >= device_s``): in a step the device then waits for the host between kernels.
    2. "launch" if the call took no more than the launch floor of its kernels
       (``seconds <= kernel_count * KERNEL_FLOOR_S``, 5 us each).
    3. Otherwise the roofline: "compute" if flops / peak FLOP/s >= bytes / peak bandwidth (the
       time the FLOPs need at peak is the larger), else "memory". With one peak missing, the side
       that can be judged decides only if it alone explains >= half the time; else None.
    """
    if not _ok(seconds) or seconds <= 0:
        return None
    if _ok(host_s, device_s) and device_s > 0 and host_s >= device_s:
        return "host"
    if kernel_count and seconds <= kernel_count * KERNEL_FLOOR_S:
        return "launch"
    t_compute = flops / peak_flops_per_s if _ok(flops, peak_flops_per_s) and peak_flops_per_s > 0 else None
    t_memory = bytes_moved / peak_bytes_per_s if _ok(bytes_moved, peak_bytes_per_s) and peak_bytes_per_s > 0 else None
    if t_compute is not None and t_memory is not None:
        return "compute" if t_compute >= t_memory else "memory"
    if t_compute is not None and t_compute >= 0.5 * seconds:
        return "compute"
    if t_memory is not None and t_memory >= 0.5 * seconds:
        return "memory"
    return None


# Timers whose figure holds the gaps the host leaves between a call's kernels (K eager calls
# issued back to back): compared with the call's in-situ span, the others with its busy time.
SPAN_TIMERS = frozenset({"stream"})


def error_basis(timer: str | None, span_ms, *, step_ms=None, compiled: bool = False,
                host_ms=None) -> str:
    """The in-situ figure to compare a call with: "step", the plain repeat of the step (a root
    that holds the host's gaps, a timer of ``SPAN_TIMERS``, or that the step ran compiled, when
    that repeat was timed); "eager", the captured step's busy time against the call's eager
    figure (a call the step ran compiled: capture runs it eagerly); for a call that holds the
    host's gaps (a timer of ``SPAN_TIMERS``), "host", the larger of its host issue time in an
    unprofiled repeat of the step (``host_ms`` > 0) and its busy time, else "span", the captured
    step's span (> 0); else "busy"."""
    paced = timer in SPAN_TIMERS
    if (paced or compiled) and step_ms is not None and step_ms > 0:
        return "step"
    if compiled:
        return "eager"
    if paced and host_ms is not None and host_ms > 0:
        return "host"
    return "span" if paced and span_ms is not None and span_ms > 0 else "busy"


def step_ms(device_ms, host_ms=None) -> float | None:
    """What a call costs a step whose host runs ahead: its device time, or its host issue time
    if that is longer. NaN reads as missing."""
    device_ms = None if device_ms is None or device_ms != device_ms else device_ms
    host_ms = None if host_ms is None or host_ms != host_ms else host_ms
    if device_ms is None:
        return None
    return device_ms if host_ms is None else max(device_ms, host_ms)


def error_pct(isolated_ms, insitu_ms) -> float | None:
    """100 * (isolated / in-situ - 1): how much slower the call reads alone than in the step."""
    if isolated_ms is None or insitu_ms is None or insitu_ms <= 0:
        return None
    return 100.0 * (isolated_ms / insitu_ms - 1.0)


def residual(parent_ms, children_ms: Iterable) -> float | None:
    """Parent time minus the sum of its children's: the glue a parent launches itself.

    None if the parent or any child has no time (a skipped or failed call).
    """
    children = list(children_ms)
    if parent_ms is None or any(c is None for c in children):
        return None
    return parent_ms - sum(children)


def binding_utilisation(mfu, mbu, has_flops: bool, bound: str | None = None) -> tuple[str | None, float | None]:
    """("mfu" | "mbu" | None, value): the utilisation of the resource that binds a call, the one
    figure a module is coloured by (Perfetto annotation and icicle alike).

    MBU when the call has no FLOPs (ReLU, a copy), is memory-bound, or uses a larger share of
    its bandwidth peak than of its FLOP peak (an EmbeddingBag's few pooling FLOPs must not show
    it as 0 % MFU); else MFU, or MBU when MFU is missing. (None, None) without either figure.
    """
    mfu, mbu = (None if v is None or math.isnan(v) else v for v in (mfu, mbu))
    use_mbu = not has_flops or (mbu is not None and (bound == "memory" or (mfu is not None and mbu > mfu)))
    if not use_mbu and mfu is not None:
        return "mfu", mfu
    if mbu is not None:
        return "mbu", mbu
    return None, None
