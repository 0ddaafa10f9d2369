"""In-situ FLOPs and bytes of trace ops, with the formulas replay uses (cbtrace.flops).

Traces taken with ``record_shapes=True`` carry ``Input Dims`` / ``Input type`` / ``Concrete
Inputs`` per op. Costs are cached by the raw JSON of those args, so each distinct
(op, shapes) pair is decoded and costed once however many steps and layers repeat it.
"""
from __future__ import annotations

import math

import msgspec

NO_FORMULA = None  # Event.cost of an op with shapes but no formula
_decode = msgspec.json.Decoder().decode


class OpCoster:
    """Loader callback: ``(name, dims, types, concrete)`` raw JSON -> cost tuple or None.

    A cost tuple is ``(flops, flops_executed, bytes, dtype)``; dtype is the first tensor
    input's dtype name ("bfloat16", "float32" ...) or None.
    """

    def __init__(self):
        from cbtrace import flops  # lazily: the formula table is only needed with shapes

        self._flops = flops
        self._cache: dict = {}

    def __call__(self, name: str, dims: bytes, types: bytes, concrete: bytes):
        key = (name, dims, types, concrete)
        hit = self._cache.get(key, False)
        if hit is not False:
            return hit
        self._cache[key] = cost = self._cost(name, dims, types, concrete)
        return cost

    def _cost(self, name, dims, types, concrete):
        if not self._flops.has_formula(name) and not self._flops.is_free(name):
            return NO_FORMULA
        try:
            d, t = _decode(dims), _decode(types) if types else []
            c = _decode(concrete) if concrete else None
            cost = self._flops.trace_op_cost(name, d, t, c)
        except (msgspec.DecodeError, TypeError, ValueError, IndexError, KeyError):
            return NO_FORMULA
        if cost is None:
            return NO_FORMULA
        dtype = next((self._flops.dtype_name(x) for x in t
                      if isinstance(x, str) and self._flops.itemsize(x) and _is_float(x)), None)
        return (float(cost.flops), float(cost.flops_executed), float(cost.bytes), dtype)


def _is_float(kineto_type: str) -> bool:
    return kineto_type in ("float", "double", "c10::Half", "c10::BFloat16") or "Float8" in kineto_type


def peak_of(device_name: str | None, dtype: str | None):
    """(flops_per_s, bytes_per_s) from cbtrace.peaks, or (nan, nan) for an unknown device."""
    if not device_name:
        return math.nan, math.nan
    from cbtrace.peaks import peak_for

    try:
        peak = peak_for(device_name, dtype or "float32")
    except (KeyError, ValueError):
        peak = None
    if peak is None:
        return math.nan, math.nan
    return (peak.flops_per_s or math.nan), (peak.bytes_per_s or math.nan)


def utilization(amount: float, ms: float, peak_per_s: float) -> float:
    """amount / (ms / 1e3) / peak; NaN when the time or the peak is unknown or zero."""
    if not ms or ms <= 0 or not peak_per_s or math.isnan(peak_per_s) or math.isnan(amount):
        return math.nan
    return amount / (ms / 1e3) / peak_per_s
