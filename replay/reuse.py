"""What replay can reuse between calls that are the same work: the profiled pass.

Two calls are the same work when their module's class, parameters and buffers (names, shapes,
dtypes), their inputs' metadata and their modes (train/eval, grad, autocast) are equal —
``signature`` — AND their counted cost (FLOPs, bytes, ops without a formula, compute dtype) came
out the same: a call whose cost depends on its values (an MoE's routing, embedding ids, a mask)
shows it there and is profiled on its own. The 12 blocks of GPT-2 small are profiled once; the
profiled pass (torch.profiler's start and stop) was a third of a call's replay wall.
"""
from __future__ import annotations

import hashlib


def signature(module, rec) -> str:
    """A digest of what decides a call's work apart from its values."""
    h = hashlib.sha256(f"{type(module).__module__}.{type(module).__qualname__}".encode())
    for kind, named in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, t in named:
            h.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}".encode())
    h.update(f"{rec.input_meta}|{rec.training}|{rec.grad_enabled}|{rec.autocast_dtype}".encode())
    return h.hexdigest()


COST_KEYS = ("flops", "flops_executed", "bytes", "unknown_ops", "compute_dtype")


class ProfileCache:
    """(signature, counted cost) -> (first call's fqn, its profiled figures)."""

    def __init__(self):
        self._seen: dict[tuple, tuple[str, dict]] = {}

    @staticmethod
    def key(sig: str, row: dict) -> tuple | None:
        if any(k not in row for k in COST_KEYS):  # not counted: nothing to check it against
            return None
        return (sig, *(row[k] for k in COST_KEYS))

    def get(self, key):
        return self._seen.get(key) if key is not None else None

    def put(self, key, fqn: str, figures: dict) -> None:
        if key is not None:
            self._seen.setdefault(key, (fqn, figures))
