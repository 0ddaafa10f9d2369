"""A per-call time limit: a call that hangs ends ``status = timeout`` and replay goes on.

``SIGALRM`` (``signal.setitimer``) interrupts Python code of the call, a ``time.sleep`` or a
blocking wait in it. What it cannot interrupt is a single kernel or C call already running
(a long CUDA kernel, a synchronize waiting for one): the alarm is handled when control
returns to Python, so such a call ends as ``timeout`` only once that kernel finishes. Without
``SIGALRM`` (Windows) or off the main thread, calls run without a limit.
"""
from __future__ import annotations

import contextlib
import signal
import threading


class CallTimeout(BaseException):
    """Raised inside a call that outlived its limit (a BaseException: the module's own
    ``except Exception`` must not swallow it)."""


def can_limit() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise CallTimeout in the block once it has run ``seconds`` (None or 0: no limit)."""
    if not seconds or not can_limit():
        yield
        return

    def expired(signum, frame):
        raise CallTimeout(f"took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
