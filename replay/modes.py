"""The call in other modes: torch.compile'd ("compile") and from a one-call CUDA graph ("cudagraph").

    steps += mode_steps(cfg, device, chain, backends)   # replay/plan.py, when cfg.modes is set

``compile``: the module under ``torch.compile(mode=cfg.compile_mode)``, compiled by one untimed
run on input copy 0 (``compile_s``), then timed exactly as the eager call (the ``Timed`` step:
same timer chain, settings and rotating copies). Each module gets a compiled entry function with
its own code object: dynamo caches per code object, so modules never share cache entries,
recompile limits or a "skip this code" mark (compiling an ``nn.Identity`` through
``torch.compile(module)`` marked the wrapper shared by every ``torch.nn`` module as skipped, and
every later module ran eagerly). A failure, or dynamo giving up and running the call eagerly, is
``compile_status = "error: ..."`` and ``torch._dynamo.reset()``, never fatal.

``cudagraph``: the eager call captured into one CUDA graph per input copy and timed from
``g.replay()`` between two CUDA events with the GPU idle before the start event (no spin
kernel): the graph's launch latency is inside the figure, the host synchronisation is not (a
host wall clock around replay + sync would add a sync latency a step never pays). Where a real
step's host runs ahead of the GPU the launch hides behind earlier work, so the figure is an
upper bound by about one graph launch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import time
import warnings

import torch

from cbtrace.replay.call import CallUnderTest
from cbtrace.replay.graph_capture import (ASKS_CAPTURE, capturing, end_pool_routing, root_cause,
                                          side_stream_warmup, watch_capture_checks)
from cbtrace.replay.steps import HostIssue, Timed, timing_config
from cbtrace.replay.limits import CallTimeout
from cbtrace.replay.timing import join_notes


def mode_steps(cfg, device, chain: list[str], backends: dict) -> list:
    """The steps of ``cfg.modes``, in a fixed order."""
    steps = []
    if "compile" in cfg.modes:
        steps.append(Compiled(cfg, chain, backends))
    if "cudagraph" in cfg.modes:
        steps.append(CudaGraphed(cfg))
    return steps


def one_line(e: BaseException, limit: int = 200) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:limit] if lines else ''}".rstrip(": ")


# ---------------------------------------------------------------- compile


_entry_ids = itertools.count()


def compiled_entry(module, mode: str):
    """torch.compile of a function calling ``module``, with a code object of its own."""
    def call(*args, **kwargs):
        return module(*args, **kwargs)

    call.__code__ = call.__code__.replace(co_name=f"cbtrace_compiled_{next(_entry_ids)}")
    return torch.compile(call, mode=mode)


@dataclasses.dataclass
class DynamoCounts:
    """What dynamo's counters moved by: frames seen and converted, graphs, why it broke."""

    frames: int = 0
    frames_ok: int = 0
    graphs: int = 0
    reasons: tuple = ()  # first lines of new graph-break / unimplemented reasons


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {g: dict(counters[g]) for g in ("frames", "stats", "graph_break", "unimplemented")}


def counted_since(before: dict) -> DynamoCounts:
    now = _counters()

    def moved(group, key):
        return now[group].get(key, 0) - before[group].get(key, 0)

    reasons = tuple(dict.fromkeys(
        k.strip().splitlines()[0][:160] for g in ("graph_break", "unimplemented")
        for k in now[g] if moved(g, k) > 0))
    return DynamoCounts(moved("frames", "total"), moved("frames", "ok"),
                        moved("stats", "unique_graphs"), reasons)


