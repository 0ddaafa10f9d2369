"""Context replay: the calls that ran just before a call in the step run, untimed, before each of
its timed runs, so that the cache holds what it held in the step.

A call timed K times back to back on its own reads its parameters from a warm L2 (an embedding
table read once per step stays resident), and reads inputs that no producer has just written.
In the step, the calls before it had just run: their traffic evicted what it read a step ago,
and its input was often the last one's output, still in L2. So each timed run is preceded by
the leaf calls that preceded it in the step (step order, up to ``max_calls`` and about the
L2's size of traffic), and an input that equals one of their outputs is taken from that output,
freshly written, as in the step. Timers run the context inside the timed slot's prologue and
time only the call (CUDA graph: events recorded inside the graph around it).

``in_step_cache_state(c)`` sets a prepared call's ``timed`` runner from its context
(``in_context``) or, for an embedding lookup without one, from a table copy per run.
"""
from __future__ import annotations

import collections
import functools
import json
import math
from dataclasses import dataclass

import torch
from torch.func import functional_call

from cbtrace import module_tree
from cbtrace.calltree import CallTree
from cbtrace.cost.dtypes import is_floating, itemsize, meta_bytes
from cbtrace.cost.peaks import PeakLookup, device_name
from cbtrace.errors import SerializationError, one_line
from cbtrace.nested import flat_tensors
from cbtrace.replay.measure.copies import (cache_bytes, clone_like, copies_of, n_copies,
                                           parameter_copies, table_copies, tensor_bytes)
from cbtrace.replay.measure.prepare import (WARM_MIN_BYTES, CallUnderTest, InputState,
                                            call_context, input_toucher)
from cbtrace.replay.timer.contract import CallRunner
from cbtrace.schema.modules import COPY_FAILED
from cbtrace.store import ref_format


def traffic_bytes(rec) -> int:
    """What a call moves at least once: its inputs, outputs and parameters (rough)."""
    return int(rec.input_bytes + meta_bytes(rec.output_meta) + rec.param_bytes + rec.buffer_bytes)


def predecessors(records, max_calls: int, max_bytes: int) -> dict[int, list[int]]:
    """call_id -> the leaf calls that ran just before it in the step, oldest first: walking back
    from it, until ``max_calls`` or until their traffic reaches ``max_bytes``. Leaves whose
    inputs were not captured are skipped. A call's own descendants never precede it (they start
    after it: call_id is the order calls begin)."""
    tree = CallTree({r.call_id: r.parent_call_id for r in records})
    by_id = {r.call_id: r for r in records}
    leaves = [c for c in sorted(tree.parent) if not tree.children[c]
              and not (by_id[c].capture_error or "").startswith(COPY_FAILED)]
    out: dict[int, list[int]] = {}
    i = 0  # leaves[:i] began before the current call
    for cid in sorted(tree.parent):
        while i < len(leaves) and leaves[i] < cid:
            i += 1
        chosen, total = [], 0
        for leaf in reversed(leaves[:i]):
            if len(chosen) >= max_calls or total >= max_bytes:
                break
            chosen.append(leaf)
            total += traffic_bytes(by_id[leaf])
        out[cid] = chosen[::-1]
    return out


@dataclass
class ContextCall:
    """One predecessor, ready to run on input copy i: its module (train flag as captured),
    record and rotating input copies (its runs in the timed graph and in the graph of contexts
    alone then read equally cold inputs, whatever the call in between did to the cache)."""

    module: torch.nn.Module
    rec: object
    copies: list  # (args, kwargs) per copy, on the replay device
    states: list | None
    device: torch.device

    def __call__(self, i: int = 0):
        i %= len(self.copies)
        if self.states is not None:
            self.states[i].restore(self.device.type == "cuda")
        a, k = self.copies[i]
        with call_context(self.rec, self.device.type):
            return self.module(*a, **k)


