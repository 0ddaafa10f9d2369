"""The built-in steps of a replay plan: each measures one thing and returns its columns.

A step has a ``name`` and ``run(call: CallUnderTest) -> dict`` of ModuleRecord fields; the
plan (``cbtrace.replay.measure.plan``) runs them in order on one prepared call. A new measurement
(another mode, another direction) is another step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
import warnings

import torch

from cbtrace.cost.opcount import OpCounter
from cbtrace.device import sm_clock_mhz
from cbtrace.nested import flat_tensors
from cbtrace.replay.measure.context import in_step_cache_state
from cbtrace.replay.measure.prepare import CallUnderTest
from cbtrace.replay.measure.profiler_pass import profile_as_timed, profile_call
from cbtrace.replay.measure.reuse import (COPIED, CountCache, ProfileCache, TimingReuse,
                                          call_key, signature, value_free)
from cbtrace.replay.timer import choice
from cbtrace.replay.timer.contract import TimerUnavailable, host_paced, join_notes
from cbtrace.replay.timer.stats import summarize


# A CUDA graph replay of a call shorter than this share of its kernels' eager busy time (the
# profiled pass) ran other kernels. Kernels alone in another cache state differ by tens of
# percent, not by half. The profiler adds about a microsecond a kernel (DCN's dense_arch.3: 0.8
# us in its graph, 1.9 us profiled), taken off first; calls under GRAPH_OTHER_MIN_MS of kernels
# after that are left alone. (wav2vec2's grouped, weight-normed Conv1d, 1.7 ms in its graph
# against 11.2 ms of eager kernels, set this off in session 20; session 23 read 1.63 ms a call
# between events eagerly too: its kernels overlap, which the busy time, a union since 2e3ff19,
# no longer counts several times over, or run slower profiled: the GPU probe pos-conv says
# which. benchmarks/RESULTS.md.)
GRAPH_OTHER_KERNELS, GRAPH_OTHER_MIN_MS, PROFILED_KERNEL_COST_MS = 0.5, 0.010, 0.001
# A call in its context whose kernels give its figure (``context_kernels_max_ms``) is still
# captured and replayed by the graph timer, which says whether the graph can hold it in its
# context at all (else it is timed back to back without one) and gives the difference for its
# notes: a few runs do, the rest of its budget would buy nothing its figure uses.
CHECK_RUNS = 3


def as_check(tcfg):
    """``tcfg`` for a graph run only as a check of a figure its kernels give: CHECK_RUNS runs,
    no budget."""
    return dataclasses.replace(tcfg, budget_s=0.0, min_runs=CHECK_RUNS, max_runs=CHECK_RUNS)


def graph_ran_other_kernels(t, device_ms, kernels=None) -> str | None:
    """Why the graph timer's figure is not the eager call's, or None."""
    if t.timer != "graph" or device_ms is None or math.isnan(device_ms) or math.isnan(
            t.median_ms):
        return None
    n = kernels if kernels is not None and not math.isnan(kernels) else 1
    busy = device_ms - PROFILED_KERNEL_COST_MS * n
    if busy < GRAPH_OTHER_MIN_MS or t.median_ms >= GRAPH_OTHER_KERNELS * busy:
        return None
    return (f"graph: its capture ran other kernels ({t.median_ms:.3g} ms a call against "
            f"{device_ms:.3g} ms of the call's kernels run eagerly)")


class Timed:
    """isolated_ms (median, p10, p90) from the first timer of the chain that can time the call;
    for a short call the graph timer holds in its context, from its own kernels' busy time in
    profiled runs after its context (``ReplayConfig.context_kernels_max_ms``), the graph then
    run as a check."""

    name = "time"

    def __init__(self, chain: list[str], backends: dict, cfg, eager_kernels: bool = True):
        """``eager_kernels``: the call timed is the one the profiled pass ran (``device_ms``);
        False for a compiled call, whose fused kernels may well take under half the time."""
        self.chain, self.backends, self.eager_kernels = chain, backends, eager_kernels
        self.tcfg, self.cold = cfg.timing(), cfg.cold
        self.profile_runs = cfg.profile_runs if cfg.profile_as_timed and eager_kernels else 0
        # a short call in its context takes its figure from its kernels so profiled
        # (context_kernels_max_ms): enough runs for a spread
        self.kernels_max_ms = cfg.context_kernels_max_ms if self.profile_runs else 0.0
        # a graph-timed call of this many kernels or more takes its kernels' figure too; not
        # cold, whose graph flushes the L2 before each run and the profiled runs do not
        self.kernels_min = cfg.kernels_figure_min if self.profile_runs and not cfg.cold else 0
        # a graph-timed call whose kernels are this short takes their figure too: a slot's
        # gap before each kernel is a share of it (small_call_max_ms); never cold either
        self.small_ms = cfg.small_call_max_ms if self.profile_runs and not cfg.cold else 0.0
        # a lookup on table copies takes its kernels' figure at any length (table_kernels_figure)
        self.tables_by_kernels = cfg.table_kernels_figure and bool(self.profile_runs) \
            and not cfg.cold
        self.figure_runs = max(cfg.profile_runs, cfg.context_kernel_runs)
        # a call of the same work as one profiled as timed before, after a context of the same
        # kinds of call on the same inputs (or as many table copies), takes its figures
        self.as_timed = ProfileCache() if cfg.count_flops and cfg.reuse_counts else None
        self.reuse = None
        if cfg.reuse_timing:
            self.reuse = TimingReuse()

    def run(self, c: CallUnderTest) -> dict:
        key = self._key(c)
        hit = self.reuse.lookup(key) if key is not None else None
        if hit is not None:  # the same work, timed and checked: its timing, no runs of its own
            fqn, fields = hit
            return {**fields, "runs": 0, "timed_ms": 0.0, "timer_notes": join_notes(
                c.row.get("timer_notes"), f"{COPIED}{fqn or '(root)'} (--reuse-timing)")}
        in_step_cache_state(c)
        eager = {k: c.row.get(k) for k in ("kernel_count", "device_ms")}
        with_context = c.timed is not None and c.timed.before is not None
        on_tables = _on_tables(c)
        # of many or short kernels and timed alone: profiled after its graph, then a check
        after_graph = c.timed is None and self._by_own_kernels(c.row.get("kernel_count"),
                                                               c.row.get("device_ms"))
        profiled, profiled_note, kernels, kernels_of = self._profile_as_timed(c, with_context)
        # sizes the graph timer's K (profiled pass); a context runs in every slot too
        expected = c.row.get("device_ms")
        expected = expected * (2 if with_context else 1) if expected else None
        run = dataclasses.replace(c.timed or c.run.timed(), expected_ms=expected)
        # a call in a context that the graph refuses is timed back to back without it (below)
        # before any timer after the stream one times it in its context
        head, tail = self.chain, []
        if with_context and "stream" in self.chain:
            cut = self.chain.index("stream") + 1
            head, tail = self.chain[:cut], self.chain[cut:]
        context_note = c.context_note
        try:
            try:
                t, fallback = self._measure(c, run, head, self._check_cfg(
                    head, with_context, kernels, after_graph, on_tables))
            except TimerUnavailable as e:
                if not with_context or "stream" not in self.chain:
                    raise
                t, fallback, alone = self._without_context(c, run, tail, e.reasons)
                if alone:
                    context_note = "no context: timed back to back, which a context would break"
                    c.row.update(eager)
                    profiled, profiled_note, kernels, kernels_of = {}, None, None, None
        finally:
            if run.release is not None:
                run.release()
        by_kernels = t.timer == "graph" and self._kernels_give_figure(with_context, kernels,
                                                                      on_tables)
        if after_graph and t.timer == "graph":  # its kernels as the graph ran them: no gaps
            profiled, profiled_note, kernels, kernels_of = self._profile_as_timed(
                c, False, after_graph=True)
            by_kernels = kernels is not None
            if not by_kernels:  # its graph's few check runs are no figure: timed in full
                t, fallback = self._measure(c, dataclasses.replace(c.run.timed(),
                                                                   expected_ms=expected), head)
        # the clock its runs left, beside the step's (``attribution.miss``)
        fields = dict(timer=t.timer, timer_fallback=fallback, isolated_ms=t.median_ms,
                      isolated_ms_p10=t.p10_ms, isolated_ms_p90=t.p90_ms, noisy=t.noisy,
                      # the clock the figure's runs left: its profiled runs', else its timer's
                      timed_clock_mhz=kernels.clock_mhz if by_kernels else sm_clock_mhz(c.device))
        runs, figure_note = t.runs, None
        if by_kernels:
            fields.update(kernel_figure(kernels.run_ms))
            # its device time is its figure: the miss's kernels against the step's are its own
            profiled = dict(profiled, device_ms=fields["isolated_ms"])
            c.row["device_ms"] = fields["isolated_ms"]
            # another call's profiled runs (the same work after the same kinds of context):
            # none of this row's own, as a timing reuse says
            runs = len(kernels.run_ms) if kernels_of is None else 0
            whose = "its kernels" if kernels_of is None else f"{kernels_of}'s kernels"
            figure_note = (f"{whose} in context, {len(kernels.run_ms)} profiled runs (graph "
                           f"less context: {t.median_ms:.4g} ms, {t.runs} runs)")
            if not with_context:
                figure_note = (f"{whose}' busy time ({kernels.kernel_count} kernels), "
                               f"{len(kernels.run_ms)} profiled runs (graph: {t.median_ms:.4g} "
                               f"ms, {t.runs} runs)")
        # a figure another call's runs gave checks nothing (--reuse-timing)
        check = (self.reuse.record(key, c.rec.fqn, fields)
                 if key is not None and (figure_note is None or kernels_of is None) else None)
        return dict(fields, **profiled, runs=runs, timed_ms=t.timed_ms, timer_notes=join_notes(
            c.row.get("timer_notes"), t.notes, "cold" if self.cold else None, context_note,
            profiled_note, figure_note, check))

    def _without_context(self, c: CallUnderTest, run, tail: list[str], refused: list[str]):
        """(Timing, timer_fallback, whether it ran without its context) of a call in a context
        that no timer up to the stream one could time: the graph cannot hold it, and its
        context would land between back-to-back runs. The host's pace, which only a
        back-to-back window keeps, decides its time more than the cache state its context
        gives: timed back to back without it (and profiled so), else in its context by the
        timers after the stream one (``tail``); TimerUnavailable naming every refusal."""
        try:
            t, _ = choice.measure(dataclasses.replace(c.run.timed(), expected_ms=None),
                                  c.n_copies, c.device, ["stream"], self.backends, self.tcfg)
            return t, "; ".join(r for r in refused if not r.startswith("stream: ")) or None, True
        except TimerUnavailable as alone:
            refused = [*refused, *(f"without its context, {r}" for r in alone.reasons)]
        if not tail:
            raise choice.refused(refused)
        try:
            t, more = choice.measure(run, c.n_copies, c.device, tail, self.backends, self.tcfg)
        except TimerUnavailable as e:
            raise choice.refused([*refused, *e.reasons]) from e
        return t, "; ".join([*refused, *([more] if more else [])]), False

    def _kernels_give_figure(self, with_context: bool, kernels, on_tables: bool = False) -> bool:
        """Whether a graph-timed call's profiled kernels give its figure: a short call in its
        context (``context_kernels_max_ms``), one of many kernels or short kernels in any
        cache state (``_by_own_kernels``), or a lookup on table copies where asked
        (``table_kernels_figure``)."""
        if kernels is None or not kernels.device_ms > 0:
            return False
        return ((with_context and kernels.device_ms < self.kernels_max_ms)
                or (on_tables and self.tables_by_kernels)
                or self._by_own_kernels(kernels.kernel_count, kernels.device_ms))

    def _by_own_kernels(self, count, device_ms) -> bool:
        """Whether a graph-timed call's kernels give its figure whatever its cache state: many
        of them (``kernels_figure_min``), or short ones (``small_call_max_ms``)."""
        return self._many_kernels(count) or (
            bool(self.small_ms) and device_ms is not None and 0 < device_ms < self.small_ms)

    def _many_kernels(self, count) -> bool:
        return bool(self.kernels_min) and count is not None and count == count \
            and count >= self.kernels_min

    def _check_cfg(self, chain: list[str], with_context: bool, kernels,
                   after_graph: bool = False, on_tables: bool = False):
        """The first timer's settings for this call: ``CHECK_RUNS`` runs where the graph timer
        comes first and the call's kernels give its figure (or will, profiled
        ``after_graph``), else the replay's."""
        if chain[:1] != ["graph"] or not (after_graph or self._kernels_give_figure(
                with_context, kernels, on_tables)):
            return self.tcfg
        return as_check(self.tcfg)

    def _measure(self, c: CallUnderTest, run, chain: list[str], tcfg=None):
        """(Timing, why the timers before it refused) by the first of ``chain`` that can, with
        ``tcfg`` (default: the replay's settings; a timer other than the graph that times the
        call with a check's settings times it again with the replay's); a graph whose capture
        ran other kernels than the step's gives way to the rest of ``chain``.
        TimerUnavailable, with every reason (``reasons``), where none can."""
        full = self.tcfg
        tcfg = tcfg or full
        t, fallback = choice.measure(run, c.n_copies, c.device, chain, self.backends, tcfg)
        if t.timer != "graph" and tcfg is not full:  # not a check then: the call's figure
            t, fallback = choice.measure(run, c.n_copies, c.device, chain, self.backends, full)
        other = (graph_ran_other_kernels(t, c.row.get("device_ms"), c.row.get("kernel_count"))
                 if self.eager_kernels else None)
        rest = chain[chain.index(t.timer) + 1:] if t.timer in chain else []
        if other and rest:  # time what the step ran: the call's eager kernels
            try:
                t, more = choice.measure(run, c.n_copies, c.device, rest, self.backends,
                                         full)
            except TimerUnavailable as e:
                raise choice.refused([*([fallback] if fallback else []), other,
                                      *e.reasons]) from e
            fallback = "; ".join(x for x in (fallback, other, more) if x)
        return t, fallback

    def _profile_as_timed(self, c: CallUnderTest, with_context: bool, after_graph: bool = False):
        """(kernel_count and device_ms, the row's note, the ``AsTimed``, the fqn of the call
        whose runs they are or None) of a call timed in its context or on copies of its table or
        parameters, or (``after_graph``) of many or short kernels timed alone, profiled so
        (``profile_as_timed``): its kernels in the cache state its isolated time has, not warm
        on copy 0; or those of a call of the same work profiled so before, after the same
        kinds of context call (``context_key``) or alone, unless timings are reused
        (``--reuse-timing``), whose check needs a second call's own. ({}, None, None, None)
        when not asked, not so timed, not found, or (``after_graph``) of fewer and longer
        kernels after all."""
        none = {}, None, None, None
        runner = c.run.timed() if after_graph else c.timed
        if not self.profile_runs or runner is None or c.device.type != "cuda":
            return none
        tag = ("alone" if self.reuse is None else None) if after_graph else c.context_key
        key = None
        if self.as_timed is not None and tag is not None:
            base = ProfileCache.key(signature(c.module, c.rec), c.row)
            key = None if base is None else (*base, tag)
        hit = self.as_timed.get(key) if key is not None else None
        note, of = "profiled as timed", None
        if hit is not None:
            of = hit[0] or "(root)"
            got, note = hit[1], f"profiled as timed as {of}"
        else:
            # for its figure: enough runs for a spread (context_kernel_runs)
            on_tables = _on_tables(c)
            for_figure = self._by_own_kernels(c.row.get("kernel_count"),
                                              c.row.get("device_ms")) or (
                with_context and self.kernels_max_ms > 0) or (
                on_tables and self.tables_by_kernels)
            got = profile_as_timed(runner, c.device,
                                   self.figure_runs if for_figure else self.profile_runs)
            if got is None or (after_graph and not self._by_own_kernels(got.kernel_count,
                                                                        got.device_ms)):
                return none
            # the clock its runs left: the row's timed clock where they give its figure (read
            # only there: a reading queues a spin kernel and waits for it)
            if self._kernels_give_figure(with_context, got, on_tables):
                got = got._replace(clock_mhz=sm_clock_mhz(c.device))
            if key is not None:
                self.as_timed.put(key, c.rec.fqn, got)
        c.row["kernel_count"], c.row["device_ms"] = got.kernel_count, got.device_ms
        return dict(kernel_count=got.kernel_count, device_ms=got.device_ms), note, got, of

    def _key(self, c: CallUnderTest):
        if self.reuse is None or not c.value_free:
            return None

        return ProfileCache.key(signature(c.module, c.rec), c.row)


