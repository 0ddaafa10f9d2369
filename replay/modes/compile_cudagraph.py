"""The call in other modes: torch.compile'd ("compile") and from a one-call CUDA graph ("cudagraph").

    steps += mode_steps(cfg, device, chain, backends)   # measure/plan.py, when cfg.modes is set

``compile``: the module under ``torch.compile(mode=cfg.compile_mode)``, compiled by one untimed
run on input copy 0 (``compile_s``), then timed exactly as the eager call (the ``Timed`` step:
same timer chain, settings and rotating copies). The compiled entry is ``call(module, *args)``
with a code object per kind of call (``reuse.call_key``: class, parameter shapes and dtypes,
settings, input metadata): dynamo caches per code object and, inlining nn.Module calls, takes
the module's parameters as graph inputs guarded on their metadata, so the 12 identical blocks of
a GPT-2 compile once and each runs with its own weights. Different kinds never share cache
entries, recompile limits or a "skip this code" mark (compiling an ``nn.Identity`` through
``torch.compile(module)`` marked the wrapper shared by every ``torch.nn`` module as skipped, and
every later module ran eagerly); a kind that recompiles per module anyway goes back to a code
object per module before dynamo's recompile limit. A failure, or dynamo giving up and running
the call eagerly, is ``compile_status = "error: ..."`` and ``torch._dynamo.reset()``, never fatal.
Inductor compiles the kernels of one graph in parallel worker processes
(``torch._inductor.config.compile_threads``); dynamo traces one frame at a time, so different
modules cannot be compiled at once in one process.

``cudagraph``: the eager call captured into one CUDA graph per input copy (on one capture stream
per device, warmed up on it, so what torch keeps per stream is made outside any capture; the
call's graphs share a private pool of torch's, are reset before the next call and torch's cached
blocks are handed back, so GPU memory returns to its level; a call that runs out of memory tries
once more after that) and timed from ``g.replay()`` between two CUDA events with the GPU idle before the start event (no spin
kernel): the graph's launch latency is inside the figure, the host synchronisation is not (a
host wall clock around replay + sync would add a sync latency a step never pays). Where a real
step's host runs ahead of the GPU the launch hides behind earlier work, so the figure is an
upper bound by about one graph launch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import statistics
import time
import warnings

import numpy as np
import torch

from cbtrace.errors import one_line
from cbtrace.replay.measure.context import in_context
from cbtrace.replay.measure.prepare import CallUnderTest
from cbtrace.replay.measure.reuse import call_key
from cbtrace.replay.timer.graph_capture import (ASKS_CAPTURE, capturing, end_pool_routing,
                                                root_cause, side_stream_warmup,
                                                watch_capture_checks)
from cbtrace.replay.measure.steps import Timed
from cbtrace.replay.measure.time_limit import CallTimeout
from cbtrace.replay.timer.contract import join_notes


def mode_steps(cfg, device, chain: list[str], backends: dict, compiled=None) -> list:
    """The steps of ``cfg.modes``, in a fixed order, sharing one time budget; ``compiled``: the
    ``Compiled`` step a plan already has (its entries and compile counts shared)."""
    steps = []
    if "compile" in cfg.modes:
        steps.append(compiled or Compiled(cfg, chain, backends))
    if "cudagraph" in cfg.modes:
        steps.append(CudaGraphed(cfg))
    if cfg.modes_budget_s is None:
        return steps
    budget = ModesBudget(cfg.modes_budget_s)
    return [Budgeted(s, budget) for s in steps]


SKIPPED = "skipped: "


class ModesBudget:
    """Seconds the modes of one replay have spent against their limit."""

    def __init__(self, limit_s: float):
        self.limit_s, self.spent_s = limit_s, 0.0

    def spent(self) -> bool:
        return self.spent_s >= self.limit_s


class Budgeted:
    """A mode step that runs while the modes' budget lasts; past it, the call's status in that
    mode says it was skipped (the eager figures of the row are untouched)."""

    def __init__(self, step, budget: ModesBudget):
        self.step, self.budget, self.name = step, budget, step.name

    def run(self, c: CallUnderTest) -> dict:
        if self.budget.spent():
            return {f"{self.name}_status": f"{SKIPPED}modes budget of "
                                          f"{self.budget.limit_s:g} s spent (--modes-budget-s)"}
        t0 = time.perf_counter()
        try:
            return self.step.run(c)
        finally:
            self.budget.spent_s += time.perf_counter() - t0


# ---------------------------------------------------------------- compile


_entry_ids = itertools.count()


def compiled_entry(mode: str):
    """torch.compile of ``call(module, *args, **kwargs)``, with a code object of its own."""
    def call(module, *args, **kwargs):
        return module(*args, **kwargs)

    call.__code__ = call.__code__.replace(co_name=f"cbtrace_compiled_{next(_entry_ids)}")
    return torch.compile(call, mode=mode)


SHARE_MISSES = 3  # recompiles of one kind before its modules get entries of their own


class EntryCache:
    """One compiled entry per kind of call (``call_key``), shared by the modules of that kind;
    a module whose call has no key, or whose kind recompiled per module ``SHARE_MISSES`` times
    (dynamo guarding on something the key does not see), gets an entry of its own."""

    def __init__(self, mode: str):
        self.mode = mode
        self.entries: dict = {}  # key -> compiled entry
        self.modules: dict = {}  # key -> modules seen (each kept: their ids stay unique)
        self.misses: dict = {}   # key -> calls that compiled again under a shared entry

    def key(self, module, rec):
        k = call_key(module, rec)
        if k is None or self.misses.get(k, 0) >= SHARE_MISSES:
            return ("module", id(module))
        return k

    def runner_fn(self, key, module):
        """The module's compiled callable (its parameters are the entry's inputs)."""
        if key not in self.entries:
            self.entries[key] = compiled_entry(self.mode)
        self.modules.setdefault(key, {})[id(module)] = module
        return functools.partial(self.entries[key], module)

    def compiled_again(self, key, module) -> None:
        """A module of a shared kind compiled a graph of its own: count a miss."""
        if not isinstance(key, tuple) and len(self.modules.get(key, ())) > 1:
            self.misses[key] = self.misses.get(key, 0) + 1

    def clear(self) -> None:
        self.entries.clear()
        self.modules.clear()


@dataclasses.dataclass
class DynamoCounts:
    """What dynamo's counters moved by: frames seen and converted, graphs, why it broke."""

    frames: int = 0
    frames_ok: int = 0
    graphs: int = 0
    reasons: tuple = ()  # first lines of new graph-break / unimplemented reasons


