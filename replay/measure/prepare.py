"""The call under test: one captured module call, ready to run on rotating input copies."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import types
from dataclasses import dataclass
from typing import Callable

import torch

from cbtrace.cost.dtypes import torch_dtype
from cbtrace.nested import flat_tensors
from cbtrace.replay.measure.copies import copies_of, embedding_copies, n_copies, tensor_bytes
from cbtrace.replay.timer.contract import CallRunner


def call_context(rec, device_type: str | None = None):
    """Grad mode and autocast as at capture time, on the replay device. Without autocast, the
    grad mode's own context alone: every timed run on a CPU enters it, and a stack of one
    costs as much again."""
    if not rec.autocast_dtype:
        return torch.set_grad_enabled(bool(rec.grad_enabled))
    stack = contextlib.ExitStack()
    stack.enter_context(torch.set_grad_enabled(bool(rec.grad_enabled)))
    dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    stack.enter_context(torch.autocast(dev, dtype=torch_dtype(rec.autocast_dtype)))
    return stack


@dataclass(frozen=True, eq=False)
class OnCopies:
    """``self(i)``: ``fn`` on input copy i as the module is called (objects in the inputs put
    back, grad mode and autocast as captured); ``on(inputs, i)``: the same on other
    (args, kwargs) that share copy i's objects; ``with_fn(other)``: another callable (the module
    compiled) over the same copies."""

    fn: Callable
    copies: list                  # (args, kwargs) per copy
    states: list | None           # InputState per copy; None: no object, list or dict in any
    rec: object                   # the call's ModuleRecord (grad mode, autocast)
    device: torch.device
    touch: Callable[[int], None] | None = None  # input_toucher(copies) where warm inputs are on

    def on(self, inputs, i: int = 0):
        self.restore(i)
        a, k = inputs
        with call_context(self.rec, self.device.type):
            return self.fn(*a, **k)

    def __call__(self, i: int = 0):
        return self.on(self.copies[i % len(self.copies)], i)

    def restore(self, i: int = 0) -> None:
        """Copy i's objects as they were before any run, as each run starts from them."""
        if self.states is not None:
            self.states[i % len(self.copies)].restore(self.device.type == "cuda")

    def put_back(self) -> None:
        """Every copy's objects as they were before any run: what the last run of each added
        (a transformers Cache's keys and values, and the autograd graph they carry) let go.
        That graph holds the call's parameters' AccumulateGrad nodes, each keeping the stream
        it was made on: one made by a run on the default stream, still held when a backward is
        captured on a side stream, breaks the capture ("operation would make the legacy stream
        depend on a capturing blocking stream"; the attention backwards of transformers models
        fell back to the events timer for it)."""
        for state in self.states or ():
            state.restore(self.device.type == "cuda")

    def with_fn(self, fn: Callable) -> "OnCopies":
        return dataclasses.replace(self, fn=fn)

    def timed(self) -> CallRunner:
        """What the timers get of it: a run per copy, after the inputs' rewrite if warm."""
        return CallRunner(run=self, n_copies=len(self.copies), before=self.touch,
                          warms_inputs=self.touch is not None)


@dataclass
class CallUnderTest:
    """What every step of a replay plan works on."""

    module: torch.nn.Module
    rec: object                    # the call's ModuleRecord
    run: OnCopies                  # run(i): the module on input copy i (0 = the captured inputs)
    n_copies: int                  # copies to rotate among (against a warm L2)
    device: torch.device
    cfg: object                    # ReplayConfig
    grads: tuple | None = None     # the gradients its outputs got in the step (grads_ref)
    row: dict = dataclasses.field(default_factory=dict)  # what the plan's steps measured so far
    value_free: bool = False       # OpCount: its time cannot depend on values (``reuse``)
    outputs: object = None         # HostIssue's last run's, for OutputCheck (no run of its own)
    timed: CallRunner | None = None  # what the timers run: ``run`` in its in-step cache state
    context_note: str | None = None  # how ``timed`` differs from ``run`` (the row's timer_notes)
    # what decides ``timed``'s cache state apart from the call itself: the context's calls by
    # kind and inputs, or its table copies (two calls of one kind with equal keys are profiled
    # once as timed: ``steps.Timed``)
    context_key: tuple | None = None
    writes_inputs: bool = False    # a forward moves its inputs' version counters (in place)
    context: object = None  # its predecessors (replay.measure.context), or their loader; None: off