class ContextSource:
    """Finds and loads each call's context: the predecessors' records (``predecessors``), their
    modules in the live model, and their inputs, kept in a small cache by call_id (neighbouring
    calls share predecessors). A predecessor replayed before the call that needs it hands its
    inputs over as the replay loads them (``offer``): a copy in memory instead of a second read
    of the run (a breadth-first replay meets a call's siblings, often its predecessors, just
    before it)."""

    def __init__(self, records, model, device, load, flags=None, *, max_calls: int = 4,
                 max_bytes: int | None = None, keep_bytes: int = 1 << 30, max_copies: int = 8,
                 rewrite: bool = False, pending=None):
        self.device, self.rewrite = torch.device(device), rewrite
        self.by_id = {r.call_id: r for r in records}
        self.model, self.load, self.flags = model, load, flags
        budget = max_bytes if max_bytes is not None else cache_bytes(self.device)
        self.before = predecessors(records, max_calls, budget)
        # calls whose inputs a rewrite would touch were all read before their context: not
        # written just before them, so not rewritten (``inputs_read_before``)
        self.read_before = inputs_read_before(records, self.before)
        self.keep_bytes, self.max_copies = keep_bytes, max_copies
        self._cache: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._cached = 0
        # predecessor -> the calls still to replay whose context load would read its inputs
        # (``pending``: the call_ids this replay will measure; None: all): an offered copy is
        # kept while one of them is left (``finished``)
        self.wanted: dict[int, set] = collections.defaultdict(set)
        for cid, before in self.before.items():
            if (pending is None or cid in pending) and self._loads(cid, before):
                for p in before:
                    self.wanted[p].add(cid)
        self._offered: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._offered_bytes = 0
        # a context is about a cache's worth of traffic: an input larger is not worth a copy
        self.offer_max_bytes, self.offered_max_bytes = budget, min(keep_bytes, 8 * budget)
        self.loads = self.offers_used = 0  # reads of the run, and offered copies taken instead

    def _loads(self, call_id: int, before: list[int]) -> bool:
        """Whether ``calls(call_id)`` loads its context (``before``, its predecessors): an input
        may be a predecessor's output, or (rewriting) one may be rewritten."""
        rec = self.by_id[call_id]
        if not before or rec.module_type in LOOKUPS:  # a lookup: table copies instead
            return False
        return ((self.may_rewrite(call_id) and may_be_rewritten(rec))
                or may_feed(rec, [self.by_id[c] for c in before]))

    def may_rewrite(self, call_id: int) -> bool:
        """Whether the call's inputs may be rewritten after its context: rewriting is on and
        some input it would touch was not read before its context (``inputs_read_before``)."""
        return self.rewrite and call_id not in self.read_before

    def of(self, call_id: int) -> "ContextOf":
        """The call's context, loaded when the timer asks for it."""
        return ContextOf(functools.partial(self.calls, call_id),
                         rewrite=self.may_rewrite(call_id))

    def offer(self, rec, inputs) -> None:
        """The captured inputs of ``rec``'s call, as the replay just loaded them (before it
        ran): a copy is kept if a later call's context will need them and they are not cached
        yet: copies of inputs up to a context's byte budget, at most eight budgets of them, the
        oldest dropped."""
        cid = rec.call_id
        if not self.wanted.get(cid) or cid in self._cache or cid in self._offered:
            return
        nbytes = tensor_bytes(inputs)
        if nbytes > self.offer_max_bytes:
            return
        self._offered[cid] = clone_like(inputs)
        self._offered_bytes += nbytes
        while self._offered_bytes > self.offered_max_bytes:
            _, old = self._offered.popitem(last=False)
            self._offered_bytes -= tensor_bytes(old)

    def finished(self, call_id: int) -> None:
        """``call_id`` is measured: what was kept only for its context is dropped."""
        for p in self.before.get(call_id, ()):
            left = self.wanted.get(p)
            if left is None:
                continue
            left.discard(call_id)
            if not left:
                del self.wanted[p]
                self._drop(p)

    def release(self) -> None:
        """Drop every copy kept (the device ran out of memory); later contexts read the run."""
        self.wanted.clear()
        self._cache.clear()
        self._offered.clear()
        self._cached = self._offered_bytes = 0

    def _drop(self, cid: int) -> None:
        old = self._offered.pop(cid, None)
        if old is not None:
            self._offered_bytes -= tensor_bytes(old)
        old = self._cache.pop(cid, None)
        if old is not None:
            self._cached -= len(old) * tensor_bytes(old[0])

    def calls(self, call_id: int) -> list[ContextCall]:
        """The context of ``call_id``, loaded; [] when it has none, or when none of its inputs
        can be one of their outputs (``may_feed``) and none may be rewritten
        (``may_be_rewritten``; never an embedding lookup's): nothing is loaded then (loading
        the predecessors' inputs of `dlrm:large`'s lookups took 13 of its 69 s). Raises what
        loading raises."""
        before = self.before.get(call_id, [])
        if not self._loads(call_id, before):
            return []
        out = []
        for cid in before:
            rec = self.by_id[cid]
            module = module_tree.get_submodule(self.model, rec.fqn)
            if self.flags is not None:
                self.flags.apply(module, rec)
            copies = self._inputs(rec)
            states = [InputState(c) for c in copies]
            out.append(ContextCall(module, rec, copies, states if any(states) else None,
                                   self.device))
        return out

    def _inputs(self, rec) -> list:
        """The call's input copies: the captured inputs and clones enough to overflow the cache."""
        hit = self._cache.get(rec.call_id)
        if hit is not None:
            self._cache.move_to_end(rec.call_id)
            return hit
        inputs = self._offered.pop(rec.call_id, None)
        if inputs is None:
            inputs = self.load(rec)
            self.loads += 1
        else:
            self._offered_bytes -= tensor_bytes(inputs)
            self.offers_used += 1
        nbytes = tensor_bytes(inputs)
        n = n_copies(nbytes, self.device, self.max_copies)
        copies = [inputs] + copies_of(inputs, n - 1)
        self._cache[rec.call_id] = copies
        self._cached += n * nbytes
        while self._cached > self.keep_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old) * tensor_bytes(old[0])
        return copies


