"""FLOPs and bytes per aten op: ONE table keyed by op name, filled by a decorator.

Conventions (torch ``utils/flop_counter.py`` where it is right, our own where it reads 0):
- matmuls (mm, addmm, bmm, baddbmm, matmul, linear): 2*M*K*N; bias adds are not counted.
- convolution: 2 * N * prod(out_spatial) * C_out * prod(kernel) * C_in/groups (transposed: input
  spatial); convolution_backward: that figure once per requested grad (input, weight).
- SDPA and its kernels: 2*B*Hq*Sq*Sk*(Dqk + Dv) for ``flops`` (dense, what mfu uses, causal or
  not); ``flops_executed`` (hfu) scales that by the unmasked fraction of the causal mask
  (top-left aligned, as ``is_causal`` is in torch): about half for Sq == Sk. Backward: 2.5x.
- elementwise: ``ELEMENTWISE_FLOPS`` per output element (1 for arithmetic; transcendentals are
  documented constants there). Reductions: 1 per input element.
- norms and softmax: per-element constants documented beside each formula.
- embedding: 0 FLOPs; embedding_bag: one add per gathered row element (+ the mean divide, or a
  multiply per element with per_sample_weights).
- bytes: tensor inputs read + outputs written, except embedding(_bag) and index_select tables,
  where only the gathered rows count, at most the table's rows (a row gathered twice is read
  from memory once: BERT's all-zero token-type ids touch one row of two), and loss gathers,
  where only the gathered logits count.

``trace_op_cost`` memoises by the event args' text. In a Kineto trace, aten ops nest
(``aten::linear`` > ``aten::addmm``; under autocast ``aten::linear`` on fp32 weights >
``aten::_to_copy`` and ``aten::linear`` on their bf16 copies). Each op's cost is counted once,
at the op that did the work (``attribution.insitu.working_ops``); ops for which ``is_free`` is
true (views, allocation, and wrappers such as ``aten::to`` / ``aten::reshape`` /
``aten::contiguous``) are transparent. Under a TorchDispatchMode composite ops never appear, so
nothing nests.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

from cbtrace.cost.dtypes import itemsize, kineto_name, name_of


@dataclass(frozen=True)
class OpCost:
    flops: float           # dense convention (mfu)
    flops_executed: float  # actually executed (hfu): causal attention skips masked blocks
    bytes: float           # tensor inputs read + outputs written


FREE = OpCost(0.0, 0.0, 0.0)

# name -> (formula, schema argument names in positional order, or None if only positions matter)
_FORMULAS: dict[str, tuple[Callable, tuple[str, ...] | None]] = {}

# Ops with no cost of their own: views/metadata, allocation without initialisation, and
# composite wrappers whose work shows up in their children (``aten::to`` -> ``aten::copy_``).
FREE_OPS = frozenset(f"aten::{n}" for n in """
    view _unsafe_view reshape _reshape_alias view_as t transpose permute expand expand_as
    as_strided detach alias squeeze unsqueeze slice select narrow split split_with_sizes chunk
    unbind flatten unflatten numpy_T diagonal movedim swapaxes unfold empty empty_like
    empty_strided new_empty new_empty_strided resolve_conj resolve_neg lift_fresh lift item
    _local_scalar_dense size stride is_same_size to type_as contiguous dropout feature_dropout
    set_ resize_ resize_as_ record_stream result_type _has_compatible_shallow_copy_type
    sym_size sym_stride sym_numel _shape_as_tensor is_nonzero real view_as_real view_as_complex
    _nested_tensor_from_mask_left_aligned clone_ alias_copy _conj _neg_view conj positive
    split_with_sizes_copy unsafe_split unsafe_chunk matrix_H adjoint mT mH align_as scalar_tensor
