"""Each captured call's host wall time in unprofiled repeats of the step (``insitu_host_ms``).

On a CPU it is the in-situ time: the capture trace's op times carry the profiler's own cost
(record_shapes and with_stack add microseconds to every op and Python call), which dwarfs small
modules; timing the same calls with plain perf_counter hooks in a second, unprofiled step does
not. On a GPU it is the host's issue time, which sets the pace of a call whose host is slower
than its kernels, free of capture's hooks and input copies.
"""
from __future__ import annotations

import statistics
import time

import torch

from cbtrace import module_tree
from cbtrace.calltree import CallTree
from cbtrace.capture import boundaries
from cbtrace.device import one_thread, waited_off_cpu
from cbtrace.state import StateGuard


def time_calls(model, fqns: list[str], run_step) -> list[float] | None:
    """Milliseconds of each call, in the order the calls are entered; None if the step's calls do
    not line up with ``fqns`` (the captured call order)."""
    modules = {f: module_tree.get_submodule(model, f) for f in set(fqns)}
    starts, spans, order, handles = [], [], [], []

    def pre(mod, args, kwargs):
        if boundaries.in_backward():  # a checkpoint's recomputation: not a call of the step
            return
        order.append(len(spans))
        spans.append(None)
        starts.append((len(spans) - 1, time.perf_counter()))

    def post(mod, args, kwargs, out):
        if boundaries.in_backward() or not starts:
            return
        i, t0 = starts.pop()
        spans[i] = (time.perf_counter() - t0) * 1e3

    try:
        for m in {id(m): m for m in modules.values()}.values():
            handles += boundaries.hook_calls(m, pre, post,
                                             boundary=boundaries.why_boundary(m) is not None)
        with module_tree.eager(model):  # a compiled model: its calls, as capture saw them
            run_step()
    finally:
        for h in handles:
            h.remove()
    if len(spans) != len(fqns) or any(s is None for s in spans):
        return None
    return spans


# Repeats taken whatever the budget (unless they take this long in all): a median of one is the
# first unprofiled step's, which may carry a fresh machine's one-off cost
MIN_REPEATS, MIN_REPEATS_MAX_S = 3, 10.0


def host_times(model, records, run_step, *, repeats: int = 7, budget_s: float = 2.0,
               one_thread_retry: bool = True) -> dict[int, float] | None:
    """call_id -> insitu_host_ms: the median over up to ``repeats`` unprofiled steps (within
    ``budget_s``) of each captured call's host time, less the cost of the hooks nested in it;
    None when a step's calls do not line up with the captured ones. The model's state is left
    untouched. Where most steps' thread waited off the CPU (a busy machine, whose intra-op
    workers a step then waits for), the steps are taken again on one intra-op thread, as the
    CPU timer does, and the try that waited less is kept (``one_thread_retry``: a CPU step)."""
    records = sorted(records, key=lambda r: r.call_id)
    guard = StateGuard(model)
    runs, plain, waited = _repeats(model, records, run_step, guard, repeats, budget_s)
    if runs is None:
        return None
    if one_thread_retry and torch.get_num_threads() > 1 and waited > len(runs) / 2:
        with one_thread():
            again = _repeats(model, records, run_step, guard, repeats, budget_s)
        if again[0] is not None and again[2] < waited:
            runs, plain, waited = again
    spans = [statistics.median(v) for v in zip(*runs)]
    parents = [r.parent_call_id for r in records]
    per_call = hook_overhead_ms(parents, spans, statistics.median(plain))
    nested = descendants(records)
    return {r.call_id: max(s - per_call * n, 0.0) for r, s, n in zip(records, spans, nested)}


def _repeats(model, records, run_step, guard, repeats: int, budget_s: float):
    """(per-step call spans, plain step ms, steps whose thread waited off the CPU); spans None
    when a step's calls do not line up with the captured ones."""
    runs, plain, waited = [], [], 0
    t0 = time.perf_counter()
    t_end, t_last = t0 + budget_s, t0 + MIN_REPEATS_MAX_S
    least = min(MIN_REPEATS, repeats)
    while len(runs) < repeats and (not runs or time.perf_counter() < t_end or (
            len(runs) < least and time.perf_counter() < t_last)):
        w0, c0 = time.perf_counter(), time.thread_time()
        with guard.call():
            spans = time_calls(model, [r.fqn for r in records], run_step)
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
        waited += waited_off_cpu(wall * 1e3, cpu * 1e3)
        with guard.call(), module_tree.eager(model):
            t0 = time.perf_counter()
            run_step()
            plain.append((time.perf_counter() - t0) * 1e3)
        if spans is None:
            return None, None, 0
        runs.append(spans)
    return runs, plain, waited


def descendants(records) -> list[int]:
    """Number of captured calls nested inside each call (records in call_id order)."""
    tree = CallTree({r.call_id: r.parent_call_id for r in records})
    return [tree.descendants[r.call_id] for r in records]


def hook_overhead_ms(parents: list[int], spans, plain_step_ms: float) -> float:
    """Cost of one hooked call, from the roots' hooked time against an unhooked step.

    With autograd on, a hooked module call costs more than a plain one. A parent's span carries
    that cost once per hooked call inside it, which is subtracted (0 when hooks cost nothing); a
    call's own share mostly falls outside its span (taken between its pre and post hooks).
    """
    roots = [s for s, p in zip(spans, parents) if p == -1]
    return max(sum(roots) - plain_step_ms, 0.0) / max(len(spans), 1)