class Compiled:
    """compile_ms (timed as isolated_ms), compile_status, compile_s, compile_graphs, and on
    CUDA compile_host_ms (host time to issue the compiled call: guards and launches)."""

    name = "compile"

    def __init__(self, cfg, chain: list[str], backends: dict):
        self.mode = cfg.compile_mode
        self.timed, self.host = Timed(chain, backends, cfg), HostIssue(cfg.host_runs)
        self.cache: dict[tuple, tuple] = {}  # (id(module), mode) -> (module, compiled fn)
        self.compiles: dict[int, tuple] = {}  # call_id -> (compile_s, graphs) of its first replay

    def _compiled(self, module):
        key = (id(module), self.mode)
        if key not in self.cache:  # the module is kept too: its id stays unique
            self.cache[key] = (module, compiled_entry(module, self.mode))
        return self.cache[key][1]

    def _failed(self, why: str, **row) -> dict:
        torch._dynamo.reset()  # a half-compiled frame must not poison the next module
        self.cache.clear()
        return dict(compile_status=f"error: {why}", **row)

    def run(self, c: CallUnderTest) -> dict:
        before = _counters()
        try:
            run = c.run.runner(self._compiled(c.module))
            t0 = time.perf_counter()
            run(0)  # compiles: never inside the timed runs
            if c.device.type == "cuda":
                torch.cuda.synchronize(c.device)
            seconds = time.perf_counter() - t0
        except CallTimeout:
            raise
        except Exception as e:  # noqa: BLE001 - the compile failed: record it, go on
            return self._failed(one_line(e), compile_graphs=counted_since(before).graphs)
        first = counted_since(before)
        if first.frames and not first.frames_ok:  # dynamo gave up and ran the frame eagerly
            why = "; ".join(first.reasons) or "no frame converted"
            return self._failed(f"not compiled, dynamo ran it eagerly ({why})", compile_s=seconds,
                                compile_graphs=0)
        try:
            # the eager row's device_ms sizes K; the same timer chain and settings as eager
            timed = self.timed.run(dataclasses.replace(c, run=run, row=dict(c.row)))
            host = self.host.run(dataclasses.replace(c, run=run, outputs=None))["host_ms"]
        except CallTimeout:
            raise
        except Exception as e:  # noqa: BLE001
            return self._failed(f"compiled call failed while timed ({one_line(e)})",
                                compile_s=seconds, compile_graphs=counted_since(before).graphs)
        later = counted_since(before).graphs - first.graphs
        # a call replayed again (CPU: timed twice) keeps the figures of its first compile
        seconds, graphs = self.compiles.setdefault(c.rec.call_id, (seconds, first.graphs))
        return dict(compile_ms=timed["isolated_ms"], compile_status="ok", compile_s=seconds,
                    compile_graphs=graphs, compile_host_ms=host,
                    timer_notes=join_notes(c.row.get("timer_notes"),
                                           *self._notes(c, timed, first, later, host)))

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


# ---------------------------------------------------------------- cudagraph


class GraphUnavailable(Exception):
    """The call cannot be captured into a CUDA graph; the message says why."""


def capture_graphs(c: CallUnderTest, warmup_runs: int) -> list:
    """One CUDA graph of one eager call per input copy (sharing one memory pool: replayed one
    at a time, in order), after a warm-up on a side stream as the CUDA graph docs require."""
    side_stream_warmup(c.run, c.n_copies, warmup_runs)
    graphs, pool, asked = [], None, []
    for i in range(c.n_copies):
        g = torch.cuda.CUDAGraph()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*empty.*")  # a call without kernels
                with capturing(g, torch.cuda.Stream(), pool), \
                        watch_capture_checks(asked):
                    c.run(i)
        except Exception as e:  # noqa: BLE001 - RuntimeError, AcceleratorError, OOM, ...
            end_pool_routing(g)
            for x in graphs:
                x.reset()
            cause = root_cause(e)
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # noqa: BLE001
                raise GraphUnavailable(f"graph capture failed ({one_line(cause)}) and left "
                                       f"CUDA unusable ({one_line(e2)})") from e
            raise GraphUnavailable(f"graph capture failed: {one_line(cause)}") from e
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
        self.tcfg = timing_config(cfg)

    def run(self, c: CallUnderTest) -> dict:
        if c.device.type != "cuda":
            return dict(cudagraph_status="unavailable: needs CUDA")
        try:
            with torch.cuda.device(c.device):
                graphs = capture_graphs(c, self.tcfg.warmup_runs)
                try:
                    touch = getattr(c.run, "touch", None) if self.tcfg.warm_inputs else None
                    ms = replay_samples(graphs, touch, self.tcfg, c.device)
                finally:
                    for g in graphs:
                        g.reset()
        except GraphUnavailable as e:
            return dict(cudagraph_status=f"error: {e}")
        except CallTimeout:
            raise
        except Exception as e:  # noqa: BLE001 - the eager figures of the row stay
            return dict(cudagraph_status=f"error: {one_line(e)}")
        return dict(cudagraph_ms=statistics.median(ms), cudagraph_status="ok")