""".split())

# FLOPs per output element. Arithmetic, comparisons and piecewise-linear activations cost 1;
# a transcendental function (exp, log, tanh, erf, sqrt, ...) counts as 1, plus the arithmetic
# around it in the textbook definition:
#   sigmoid 1/(1+exp(-x)) = 3; silu x*sigmoid(x) = 4; gelu 0.5*x*(1+erf(x/sqrt2)) = 5 (the tanh
#   approximation, 0.5x(1+tanh(c(x+0.044715x^3))), = 9, see _gelu); softplus log(1+exp(x)) = 3;
#   mish x*tanh(softplus(x)) = 5; elu = 3; hardswish x*relu6(x+3)/6 = 4; hardsigmoid = 3;
#   addcmul/addcdiv/lerp = 2; backward of tanh g*(1-y^2) = 3, of sigmoid g*y*(1-y) = 3,
#   of silu = 6, of gelu = 8.
ELEMENTWISE_FLOPS = {
    **dict.fromkeys("""add sub rsub mul div neg abs relu relu6 clamp clamp_min clamp_max maximum
        minimum where threshold leaky_relu hardtanh eq ne lt le gt ge reciprocal masked_fill sign
        floor ceil round trunc frac remainder fmod logical_not logical_and logical_or bitwise_and
        bitwise_or bitwise_xor bitwise_not square prelu _prelu_kernel threshold_backward
        hardtanh_backward leaky_relu_backward isnan isinf nan_to_num true_divide floor_divide
        exp exp2 log log2 log10 log1p expm1 sqrt rsqrt tanh erf erfc sin cos tan atan pow
        """.split(), 1),
    "sigmoid": 3, "silu": 4, "gelu": 5, "softplus": 3, "mish": 5, "elu": 3, "selu": 3, "celu": 3,
    "hardswish": 4, "hardsigmoid": 3, "addcmul": 2, "addcdiv": 2, "lerp": 2, "logit": 3,
    "tanh_backward": 3, "sigmoid_backward": 3, "silu_backward": 6, "gelu_backward": 8, "logit_backward": 3,
}
_COMPARISONS = frozenset("eq ne lt le gt ge isnan isinf logical_not logical_and logical_or".split())


class _Unknown(Exception):
    """A formula lacks a shape or argument it needs (e.g. conv stride missing from a trace)."""


@functools.lru_cache(maxsize=4096)
def normalize_name(name) -> str:
    """"aten.mm.default", "aten::add.Tensor", an OpOverload or "mm" -> "aten::mm" / "aten::add"."""
    name = str(name)
    if "::" in name:
        ns, rest = name.split("::", 1)
        return f"{ns}::{rest.split('.')[0]}"
    parts = name.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) > 1 else f"aten::{parts[0]}"


def flop_formula(*names: str, params: tuple[str, ...] | None = None):
    """Register a formula for aten ops; a second registration for a name raises at once.

    ``params``: the op schema's argument names in positional order (a Kineto event's
    "Input Dims" / "Concrete Inputs" follow it), needed where the formula reads an argument by name.
    """
    def deco(fn):
        for n in names:
            key = normalize_name(n)
            if key in _FORMULAS or key in FREE_OPS:
                raise ValueError(f"flop formula for {key} registered twice")
            _FORMULAS[key] = (fn, params)
        return fn
    return deco


def has_formula(name) -> bool:
    return normalize_name(name) in _FORMULAS


def is_free(name) -> bool:
    """Views, allocation and wrapper ops: no cost of their own (never 'unknown')."""
    return normalize_name(name) in FREE_OPS


def registered_ops() -> dict[str, tuple[str, ...] | None]:
    """Every op with a formula -> its declared schema argument names (for tests and docs)."""
    return {k: p for k, (_, p) in _FORMULAS.items()}


class _Inputs:
    """An op's inputs as a formula sees them: tensors (shape, dtype) and scalars, by position or name."""

    def __init__(self, shapes, dtypes, scalars, params):
        self.shapes = [None if s is None else _as_shape(s) for s in shapes]
        self.dtypes = [name_of(d) for d in dtypes] + [None] * (len(shapes) - len(dtypes))
        self.params = params or ()
        self.scalars = dict(scalars or {})

    def _pos(self, key):
        if isinstance(key, int):
            return key
        return self.params.index(key) if key in self.params else None

    def has(self, key) -> bool:
        i = self._pos(key)
        return i is not None and i < len(self.shapes) and self.shapes[i] is not None

    def shape(self, key) -> tuple:
        if not self.has(key):
            raise _Unknown(key)
        return self.shapes[self._pos(key)]

    def dtype(self, key):
        return self.dtypes[self._pos(key)] if self.has(key) else None

    def get(self, name, default=None, *, required=False):
        if name in self.scalars and self.scalars[name] is not None:
            return self.scalars[name]
        if required:
            raise _Unknown(name)
        return default

    def tensors(self):
        """(shape, dtype) of every tensor input, tensor lists flattened."""
        out = []
        for s, d in zip(self.shapes, self.dtypes):
            if s is not None:
                out.extend([(t, d) for t in s] if _is_list_of_shapes(s) else [(s, d)])
        return out

    def first_dtype(self):
        return next((d for _, d in self.tensors() if d), "float32")


def _is_list_of_shapes(s) -> bool:
    return len(s) > 0 and isinstance(s[0], tuple)


def _as_shape(s):
    s = tuple(s)
    if s and isinstance(s[0], (list, tuple)):
        return tuple(tuple(int(v) for v in t) for t in s)
    return tuple(int(v) for v in s)


def op_cost(name, shapes: list, dtypes: list, *, scalars: dict | None = None) -> OpCost | None:
    """FLOPs and bytes of one aten op call; None when the op has no formula or lacks an argument.

    Args:
        name: "aten::mm", "aten.mm.default" or an OpOverload.
        shapes: per positional input, a shape (tensor), a list of shapes (tensor list) or None.
        dtypes: per positional input, a dtype (torch.dtype or name) or None.
        scalars: non-tensor arguments by schema name, e.g. {"is_causal": True, "stride": [2, 2]}.
    """
    key = normalize_name(name)
    if key in FREE_OPS:
        return FREE
    entry = _FORMULAS.get(key)
    if entry is None:
        return None
    fn, params = entry
    try:
        return fn(_Inputs(shapes, dtypes, scalars, params))
    except (_Unknown, IndexError, ValueError, ZeroDivisionError, TypeError):
        return None


