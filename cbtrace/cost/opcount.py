"""Count FLOPs and bytes of everything a module call runs, with a TorchDispatchMode.

    with OpCounter(params={id(p): n for n, p in module.named_parameters()}) as oc:
        out = module(*args, **kwargs)
    cost = oc.cost()          # or oc.cost(outputs=out) to count exactly the returned tensors

FLOPs are the sum of ``flops.op_cost`` over the aten ops seen. Bytes are module-level, not the sum
over ops: every storage read that the call did not produce itself (inputs, parameters, buffers)
counts once, as the union of the byte ranges read (an embedding table only as the unique rows
gathered), plus what the call wrote and did not read back itself (its outputs, and side outputs
such as saved statistics), plus inputs or buffers it updated in place.
"""
from __future__ import annotations

import functools
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbtrace.cost.compute_dtype import dominant_dtype, op_dtype
from cbtrace.cost.dtypes import name_of
from cbtrace.cost.flops import OpCost, is_free, normalize_name, op_cost

# Ops whose fp32 inputs run as TF32 on CUDA when TF32 is allowed.
_MATMULS = frozenset(f"aten::{n}" for n in "mm addmm bmm baddbmm matmul linear _addmm_activation mv addmv".split())
_CONVS = frozenset(f"aten::{n}" for n in "convolution _convolution cudnn_convolution convolution_backward".split())
_UNANNOTATED_MUTATIONS = frozenset({"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"})
# op -> (table argument, indices argument): only the gathered rows of the table are read.
_GATHERS = {"aten::embedding": (0, 1), "aten::embedding_bag": (0, 1), "aten::_embedding_bag": (0, 1),
            "aten::_embedding_bag_forward_only": (0, 1)}


@dataclass(frozen=True)
class OpCall:
    name: str              # "aten::mm"
    dtype: str | None      # compute dtype of this op ("tf32" for fp32 matmuls run as TF32)
    cost: OpCost | None    # None: no formula (counted in unknown_ops)


@dataclass(frozen=True)
class CallCost:
    flops: float                 # dense convention (mfu)
    flops_executed: float        # executed (hfu)
    bytes: float                 # bytes_read + bytes_written
    bytes_read: float            # unique external storages read (params once; tables: gathered rows)
    bytes_written: float         # outputs and side outputs not read back, plus in-place updates
    op_bytes: float              # sum of per-op bytes (what trace attribution can see)
    unknown_ops: int             # op calls with no formula
    unknown_names: tuple         # their names, sorted
    compute_dtype: str | None    # dtype of the ops with the most FLOPs (bytes if no FLOPs)
    params_touched: tuple        # parameter names read, sorted
    ops: tuple                   # OpCall per non-free op, in order


def _storage_key(t):
    """Identity of a tensor's storage, shared by its views (works for meta tensors too)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))


def _span(t) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def _union_length(spans) -> int:
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def _flat_tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


def _mutated(func, args, kwargs):
    """Tensors the op writes in place: schema arguments annotated ``Tensor(a!)``, plus the
    running statistics of training-mode batch norms, whose legacy schemas do not say so."""
    out = []
    hidden = func._schema.name in _UNANNOTATED_MUTATIONS and _argument(func, args, kwargs, "training")
    for i, arg in enumerate(func._schema.arguments):
        if (arg.alias_info is not None and arg.alias_info.is_write) or (
                hidden and arg.name in ("running_mean", "running_var")):
            v = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            out.extend(t for t in _flat_tensors(v) if t.numel())
    return out


def _argument(func, args, kwargs, name):
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(name)
    return None


def _describe(func, args, kwargs):
    """Schema-ordered shapes, dtypes and named scalars of one call, as ``op_cost`` takes them."""
    shapes, dtypes, scalars = [], [], {}
    for i, arg in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(v, torch.Tensor) and v.is_nested:  # no single shape: no formula reads it
            shapes.append(None)
            dtypes.append(v.dtype)
        elif isinstance(v, torch.Tensor):
            shapes.append(tuple(v.shape))
            dtypes.append(v.dtype)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
            shapes.append([tuple(t.shape) for t in v])
            dtypes.append(v[0].dtype)
        else:
            shapes.append(None)
            dtypes.append(None)
            if v is not None:
                scalars[arg.name] = name_of(v) if isinstance(v, torch.dtype) else v
    return shapes, dtypes, scalars


def _compute_dtype(name, tensors) -> str | None:
    """``op_dtype`` of the op's tensors; TF32 where CUDA runs this fp32 matmul/conv as TF32."""
    first = next((t for t in tensors if t.is_floating_point()), None)
    return op_dtype([t.dtype for t in tensors], tf32=first is not None and first.is_cuda and _tf32(name))


def _tf32(name) -> bool:
    if name in _MATMULS:
        return torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return name in _CONVS and torch.backends.cudnn.allow_tf32


