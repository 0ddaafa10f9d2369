"""Backward attribution: autograd ops belong to the module whose forward op they differentiate.

Each forward op that autograd records carries a ``Sequence number``; the backward node it creates
runs as ``autograd::engine::evaluate_function: XBackward0`` with the same number, on the
autograd thread (GPU) or the calling thread (CPU); Kineto also links the two with ``fwdbwd``
flows. A backward op whose number matches no forward op inside a module (AccumulateGrad, ops
of tied weights, code outside every module) stays unattributed, in its own row.
"""
from __future__ import annotations

import numpy as np

from cbtrace.attribution.forest import Forest, string_mask

EVALUATE = "autograd::engine::evaluate_function: "


def backward_roots(forest: Forest) -> np.ndarray:
    """Per host event: index of its innermost enclosing evaluate_function op (itself), else -1.

    Such ops nest only in a reentrant backward (``checkpoint(use_reentrant=True)`` runs one
    inside its node's): each inner op is a root of its own, the enclosing one keeps the rest."""
    is_eval = string_mask(forest.strings, lambda s: s.startswith(EVALUATE))
    mark = is_eval[forest.name] if len(forest) else np.zeros(0, bool)
    return forest.nearest(mark)


def forward_owner_by_seq(forest: Forest, module_of: np.ndarray, bwd_root: np.ndarray,
                         skip: np.ndarray, recomputed=None) -> tuple[np.ndarray, np.ndarray]:
    """Sequence numbers and the module node of the last forward op with each (outside backward).

    Ops that create no autograd node still record the current number, so several forward ops
    share one; the node is created by the last of them (by start time). Ops with
    ``skip[i] >= 0`` (cbtrace's input copies) are ignored. ``recomputed`` (recompute_of's
    innermost map): ops a checkpoint recomputed in the backward count for the module call
    they recompute (a reentrant checkpoint's inner backward differentiates them). Returns
    sorted (seq, module) arrays, only numbers whose last op is inside a module.
    """
    rc = np.full(len(forest), -1, np.int64) if recomputed is None else recomputed
    mod = np.where(rc >= 0, rc, module_of)
    ok = np.flatnonzero((forest.seq >= 0) & ((bwd_root < 0) | (rc >= 0)) & (skip < 0))
    order = ok[np.lexsort((ok, forest.ts[ok]))][::-1]  # latest first
    seqs, first = np.unique(forest.seq[order], return_index=True)
    owner = mod[order[first]]
    keep = owner >= 0
    return seqs[keep], owner[keep]


def backward_owner(forest: Forest, bwd_root: np.ndarray, seq_owner) -> np.ndarray:
    """Per host event that is a backward root: the module node it belongs to (-1 elsewhere)."""
    roots = np.flatnonzero(bwd_root == np.arange(len(forest)))
    seq = forest.seq[roots].copy()
    inner = inner_ops(forest, roots)  # some torch versions number the inner XBackward0 op only
    seq = np.where((seq < 0) & (inner >= 0), forest.seq[np.maximum(inner, 0)], seq)
    seqs, owner = seq_owner
    pos = np.minimum(np.searchsorted(seqs, seq), max(len(seqs) - 1, 0))
    hit = (seq >= 0) & (seqs[pos] == seq) if len(seqs) else np.zeros(len(seq), bool)
    out = np.full(len(forest), -1, np.int64)
    out[roots] = np.where(hit, owner[pos] if len(seqs) else -1, -1)
    return out


def inner_ops(forest: Forest, roots: np.ndarray) -> np.ndarray:
    """Per root ``evaluate_function: X``: the index of its child op ``X`` (the node's own
    work), -1 without. Found by name, not position: in a ``with_stack`` trace of a capture the
    Python frames of cbtrace's gradient hooks come first (every LayerNorm and GELU backward of
    a GPT-2 step lost its module that way)."""
    s, n = forest.strings, len(forest)
    out = np.full(len(roots), -1, np.int64)
    if not len(roots):
        return out
    code = {name: c for c, name in enumerate(s)}
    inner = np.full(len(s), -2, np.int64)  # root name code -> code of its op's name
    for c, name in enumerate(s):
        if name.startswith(EVALUATE):
            inner[c] = code.get(name[len(EVALUATE):], -2)
    at = np.full(n + 1, -1, np.int64)
    at[roots] = np.arange(len(roots))
    kids = np.flatnonzero(forest.parent >= 0)
    kids = kids[at[forest.parent[kids]] >= 0]  # children of a root
    kids = kids[forest.name[kids] == inner[forest.name[forest.parent[kids]]]]
    which, first = np.unique(at[forest.parent[kids]], return_index=True)
    out[which] = kids[first]
    return out


ACCUMULATE = ("aten::add", "aten::add_")  # the engine's sum of a tensor's gradients