def prepare(module, rec, args, kwargs, device, cfg, grads=None) -> CallUnderTest:
    """The call on ``args``/``kwargs`` and enough copies of them (ids shifted for embeddings);
    objects, lists and dicts in the inputs (a transformers Cache, a list of levels) are put
    back as they were before every run."""
    copies = embedding_copies(module, args, kwargs, device)
    if copies is None:
        n = n_copies(tensor_bytes((args, kwargs)), device, cfg.max_copies)
        copies = [(args, kwargs)] + copies_of((args, kwargs), n - 1)
    states = [InputState(c) for c in copies]
    # the warm-inputs toucher only where asked for: finding what it may write costs a kernel
    # per large input, and every call is prepared
    touch = input_toucher(copies) if cfg.warm_inputs and not cfg.cold else None
    run = OnCopies(module, copies, states if any(states) else None, rec, device, touch)
    return CallUnderTest(module, rec, run, len(copies), device, cfg, grads)


WARM_MIN_BYTES = 64 << 10  # smaller inputs stay cached whatever happens; not worth a kernel


def input_toucher(copies, *, as_a_sum: bool = False, floating_only: bool = False):
    """touch(i) rewrites copy i's larger input tensors in place with their own values (x * 1),
    as the op that produced them would have: in the real step a module reads an input its
    producer has just written, often still in L2 (an activation after its producer reads slow
    from cold inputs). None when no input qualifies (or for
    dtypes without an in-place multiply); parameters and overlapping views are left alone.
    Writes go through aliases with version counters of their own: an in-place write on a view
    of a non-leaf input (even untimed, under no_grad) makes autograd regenerate its grad_fn as
    AsStridedBackward, whose backward zero-fills and copies a buffer the size of the input (two
    extra kernels in every replayed backward of such a call).

    ``as_a_sum``: rewrite copy i's tensors as x + 0 * y, y the same tensor of the next copy (of
    the same values, so x keeps its own), as an op of two operands of its size (a residual add)
    leaves its output: that op also read y, which took part of the cache. ``floating_only``:
    floating-point tensors alone (activations; indices and masks are the batch's data, which no
    op wrote just before)."""
    per_copy = [[_alias(t) for t in flat_tensors(c)
                 if _touchable(t) and (t.is_floating_point() or not floating_only)]
                for c in copies]
    if not any(per_copy):
        return None
    n = len(per_copy)

    def touch(i: int) -> None:
        with torch.no_grad():
            mine = per_copy[i % n]
            if not as_a_sum:
                for t in mine:
                    t.mul_(1)
                return
            for t, y in zip(mine, per_copy[(i + 1) % n]):
                t.add_(y, alpha=0)

    return touch


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s bytes (same shape, strides, offset) outside its autograd history."""
    if t.is_conj() or t.is_neg() or t.is_sparse or t.layout != torch.strided:
        return t  # _touchable leaves these alone
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _touchable(t: torch.Tensor) -> bool:
    if isinstance(t, torch.nn.Parameter) or t.numel() * t.element_size() < WARM_MIN_BYTES:
        return False
    if t.dtype == torch.bool or t.is_conj() or t.is_neg() or t.device.type == "meta":
        return False
    if t.is_sparse or t.layout != torch.strided:
        return False
    if torch._debug_has_internal_overlap(t) != 0:  # expanded: writing it is refused
        return False
    try:
        with torch.no_grad():
            _alias(t).reshape(-1)[:1].mul_(1)  # the dtype has an in-place multiply (not float8)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


# Not state of the call: its modules and code, or the model's own state (StateGuard's care).
NOT_STATE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
             enum.Enum, torch.nn.Module)
SMALL_NUMEL = 16      # tensors held by objects up to this size are counters: copied back
MAX_OBJECTS = 10_000  # a walk this long is not a cache; stop there


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


class InputState:
    """The attribute state of the objects reachable in one input copy, to put back before a run.

    A module may mutate an object it receives: a transformers DynamicLayer appends this call's
    keys and values (``self.keys = torch.cat([self.keys, k])``), a StaticLayer bumps its
    ``cumulative_length``. Timers run a call hundreds of times, so run N would see N-1 runs of
    growth; a module handed a list may append to it (torchvision's FPN extra block appends its
    pooled level to the list of levels it is given), and run N would return N outputs and meet a
    gradient for each. The snapshot is shallow: each object's attribute dict, and the contents
    of every list and dict in the inputs or held by an object, recursively (not the call's own
    argument tuple and keyword dict, which the call cannot reach); tensors are not copied.
    Putting references back suffices because DynamicLayer (and its sliding-window and quantized
    kin) reassigns rather than writes: the tensors the snapshot points to are never changed.
    StaticLayer does write in place (index_copy_ at ``cumulative_length + arange(n)``), but with
    its counter put back every run writes the same positions with the same values, so run N does
    run 1's work on run 1's data. That counter is a 0-dim tensor bumped with add_, so small
    tensors held by objects are copied back in place, and only when their version counter moved
    (or while a CUDA graph is being captured: the copy must be in the graph, which replays
    without us). Large buffers written elsewhere (a full sliding window rolls) keep shapes and
    work; only values drift, and copying them back would add a buffer copy to every timed run.
    """

    def __init__(self, inputs):
        self.objects: list[tuple[dict, dict]] = []  # (obj.__dict__, its copy)
        self.lists: list[tuple[list, list]] = []
        self.dicts: list[tuple[dict, dict]] = []
        self.small: list[list] = []  # [tensor, its copy, version after the last copy-back]
        self._walk(inputs)

    def __bool__(self) -> bool:
        return bool(self.objects or self.lists or self.dicts)

    def _walk(self, inputs) -> None:
        seen: set[int] = set()
        args, kwargs = inputs  # unpacked into the call: only what they hold can change
        stack = [(v, False) for v in (*args, *kwargs.values())]  # (value, held by an object)
        while stack and len(self.objects) < MAX_OBJECTS:
            x, held = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            if isinstance(x, torch.Tensor):
                if held and x.numel() <= SMALL_NUMEL and x.device.type != "meta":
                    self.small.append([x, x.detach().clone(), _version(x)])
            elif isinstance(x, (tuple, list)):
                if isinstance(x, list):
                    self.lists.append((x, list(x)))
                stack.extend((v, held) for v in x)
            elif isinstance(x, dict):
                self.dicts.append((x, dict(x)))
                stack.extend((v, held) for v in x.values())
            elif isinstance(getattr(x, "__dict__", None), dict) and not isinstance(x, NOT_STATE):
                d = vars(x)
                self.objects.append((d, dict(d)))
                stack.extend((v, True) for v in d.values())

    def restore(self, cuda: bool = False) -> None:
        """Put every attribute, list and dict back; copy back the small tensors that changed."""
        for d, saved in self.objects:
            d.clear()
            d.update(saved)
        for lst, saved in self.lists:
            lst[:] = saved
        for d, saved in self.dicts:
            d.clear()
            d.update(saved)
        if self.small:
            # the C check: the graph timer watches torch.cuda.is_current_stream_capturing for
            # calls that branch on capture, and would refuse this one for cbtrace's own question
            capturing = cuda and torch._C._cuda_isCurrentStreamCapturing()
            with torch.no_grad():
                for s in self.small:
                    t, saved, version = s
                    if capturing or version is None or _version(t) != version:
                        t.copy_(saved)
                        s[2] = _version(t)
