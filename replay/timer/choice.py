"""The timer chain: which registered timers may time a call, in order, and the fallback.

Every timer comes from the backend registry (``register_backends``). A timer with a
``fallback_rank`` takes part in ``--timer auto`` (highest rank first: graph 30, stream 25,
events 20, cpu 10) and is a fallback for any timer ranked above it; a timer without one (a third
party's, say) is used only when asked for by name, falling back to the ranked timers. Fallbacks
that cannot run on the device are left out silently; the requested timer's failure, and a
fallback's, are recorded in the row's ``timer_fallback``.
"""
from __future__ import annotations

from cbtrace.errors import ReplayError
from cbtrace.replay.timer.contract import (CallRunner, Timing, TimerUnavailable, TimingConfig,
                                           as_runner)

AUTO = "auto"


def names(backends: dict) -> list[str]:
    """What ``--timer`` accepts: ``auto`` and every registered timer."""
    return [AUTO, *sorted(backends)]


def chain(requested: str, device, backends: dict) -> list[str]:
    """Timers to try in order: the requested one, then the ranked ones below it that can run on
    ``device`` (``auto``: all ranked ones that can)."""
    if requested != AUTO and requested not in backends:
        raise ReplayError(f"--timer {requested}: no such timer (registered: "
                          f"{', '.join(names(backends))})")
    ranked = sorted((n for n, b in backends.items() if _rank(b) is not None),
                    key=lambda n: -_rank(backends[n]))
    top = _rank(backends[requested]) if requested != AUTO else None
    below = [n for n in ranked if n != requested and (top is None or _rank(backends[n]) < top)]
    usable = [n for n in below if backends[n].unavailable_reason(device) is None]
    return usable if requested == AUTO else [requested, *usable]


def measure(call: CallRunner, n_copies: int, device, timers: list[str], backends: dict,
            cfg: TimingConfig) -> tuple[Timing, str | None]:
    """Time ``call`` (a CallRunner, or a bare ``fn(i)``) with the first timer of ``timers``
    that can; returns (Timing, why the ones before it could not, or None)."""
    import torch  # on use: the CLI's --timer choices read this module, and --help stays light

    call = as_runner(call, n_copies)
    n_copies = call.n_copies
    reasons = []
    for name in timers:
        backend = backends[name]
        why = backend.unavailable_reason(device)
        if why:
            reasons.append(f"{name}: {why}")
            continue
        try:
            return backend.measure(call, n_copies, device, cfg), "; ".join(reasons) or None
        except TimerUnavailable as e:
            reasons.append(f"{name}: {e}")
            if device.type == "cuda":
                torch.cuda.synchronize()
            if call.release is not None:  # what a failed capture left (its context's outputs)
                call.release()
    raise refused(reasons)


def refused(reasons: list[str]) -> TimerUnavailable:
    """The error of a call no timer could measure, each timer's reason in its message."""
    return TimerUnavailable("no timer could measure this call (" + "; ".join(reasons) + ")",
                            reasons)


def _rank(backend) -> int | None:
    return getattr(backend, "fallback_rank", None)