def dynamo_counters() -> dict:
    """Dynamo's counters now, the ``before`` of ``counted_since``."""
    from torch._dynamo.utils import counters  # dynamo loads only when a call is compiled

    return {g: dict(counters[g]) for g in ("frames", "stats", "graph_break", "unimplemented")}


def counted_since(before: dict) -> DynamoCounts:
    now = dynamo_counters()

    def moved(group, key):
        return now[group].get(key, 0) - before[group].get(key, 0)

    reasons = tuple(dict.fromkeys(
        k.strip().splitlines()[0][:160] for g in ("graph_break", "unimplemented")
        for k in now[g] if moved(g, k) > 0))
    return DynamoCounts(moved("frames", "total"), moved("frames", "ok"),
                        moved("stats", "unique_graphs"), reasons)


ISSUE_MIN_MS = 2.0    # steady_issue_ms: enough calls back to back to span this much host time
ISSUE_MAX_CALLS = 50


def steady_issue_ms(run, n_copies: int, device, *, warmup: int = 3, repeats: int = 3) -> float:
    """Host ms to issue one call in steady state: after ``warmup`` calls (guards, caches and
    allocator warm), K calls back to back with no sync, their wall / K, median of ``repeats``
    (K: enough calls for ISSUE_MIN_MS, at most ISSUE_MAX_CALLS). Should the launch queue fill,
    the figure becomes the device's pace, which the step would pay anyway. Each call's outputs
    go before the next (one call's activations alive at a time, as in the step)."""
    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(warmup):
        run(i % n_copies)
    sync()
    t0 = time.perf_counter()
    run(0)
    one_ms = (time.perf_counter() - t0) * 1e3
    sync()
    k = max(2, min(ISSUE_MAX_CALLS, math.ceil(ISSUE_MIN_MS / max(one_ms, 1e-3))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(k):
            run(i % n_copies)
        samples.append((time.perf_counter() - t0) * 1e3 / k)
        sync()
    return statistics.median(samples)


EVICT_BYTES = 64 << 20  # cold_issue_ms: written before each call, about twice a server LLC


class HostEvictor:
    """``evict()`` writes a host buffer of ``nbytes`` from one thread (numpy: torch's fill
    would wake its thread pool, whose spinning threads then slow the call timed next): what the
    CPU's caches held is gone, as the rest of a step leaves them before a call."""

    def __init__(self, nbytes: int = EVICT_BYTES):
        self.buf = np.zeros(nbytes, dtype=np.uint8)

    def __call__(self) -> None:
        self.buf.fill(1)


def cold_issue_ms(run, n_copies: int, device, evict, *, warmup: int = 3, runs: int = 9) -> float:
    """Host ms to issue one call with the CPU's caches as a step leaves them: after ``warmup``
    calls, ``runs`` calls each after ``evict()`` (the step's root run eagerly, or a write of a
    large buffer) and the device idle again, the median. A compiled call issued once per step
    runs dynamo's guards, its wrappers and its kernels' launchers from cold caches, while an
    eager call's code paths are the step's own and stay warm: on a 2-core CPU a compiled Dropout
    took 19-25 us back to back, 58-60 us after an eager step, 59-93 us after a 64 MB write, and
    compiled in place it cost a NanoGPT-tiny step 82-112 us; the eager Dropout 3, 5 and 13-17 us
    (benchmarks/probes/probe_inplace_host.py)."""
    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(warmup):
        run(i % n_copies)
    samples = []
    for i in range(runs):
        sync()
        evict()
        sync()  # a step run as the eviction leaves kernels queued: the call must not wait
        t0 = time.perf_counter()
        out = run(i % n_copies)
        samples.append((time.perf_counter() - t0) * 1e3)
        del out
    sync()
    return statistics.median(samples)


NOTHING_TO_FUSE = "one kernel and no submodule: nothing to fuse"
FAILED_ALIKE = 3  # compiled calls in a row failing with one error that stop compile mode


def nothing_to_fuse(c: CallUnderTest) -> bool:
    """A leaf module whose profiled pass saw at most one kernel on a GPU: compiled, it runs that
    kernel (or one like it) behind guards, so its compile would only cost the modes' wall."""
    kernels = c.row.get("kernel_count")
    return (c.device.type == "cuda" and kernels is not None and kernels <= 1
            and next(c.module.children(), None) is None)


class Compiled:
    """compile_ms (timed as isolated_ms), compile_status, compile_s, compile_graphs, and on
    CUDA compile_host_ms (host time to issue the compiled call in steady state: guards and
    launches, ``steady_issue_ms``)."""

    name = "compile"

    def __init__(self, cfg, chain: list[str], backends: dict):
        self.mode = cfg.compile_mode
        # the row's device_ms is the eager call's, not the compiled one's
        self.timed = Timed(chain, backends, cfg, eager_kernels=False)
        self.evict = HostEvictor() if cfg.cold_host_issue else None
        self.step = None  # the step's root call (its first), run as the eviction once replayed
        self.cache = EntryCache(self.mode)
        self.compiles: dict[int, tuple] = {}  # call_id -> (compile_s, graphs) of its first replay
        # (kind, cold) -> (steady issue ms, what compiling adds cold, whose): _host_ms
        self.issue: dict[tuple, tuple] = {}
        self.failures: list[str] = []  # the last calls' errors, alike and in a row
        self.stopped: str | None = None  # why compile mode stopped (FAILED_ALIKE calls in a row)

    def _failed(self, why: str, **row) -> dict:
        torch._dynamo.reset()  # a half-compiled frame must not poison the next module
        self.cache.clear()
        return dict(compile_status=f"error: {why}", **row)

    def run(self, c: CallUnderTest) -> dict:
        if c.row.get("eager_ms") is not None:  # AsInStep timed it compiled already
            return dict(compile_status=f"{SKIPPED}the step ran it compiled: isolated_ms is the "
                                       "compiled call")
        if nothing_to_fuse(c):
            return dict(compile_status=f"{SKIPPED}{NOTHING_TO_FUSE}")
        if self.stopped:
            return dict(compile_status=f"{SKIPPED}{self.stopped}")
        fields = self.measure(c)[0]
        self._watch(fields["compile_status"])
        return fields

    def _watch(self, status: str) -> None:
        """Stop compile mode once FAILED_ALIKE calls in a row failed with the same error: the
        cause is then the setting or the environment, not the modules (a bad --compile-mode; a
        bug on one branch failed 133 of 133 EfficientNet-B0 calls, each failure resetting
        dynamo, so every later call compiled from nothing: 107 s of a 135 s replay). Each call
        runs once: a call timed again runs the time steps alone (``plan.time_plan``)."""
        if not status.startswith("error: "):
            if status == "ok":
                self.failures.clear()
            return
        if self.failures and self.failures[-1] != status:
            self.failures.clear()
        self.failures.append(status)
        if len(self.failures) >= FAILED_ALIKE:
            self.stopped = (f"compile mode stopped: {len(self.failures)} calls in a row failed "
                            f"alike ({status[len('error: '):][:200]})")

    def measure(self, c: CallUnderTest, cold: bool = True) -> tuple[dict, dict | None]:
        """The row's compile fields, and the Timed step's figures of the compiled call (None
        where it was not timed compiled); ``cold``: compile_host_ms by ``cold_host_issue`` where
        it is on (the compile mode's estimate), else back to back (a call the step ran
        compiled, timed as in the step)."""
        with stance("default"):  # a step_compiled row's plan runs eagerly
            return self._measure(c, cold)

    def _measure(self, c: CallUnderTest, cold: bool) -> tuple[dict, dict | None]:
        before = dynamo_counters()
        key = self.cache.key(c.module, c.rec)
        try:
            run = c.run.with_fn(self.cache.runner_fn(key, c.module))
            t0 = time.perf_counter()
            run(0)  # compiles: never inside the timed runs
            if c.device.type == "cuda":
                torch.cuda.synchronize(c.device)
            seconds = time.perf_counter() - t0
        except CallTimeout:
            raise
        except Exception as e:  # noqa: BLE001 - the compile failed: record it, go on
            return self._failed(one_line(e), compile_graphs=counted_since(before).graphs), None
        first = counted_since(before)
        if first.graphs and c.rec.call_id not in self.compiles:
            self.cache.compiled_again(key, c.module)
        if first.frames and not first.frames_ok:  # dynamo gave up and ran the frame eagerly
            why = "; ".join(first.reasons) or "no frame converted"
            return self._failed(f"not compiled, dynamo ran it eagerly ({why})", compile_s=seconds,
                                compile_graphs=0), None
        try:
            # the eager row's device_ms sizes K; the same timer chain and settings as eager,
            # after the same predecessors (the eager call's own timed function never)
            cc = dataclasses.replace(c, run=run, timed=None, context_note=None, row=dict(c.row))
            if cc.context is not None:
                in_context(cc, cc.context)
                cc.context = None  # no embedding table copies: they would run the eager module
            timed = self.timed.run(cc)
            host, steady, like = (self._host_ms(c, run, cold, key) if c.device.type == "cuda"
                                  else (None, None, None))
        except CallTimeout:
            raise
        except Exception as e:  # noqa: BLE001
            return self._failed(f"compiled call failed while timed ({one_line(e)})",
                                compile_s=seconds, compile_graphs=counted_since(before).graphs), None
        later = counted_since(before).graphs - first.graphs
        # a call replayed again (CPU: timed twice) keeps the figures of its first compile
        seconds, graphs = self.compiles.setdefault(c.rec.call_id, (seconds, first.graphs))
        alone = ("compile timed without the eager call's in-step cache state"
                 if c.timed is not None and cc.timed is None else None)
        return dict(compile_ms=timed["isolated_ms"], compile_status="ok", compile_s=seconds,
                    compile_graphs=graphs, compile_host_ms=host, compile_host_steady_ms=steady,
                    timer_notes=join_notes(c.row.get("timer_notes"), alone,
                                           *self._notes(c, timed, first, later, host),
                                           like and f"compile host issue as {like}'s (same kind "
                                                    "of call)")), timed

    def _host_ms(self, c: CallUnderTest, run, cold: bool = True,
                 key=None) -> tuple[float, float | None, str | None]:
        """(compile_host_ms, compile_host_steady_ms, the fqn whose issue times these are when
        another's). compile_host_ms: the compiled call's issue time back to back
        (``steady_issue_ms``); with ``cold_host_issue``, the eager call's host_ms plus what
        compiling adds to the issue time when both are issued right after the step's root run
        eagerly (before the root is replayed: after a large write; ``cold_issue_ms``), so that
        the opportunity's host saving, host_ms - compile_host_ms, is a difference of figures
        taken as in a step; the back-to-back figure is then kept beside it
        (compile_host_steady_ms, else None). The issue times are taken once per kind of call
        (``key``, a ``reuse.call_key``: the same work, compiled into one shared entry): each
        cold figure runs the root eagerly a dozen times, seconds a call on a large model."""
        eager = c.row.get("host_ms")
        if self.step is None and c.rec.parent_call_id == -1:
            self.step = c.run  # the root, replayed first: its eager run is the step's host work
        with_cold = cold and self.evict is not None and eager is not None
        known = self.issue.get((key, with_cold)) if isinstance(key, str) else None
        like = None
        if known is None:
            steady = steady_issue_ms(run, c.n_copies, c.device)
            added = None
            if with_cold:
                evict = self.evict if self.step is None else self._after_step
                added = (cold_issue_ms(run, c.n_copies, c.device, evict)
                         - cold_issue_ms(c.run, c.n_copies, c.device, evict))
            if isinstance(key, str):
                self.issue[(key, with_cold)] = (steady, added, c.rec.fqn or "(root)")
        else:
            steady, added, like = known
        if not with_cold:
            return steady, None, like
        return max(eager + added, 0.0), steady, like

    def _after_step(self) -> None:
        out = self.step(0)
        del out

    @staticmethod
    def _notes(c, timed: dict, first: DynamoCounts, later: int, host) -> list[str | None]:
        """What the eager row's notes should add about the compiled call."""
        timer = None
        if timed["timer"] != c.row.get("timer"):
            timer = f"compile timed with {timed['timer']} ({timed['timer_fallback']})"
        breaks = (f"compile: {first.graphs} graphs ({first.reasons[0]})"
                  if first.graphs > 1 and first.reasons else None)
        # e.g. the CPU timer's retry on one thread: dynamo guards on the thread count
        again = f"compile: {later} more graph(s) compiled while timed" if later > 0 else None
        return [timer, breaks, again, None if host is None else f"compile host={host:.3f}ms"]


AS_IN_STEP = "timed compiled, as in the step"  # timer_notes of a step_compiled row
# the Timed step's columns, which a step_compiled row takes from the compiled call
TIMED_COLUMNS = ("timer", "timer_fallback", "isolated_ms", "isolated_ms_p10", "isolated_ms_p90",
                 "runs", "timed_ms", "noisy")


class AsInStep:
    """A call the step ran under torch.compile (``step_compiled``) timed compiled, as the step
    ran it, through ``Compiled``'s entries: isolated_ms and its timer columns are the compiled
    call's, eager_ms the eager figure the Timed step took; host_ms the compiled call's issue
    time where there is one (CUDA). Should the compile fail, the eager figures stay and
    timer_notes says why."""

    name = "as_in_step"

    def __init__(self, compiled: Compiled):
        self.compiled = compiled

    def run(self, c: CallUnderTest) -> dict:
        if not c.rec.step_compiled or c.row.get("isolated_ms") is None:
            return {}
        fields, timed = self.compiled.measure(c, cold=False)  # its host figure as in the step
        counts = {k: fields[k] for k in ("compile_s", "compile_graphs", "compile_host_ms",
                                         "compile_host_steady_ms")
                  if k in fields}
        if timed is None:
            return dict(counts, timer_notes=join_notes(
                c.row.get("timer_notes"), f"the step ran it compiled; timed eagerly: "
                f"{fields['compile_status']}"))
        host = fields.get("compile_host_ms")
        return dict(counts, eager_ms=c.row["isolated_ms"],
                    **{k: timed[k] for k in TIMED_COLUMNS},
                    host_ms=host if host is not None else c.row.get("host_ms"),
                    timer_notes=join_notes(fields["timer_notes"], AS_IN_STEP))


# ---------------------------------------------------------------- cudagraph


class GraphUnavailable(Exception):
    """The call cannot be captured into a CUDA graph; the message says why."""


def capture_graphs(c: CallUnderTest, warmup_runs: int, stream=None, pool=None) -> list:
    """One CUDA graph of one eager call per input copy (sharing one memory pool, ``pool`` when
    given: replayed one at a time, in order), on ``stream`` (default: a fresh one) after a
    warm-up on it as the CUDA graph docs require."""
    stream = stream or torch.cuda.Stream()
    side_stream_warmup(c.run, c.n_copies, warmup_runs, stream)
    graphs, asked = [], []
    for i in range(c.n_copies):
        g = torch.cuda.CUDAGraph()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*empty.*")  # a call without kernels
                with capturing(g, stream, pool), watch_capture_checks(asked):
                    c.run(i)
        except Exception as e:  # noqa: BLE001 - RuntimeError, AcceleratorError, OOM, ...
            end_pool_routing(g)
            del g  # destroyed here, on this thread, not when the traceback goes
            for x in graphs:
                x.reset()
            # the message, not the exception: one kept in a local of this frame, which its
            # traceback holds, is a cycle that keeps these graphs until a collection
            cause = one_line(root_cause(e))
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # noqa: BLE001
                raise GraphUnavailable(f"graph capture failed ({cause}) and left "
                                       f"CUDA unusable ({one_line(e2)})") from e
            raise GraphUnavailable(f"graph capture failed: {cause}") from e
        graphs.append(g)
        pool = g.pool()
        if asked:
            for x in graphs:
                x.reset()
            raise GraphUnavailable(ASKS_CAPTURE)
    return graphs


def replay_samples(graphs: list, touch, tcfg, device) -> list[float]:
    """Per-call ms of graph replays, launch included: each after an L2 flush and its inputs'
    touch, with the GPU idle, ``g.replay()`` between two events. Warm-up first, then at least
    ``min_runs`` within the time budget."""
    flush = None
    if tcfg.flush_l2:
        with contextlib.suppress(torch.OutOfMemoryError):
            flush = torch.empty(tcfg.flush_bytes, dtype=torch.int8, device=device)

    def once(j: int):
        if flush is not None:
            flush.zero_()
        if touch is not None:
            touch(j)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()  # idle: the graph's launch latency lands between the events
        start.record()
        graphs[j % len(graphs)].replay()
        end.record()
        return start, end

    t_warm = time.perf_counter() + tcfg.warmup_s
    for j in itertools.count():  # every graph at least once: its first launch uploads it
        once(j)
        if j + 1 >= max(tcfg.warmup_runs, len(graphs)) and time.perf_counter() >= t_warm:
            break
    torch.cuda.synchronize()
    pairs, t0 = [], time.perf_counter()
    while len(pairs) < tcfg.max_runs and (
            len(pairs) < tcfg.min_runs or time.perf_counter() - t0 < tcfg.budget_s):
        pairs.append(once(len(pairs)))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in pairs]


class CudaGraphed:
    """cudagraph_ms (median over replays, launch included) and cudagraph_status."""

    name = "cudagraph"

    def __init__(self, cfg):
        self.tcfg = cfg.timing()
        self.streams: dict[int, torch.cuda.Stream] = {}  # device index -> capture stream

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """This device's capture stream, made on its first call."""
        i = device.index if device.index is not None else torch.cuda.current_device()
        if i not in self.streams:
            self.streams[i] = torch.cuda.Stream(device)
        return self.streams[i]

    @staticmethod
    def _release() -> None:
        """Hand torch's unused cached blocks back to the driver: the pool of graphs just reset
        (torch frees a graph's private pool only then; a pool kept for the next call's graphs
        failed every capture after the first under torch 2.11, and deleting a MemPool that a
        failed capture still held aborted the process), and what an allocation outside torch's
        allocator, such as a graph's instantiation, cannot make torch free."""
        torch.cuda.empty_cache()

    def run(self, c: CallUnderTest) -> dict:
        if c.device.type != "cuda":
            return dict(cudagraph_status="unavailable: needs CUDA")
        for attempt in range(2):
            try:
                with torch.cuda.device(c.device):
                    return self._run(c)
            except CallTimeout:
                raise
            except Exception as e:  # noqa: BLE001 - the eager figures of the row stay
                why = str(e) if isinstance(e, GraphUnavailable) else one_line(e)
                if attempt == 0 and "out of memory" in why.lower():
                    with torch.cuda.device(c.device):
                        self._release()
                    continue  # once more, with what torch had cached handed back
                return dict(cudagraph_status=f"error: {why}")

    def _run(self, c: CallUnderTest) -> dict:
        graphs = capture_graphs(c, self.tcfg.warmup_runs, self._stream(c.device))
        try:
            ms = replay_samples(graphs, c.run.touch, self.tcfg, c.device)
        finally:
            for g in graphs:
                g.reset()
            graphs.clear()
            self._release()  # the graphs' pool, before the next call's captures
        return dict(cudagraph_ms=statistics.median(ms), cudagraph_status="ok")


def stance(name: str):
    """torch.compiler's stance ``name`` for the block (torch < 2.6 has none: a no-op there)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance(name) if set_stance is not None else contextlib.nullcontext()