@dataclass
class ContextOf:
    """A call's context as the timer meets it: ``load()`` gives its calls (read on first
    use); ``rewrite``: whether its inputs may be rewritten after them (``in_context``)."""

    load: object
    rewrite: bool = True

    def __call__(self) -> list:
        return self.load()


def inputs_read_before(records, before: dict) -> set[int]:
    """The call_ids whose inputs a rewrite would touch (floating point, WARM_MIN_BYTES or more)
    were each an input of a call that began before its context (``before``: call_id -> its
    predecessors, oldest first) and is not one of its ancestors: the same stored chunk, which
    capture keeps once while the tensor is unchanged. In the step such an input was written
    before the whole context, not just before the call (DLRM's factorization machine reads
    the embeddings its sibling's MLP read first), so rewriting it after the context would
    leave it in the L2 as the step did not. A reader inside the context (an Identity handing
    its input on) does not count: what it read was written just before it. A parent's input
    is its first child's, so ancestors do not count. A reference that does not parse counts
    as unread."""
    parent = {r.call_id: r.parent_call_id for r in records}
    readers: dict = collections.defaultdict(list)  # chunk -> the calls that read it, in order
    wanted: dict[int, list] = {}
    for rec in sorted(records, key=lambda r: r.call_id):
        try:
            keys = _rewritable_chunks(rec.inputs_ref)
        except (SerializationError, ValueError, TypeError, KeyError):
            continue
        wanted[rec.call_id] = keys
        for k in keys:
            readers[k].append(rec.call_id)
    out = set()
    for cid, keys in wanted.items():
        if not keys or not before.get(cid):
            continue
        start = before[cid][0]  # the context's first call
        ancestors, p = set(), parent.get(cid, -1)
        while p != -1 and p not in ancestors:
            ancestors.add(p)
            p = parent.get(p, -1)
        if all(any(r < start and r not in ancestors for r in readers[k]) for k in keys):
            out.add(cid)
    return out


def _rewritable_chunks(inputs_ref) -> list:
    """The stored chunks (shard, row, lo, nbytes) of a call's inputs that ``input_toucher``
    would rewrite, by their reference: floating point, of WARM_MIN_BYTES or more."""
    if not inputs_ref:
        return []
    doc = ref_format.parse(inputs_ref)
    chunks = doc["chunks"]
    keys = []
    for node in ref_format.tensor_nodes(doc):
        if not is_floating(str(node.get("dtype"))):
            continue
        if math.prod(node.get("shape") or ()) * itemsize(str(node["dtype"])) < WARM_MIN_BYTES:
            continue
        entry = chunks.get(str(node.get("c")))
        if entry is not None:
            keys.append((entry[0], entry[1], entry[3], entry[4]))
    return keys


def may_feed(rec, context_recs) -> bool:
    """Whether an input of ``rec`` may be an output of a context call, by their records'
    metadata (shape, dtype, strides); True where a record's metadata does not parse."""
    try:
        wanted = _meta_keys(rec.input_meta)
        return any(_meta_keys(r.output_meta) & wanted for r in context_recs)
    except (ValueError, TypeError):
        return True