def _on_tables(c: CallUnderTest) -> bool:
    """Whether the call runs on copies of its table (``context.with_table_copies``)."""
    return bool(c.context_key) and c.context_key[0] == "tables"


def kernel_figure(run_ms) -> dict:
    """isolated_ms, p10 and p90 from a call's kernels' busy time in each profiled run, by the
    timers' own percentiles (within the runs: a few runs give no decile below the lowest)."""
    median, p10, p90 = summarize(list(run_ms))
    return dict(isolated_ms=median, isolated_ms_p10=p10, isolated_ms_p90=p90)


def profiled_copies(n: int) -> list[int]:
    """The input copies the profiled pass rotates over, as a timer rotates over them all: not
    copy 0, which the steps after timing run, nor the last, whose values context replay
    compares its predecessors' outputs with (an in-place call rewrites the copy it runs on)."""
    return list(range(1, n - 1)) if n >= 3 else [0]


class ProfilerPass:
    """Kernel count, device and wall time, launch overhead and peak memory, from torch.profiler;
    reused for a call that is the same work as one profiled before (``replay.measure.reuse``)."""

    name = "profile"

    def __init__(self, runs: int, cache=None, as_timed: bool = True):
        self.runs, self.cache, self.as_timed = runs, cache, as_timed

    def run(self, c: CallUnderTest) -> dict:
        key = self.cache.key(signature(c.module, c.rec), c.row) if self.cache else None
        hit = self.cache.get(key) if self.cache else None
        if hit is not None:
            fqn, figures = hit
            notes = join_notes(c.row.get("timer_notes"), f"profiled as {fqn or '(root)'}")
            return {**figures, "timer_notes": notes}
        order = itertools.cycle(profiled_copies(c.n_copies) if self.as_timed else [0])
        p = profile_call(lambda: c.run(next(order)), c.device, runs=self.runs)
        figures = dict(kernel_count=p.kernel_count, device_ms=p.device_ms, wall_ms=p.wall_ms,
                       launch_overhead_ms=p.launch_overhead_ms, peak_mem_bytes=p.peak_mem_bytes,
                       peak_mem_source=p.peak_mem_source)
        if self.cache:
            self.cache.put(key, c.rec.fqn, figures)
        return figures


