"""``--timer auto``: try timers in order (graph -> events -> cpu), recording why one failed."""
from __future__ import annotations

from .base import Timing, TimerUnavailable, TimingConfig, join_notes
from .hooks import AUTO_ORDER


def measure_auto(call, n_copies: int, device, cfg: TimingConfig, backends: dict,
                 order: tuple[str, ...] = AUTO_ORDER) -> Timing:
    """Time ``call`` with the first timer in ``order`` that can.

    Timers unavailable on the device (graph and events on CPU) are skipped silently; a timer that
    failed on this call (e.g. graph capture of an embedding backward) is named in the notes.

    Args:
        backends: name -> backend, e.g. ``cbtrace.registry.backends()``; absent names are skipped.
    Returns:
        The Timing of the first timer that worked, its ``notes`` prefixed with the failures.
    Raises:
        TimerUnavailable: no timer in ``order`` could time the call (the message lists why).
    """
    reasons, failures = [], []
    for name in order:
        backend = backends.get(name)
        if backend is None:
            continue
        reason = backend.unavailable_reason(device)
        if reason is None:
            try:
                timing = backend.measure(call, n_copies, device, cfg)
            except TimerUnavailable as e:
                reason = str(e)
                failures.append(f"{name} failed: {reason}")
            else:
                timing.notes = join_notes(*failures, timing.notes)
                return timing
        reasons.append(f"{name}: {reason}")
    why = "; ".join(reasons) or "none registered"
    raise TimerUnavailable(f"no timer could measure the call: {why}")