@functools.cache
def _counting_mode():
    """The dispatch mode that hands each aten op to an OpCounter (the class made once).

    TorchDispatchMode wraps a subclass's ``__torch_dispatch__`` in ``torch._dynamo.disable``,
    whose first call imports torch._dynamo: a second, as long as importing torch, that every
    fresh ``cbtrace replay`` paid in its first count. The wrapper is left out: Dynamo already
    skips every frame while a dispatch mode is active (convert_frame's dispatch-mode check).
    """
    class _CountingMode(TorchDispatchMode):
        def __init__(self, counter):
            super().__init__()
            self.counter = counter

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.counter._record(func, args, kwargs, out)
            return out

    return _CountingMode


class OpCounter:
    """Context manager: counts FLOPs and bytes of the aten ops run inside it."""

    def __init__(self, params: dict[int, str] | None = None):
        self.params = dict(params or {})   # id(parameter tensor) -> name
        self._mode = None
        self._ops: list[OpCall] = []
        self._ext_spans = defaultdict(list)    # external storage -> byte ranges read
        self._ext_gathered = Counter()         # external storage -> bytes gathered (tables)
        self._ext_written = {}                 # external storage -> bytes updated in place
        self._produced = {}                    # storage made here -> [nbytes, consumed, written]
        self._sink_bytes = 0                   # produced, written, never read, since recycled
        self._param_keys = {}                  # storage -> parameter name
        self._touched = set()

    def __enter__(self):
        self._mode = _counting_mode()(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        mode, self._mode = self._mode, None
        return mode.__exit__(*exc)

    # ------------------------------------------------------------------ recording

    def _record(self, func, args, kwargs, out):
        name = normalize_name(func._schema.name)
        free = is_free(name)
        inputs = _flat_tensors(args) + _flat_tensors(kwargs)
        in_keys = set()
        for t in inputs:
            key = _storage_key(t)
            in_keys.add(key)
            if id(t) in self.params:
                self._param_keys[key] = self.params[id(t)]
        if not free:
            self._record_reads(name, args, inputs)
            shapes, dtypes, scalars = _describe(func, args, kwargs)
            cost = op_cost(name, shapes, dtypes, scalars=scalars)
            self._ops.append(OpCall(name, _compute_dtype(name, inputs), cost))
        if not free:
            for t in _mutated(func, args, kwargs):   # e.g. BatchNorm running stats, add_'s self
                self._mark_written(_storage_key(t), t.numel() * t.element_size())
        for t in _flat_tensors(out):
            if t.numel() == 0:
                continue
            key, nbytes = _storage_key(t), t.numel() * t.element_size()
            if key in in_keys:              # in place, or a view of an input
                if not free:
                    self._mark_written(key, nbytes)
                continue
            if key in self._produced:       # the allocator recycled a freed storage
                self._retire(key)
            self._produced[key] = [nbytes, False, not free]

    def _mark_written(self, key, nbytes):
        if key in self._produced:
            self._produced[key][2] = True
        else:
            self._ext_written[key] = max(self._ext_written.get(key, 0), nbytes)

    def _record_reads(self, name, args, inputs):
        gather = _GATHERS.get(name)
        table = args[gather[0]] if gather else None
        for t in inputs:
            if t.numel() == 0:
                continue
            key = _storage_key(t)
            if key in self._produced:
                self._produced[key][1] = True
                continue
            if key in self._param_keys:
                self._touched.add(self._param_keys[key])
            if t is table:
                self._ext_gathered[key] = max(self._ext_gathered[key], self._gathered_bytes(t, args[gather[1]]))
            else:
                self._ext_spans[key].append(_span(t))

    @staticmethod
    def _gathered_bytes(table, indices) -> int:
        rows = torch.unique(indices).numel()
        return min(rows, table.shape[0]) * (table[0].numel() * table.element_size())

    def _retire(self, key):
        nbytes, consumed, written = self._produced.pop(key)
        if written and not consumed:
            self._sink_bytes += nbytes

    # ------------------------------------------------------------------ results

    def op_names(self) -> set[str]:
        """The aten ops counted so far (view and metadata ops left out)."""
        return {op.name for op in self._ops}

    def cost(self, outputs=None) -> CallCost:
        """Totals so far. ``outputs``: the call's return value, to count exactly those as written."""
        read = sum(max(_union_length(self._ext_spans.get(k, [])), self._ext_gathered.get(k, 0))
                   for k in set(self._ext_spans) | set(self._ext_gathered))
        written = sum(self._ext_written.values())
        if outputs is None:
            written += self._sink_bytes + sum(n for n, consumed, w in self._produced.values() if w and not consumed)
        else:
            spans = defaultdict(list)
            for t in _flat_tensors(outputs):
                spans[_storage_key(t)].append(_span(t))
            written += sum(_union_length(s) for s in spans.values())
        known = [op for op in self._ops if op.cost is not None]
        unknown = sorted({op.name for op in self._ops if op.cost is None})
        return CallCost(
            flops=sum(op.cost.flops for op in known),
            flops_executed=sum(op.cost.flops_executed for op in known),
            bytes=float(read + written), bytes_read=float(read), bytes_written=float(written),
            op_bytes=sum(op.cost.bytes for op in known),
            unknown_ops=len(self._ops) - len(known), unknown_names=tuple(unknown),
            compute_dtype=dominant_dtype((op.dtype, op.cost.flops, op.cost.bytes) for op in known),
            params_touched=tuple(sorted(self._touched)), ops=tuple(self._ops))