def trace_op_cost(name: str, input_dims: list, input_types: list,
                  concrete_inputs: list | None) -> OpCost | None:
    """``op_cost`` from a Kineto event's args: "Input Dims", "Input type", "Concrete Inputs".

    Results are memoised by the args' text (a training trace repeats the same shapes every step).
    """
    key = normalize_name(name)
    if key in FREE_OPS:
        return FREE
    if key not in _FORMULAS:
        return None
    memo = (key, repr(input_dims), repr(input_types), repr(concrete_inputs))
    cost = _TRACE_MEMO.get(memo, _MISSING)
    if cost is _MISSING:
        if len(_TRACE_MEMO) > 100_000:
            _TRACE_MEMO.clear()
        cost = _TRACE_MEMO[memo] = _trace_op_cost(key, input_dims, input_types, concrete_inputs)
    return cost


_TRACE_MEMO: dict = {}
_MISSING = object()


def _trace_op_cost(key, input_dims, input_types, concrete_inputs):
    params = _FORMULAS[key][1] or ()
    shapes, dtypes, scalars = [], [], {}
    for i, typ in enumerate(input_types or []):
        dims = input_dims[i] if i < len(input_dims or []) else []
        dtype = kineto_name(typ)
        tensor = dtype is not None
        if typ == "TensorList" and dims and isinstance(dims[0], list):
            tensor = True   # some torch versions record each list member's dims (not dtypes)
        shapes.append(dims if tensor else None)
        dtypes.append(dtype)
        if not tensor and concrete_inputs and i < len(concrete_inputs) and i < len(params):
            value = _parse_concrete(concrete_inputs[i])
            if value is not None:
                scalars[params[i]] = value
    return op_cost(key, shapes, dtypes, scalars=scalars)


def _parse_concrete(text):
    """Kineto "Concrete Inputs" strings: '1', '0.1', 'True', '[1, 1]', '' -> python values."""
    text = (text or "").strip()
    if text in ("", "None"):
        return None
    if text in ("True", "False"):
        return text == "True"
    if text.startswith("["):
        items = [_parse_concrete(t) for t in text.strip("[]").split(",") if t.strip()]
        return items
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip("'\"")


# ---------------------------------------------------------------- helpers for formulas

def _numel(shape) -> int:
    return math.prod(shape)


def _nbytes(shape, dtype) -> int:
    return _numel(shape) * itemsize(dtype)


def _read_all(x: _Inputs) -> int:
    return sum(_nbytes(s, d) for s, d in x.tensors())


def _cost(flops, x: _Inputs, out_elems, *, executed=None, read=None, out_dtype=None) -> OpCost:
    """OpCost with bytes = ``read`` (default: every tensor input) + outputs written."""
    read = _read_all(x) if read is None else read
    written = out_elems * itemsize(out_dtype or x.first_dtype())
    return OpCost(float(flops), float(flops if executed is None else executed), float(read + written))


def _broadcast(*shapes) -> tuple:
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(ndim):
        dims = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0} - {1}
        if len(dims) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _ints(v, n) -> list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return [int(a) for a in (v * n if len(v) == 1 else v)]


# ---------------------------------------------------------------- matmuls

@flop_formula("aten::mm", params=("self", "mat2"))
def _mm(x):
    (m, k), (_, n) = x.shape(0), x.shape(1)
    return _cost(2 * m * k * n, x, m * n)


@flop_formula("aten::addmm", params=("self", "mat1", "mat2", "beta", "alpha"))
@flop_formula("aten::_addmm_activation", params=("self", "mat1", "mat2", "beta", "alpha", "use_gelu"))
def _addmm(x):
    (m, k), (_, n) = x.shape(1), x.shape(2)
    return _cost(2 * m * k * n, x, m * n)


@flop_formula("aten::_scaled_mm", params=("self", "mat2", "scale_a", "scale_b", "bias",
                                           "scale_result", "out_dtype", "use_fast_accum"))
def _scaled_mm(x):
    (m, k), (_, n) = x.shape(0), x.shape(1)
    out_dtype = x.get("out_dtype")
    return _cost(2 * m * k * n, x, m * n, out_dtype=out_dtype if isinstance(out_dtype, str) else None)


@flop_formula("aten::bmm", params=("self", "mat2"))
def _bmm(x):
    (b, m, k), (_, _, n) = x.shape(0), x.shape(1)
    return _cost(2 * b * m * k * n, x, b * m * n)


@flop_formula("aten::baddbmm", params=("self", "batch1", "batch2", "beta", "alpha"))
def _baddbmm(x):
    (b, m, k), (_, _, n) = x.shape(1), x.shape(2)
    return _cost(2 * b * m * k * n, x, b * m * n)


@flop_formula("aten::matmul", params=("self", "other"))
def _matmul(x):
    a, b = x.shape(0), x.shape(1)
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    batch = _broadcast(a2[:-2], b2[:-2])
    m, k, n = a2[-2], a2[-1], b2[-1]
    return _cost(2 * _numel(batch) * m * k * n, x, _numel(batch) * m * n)


@flop_formula("aten::mv", params=("self", "vec"))
@flop_formula("aten::addmv", params=("self", "mat", "vec", "beta", "alpha"))
def _mv(x):
    m, k = x.shape(0 if len(x.shape(0)) == 2 else 1)
    return _cost(2 * m * k, x, m)


@flop_formula("aten::dot", params=("self", "tensor"))
@flop_formula("aten::vdot", params=("self", "other"))
def _dot(x):
    return _cost(2 * _numel(x.shape(0)), x, 1)


