"""ONE compute-dtype rule, for replay (cost/opcount.py) and attribution (attribution/insitu.py).

- An op computes in the dtype its floating operands had when it ran: the first floating one
  ("tf32" for float32 when the op ran on TF32 tensor cores); an op with none (integer index
  arithmetic) has no compute dtype. Under autocast that is the dtype of the casts: replay's
  dispatch mode sees only the ops that ran (``_to_copy``, then the bf16 ``addmm``), and a trace
  counts the op that did the work, not the ``aten::linear`` that saw the fp32 weights
  (``attribution.insitu.working_ops``).
- A module call computes in the dtype with the most FLOPs over its ops, or the most bytes when
  none of them has FLOPs (an Embedding); ties go to the name that sorts first, so the answer
  does not depend on the order ops were seen in.
This dtype picks the peak that mfu and mbu divide by.
"""
from __future__ import annotations

from typing import Iterable

from cbtrace.cost.dtypes import is_floating, name_of


def op_dtype(operand_dtypes: Iterable, *, tf32: bool = False) -> str | None:
    """Compute dtype of one op from its operands' dtypes, in order (any spelling; None skipped).

    ``tf32``: the op is a matmul or convolution that ran with TF32 allowed on CUDA.
    """
    first = next((name_of(d) for d in operand_dtypes if d is not None and is_floating(d)), None)
    return "tf32" if tf32 and first == "float32" else first


def dominant_dtype(costs: Iterable[tuple[str | None, float, float]]) -> str | None:
    """Compute dtype of a module call from ``(dtype, flops, bytes)`` per op (or per dtype).

    The dtype with the most FLOPs; the most bytes when no entry has FLOPs; None when no entry
    with a dtype has FLOPs or bytes. Entries with dtype None are ignored.
    """
    flops: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    for dtype, f, b in costs:
        if dtype:
            flops[dtype] = flops.get(dtype, 0.0) + (f or 0.0)
            nbytes[dtype] = nbytes.get(dtype, 0.0) + (b or 0.0)
    by = flops if any(v > 0 for v in flops.values()) else nbytes
    best = min(by, key=lambda d: (-by[d], d), default=None)
    return best if best is not None and by[best] > 0 else None