# module types timed with table copies (``with_table_copies``), never in a context
LOOKUPS = ("Embedding", "EmbeddingBag")


def may_be_rewritten(rec) -> bool:
    """Whether ``rec`` has an input the context's rewrite would touch (``input_toucher``), by
    its metadata: floating-point, of WARM_MIN_BYTES or more, not float8 (no in-place multiply),
    not expanded (a stride of 0). An embedding lookup's ids and offsets are not; True where the
    metadata does not parse."""
    def touched(m) -> bool:
        shape, stride, dtype = m["shape"], m.get("stride") or (), str(m.get("dtype"))
        expanded = any(st == 0 and n > 1 for st, n in zip(stride, shape))
        return (is_floating(dtype) and "float8" not in dtype and not expanded
                and math.prod(shape) * itemsize(dtype) >= WARM_MIN_BYTES)

    try:
        metas = json.loads(rec.input_meta or "[]")
        return any(touched(m) for m in metas if isinstance(m, dict) and "shape" in m)
    except (ValueError, TypeError, AttributeError, KeyError):
        return True


def _meta_keys(metas_json: str | None) -> set:
    return {(tuple(m["shape"]), m.get("dtype"), tuple(m.get("stride") or ()))
            for m in json.loads(metas_json or "[]") if isinstance(m, dict) and "shape" in m}


def written_outputs(x: ContextCall, i: int = 0) -> list:
    """The flat outputs of context call ``x`` run on copy ``i``, None in place of one that is
    one of its inputs (or a view of one) which the call did not write: an Identity's, an eval
    Dropout's, a reshape's. Such an output holds the input copy as loaded, not data the call
    just wrote; in the step it held what the code before the call wrote (timm's BatchNormAct2d:
    the BatchNorm its own forward computes, then ``drop``, an Identity, then ``act``). An input
    written in place (an in-place ReLU's) is the call's output."""
    ins = flat_tensors(x.copies[i % len(x.copies)])
    before = [(_storage(t), _version(t)) for t in ins]
    outs = flat_tensors(x(i))
    # tensors on one storage may count versions apart (a run's tensors are rebuilt each on its
    # own with set_): a storage any of them wrote was written
    same, wrote = set(), set()
    for (ptr, v), t in zip(before, ins):
        if ptr is not None and v is not None:
            (same if _version(t) == v else wrote).add(ptr)
    untouched = same - wrote
    return [None if _storage(o) in untouched else o for o in outs]


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def chained_positions(outputs: list, inputs: tuple) -> dict:
    """Where a call's top-level input tensors (args by index, kwargs by name) equal an output of
    its context (``outputs``: one flat list of tensors per context call, None where a call
    wrote none: ``written_outputs``): {position: (context index, output index)}. Equal shape,
    dtype, strides, device and values: in the step that input was (or could not be told from)
    that output."""
    args, kwargs = inputs
    found = {}
    positions = [(("a", i), t) for i, t in enumerate(args)] + [
        (("k", k), t) for k, t in kwargs.items()]
    for pos, t in positions:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0:
            continue
        for ci in range(len(outputs) - 1, -1, -1):  # the latest producer first
            hit = next((oi for oi, o in enumerate(outputs[ci])
                        if o is not None and _same(o, t)), None)
            if hit is not None:
                found[pos] = (ci, hit)
                break
    return found


def _same(o: torch.Tensor, t: torch.Tensor) -> bool:
    if (o.shape != t.shape or o.dtype != t.dtype or o.device != t.device
            or o.layout != torch.strided or o.stride() != t.stride()):
        return False
    with torch.no_grad():
        return bool(torch.equal(o, t))


def substitute(inputs: tuple, chained: dict, outputs: list) -> tuple:
    """``inputs`` with each chained position taken from the context's fresh ``outputs``."""
    if not chained:
        return inputs
    args, kwargs = list(inputs[0]), dict(inputs[1])
    for (kind, key), (ci, oi) in chained.items():
        value = outputs[ci][oi]
        if kind == "a":
            args[key] = value
        else:
            kwargs[key] = value
    return tuple(args), kwargs


