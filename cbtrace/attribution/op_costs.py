"""In-situ FLOPs and bytes of trace ops, with the formulas replay uses (cbtrace.cost.flops).

Traces taken with ``record_shapes=True`` carry ``Input Dims`` / ``Input type`` / ``Concrete
Inputs`` per op. Costs are cached by the raw JSON of those args, so each distinct
(op, shapes) pair is decoded and costed once however many steps and layers repeat it.
"""
from __future__ import annotations

import msgspec

from cbtrace.attribution.loader import SHAPED
from cbtrace.cost import flops
from cbtrace.cost.compute_dtype import op_dtype
from cbtrace.cost.dtypes import kineto_name

NO_FORMULA = -1  # cost code of an op with shapes but no formula
_decode = msgspec.json.Decoder().decode


class OpCoster:
    """Loader callback: ``(name, dims, types, concrete)`` raw JSON -> cost code (-1: no formula).

    ``costs[code]`` is ``(flops, flops_executed, bytes, dtype)``; dtype is the op's compute
    dtype (``cost.compute_dtype.op_dtype``: its first floating input's, "bfloat16" ...) or
    None. An op without a formula, or a free one (views ...), gets its code from its name
    alone; others are costed once per distinct args text.
    """

    def __init__(self):
        self._flops = flops
        self._cache: dict = {}
        self.costs: list[tuple] = [(0.0, 0.0, 0.0, None)]  # code 0: free ops

    def by_name(self, name: str) -> int:
        """-1 for an op without a formula, 0 for a free one, else SHAPED (costed per call)."""
        f = self._flops
        return 0 if f.is_free(name) else SHAPED if f.has_formula(name) else NO_FORMULA

    def __call__(self, name: str, dims, types, concrete) -> int:
        key = (name, b"\0".join((dims, types, concrete)))  # NUL never occurs in JSON text
        code = self._cache.get(key)
        if code is None:
            cost = self._cost(name, bytes(dims), bytes(types), bytes(concrete))
            code = NO_FORMULA if cost is None else len(self.costs)
            if cost is not None:
                self.costs.append(cost)
            self._cache[key] = code
        return code

    def _cost(self, name, dims, types, concrete):
        if not self._flops.has_formula(name) and not self._flops.is_free(name):
            return None
        try:
            d, t = _decode(dims), _decode(types) if types else []
            c = _decode(concrete) if concrete else None
            cost = self._flops.trace_op_cost(name, d, t, c)
        except (msgspec.DecodeError, TypeError, ValueError, IndexError, KeyError):
            return None
        if cost is None:
            return None
        # TF32 is invisible in a trace: fp32 matmuls count as float32
        dtype = op_dtype(kineto_name(x) for x in t if isinstance(x, str))
        return (float(cost.flops), float(cost.flops_executed), float(cost.bytes), dtype)
