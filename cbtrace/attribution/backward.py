"""Backward attribution: autograd ops belong to the module whose forward op they differentiate.

Each forward op that autograd records carries a ``Sequence number``; the backward node it creates
runs as ``autograd::engine::evaluate_function: XBackward0`` with the same number, on the
autograd thread (GPU) or the calling thread (CPU); Kineto also links the two with ``fwdbwd``
flows. A backward op whose number matches no forward op inside a module (AccumulateGrad, ops
of tied weights, code outside every module) stays unattributed, in its own row.
"""
from __future__ import annotations

from cbtrace.attribution.tree import Forest

EVALUATE = "autograd::engine::evaluate_function: "


def backward_roots(forest: Forest) -> list[int]:
    """Per host event: index of its outermost enclosing evaluate_function op (itself), else -1."""
    out = [-1] * len(forest.host)
    for i, e in enumerate(forest.host):
        p = forest.parent[i]
        if p >= 0 and out[p] >= 0:
            out[i] = out[p]
        elif e.name.startswith(EVALUATE):
            out[i] = i
    return out


def forward_owner_by_seq(forest: Forest, module_of: list[int], bwd_root: list[int],
                         skip: list[int] | None = None) -> dict:
    """Sequence number -> module node of the last forward op with it (outside backward).

    Ops that create no autograd node still record the current number, so several forward ops
    share one; the node is created by the last of them. Ops with ``skip[i] >= 0`` (cbtrace's
    input copies) are ignored.
    """
    owner: dict = {}
    order = sorted(range(len(forest.host)), key=lambda i: forest.host[i].ts)
    for i in order:
        a = forest.host[i].args
        if a is None or a.seq is None or bwd_root[i] >= 0 or (skip is not None and skip[i] >= 0):
            continue
        owner[a.seq] = module_of[i]
    return {k: v for k, v in owner.items() if v >= 0}


def backward_owner(forest: Forest, bwd_root: list[int], seq_owner: dict) -> dict[int, int]:
    """evaluate_function host index -> module node it belongs to (-1: unattributed)."""
    out = {}
    for i, r in enumerate(bwd_root):
        if r != i:
            continue
        seq = forest.host[i].args.seq if forest.host[i].args is not None else None
        if seq is None:  # some torch versions put the number on the inner XBackward0 op only
            seq = _child_seq(forest, i)
        out[i] = seq_owner.get(seq, -1) if seq is not None else -1
    return out


def _child_seq(forest: Forest, i: int):
    for j in range(i + 1, min(i + 4, len(forest.host))):
        if forest.parent[j] == i and forest.host[j].args is not None and forest.host[j].args.seq is not None:
            return forest.host[j].args.seq
    return None
