"""``--backward``: each call's backward, on the gradients its outputs got in the step.

The backward is timed on its own: ``torch.autograd.grad`` of its outputs down to its inputs'
gradient edges and the leaves it reads short of them (its parameters) is the timed work
(grad-input where an input required grad, grad-weight for parameters); as in the step,
nothing runs past the inputs and no gradient is accumulated into a ``.grad``. The call's
forward runs untimed before it. The graph timer stages one forward per captured slot, eagerly
on the capture stream, and captures only the K backwards (``retain_graph``: each replay runs
them again over the same saved tensors); the events timer runs the forward as its untimed
``before``, queued before the start event; nothing is subtracted. Gradients come from the
capture (``grads_ref``: ``cbtrace capture --step train``), else random ones of the outputs'
shape and dtype (``grad_source``). The forward's saved tensors, the backward's peak memory and
the parameter gradients it makes give the call's memory split.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.profiler import ProfilerActivity, profile

from cbtrace.console import quiet_kineto
from cbtrace.cost.opcount import OpCounter
from cbtrace.device import OOM_RETRIED, hand_back
from cbtrace.errors import one_line
from cbtrace.nested import flat_tensors, map_tensors
from cbtrace.replay.measure.prepare import CallUnderTest
from cbtrace.replay.measure.profiler_pass import (peak_live_bytes, profile_as_timed,
                                                  rows_from_kineto)
from cbtrace.replay.measure.steps import as_check, kernel_figure
from cbtrace.replay.timer import choice
from cbtrace.replay.timer.contract import CallRunner, join_notes
from cbtrace.store.autograd_shape import as_non_leaf, is_non_leaf


class BackwardStep:
    """bwd_* columns, grad_source, saved_bytes, grad_bytes, bwd_peak_mem_bytes."""

    name = "backward"

    def __init__(self, cfg, chain: list[str], backends: dict):
        self.chain, self.backends = chain, backends
        self.tcfg = cfg.timing()
        self.profile_runs = cfg.profile_runs if cfg.profile_as_timed else 0
        # a backward whose kernels may give its figure: as many profiled runs as a forward's
        self.figure_runs = max(cfg.profile_runs, cfg.context_kernel_runs)
        # not cold: its graph flushes the L2 before each run, the profiled runs do not
        self.kernels_min = cfg.kernels_figure_min if self.profile_runs and not cfg.cold else 0

    def run(self, c: CallUnderTest) -> dict:
        # the inputs as captured: the forward steps' last runs left their keys and values, with
        # their graphs, in the copies' objects (a transformers Cache), and a target taken there
        # would hold those graphs, and the parameters' AccumulateGrad nodes they reach, made on
        # the default stream, through every capture below (see OnCopies.put_back)
        c.run.put_back()
        targets = grad_targets(flat_tensors(c.run.copies[0]))  # before an in-place forward
        outs = _grad_outputs(c.run(0))
        sums = grad_sums(outs, targets, c.module)
        del targets  # its nodes (an input's producer) go with it
        _note_inplace(c)
        if not outs:
            return dict(bwd_status="skipped", bwd_status_reason="no output requires grad (the "
                        "call ran without grad, or its outputs are not differentiable)")
        grads, source = _gradients(c, outs)
        del outs  # its autograd graph would keep the parameters' AccumulateGrad nodes alive, and
        # with them the stream they were made on: a backward captured on another stream fails
        backward = _Backward(c, grads)
        bwd = _backward_runner(c, backward)
        # profiled first where its kernels may give its figure: of many, its graph is a check
        kernels = (_kernels(c, bwd, self.figure_runs)
                   if self.kernels_min and self.chain[:1] == ["graph"] else None)
        many = kernels is not None and bool(kernels.get("bwd_run_ms")) and (
            kernels.get("bwd_kernel_count") or 0) >= self.kernels_min
        tcfg = as_check(self.tcfg) if many else self.tcfg
        for attempt in (1, 2):  # out of memory: once more, the cache handed back
            try:
                t, fallback = choice.measure(bwd, c.n_copies, c.device, self.chain,
                                             self.backends, tcfg)
                if t.timer != "graph" and tcfg is not self.tcfg:  # no check: its figure
                    t, fallback = choice.measure(bwd, c.n_copies, c.device, self.chain,
                                                 self.backends, self.tcfg)
                break
            except torch.OutOfMemoryError as e:
                oom = one_line(e)  # the error's frames go with it, below
            except Exception as e:  # noqa: BLE001 - the backward failed: record it, go on
                after = f" (after running out of memory once: {oom})" if attempt == 2 else ""
                return dict(bwd_status="error", grad_source=source,
                            bwd_status_reason=one_line(e) + after)
            if attempt == 2:
                return dict(bwd_status="error", grad_source=source,
                            bwd_status_reason=f"{oom} (twice, the second after torch's cache "
                            "went back to the driver)")
            for p in c.module.parameters():  # a backward into the leaves wrote them
                p.grad = None
            hand_back(c.device)
        if kernels is None:
            kernels = _kernels(c, bwd, self.profile_runs)
        figure, figure_note = (t.median_ms, t.p10_ms, t.p90_ms), None
        run_ms = kernels.pop("bwd_run_ms", None)
        if many and t.timer == "graph":  # its kernels' busy time, as the step's
            got = kernel_figure(run_ms)  # as a forward's, from its runs
            if got["isolated_ms"] > 0:
                figure = (got["isolated_ms"], got["isolated_ms_p10"], got["isolated_ms_p90"])
                kernels["bwd_device_ms"] = figure[0]  # its figure, as its miss compares it
                count = kernels["bwd_kernel_count"]
                figure_note = (f"its kernels' busy time ({count} kernels), {len(run_ms)} "
                               f"profiled runs (graph: {t.median_ms:.4g} ms, {t.runs} runs)")
        row = dict(bwd_status="ok", grad_source=source, bwd_grad_sums=sums,
                   bwd_timer=t.timer, bwd_ms=figure[0],
                   bwd_ms_p10=figure[1], bwd_ms_p90=figure[2],
                   bwd_timer_fallback=fallback or None,
                   bwd_timer_notes=join_notes(t.notes, backward.why,
                                              kernels.pop("bwd_profile_error", None),
                                              OOM_RETRIED if attempt == 2 else None,
                                              figure_note),
                   **kernels)
        row.update(_cost(c, backward))
        row.update(_memory(c, backward))
        return row


def grad_targets(inputs) -> set:
    """Where the gradients of ``inputs`` go: each non-leaf's (node, output) and each leaf's
    id (its AccumulateGrad node's variable)."""
    return {(t.grad_fn, t.output_nr) if t.grad_fn is not None else id(t)
            for t in inputs if t.requires_grad}


def grad_sums(outs, inputs: set, module, limit: int = 100_000) -> int | None:
    """Gradient sums the autograd engine makes in the backward of ``outs`` down to ``inputs``
    (``grad_targets``): for every tensor the call's nodes feed gradients into (an input, a
    parameter of ``module``, an intermediate), one add per edge into it beyond the first. A
    tanh GELU uses its input three times: 2. In the step these adds run inside whichever
    consumer's node finishes later, and the in-situ attribution needs to know they are the
    call's own (``attribution.backward_ops``). None past ``limit`` nodes."""
    params = {id(p) for p in module.parameters()}
    edges: dict = {}
    try:  # an input's producer is not the call's: the walk stops at an input's edge
        for _, nexts in walk_graph([o.grad_fn for o in outs],
                                   lambda fn, nr: (fn, nr) not in inputs, limit):
            for fn, nr in nexts:
                var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
                if var is None:
                    key = (fn, nr)
                elif id(var) in inputs or id(var) in params:
                    key = id(var)
                else:
                    continue
                edges[key] = edges.get(key, 0) + 1
    except GraphTooLarge:
        return None
    return sum(n - 1 for n in edges.values() if n > 1)


class GraphTooLarge(Exception):
    """``walk_graph`` met more nodes than its limit."""


def walk_graph(roots, descend=None, limit: int | None = None):
    """(node, its edges to the next nodes as (fn, output_nr), None ones left out) for every
    node of the autograd graph below ``roots`` (nodes), each once, walking below a non-leaf
    edge only where ``descend(fn, nr)`` says so (all, without it). Holds the nodes it has
    seen: a node's id is unique only while its Python object lives, and nothing promises that
    object outlives the reference. Raises GraphTooLarge past ``limit`` nodes."""
    stack = list(dict.fromkeys(roots))
    seen = set(stack)
    while stack:
        node = stack.pop()
        nexts = [(fn, nr) for fn, nr in node.next_functions if fn is not None]
        yield node, nexts
        for fn, nr in nexts:
            if (getattr(fn, "variable", None) is None and fn not in seen
                    and (descend is None or descend(fn, nr))):
                seen.add(fn)
                if limit is not None and len(seen) > limit:
                    raise GraphTooLarge
                stack.append(fn)


def _grad_outputs(out) -> list[torch.Tensor]:
    return [t for t in flat_tensors(out) if t.requires_grad and t.grad_fn is not None]


def _gradients(c: CallUnderTest, outs) -> tuple[list, str]:
    """The captured gradients of the outputs, else random ones like them."""
    grads = c.grads
    if grads is not None:
        if len(grads) == len(outs) and all(g is None or (g.shape == o.shape and g.dtype == o.dtype)
                                           for g, o in zip(grads, outs)):
            full = [g if g is not None else torch.zeros_like(o) for g, o in zip(grads, outs)]
            return full, "captured" if all(g is not None for g in grads) else "captured, partly"
    gen = torch.Generator(device=c.device).manual_seed(0)
    return [torch.randn(o.shape, dtype=o.dtype, device=c.device, generator=gen)
            for o in outs], "random"


class _Backward:
    """``self(outs, targets)``: the backward of one forward's outputs, down to ``targets``
    (``forward``'s). In the step an input's gradient flows on into its producer; here it is
    handed back at the input's edge, so neither the nodes the input was rebuilt with
    (``store.autograd_shape``) nor an accumulation into a leaf's ``.grad`` run: a gradient that
    reached a leaf unchanged (an input added as it came) would be copied there, work the step
    never did. Parameters are handed back the same way: their AccumulateGrad is no call's in
    situ (``attribution``). Where torch cannot stop there (``Targets.why``), the backward runs
    into the leaves from empty ``.grad``. ``retain``: keep the saved tensors for another."""

    def __init__(self, c: CallUnderTest, grads):
        self.c, self.grads = c, grads
        self.why: str | None = None  # the last backward's Targets.why: the row's note

    def __call__(self, outs, targets: Targets, retain: bool = False) -> None:
        self.why = targets.why
        if not targets.why:
            torch.autograd.grad(outs, targets.grad_to, self.grads, retain_graph=retain,
                                allow_unused=True)
            return
        for t in (*self.c.module.parameters(), *targets.leaves):
            t.grad = None  # the replay's StateGuard puts the parameters' back after the call
        torch.autograd.backward(outs, self.grads, retain_graph=retain)

    def forward(self, i: int = 0, inputs=None) -> tuple[list, Targets]:
        """(outputs that require grad, backward targets) of one forward of copy i, on
        ``inputs`` if given (a staged slot's own), else on the copy; on inputs given a history
        of their own when the call writes its inputs in place (``ReLU(inplace=True)`` on a
        rebuilt non-leaf): each in-place run on the shared copy extends its base's history, and
        a backward through it meets an earlier run's saved output at a newer version ("modified
        by an inplace operation"). The inputs' edges are taken before the forward (an in-place
        op moves an input's edge to its own node) and after the copy's objects are put back
        (a Cache holds the last run's keys and values, and the graph that made them)."""
        c, j = self.c, i % self.c.n_copies
        if inputs is None and c.writes_inputs:
            inputs = _fresh_autograd(c.run.copies[j], view=False)
        c.run.restore(j)
        edges = _input_edges(c.run.copies[j] if inputs is None else inputs)
        mark = _sequence_mark()
        outs = _grad_outputs(c.run(i) if inputs is None else c.run.on(inputs, j))
        return outs, backward_targets(outs, edges, mark)


def _input_edges(inputs) -> list:
    """The gradient edge of each tensor of ``inputs`` that requires grad, once per tensor."""
    ts = {id(t): t for t in flat_tensors(inputs) if t.requires_grad}
    return [get_gradient_edge(t) for t in ts.values()]


def _sequence_mark() -> int:
    """The sequence number of a node made now: every node a forward run after this makes has a
    larger one (the counter is per thread; AccumulateGrad's is the largest there is)."""
    with torch.inference_mode(False), torch.enable_grad():
        return (torch.empty(0, requires_grad=True) * 1).grad_fn._sequence_nr()


class Targets(NamedTuple):
    """Where a call's backward ends: ``grad_to``, where ``torch.autograd.grad`` hands the
    gradients back. Where it cannot, ``why`` says so, and ``leaves`` are every leaf the graph
    reaches, each ``.grad`` emptied before a backward into them."""

    grad_to: list
    leaves: list
    why: str | None = None


# torch's reentrant checkpoint, and the ones written after it (DeepSpeed's, Megatron's): their
# node runs torch.autograd.backward itself and refuses to run under torch.autograd.grad
_REENTRANT = "checkpoint"


def backward_targets(outs, edges: list, mark: int) -> Targets:
    """What the step's backward of a call gives gradients to: its inputs' ``edges``, every
    leaf its outputs' graph reaches short of them (its parameters; a tensor it read that is
    none of its own, a shared weight) and every edge into a node made before its forward
    (sequence number below ``mark``: a tensor another call made and this one read from
    elsewhere than its inputs). An output that is an input as it came, or such a tensor, has
    nothing of the call's behind it."""
    stop = {(e.node, e.output_nr) for e in edges}
    starts = {(o.grad_fn, o.output_nr) for o in outs} - stop
    before = {e: GradientEdge(*e) for e in starts if e[0]._sequence_nr() < mark}  # not its own
    leaves: dict = {}

    def own(fn, nr) -> bool:  # a node of the call's forward, not past an input's edge
        return (fn, nr) not in stop and fn._sequence_nr() >= mark

    for node, nexts in walk_graph([fn for fn, nr in starts if (fn, nr) not in before], own):
        if _REENTRANT in getattr(getattr(node, "_forward_cls", None), "__name__", "").lower():
            return Targets([], _all_leaves(outs), "a reentrant checkpoint in its graph "
                           "(torch.autograd.grad refuses one): run into its leaves")
        for fn, nr in nexts:
            if (fn, nr) in stop:
                continue
            var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
            if var is not None:
                leaves.setdefault(id(var), var)
            elif not own(fn, nr):
                before.setdefault((fn, nr), GradientEdge(fn, nr))
    grad_to = [*edges, *leaves.values(), *before.values()]
    if not grad_to:  # torch.autograd.grad needs somewhere to hand them back
        return Targets([], _all_leaves(outs), "nothing to hand the gradients back at")
    return Targets(grad_to, [])


def _all_leaves(outs) -> list:
    """Every leaf the graph of ``outs`` reaches."""
    leaves: dict = {}
    for _, nexts in walk_graph([o.grad_fn for o in outs]):
        for fn, _ in nexts:
            var = getattr(fn, "variable", None)
            if var is not None:
                leaves.setdefault(id(var), var)
    return list(leaves.values())


def _backward_runner(c: CallUnderTest, backward: _Backward) -> CallRunner:
    """bwd(i): the backward of copy i's forward. Its forward ran untimed before it: staged
    for slot i (``bwd.stage(i)``, the graph timer: kept until ``bwd.unstage()``, every
    backward over it retains it), or just before (``bwd.before(i)``, the events timer's
    untimed work, used by the next backward of the same copy only, inside the same CUDA graph
    capture or outside one); without either (a warm-up call) bwd runs the forward itself."""
    n = c.n_copies
    last: dict = {}
    slots: dict[int, tuple] = {}  # slot -> (outputs, targets) of the slot's own inputs

    def capturing() -> bool:
        # the C check, not torch.cuda.is_current_stream_capturing: the graph timer watches that
        # one for calls that branch on capture (and refuses them); this question is cbtrace's
        return c.device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()

    def forward(i: int) -> None:
        last.clear()
        outs, targets = backward.forward(i)
        last.update(i=i % n, capturing=capturing(), outs=outs, targets=targets)

    def stage(j: int) -> None:
        # its own autograd leaves: their nodes made now, on the capture stream
        slots[j] = backward.forward(j, _fresh_autograd(c.run.copies[j % n],
                                                       view=not c.writes_inputs))

    def bwd(i: int) -> None:
        if i in slots:
            backward(*slots[i], retain=True)
            return
        if last.get("i") != i % n or last.get("capturing") != capturing():
            forward(i)
        outs, targets = last.pop("outs"), last.pop("targets")
        last.clear()
        backward(outs, targets)

    def unstage() -> None:
        # nothing of an earlier forward's graph left alive, in the slots, the last forward or
        # the copies' objects (a Cache's keys): its parameters' AccumulateGrad nodes would
        # keep the stream they were made on into the next staging (``OnCopies.put_back``)
        slots.clear()
        last.clear()
        c.run.put_back()

    # the forward is the backward's input state: timers skip it in warm-up, as a rewrite's
    return CallRunner(run=bwd, n_copies=n, before=forward, warms_inputs=True, stage=stage,
                      unstage=unstage)


def _note_inplace(c: CallUnderTest) -> None:
    """Whether the call writes its inputs in place (their version counters move in one
    forward of copy 0): its backwards then run on inputs rebuilt for each forward."""
    ts = [t for t in flat_tensors(c.run.copies[0]) if t.requires_grad]
    before = [t._version for t in ts]
    c.run(0)
    c.writes_inputs = any(t._version != v for t, v in zip(ts, before))


def _fresh_autograd(inputs, view: bool = True):
    """``inputs`` (one copy's args and kwargs) with each tensor that requires grad derived
    anew from a leaf of its own over the same bytes (a non-leaf input's base cloned again, a
    leaf input detached and made to require grad). Autograd keeps the stream a node was made
    on: an input's AccumulateGrad made at load, on the default stream, and reached by a
    backward captured on a side stream breaks the capture ("operation would make the legacy
    stream depend on a capturing blocking stream", torch 2.11; pytorch#180090). Nodes made by
    the staged forward are made on the capture stream."""
    if not any(t.requires_grad for t in flat_tensors(inputs)):
        return inputs
    bases: dict = {}  # tensors over one storage keep sharing one base

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if not t.requires_grad:
            return t
        if is_non_leaf(t):
            return as_non_leaf(t.detach(), bases, view=view)
        return t.detach().requires_grad_(True)

    return map_tensors(fresh, inputs)


def _kernels(c: CallUnderTest, bwd: CallRunner, runs: int) -> dict:
    """bwd_kernel_count and bwd_device_ms: the backward's own device work as its timer runs it
    (each run after its untimed forward), profiled as the forward's kernels are; what its miss
    against the step is made of (``attribution.miss``). None on a CPU, with ``runs`` 0 (the
    profiled pass not as timed), or where the profile could not tell the backward's kernels
    from its forward's; a profile that fails says so and leaves the timing that ran."""
    if runs < 1:
        return {}
    try:
        got = profile_as_timed(bwd, c.device, runs)
    except Exception as e:  # noqa: BLE001 - the timing stands; the profile is what it lacks
        return dict(bwd_profile_error=f"backward not profiled: {one_line(e)}")
    finally:
        bwd.unstage()
    if got is None:
        return dict(bwd_kernel_count=None, bwd_device_ms=None)
    return dict(bwd_kernel_count=got.kernel_count, bwd_device_ms=got.device_ms,
                bwd_run_ms=got.run_ms)


def _cost(c: CallUnderTest, backward: _Backward) -> dict:
    """FLOPs and bytes of one backward as it runs (grad-input and grad-weight, counted)."""
    outs, targets = backward.forward(0)
    params = {id(p): n for n, p in c.module.named_parameters()}
    with OpCounter(params=params) as oc:
        backward(outs, targets)
    cost = oc.cost()
    return dict(bwd_flops=cost.flops, bwd_bytes=cost.bytes, bwd_compute_dtype=cost.compute_dtype)


def _memory(c: CallUnderTest, backward: _Backward) -> dict:
    """Bytes the forward saved for backward, the backward's peak and the gradients of the
    parameters its backward reaches (one the call does not use gets none)."""
    saved: dict[tuple, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            saved[(st.data_ptr(), t.device)] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs, targets = backward.forward(0)
    params = [p for p in c.module.parameters() if p.requires_grad]
    if c.device.type == "cuda":
        for p in params:
            p.grad = None  # a backward into the leaves wrote them; their memory is not this one's
        torch.cuda.synchronize(c.device)
        torch.cuda.reset_peak_memory_stats(c.device)
        base = torch.cuda.memory_allocated(c.device)
        backward(outs, targets)
        torch.cuda.synchronize(c.device)
        peak = max(torch.cuda.max_memory_allocated(c.device) - base, 0)
    else:
        peak = _cpu_peak(lambda: backward(outs, targets))
    reached = {id(t) for t in targets.grad_to if isinstance(t, torch.Tensor)}
    if targets.why:  # a reentrant checkpoint's parameters are out of the walk's sight
        reached = {id(p) for p in params}
    return dict(saved_bytes=sum(saved.values()), bwd_peak_mem_bytes=int(peak),
                grad_bytes=sum(p.numel() * p.element_size() for p in params if id(p) in reached))


def _cpu_peak(fn) -> int:
    """Peak of live host bytes while ``fn`` runs, from the profiler's memory events."""
    with quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return peak_live_bytes(rows_from_kineto(prof.profiler.kineto_results.events()), on_cpu=True)