def engine_work(forest: Forest, bwd_root: np.ndarray) -> np.ndarray:
    """Per host event: is it the autograd engine adding a gradient into the buffer of a tensor
    that had several consumers, inside a backward op but outside the node's op ``X``? (A
    residual stream's ``x`` feeds a LayerNorm and the add after it: the add runs in whichever
    consumer's backward finishes second, a visible share of it.) Only the add: the
    engine's other work there is the node's own (``validate_outputs`` sums a broadcast bias's
    gradient down to its shape: a Linear's bias reduction)."""
    roots = np.flatnonzero(bwd_root == np.arange(len(forest)))
    inner = inner_ops(forest, roots)
    mark = np.zeros(len(forest), bool)
    mark[inner[inner >= 0]] = True
    with_inner = np.zeros(len(forest) + 1, bool)
    with_inner[roots[inner >= 0]] = True
    outside = ((bwd_root >= 0) & (bwd_root != np.arange(len(forest))) & with_inner[bwd_root]
               & (forest.nearest(mark) < 0))
    add = string_mask(forest.strings, ACCUMULATE.__contains__)[forest.name] if len(forest) \
        else outside
    return outside & (forest.nearest(outside & add) >= 0)


def keep_own_adds(forest: Forest, engine: np.ndarray, bwd_root: np.ndarray,
                  b_owner: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``engine`` less the gradient adds that are a module call's own: of the adds run inside
    the backward nodes of the call whose range event is ``m``, the first ``keep[m]`` (host
    order) leave the mask and count for the call with the rest of its node. ``keep`` comes from
    the replay (the sums its backward alone makes, less its children's): a tanh GELU sums the
    three gradients of its input with two adds, which run in its own nodes and are its own; a
    LayerNorm's add, summing its input's gradient with the residual stream's, is not."""
    top = forest.outermost(engine)
    adds = np.flatnonzero(engine & (top == np.arange(len(forest))))
    if not len(adds):
        return engine
    owner = b_owner[np.maximum(bwd_root[adds], 0)]
    quota = np.where(owner >= 0, keep[np.maximum(owner, 0)], 0)
    order = np.lexsort((adds, owner))  # by owner, then host order
    grouped = owner[order]
    first = np.r_[True, grouped[1:] != grouped[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order)) - start
    kept = adds[rank < quota]
    return engine & ~np.isin(top, kept) if len(kept) else engine


RECOMPUTE = "cbtrace.recompute::"  # capture's range around a call recomputed in the backward


def recompute_of(forest: Forest, lab: np.ndarray, labels: list
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activation checkpointing: per host event, the forward module call (its node) whose
    recomputation in the backward encloses it (the outermost ``cbtrace.recompute::<fqn>#<k>``
    range: the fqn's k-th call in the capture, as capture matched it), else -1; which events
    are those outermost ranges; and the same call for the innermost range (the module whose op
    it recomputes).

    A range without ``#<k>`` (an older capture): the k-th recomputation of an fqn in a step
    belongs to its k-th forward call from the last (the backward runs in reverse), wrong where
    a module is called both inside and outside a checkpoint."""
    n = len(forest)
    none = np.full(n, -1, np.int64)
    if not n:
        return none, np.zeros(0, bool), none
    mark = string_mask(forest.strings, lambda x: x.startswith(RECOMPUTE))[forest.name]
    outer, inner = forest.outermost(mark), forest.nearest(mark)
    ranges = np.flatnonzero(mark)
    if not len(ranges):
        return none, np.zeros(n, bool), none
    step = forest.step_of_host
    calls: dict = {}  # (step, fqn) -> forward module nodes in time order
    in_capture: dict = {}  # fqn -> the same over all steps (capture's call_index)
    mods = np.flatnonzero(lab >= 0)
    for m in mods[np.argsort(forest.ts[mods], kind="stable")].tolist():
        calls.setdefault((int(step[m]), labels[lab[m]]), []).append(m)
        in_capture.setdefault(labels[lab[m]], []).append(m)
    seen: dict = {}
    target = np.full(n + 1, -1, np.int64)  # [-1]: events outside every recomputation
    for r in ranges[np.argsort(forest.ts[ranges], kind="stable")].tolist():
        name = forest.strings[forest.name[r]][len(RECOMPUTE):]
        fqn, sep, index = name.rpartition("#")
        if sep and index.isdigit():
            fwd = in_capture.get(fqn, [])
            if int(index) < len(fwd):
                target[r] = fwd[int(index)]
            continue
        key = (int(step[r]), name)
        k = seen[key] = seen.get(key, -1) + 1
        fwd = calls.get(key)
        if fwd:
            target[r] = fwd[max(len(fwd) - 1 - k, 0)]
    rcp = target[outer]
    return rcp, (outer == np.arange(n)) & (rcp >= 0), target[inner]