@flop_formula("aten::linear", params=("input", "weight", "bias"))
def _linear(x):
    inp, (n, k) = x.shape(0), x.shape(1)
    m = _numel(inp[:-1])
    return _cost(2 * m * k * n, x, m * n)


# ---------------------------------------------------------------- convolution

def _conv_out_spatial(inp, weight, stride, padding, dilation, transposed, output_padding):
    spatial, kernel = inp[2:], weight[2:]
    n = len(spatial)
    if padding in ("same", "valid"):
        return list(spatial) if padding == "same" else [i - (k - 1) for i, k in zip(spatial, kernel)]
    s, p, d = _ints(stride, n), _ints(padding, n), _ints(dilation, n)
    if transposed:
        op = _ints(output_padding, n)
        return [(i - 1) * s_ - 2 * p_ + d_ * (k - 1) + o + 1
                for i, k, s_, p_, d_, o in zip(spatial, kernel, s, p, d, op)]
    return [(i + 2 * p_ - d_ * (k - 1) - 1) // s_ + 1 for i, k, s_, p_, d_ in zip(spatial, kernel, s, p, d)]


def _conv_flops(inp, weight, out_spatial, transposed) -> int:
    # torch conv_flop_count: weight (C_out, C_in/groups, *k), or (C_in, C_out/groups, *k) transposed
    conv_shape = inp[2:] if transposed else out_spatial
    c_a, c_b, *kernel = weight
    return 2 * inp[0] * _numel(conv_shape) * _numel(kernel) * c_a * c_b


def _conv(x, transposed=None):
    inp, weight = x.shape(0), x.shape(1)
    if transposed is None:
        transposed = bool(x.get("transposed", False))
    out_sp = _conv_out_spatial(inp, weight, x.get("stride", required=True),
                               x.get("padding", required=True), x.get("dilation", 1),
                               transposed, x.get("output_padding", 0))
    groups = x.get("groups") or (inp[1] // weight[1] if not transposed else 1)
    c_out = weight[1] * groups if transposed else weight[0]
    return _cost(_conv_flops(inp, weight, out_sp, transposed), x, inp[0] * c_out * _numel(out_sp))


_CONV_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
                "output_padding", "groups")
flop_formula("aten::convolution", params=_CONV_PARAMS)(_conv)
flop_formula("aten::_convolution", params=_CONV_PARAMS + ("benchmark", "deterministic",
                                                          "cudnn_enabled", "allow_tf32"))(_conv)
flop_formula("aten::conv1d", "aten::conv2d", "aten::conv3d",
             params=("input", "weight", "bias", "stride", "padding", "dilation", "groups"))(_conv)
flop_formula("aten::cudnn_convolution", params=("self", "weight", "padding", "stride", "dilation",
                                                "groups", "benchmark", "deterministic", "allow_tf32"))(_conv)
flop_formula("aten::mkldnn_convolution",
             params=("self", "weight", "bias", "padding", "stride", "dilation", "groups"))(_conv)


@flop_formula("aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d",
              params=("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation"))
def _conv_transpose(x):
    return _conv(x, transposed=True)


@flop_formula("aten::convolution_backward", params=(
    "grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
    "output_padding", "groups", "output_mask"))
def _conv_backward(x):
    grad_out, inp, weight = x.shape(0), x.shape(1), x.shape(2)
    transposed = bool(x.get("transposed", False))
    mask = x.get("output_mask", [True, True, True])
    fwd = _conv_flops(inp, weight, grad_out[2:], transposed)
    flops = fwd * (bool(mask[0]) + bool(mask[1]))
    out = _numel(inp) * bool(mask[0]) + _numel(weight) * bool(mask[1]) + grad_out[1] * bool(mask[2])
    return _cost(flops, x, out)


# ---------------------------------------------------------------- attention

def _causal_fraction(s_q: int, s_k: int) -> float:
    """Unmasked share of a top-left causal mask (row i sees min(i+1, Sk) keys)."""
    if s_q <= s_k:
        kept = s_q * (s_q + 1) // 2
    else:
        kept = s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k
    return kept / (s_q * s_k)


def _sdpa(x, *, layout="bhsd", causal=None, backward=False, q=0, k=1, v=2):
    qs, ks, vs = x.shape(q), x.shape(k), x.shape(v)
    if len(qs) != 4:
        raise _Unknown("varlen attention")  # packed (total, H, D) layouts
    if layout == "bshd":
        qs, ks, vs = [(s[0], s[2], s[1], s[3]) for s in (qs, ks, vs)]
    b, h, s_q, d = qs
    s_k, d_v = ks[2], vs[3]
    dense = 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v   # QK^T + PV
    if backward:
        dense = dense * 5 // 2   # recompute QK^T, then 4 grad matmuls (torch sdpa_backward_flop)
    causal = bool(x.get("is_causal", False)) if causal is None else causal
    executed = dense * _causal_fraction(s_q, s_k) if causal else dense
    out = _numel(qs) + _numel(ks) + _numel(vs) if backward else b * h * s_q * d_v
    return _cost(dense, x, out, executed=executed)


flop_formula("aten::scaled_dot_product_attention", params=(
    "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))(_sdpa)
flop_formula("aten::_scaled_dot_product_attention_math", params=(
    "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "dropout_mask", "scale",
    "enable_gqa"))(_sdpa)
flop_formula("aten::_scaled_dot_product_flash_attention", params=(
    "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"))(_sdpa)
flop_formula("aten::_scaled_dot_product_flash_attention_for_cpu", params=(
    "query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"))(_sdpa)
flop_formula("aten::_scaled_dot_product_efficient_attention", params=(
    "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"))(_sdpa)
flop_formula("aten::_scaled_dot_product_cudnn_attention", params=(
    "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
    "return_debug_mask", "scale"))(_sdpa)


@flop_formula("aten::_flash_attention_forward", params=(
    "query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"))
def _flash_fwd(x):
    return _sdpa(x, layout="bshd")


@flop_formula("aten::_efficient_attention_forward", params=(
    "query", "key", "value", "bias", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    "dropout_p", "custom_mask_type"))
def _efficient_fwd(x):
    return _sdpa(x, layout="bshd", causal=int(x.get("custom_mask_type", 0)) != 0)


@flop_formula("aten::_scaled_dot_product_flash_attention_backward", params=(
    "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
    "max_k", "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"))
@flop_formula("aten::_scaled_dot_product_efficient_attention_backward", params=(
    "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed",
    "philox_offset", "dropout_p", "grad_input_mask", "is_causal", "scale"))
@flop_formula("aten::_scaled_dot_product_cudnn_attention_backward", params=(
    "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
    "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"))
@flop_formula("aten::_scaled_dot_product_flash_attention_for_cpu_backward", params=(
    "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal",
    "attn_mask", "scale"))
def _sdpa_backward(x):
    return _sdpa(x, backward=True, q=1, k=2, v=3)


# ---------------------------------------------------------------- elementwise and reductions

def _elementwise(flops_per_elem, comparison=False):
    def formula(x):
        shapes = [s for s, _ in x.tensors()]
        out = _broadcast(*shapes) if shapes else ()
        per = 9 if flops_per_elem == 5 and x.get("approximate") == "tanh" else flops_per_elem
        return _cost(per * _numel(out), x, _numel(out), out_dtype="bool" if comparison else None)
    return formula


for _name, _per in ELEMENTWISE_FLOPS.items():
    for _variant in (_name, _name + "_"):
        flop_formula(f"aten::{_variant}", params=("self", "approximate") if _name == "gelu" else None)(
            _elementwise(_per, _name in _COMPARISONS))


def _reduced_elems(shape, dim) -> int:
    if not shape or dim is None or dim == [] or not isinstance(dim, (int, list, tuple)):
        return 1
    dims = [d % len(shape) for d in _ints(dim, 1)] if shape else []
    return _numel(s for i, s in enumerate(shape) if i not in dims)


def _reduction(flops_per_elem):  # 1 (or 3 for var/std, 2 for norms) per input element
    def formula(x):
        shape = x.shape(0)
        return _cost(flops_per_elem * _numel(shape), x, _reduced_elems(shape, x.get("dim")))
    return formula


for _names, _per in (("sum mean amax amin max min prod argmax argmin any all logsumexp nansum", 1),
                     ("var std var_mean std_mean", 3)):
    for _name in _names.split():
        flop_formula(f"aten::{_name}", params=("self", "dim"))(_reduction(_per))
flop_formula("aten::norm", params=("self", "p", "dim"))(_reduction(2))
flop_formula("aten::linalg_vector_norm", params=("self", "ord", "dim"))(_reduction(2))


@flop_formula("aten::cumsum", "aten::cumprod", params=("self", "dim"))
def _scan(x):
    return _cost(_numel(x.shape(0)), x, _numel(x.shape(0)))


# ---------------------------------------------------------------- norms and softmax

def _norm_rows(shape, normalized_shape) -> int:
    return _numel(shape) // max(1, _numel(_ints(normalized_shape, 1)))


def _layer_norm(x):
    # mean 1 + variance 2 (subtract-square, sum) + normalise 2 (subtract, *rstd) = 5 per element;
    # +1 for a weight, +1 for a bias. Outputs: y, plus float32 mean and rstd per row.
    shape = x.shape(0)
    n = _numel(shape)
    per = 5 + x.has("weight") + x.has("bias")
    rows = _norm_rows(shape, x.get("normalized_shape", shape[-1:]))
    return _cost(per * n, x, n + 2 * rows * 4 // itemsize(x.dtype(0)))


flop_formula("aten::native_layer_norm", params=("input", "normalized_shape", "weight", "bias", "eps"))(_layer_norm)
flop_formula("aten::layer_norm", params=("input", "normalized_shape", "weight", "bias", "eps",
                                         "cudnn_enable"))(_layer_norm)


@flop_formula("aten::rms_norm", params=("input", "normalized_shape", "weight", "eps"))
@flop_formula("aten::_fused_rms_norm", params=("input", "normalized_shape", "weight", "eps"))
def _rms_norm(x):
    # square 1 + sum 1 + scale by rstd 1 = 3 per element; +1 for a weight.
    n = _numel(x.shape(0))
    return _cost((3 + x.has("weight")) * n, x, n)


def _batch_norm(x):
    # training: statistics 3 per element + normalise 2; eval: normalise 2; affine +2.
    # An unknown ``training`` flag (a trace without Concrete Inputs) counts as training.
    n = _numel(x.shape(0))
    training = x.get("training", True)
    per = (5 if training else 2) + (2 if x.has("weight") else 0)
    read = _nbytes(x.shape(0), x.dtype(0)) + sum(
        _nbytes(x.shape(p), x.dtype(p)) for p in ("weight", "bias", "running_mean", "running_var") if x.has(p))
    return _cost(per * n, x, n, read=read)


_BN = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
flop_formula("aten::native_batch_norm", "aten::_native_batch_norm_legit", params=_BN)(_batch_norm)
flop_formula("aten::batch_norm", params=_BN + ("cudnn_enabled",))(_batch_norm)
flop_formula("aten::cudnn_batch_norm", "aten::miopen_batch_norm", params=(
    "input", "weight", "bias", "running_mean", "running_var", "training",
    "exponential_average_factor", "epsilon"))(_batch_norm)


@flop_formula("aten::_native_batch_norm_legit_no_training", params=(
    "input", "weight", "bias", "running_mean", "running_var", "momentum", "eps"))
def _batch_norm_eval(x):
    x.scalars["training"] = False
    return _batch_norm(x)


@flop_formula("aten::native_group_norm", params=("input", "weight", "bias", "N", "C", "HxW", "group", "eps"))
@flop_formula("aten::group_norm", params=("input", "num_groups", "weight", "bias", "eps", "cudnn_enabled"))
def _group_norm(x):
    n = _numel(x.shape(0))
    return _cost((5 + x.has("weight") + x.has("bias")) * n, x, n)


@flop_formula("aten::native_layer_norm_backward", params=(
    "grad_out", "input", "normalized_shape", "mean", "rstd", "weight", "bias", "output_mask"))
def _layer_norm_backward(x):
    # grad_input ~ 8 per element; grad_weight/bias 2 per element (multiply-accumulate).
    n = _numel(x.shape(0))
    return _cost(10 * n, x, n)


def _softmax(per):
    def formula(x):
        n = _numel(x.shape(0))
        return _cost(per * n, x, n)
    return formula


# softmax: max 1 + subtract 1 + exp 1 + sum 1 + divide 1 = 5; log_softmax: max, subtract, exp,
# sum, subtract (one log per row, not counted) = 5. Backward: softmax g*y - y*sum(g*y) = 4,
# log_softmax g - exp(y)*sum(g) = 3.
flop_formula("aten::softmax", "aten::_softmax", "aten::_safe_softmax", "aten::log_softmax", "aten::_log_softmax",
             params=("self", "dim"))(_softmax(5))
flop_formula("aten::_softmax_backward_data", params=("grad_output", "output", "dim", "input_dtype"))(_softmax(4))
flop_formula("aten::_log_softmax_backward_data",
             params=("grad_output", "output", "dim", "input_dtype"))(_softmax(3))


# ---------------------------------------------------------------- embeddings and losses

@flop_formula("aten::embedding", params=("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse"))
def _embedding(x):
    (v, d), idx = x.shape(0), x.shape(1)
    rows = min(_numel(idx), v) * d * itemsize(x.dtype(0))   # only the gathered rows are read
    read = rows + _nbytes(idx, x.dtype(1))
    return _cost(0, x, _numel(idx) * d, read=read, out_dtype=x.dtype(0))


@flop_formula("aten::embedding_bag", "aten::_embedding_bag", "aten::_embedding_bag_forward_only",
              params=("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse",
                      "per_sample_weights", "include_last_offset", "padding_idx"))
def _embedding_bag(x):
    (v, d), idx = x.shape(0), x.shape(1)
    n = _numel(idx)
    if x.has("offsets") and len(idx) == 1:
        bags = x.shape("offsets")[0] - bool(x.get("include_last_offset", False))
    else:
        bags = idx[0]
    mode = x.get("mode", 0)      # 0 sum, 1 mean, 2 max
    flops = n * d                # one add (or compare, for max) per gathered row element
    flops += bags * d if mode in (1, "mean") else 0
    flops += n * d if x.has("per_sample_weights") else 0
    read = min(n, v) * d * itemsize(x.dtype(0)) + sum(
        _nbytes(x.shape(p), x.dtype(p)) for p in ("indices", "offsets", "per_sample_weights") if x.has(p))
    return _cost(flops, x, bags * d, read=read, out_dtype=x.dtype(0))


@flop_formula("aten::embedding_dense_backward", params=(
    "grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq"))
@flop_formula("aten::embedding_backward", params=(
    "grad", "indices", "num_weights", "padding_idx", "scale_grad_by_freq", "sparse"))
def _embedding_backward(x):
    grad, d = x.shape(0), x.shape(0)[-1]
    rows = x.get("num_weights", required=True)
    return _cost(_numel(grad), x, rows * d, out_dtype=x.dtype(0))


def _nll(x):
    # one add per sample (the reduction); only the gathered logits are read.
    n = _numel(x.shape(1))
    read = _nbytes(x.shape(1), x.dtype(1)) + n * itemsize(x.dtype(0))
    return _cost(n, x, 1 if x.get("reduction", 1) else n, read=read, out_dtype=x.dtype(0))


_NLL = ("self", "target", "weight", "reduction", "ignore_index")
flop_formula("aten::nll_loss", "aten::nll_loss_forward", "aten::nll_loss2d_forward",
             "aten::nll_loss_nd", "aten::nll_loss2d", params=_NLL)(_nll)


@flop_formula("aten::cross_entropy_loss", params=_NLL + ("label_smoothing",))
def _cross_entropy(x):
    # log_softmax (5 per logit) + nll (1 per sample); logits read once.
    logits = x.shape(0)
    read = _nbytes(logits, x.dtype(0)) + _nbytes(x.shape(1), x.dtype(1))
    return _cost(5 * _numel(logits) + _numel(x.shape(1)), x, 1, read=read, out_dtype=x.dtype(0))


@flop_formula("aten::nll_loss_backward", "aten::nll_loss2d_backward", params=(
    "grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight"))
def _nll_backward(x):
    return _cost(_numel(x.shape("target")), x, _numel(x.shape("self")), read=_nbytes(
        x.shape("target"), x.dtype("target")), out_dtype=x.dtype("self"))


@flop_formula("aten::binary_cross_entropy_with_logits", params=("self", "target", "weight", "pos_weight", "reduction"))
def _bce_logits(x):
    # max(x,0) - x*t + log1p(exp(-|x|)): max, mul, sub, abs, exp, log1p, add = 7; + reduction 1
    n = _numel(x.shape(0))
    return _cost(8 * n, x, 1 if x.get("reduction", 1) else n)


@flop_formula("aten::mse_loss", params=("self", "target", "reduction"))
def _mse(x):
    n = _numel(x.shape(0))   # subtract, square, sum
    return _cost(3 * n, x, 1 if x.get("reduction", 1) else n)


# ---------------------------------------------------------------- data movement (0 FLOPs)

@flop_formula("aten::clone", "aten::_to_copy", "aten::tril", "aten::triu", "aten::roll",
              "aten::flip", params=("self",))
def _copy_like(x):
    return _cost(0, x, _numel(x.shape(0)))


@flop_formula("aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::rand_like",
              "aten::randn_like", params=("self",))
def _new_like(x):
    return _cost(0, x, _numel(x.shape(0)), read=0)


@flop_formula("aten::copy_", params=("self", "src", "non_blocking"))
def _copy_(x):
    return _cost(0, x, _numel(x.shape(0)), read=_nbytes(x.shape(1), x.dtype(1)), out_dtype=x.dtype(0))


@flop_formula("aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_", "aten::bernoulli_",
              "aten::random_", "aten::exponential_", params=("self",))
def _fill(x):
    return _cost(0, x, _numel(x.shape(0)), read=0)


@flop_formula("aten::zeros", "aten::ones", "aten::rand", "aten::randn", params=("size", "dtype"))
def _create(x):
    size, dtype = x.get("size", required=True), x.get("dtype")
    return OpCost(0.0, 0.0, float(_numel(_ints(size, 1)) * (itemsize(dtype) if dtype else 4)))


@flop_formula("aten::arange", params=("start", "end", "step"))
def _arange(x):
    start, end, step = x.get("start", 0), x.get("end"), x.get("step", 1)
    if end is None:                 # arange(end)
        start, end = 0, start
    n = max(0, math.ceil((float(end) - float(start)) / float(step)))
    dtype = x.get("dtype")
    return OpCost(0.0, 0.0, float(n * (itemsize(dtype) if isinstance(dtype, str) else 8)))


@flop_formula("aten::cat", "aten::concat", "aten::stack", params=("tensors", "dim"))
def _cat(x):
    shapes = x.shape(0)
    if not _is_list_of_shapes(shapes):
        raise _Unknown("tensors")   # Kineto records a TensorList with empty dims
    return _cost(0, x, sum(_numel(s) for s in shapes))


@flop_formula("aten::select_backward", params=("grad_output", "input_sizes", "dim", "index"))
@flop_formula("aten::slice_backward", params=("grad_output", "input_sizes", "dim", "start", "end", "step"))
def _view_backward(x):
    # zeros of the input's size, then the gradient copied into the selected part
    return _cost(0, x, _numel(_ints(x.get("input_sizes", required=True), 1)))


@flop_formula("aten::scatter_add", "aten::scatter_add_", params=("self", "dim", "index", "src"))
def _scatter_add(x):
    idx = x.shape("index")
    read = _nbytes(idx, x.dtype("index")) + _numel(idx) * itemsize(x.dtype("src")) * 2
    return _cost(_numel(idx), x, _numel(idx), read=read, out_dtype=x.dtype("self"))


@flop_formula("aten::index_select", params=("self", "dim", "index"))
def _index_select(x):
    shape, idx = x.shape(0), x.shape(2)
    dim = int(x.get("dim", 0)) % len(shape)
    row = _numel(shape) // shape[dim]
    out = row * _numel(idx)
    read = row * min(_numel(idx), shape[dim]) * itemsize(x.dtype(0)) + _nbytes(idx, x.dtype(2))
    return _cost(0, x, out, read=read)


@flop_formula("aten::gather", params=("self", "dim", "index"))
def _gather(x):
    idx = x.shape(2)
    read = _numel(idx) * itemsize(x.dtype(0)) + _nbytes(idx, x.dtype(2))
    return _cost(0, x, _numel(idx), read=read, out_dtype=x.dtype(0))


@flop_formula("aten::native_dropout", params=("input", "p", "train"))
def _native_dropout(x):
    # draw + compare + scale = 3 per element; writes the output and a bool mask.
    n = _numel(x.shape(0))
    return _cost(3 * n, x, n + n // itemsize(x.dtype(0)))


# ---------------------------------------------------------------- quantized (torch.ao)
# Quantized ops take their weight packed (a LinearPackedParamsBase / ConvPackedParamsBase
# script object) and are counted like their float versions: 2*M*K*N, the conv formula. Only a
# live call hands the packed object over; a Kineto event records no dims for it (in-situ from a
# trace reads no FLOPs for these ops).

def _packed(x, name):
    """(weight shape, weight bytes, packed object) of a packed-weight argument."""
    packed = x.get(name, required=True)
    unpack = getattr(packed, "unpack", None)
    if unpack is None:
        raise _Unknown(name)
    w = unpack()[0]
    return tuple(w.shape), w.numel() * w.element_size(), packed


_QLINEAR_DYNAMIC = ("X", "W_prepack", "reduce_range")
_QLINEAR = ("X", "W_prepack", "Y_scale_i", "Y_zero_point_i")


@flop_formula("quantized::linear_dynamic", "quantized::linear_relu_dynamic",
              params=_QLINEAR_DYNAMIC)
@flop_formula("quantized::linear_dynamic_fp16", "quantized::linear_relu_dynamic_fp16",
              params=_QLINEAR_DYNAMIC[:2])
@flop_formula("quantized::linear", "quantized::linear_relu", params=_QLINEAR)
def _quantized_linear(x):
    inp = x.shape(0)
    (n, k), w_bytes, _ = _packed(x, "W_prepack")
    m = _numel(inp[:-1])
    return _cost(2 * m * k * n, x, m * n, read=_read_all(x) + w_bytes)


@flop_formula("quantized::conv1d", "quantized::conv2d", "quantized::conv3d",
              "quantized::conv1d_relu", "quantized::conv2d_relu", "quantized::conv3d_relu",
              "quantized::conv_transpose1d", "quantized::conv_transpose2d",
              "quantized::conv_transpose3d",
              params=("qx", "packed_weight", "output_scale", "output_zero_point"))
def _quantized_conv(x):
    inp = x.shape(0)
    weight, w_bytes, p = _packed(x, "packed_weight")
    transposed = bool(p.transpose())
    if len(inp) == 3 and len(weight) == 4:  # conv1d packs its weight as 2-d (a unit height)
        weight = weight[:2] + weight[3:]
    out_sp = _conv_out_spatial(inp, weight, p.stride()[-len(inp) + 2:],
                               p.padding()[-len(inp) + 2:], p.dilation()[-len(inp) + 2:],
                               transposed, p.output_padding()[-len(inp) + 2:] if transposed else 0)
    c_out = weight[1] * p.groups() if transposed else weight[0]
    return _cost(_conv_flops(inp, weight, out_sp, transposed), x, inp[0] * c_out * _numel(out_sp),
                 read=_read_all(x) + w_bytes)


# ---------------------------------------------------------------- fused transformer fast paths
# nn.TransformerEncoderLayer / nn.MultiheadAttention in eval run one fused op; counted as the
# ops of the unfused path are: projections 2*T*K*N, attention as SDPA (2*B*S*S*E for QK^T and
# as much for PV), layer norms and the activation by their per-element constants, the two
# residual adds 1 per element (the unfused path's separate in-projection bias add is not, as
# addmm's bias is not). A nested src (padding mask) has no single shape: no figure.

def _mha_core(b, s_q, s_k, e) -> int:
    t_q, t_k = b * s_q, b * s_k
    qkv = 2 * t_q * e * e + 2 * 2 * t_k * e * e  # q from the query, k and v from the key/value
    return qkv + 4 * b * s_q * s_k * e + 2 * t_q * e * e  # attention, out projection


@flop_formula("aten::_native_multi_head_attention", params=(
    "query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias", "proj_weight",
    "proj_bias", "mask", "need_weights", "average_attn_weights", "mask_type"))
def _native_mha(x):
    (b, s_q, e), (_, s_k, _) = x.shape("query"), x.shape("key")
    return _cost(_mha_core(b, s_q, s_k, e), x, b * s_q * e)


@flop_formula("aten::_transformer_encoder_layer_fwd", params=(
    "src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias",
    "use_gelu", "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2",
    "norm_bias_2", "ffn_weight_1", "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask",
    "mask_type"))
def _encoder_layer(x):
    b, s, e = x.shape("src")
    f, t = x.shape("ffn_weight_1")[0], b * s
    act = ELEMENTWISE_FLOPS["gelu"] if x.get("use_gelu") else ELEMENTWISE_FLOPS["relu"]
    ffn = 2 * t * e * f * 2 + act * t * f
    return _cost(_mha_core(b, s, s, e) + ffn + 2 * 7 * t * e + 2 * t * e, x, t * e)