def describe(calls: list[ContextCall], chained: dict) -> str:
    """The row's note: which calls ran before each timed run, and which inputs they produced."""
    names = ", ".join(c.rec.fqn or "(root)" for c in calls)
    note = f"context: {len(calls)} call{'s' if len(calls) != 1 else ''} before ({names})"
    if chained:
        note += f"; {len(chained)} input{'s' if len(chained) != 1 else ''} from their outputs"
    return note


def in_context(c: CallUnderTest, context) -> None:
    """Set ``c.timed``: ``c.run`` preceded by its context (``context``) when one of the
    call's inputs is an output of that context (its producer ran just before it in the step).
    ``before(j)`` runs the context calls for slot j (untimed work a timer puts before the timed
    call); ``run(j)`` then runs the call on copy j, each input that equals a context output
    taken from slot j's fresh output. A context that fails to run is dropped (the note says
    why); ``release()`` drops what the slots still hold. ``context``: the calls, or a function
    loading them, called only for a call that qualifies (loading reads their inputs)."""
    if not context or not _small(c):
        return
    may_rewrite = getattr(context, "rewrite", True)  # a ContextOf's; a list of calls: True
    try:
        context = context() if callable(context) else context
        if not context:
            return
        first = [written_outputs(x) for x in context]
    except Exception as e:  # noqa: BLE001 - a predecessor that cannot run alone: time without
        c.context_note = f"no context: {one_line(e, 120)}"
        return
    copies, run_on, n = c.run.copies, c.run.on, c.n_copies  # no reference back to c
    # the last copy: steps before timing ran copy 0, which an in-place call has rewritten
    chained = chained_positions(first, copies[-1])
    del first
    rewrite = None
    if not chained:
        if c.cfg.context_rewrite == "off":
            return
        if not may_rewrite:
            c.context_note = "no context: its inputs were read before, not written just before it"
            return
        # as what non-module code wrote just before it left it
        rewrite = input_toucher(copies, as_a_sum=c.cfg.context_rewrite == "sum",
                                floating_only=True)
        if rewrite is None:
            return
    slots: dict = {}
    sets = parameter_sets(c)
    ons = [r.on for r in on_parameter_sets(c, sets)] if sets else [run_on]

    def before(j: int) -> None:
        slots[j] = [flat_tensors(x(j)) for x in context]
        if rewrite is not None:
            rewrite(j)

    def timed(j: int = 0):
        outs = slots.pop(j, None)
        inputs = copies[j % n]
        if outs is not None:
            inputs = substitute(inputs, chained, outs)
        return ons[j % len(ons)](inputs, j)

    c.timed = CallRunner(run=timed, n_copies=max(n, len(ons)), before=before,
                         release=slots.clear)
    c.context_key = ("context", tuple((x.rec.module_type, x.rec.input_meta) for x in context),
                     len(chained), c.cfg.context_rewrite if rewrite is not None else None,
                     len(ons))
    c.context_note = describe(context, chained) + (
        f"; its inputs rewritten after them ({REWRITTEN_AS[c.cfg.context_rewrite]})"
        if rewrite is not None else "") + (
        f"; {len(ons)} copies of its parameters, one a run" if sets else "")


REWRITTEN_AS = {"self": "x * 1", "sum": "x + 0 * y"}


def _small(c: CallUnderTest) -> bool:
    """Whether the call is short enough to be timed in its context: under ``context_max_ms``
    of device time, an activation under ``context_activation_max_ms``, a memory-bound call
    under ``context_memory_max_ms``."""
    ms = c.row.get("device_ms")
    if c.device.type != "cuda":
        return True
    cfg = c.cfg
    if ms is None or not ms > 0:
        return False
    if ms < max(cfg.context_max_ms,
                cfg.context_activation_max_ms if activation(c.module, c.rec) else 0.0):
        return True
    # the device's peaks are looked up only for a call its counted figures could qualify
    return (ms < cfg.context_memory_max_ms and c.row.get("flops") is not None
            and memory_bound(c.row, device_name(c.device)))


@functools.lru_cache(maxsize=8)
def _peaks(device: str) -> PeakLookup:
    """One lookup a device for the replay's calls (each dtype's peak read once)."""
    return PeakLookup(device)


def memory_bound(row: dict, device: str) -> bool:
    """Whether a call's bytes at the device's peak bandwidth take longer than its FLOPs at the
    peak of their dtype (its counted ``flops``, ``bytes`` and ``compute_dtype``): its time
    then follows where its inputs are, in the cache or not. False without the figures."""
    flops, nbytes = row.get("flops"), row.get("bytes")
    peak = _peaks(device)(row.get("compute_dtype"))
    if peak is None or not nbytes or flops is None or not peak.bytes_per_s:
        return False
    if not flops:
        return True
    return bool(peak.flops_per_s) and nbytes / peak.bytes_per_s > flops / peak.flops_per_s


