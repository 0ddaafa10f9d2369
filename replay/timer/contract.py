"""The timer contract: what a timer receives, how it is configured, what it returns.

A backend (timer) has a ``name`` and two methods::

    backend.unavailable_reason(device) -> str | None   # None: it can run on this device
    backend.measure(call, n_copies, device, cfg) -> Timing

``call`` is a ``CallRunner``: ``call.run(i)`` (or ``call(i)``) runs the module once on input
copy ``i`` (0 <= i < ``call.n_copies``, the same number as ``n_copies``); rotating among copies
keeps repeated runs from reading their inputs out of a warm L2. Its other fields say what else
a timer may do with it: untimed work before each timed run (``before``), staging for CUDA graph
slots (``stage``/``unstage``), the expected time (``expected_ms``) and whether it may be
captured at all (``graph_ok``). ``measure`` raises ``TimerUnavailable`` when it cannot time this
particular call (e.g. CUDA graph capture fails); the replay engine then falls back
(``timer.choice``) and records the reason. Exceptions raised by the module itself pass
through unchanged.

This module and ``graph_capture`` are the layer timers build on: they import nothing else of
``cbtrace.replay`` (an import-linter contract in pyproject.toml).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

from cbtrace.errors import CbtraceError


class TimerUnavailable(CbtraceError):
    """This timer cannot time this call here; the message (the fallback reason) says why.
    ``reasons``: each timer's, where a chain of them refused."""

    def __init__(self, message: str = "", reasons: list[str] | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.reasons = list(reasons) if reasons is not None else [str(self)]


@dataclass(frozen=True, kw_only=True)
class TimingConfig:
    """How one call is timed. Defaults suit a whole-model replay (hundreds of calls in ~20 s);
    ``ReplayConfig`` takes its shared settings' defaults from here and derives one
    (``ReplayConfig.timing``)."""

    budget_s: float = 0.03
    """Wall-clock budget for the timed runs of one call, warm-up and capture excluded (s)."""
    min_runs: int = 10
    """Timed runs taken even when they overrun the budget."""
    converge_spread: float = 0.01
    """Stop sampling once p10..p90 is within this share of the median (0: off)."""
    converge_ci: float = 0.01
    """Also stop once the median's 95 % CI is within +- this share of it (0: off; RESULTS.md)."""
    converge_ci_floor: bool = False
    """... or within +- the timer's own jitter per sample (for A/B runs: not yet measured)."""
    max_runs: int = 10_000
    """Timed runs never exceeded, whatever the budget."""
    warmup_runs: int = 1
    """Untimed runs first (allocator, cuBLAS heuristics, lazy init); graph: on a side stream."""
    warmup_min_s: float = 0.02
    """CPU timer: also warm up for at least this long (s); first thread-pool calls can read 8 ms."""
    warmup_s: float = 0.0
    """GPU timers: before sampling, run flushed timed-like replays (discarded) for this long (s)."""
    settle_tol: float = 0.0
    """GPU timers: also warm up until one window's median is within this of the last (0: off)."""
    settle_window_s: float = 0.025
    """Length of one such warm-up window (s)."""
    settle_lag: int = 3
    """A window's median is compared with the one this many windows before (>= 1)."""
    settle_max_s: float = 1.0
    """Longest warm-up when waiting for the time to settle (s); the row then says so."""
    graph_k: int = 20
    """Calls captured back-to-back in one CUDA graph; per-call time = replay time / K."""
    graph_max_ms: float = 1.0
    """K shrinks (to >= 1) to keep one replay under this (ms): long GEMM runs drop the SM clock."""
    flush_l2: bool = True
    """Memset a big buffer before each timed run/replay (GPU): cold L2 and a do_bench-style gap."""
    flush_bytes: int = 256 * 2**20
    """Size of the L2-flushing buffer (bytes); several times the largest L2 (H200: 50 MB)."""
    gap_s: float = 0.0
    """Extra spacing before each timed run/replay (s): a spin kernel on GPU, a sleep on CPU."""
    spin_min_ms: float = 0.05
    """Shortest spin before a start event, so the host enqueues the call (ms); graph: no flush."""
    spin_max_ms: float = 200.0
    """Longest such spin (ms): hides a whole model's host issue (a 0.5 B Llama's: 33 ms)."""

    def __post_init__(self):
        if self.budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {self.budget_s}")
        if not 1 <= self.min_runs <= self.max_runs:
            raise ValueError(f"need 1 <= min_runs <= max_runs, got {self.min_runs}, "
                             f"{self.max_runs}")
        if (self.warmup_s < 0 or self.settle_tol < 0 or self.settle_window_s <= 0
                or self.settle_lag < 1 or self.settle_max_s < self.warmup_s):
            raise ValueError("need warmup_s >= 0, settle_tol >= 0, settle_window_s > 0, "
                             "settle_lag >= 1 and settle_max_s >= warmup_s, got "
                             f"{self.warmup_s}, {self.settle_tol}, {self.settle_window_s}, "
                             f"{self.settle_lag}, {self.settle_max_s}")
        if self.converge_spread < 0 or self.converge_ci < 0:
            raise ValueError(f"need converge_spread >= 0 and converge_ci >= 0, got "
                             f"{self.converge_spread}, {self.converge_ci}")
        if self.warmup_runs < 0:
            raise ValueError(f"warmup_runs must be >= 0, got {self.warmup_runs}")
        if self.graph_k < 1:
            raise ValueError(f"graph_k must be >= 1, got {self.graph_k}")


@dataclass(frozen=True, kw_only=True)
class CallRunner:
    """One call as a timer receives it: what to run and what else a timer may do with it."""

    run: Callable[[int], object]
    """run(i): the call on input copy i; with ``stage``, on staged slot i instead."""
    n_copies: int = 1
    """Input copies to rotate among (i % n_copies), against a warm L2."""
    before: Callable[[int], None] | None = None
    """Untimed work right before each timed run(i): its context's calls, or its inputs' rewrite."""
    warms_inputs: bool = False
    """``before`` only readies the inputs (a rewrite, a backward's forward): warm-ups skip it."""
    stage: Callable[[int], None] | None = None
    """Untimed work for graph slot j, done for all slots before run(j) is captured for each."""
    unstage: Callable[[], None] | None = None
    """Releases what ``stage`` holds; a timer calls it before staging again and when done."""
    expected_ms: float | None = None
    """Device time of one run from the profiled pass (sizes a graph timer's K); None: unknown."""
    graph_ok: bool = True
    """Whether the call may be captured into a CUDA graph (False: a graph timer declines it)."""
    release: Callable[[], None] | None = None
    """What the replay calls once timing is over (``before``'s leftovers); timers never call it."""

    def __post_init__(self):
        if self.n_copies < 1:
            raise ValueError(f"n_copies must be >= 1, got {self.n_copies}")
        if (self.stage is None) != (self.unstage is None):
            raise ValueError("stage and unstage come together (one without the other)")

    def __call__(self, i: int = 0):
        return self.run(i)


def as_runner(call, n_copies: int) -> CallRunner:
    """``call`` as a CallRunner: a bare function ``fn(i)`` becomes one with nothing else to do."""
    return call if isinstance(call, CallRunner) else CallRunner(run=call, n_copies=n_copies)


@dataclass
class Timing:
    """What a backend measured for one call (all times per single call, in ms)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int            # timed samples (graph: replays, each the mean of K calls)
    timer: str           # backend name: "graph" | "stream" | "events" | "cpu" | a plugin's
    samples_ms: list[float] = field(default_factory=list)
    notes: str | None = None  # e.g. "K=20", "spin=0.050ms", fallback reasons
    noisy: bool = False  # the samples say the machine was busy (waits off-CPU, a wide spread)
    timed_ms: float = 0.0  # time inside the timing events, all runs (graph: K calls a replay)


def join_notes(*notes: str | None) -> str | None:
    """'a; b' from the notes that are not None or empty; None if none is."""
    return "; ".join(n for n in notes if n) or None


class Backend(Protocol):
    """What the replay engine expects of a timer (see the module docstring)."""

    name: str

    def unavailable_reason(self, device) -> str | None: ...

    def measure(self, call: CallRunner, n_copies: int, device, cfg: TimingConfig) -> Timing: ...


class Pausable(Protocol):
    """Background work of this process that takes the host (the replay's read-ahead)."""

    def paused(self) -> contextlib.AbstractContextManager:
        """Holds the work while open (one part under way finishes first)."""


# weak references: a registered object that is dropped without unregistering is not kept alive
_BACKGROUND: list[weakref.ref] = []


def pause_while_host_paced(work: Pausable) -> Callable[[], None]:
    """Register ``work``, paused while a host-paced measurement runs; returns the function that
    unregisters it."""
    def drop(ref):  # by identity: a Pausable's own __eq__ is not asked
        _BACKGROUND[:] = [r for r in _BACKGROUND if r is not ref]

    ref = weakref.ref(work, drop)  # dropped unregistered: its entry goes with it
    _BACKGROUND.append(ref)
    return lambda: drop(ref)


@contextlib.contextmanager
def host_paced():
    """Around a measurement whose figure is the host's pace (a call's host issue time, K calls
    issued back to back): the background work registered with ``pause_while_host_paced`` waits
    until it ends: its reads take the GIL and cores from the measured thread
    (benchmarks/probes/probe_root_host.py)."""
    with contextlib.ExitStack() as stack:
        for work in [ref() for ref in tuple(_BACKGROUND)]:
            if work is not None:
                stack.enter_context(work.paused())
        yield