class HostIssue:
    """host_ms: host time to enqueue one call on a GPU, no sync in the timed loop (if it exceeds
    the device time, the GPU starves in a real step: host-bound); host_syncs: the host
    synchronisations torch reports in its first run, which is left out of host_ms (a warning
    per sync costs host time). Both None on CPU."""

    name = "host_issue"

    def __init__(self, reps: int = 5):
        self.reps = reps

    def run(self, c: CallUnderTest) -> dict:
        if c.device.type != "cuda":
            return dict(host_ms=None, host_syncs=None)
        torch.cuda.synchronize(c.device)
        times, syncs = [], []
        # the queue never fills in `reps` calls: none waits. The last run is on copy 0 (the
        # captured inputs), whose outputs OutputCheck looks at; a run's outputs are dropped
        # before the next (one run's activations alive at a time, as in the step)
        with host_paced():  # the read-ahead's reads wait: they would take the host
            for i in reversed(range(self.reps)):
                c.outputs = None
                counted = not syncs
                with counting_syncs(syncs) if counted else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    out = c.run(i % c.n_copies)
                    took = time.perf_counter() - t0
                if not counted or self.reps == 1:
                    times.append(took)
                c.outputs, out = out, None
        torch.cuda.synchronize(c.device)
        # median: one slow call is the OS, not the module
        return dict(host_ms=sorted(times)[len(times) // 2] * 1e3, host_syncs=syncs[0])


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text in sync-debug "warn" mode
_SHOWN: dict = {}  # the warnings registry of the calls' own warnings passed on


@contextlib.contextmanager
def counting_syncs(found: list):
    """Appends to ``found`` how many host synchronisations torch warned of in the block
    (``torch.cuda.set_sync_debug_mode("warn")``: .item(), nonzero, a device-to-host copy,
    Stream.synchronize; not torch.cuda.synchronize). The previous mode is restored, even on
    error."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every sync, not once per line of code
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if SYNC_WARNING in str(w.message)]
    for w in caught:  # the call's own warnings go on, once per place as they would have
        if w not in syncs:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                   registry=_SHOWN)
    found.append(len(syncs))


class OpCount:
    """FLOPs, bytes and compute dtype of one call with cbtrace's formulas (one untimed run);
    a call with the same ``call_key`` as value-free ones counted before takes their count once
    two agreed (``replay.measure.reuse``: GPT-2's 12 blocks and their parts are counted twice)."""

    name = "count"

    def __init__(self, reuse: bool = True):
        self.cache = CountCache() if reuse else None

    def run(self, c: CallUnderTest) -> dict:
        key = call_key(c.module, c.rec) if self.cache is not None else None
        hit = self.cache.get(key) if key is not None else None
        if hit is not None:
            c.value_free = True
            return dict(hit)
        params = {id(p): n for n, p in c.module.named_parameters()}
        with OpCounter(params=params) as oc:
            c.run(0)
        cost = oc.cost()
        c.value_free = value_free(c.rec.input_meta, oc.op_names())
        fields = dict(flops=cost.flops, flops_executed=cost.flops_executed, bytes=cost.bytes,
                      unknown_ops=cost.unknown_ops, compute_dtype=cost.compute_dtype)
        if key is not None:
            self.cache.put(key, fields, c.value_free)
        return fields


class OutputCheck:
    """nonfinite_outputs: whether the call's outputs hold NaN or Inf (timed as usual, flagged);
    those of a run an earlier step left (HostIssue's last), else of one more run."""

    name = "outputs"

    def run(self, c: CallUnderTest) -> dict:
        out = c.outputs if c.outputs is not None else c.run(0)
        c.outputs = None
        floats = [t for t in flat_tensors(out) if t.is_floating_point() or t.is_complex()]
        bad = any(not bool(torch.isfinite(t).all()) for t in floats if t.numel())
        return dict(nonfinite_outputs=bad)