def activation(module, rec) -> bool:
    """Whether a call is an activation, by structure: a leaf module with no parameters or
    buffers, one tensor in and one out of its shape and dtype (a ReLU, SiLU, GELU; not a
    pooling, which changes the shape, nor an attention core, which takes three)."""
    if next(module.children(), None) is not None or next(module.parameters(), None) is not None:
        return False
    if next(module.buffers(), None) is not None:
        return False
    try:
        ins, outs = json.loads(rec.input_meta or "[]"), json.loads(rec.output_meta or "[]")
        ins = [m for m in ins if isinstance(m, dict) and "shape" in m]
        outs = [m for m in outs if isinstance(m, dict) and "shape" in m]
    except (ValueError, TypeError):
        return False
    return (len(outs) == 1 and len(ins) == 1 and outs[0]["shape"] == ins[0]["shape"]
            and outs[0].get("dtype") == ins[0].get("dtype"))


def in_step_cache_state(c: CallUnderTest) -> None:
    """Set ``c.timed`` so that the call meets the cache state it had in the step, where that is
    on (``c.context`` not None): for an embedding lookup, a table copy per run
    (``with_table_copies``: its ids are the batch's data; in the step its table was read once,
    after the others'), else its context before it (``in_context``); a short call with
    neither, a copy of its parameters per run (``with_param_copies``)."""
    if c.context is None or c.timed is not None:
        return
    if not isinstance(c.module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        in_context(c, c.context)  # a lookup's table copies instead (per-sample weights too)
    if c.timed is None:
        with_table_copies(c)
    if c.timed is None:
        with_param_copies(c)


def with_table_copies(c: CallUnderTest) -> None:
    """Set ``c.timed`` for an embedding lookup whose table would stay in the cache across its
    back-to-back timed runs (in the step each table is read once, after all the others): run
    j reads table copy j, enough copies to overflow the cache twice (``copies.table_copies``):
    a graph's K slots, run after the L2 flush, then read K copies, none of them twice while it
    is still in the cache."""
    tables = table_copies(c.module, c.device, c.cfg.table_copies_max)
    if tables is not None:
        rotate(c, tables, "tables", f"{len(tables)} copies of the table, one a run")


def parameter_sets(c: CallUnderTest) -> list | None:
    """``copies.parameter_copies`` of a short call's parameters and buffers (its kernels under
    ``small_call_max_ms``; at most ``table_copies_max``): in the step it read them once, cold,
    where K back-to-back runs on one copy read them warm. None where that is off, cold or for
    a longer call."""
    limit, ms = c.cfg.small_call_max_ms, c.row.get("device_ms")
    if not limit or c.cfg.cold or not (ms and 0 < ms < limit):
        return None
    own = {**dict(c.module.named_parameters()), **dict(c.module.named_buffers())}
    return parameter_copies(own, c.device, c.cfg.table_copies_max)


def on_parameter_sets(c: CallUnderTest, sets: list) -> list:
    """``c.run`` once per parameter set: each runs the module on that set."""
    module = c.module  # no reference back to c
    return [c.run.with_fn(lambda *a, p=p, **k: functional_call(module, p, a, k)) for p in sets]


def with_param_copies(c: CallUnderTest) -> None:
    """Set ``c.timed`` for a short call timed alone: run j on copy j of its parameters and
    buffers (``parameter_sets``), as an embedding's table copies are."""
    sets = parameter_sets(c)
    if sets is not None:
        rotate(c, sets, "parameters", f"{len(sets)} copies of its parameters, one a run")


def rotate(c: CallUnderTest, sets: list, kind: str, note: str) -> None:
    """Set ``c.timed``: run j on parameter set j (of ``sets``) and input copy j, nothing before
    it; ``kind`` and the number of sets key its profiled runs (``context_key``)."""
    runs = on_parameter_sets(c, sets)

    def timed(j: int = 0):
        return runs[j % len(runs)](j)

    c.timed = CallRunner(run=timed, n_copies=max(c.n_copies, len(runs)))
    c.context_key = (kind, len(sets))
    c.context_note = note
