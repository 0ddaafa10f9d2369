"""Per-module in-situ time, kernels and FLOPs of one loaded trace (one rank).

Every host event gets one owner: cbtrace overhead (inside a ``cbtrace.copy::`` range), the
recomputation of a module call in the backward (inside a ``cbtrace.recompute::`` range:
activation checkpointing; phase "recompute"), the backward of a module (inside an autograd
evaluate_function op, see backward_ops.py), the innermost enclosing module call (forward), or
nobody. A device event belongs to the owner of the host event
that launched it; one with no launcher, or whose launcher has no owner, is unattributed (NCCL
kernels too: their launch sits inside the collective's ops, inside the issuing module). Each
device event is counted exactly once, so per step::

    sum(gpu_self_ms of module rows) + unattributed + overhead == sum of device event durations

All of it is array arithmetic: owners are integer keys, per-owner sums are ``np.bincount``,
inclusive figures are sums over the module tree, level by level.
"""
from __future__ import annotations

import numpy as np

from cbtrace.attribution import backward_ops, identity, intervals
from cbtrace.attribution.forest import Forest, by_level, string_mask
from cbtrace.cost import metrics
from cbtrace.cost.compute_dtype import dominant_dtype
from cbtrace.cost.peaks import PeakLookup

UNATTRIBUTED = "<unattributed>"
OVERHEAD = "<cbtrace-overhead>"
_OPS = ("cpu_op", "Operator")
FWD, BWD, UFWD, UBWD, OVH, RCP = range(6)  # owner kinds; a key is (id + 1) * KINDS + kind
KINDS = 6
PHASES = np.array(["fwd", "bwd", "recompute"])


def _key(kind, ident):
    return (np.asarray(ident, np.int64) + 1) * KINDS + kind


def owners(forest: Forest, module_of, copy_of, roots, b_owner, engine=None,
           recompute=None) -> np.ndarray:
    """Owner key per host event (see the module docstring). ``engine`` (backward_ops.engine_work):
    gradient adds of the autograd engine inside a backward op, which go to the parent of the
    op's module: where a residual stream's two consumers meet. Where a tensor's consumers sit
    further apart (a LayerNorm output feeding parallel attention and MLP blocks) they meet
    higher up, and the add lands below that (the trace does not say which consumer came first).
    ``recompute`` (backward_ops.recompute_of): per event, the forward module call whose
    recomputation encloses it, else -1."""
    step = forest.step_of_host
    rs = np.maximum(roots, 0)
    bo = b_owner[rs]
    if engine is not None:
        par = forest.parent[np.maximum(bo, 0)]
        up = np.where(par >= 0, module_of[np.maximum(par, 0)], -1)
        bo = np.where(engine & (bo >= 0) & (up >= 0), up, bo)
    key = np.where(roots >= 0, np.where(bo >= 0, _key(BWD, bo), _key(UBWD, step[rs])),
                   np.where(module_of >= 0, _key(FWD, module_of), _key(UFWD, step)))
    if recompute is not None:
        key = np.where(recompute >= 0, _key(RCP, recompute), key)
    return np.where(copy_of >= 0, _key(OVH, step), key)


def rows(forest: Forest, *, costs: list | None = None, class_map: dict | None = None,
         device_name: str | None = None, with_shapes: bool = True,
         every_step: bool = True, grad_sums: dict | None = None) -> dict:
    """Columns of one row per (module call, phase) plus unattributed and overhead rows, per step.

    An unattributed fwd row is given for every step (step -1 without steps) even if empty,
    unless ``every_step`` is False (then only where something is unattributed).
    ``grad_sums``: (fqn, call_index) -> the gradient sums that are the call's own (its
    replayed backward's, less its children's): that many of the engine's adds in its backward
    nodes stay with it (``backward_ops.keep_own_adds``) instead of going to its parent.
    """
    source = identity.choose_source(forest)
    lab, is_copy, labels = identity.labels(forest, source)
    module_of, copy_of = forest.nearest(lab >= 0), forest.outermost(is_copy)
    roots = backward_ops.backward_roots(forest)
    rcp, rcp_root, rcp_inner = backward_ops.recompute_of(forest, lab, labels)
    b_owner = backward_ops.backward_owner(
        forest, roots, backward_ops.forward_owner_by_seq(forest, module_of, roots, copy_of,
                                                     rcp_inner))
    calls = _Calls(forest, lab, labels, module_of, source, class_map)
    engine = backward_ops.engine_work(forest, roots)
    if grad_sums:
        engine = backward_ops.keep_own_adds(forest, engine, roots, b_owner,
                                            calls.per_node(grad_sums))
    key = owners(forest, module_of, copy_of, roots, b_owner, engine, rcp)
    copy_root = is_copy & (copy_of == np.arange(len(forest)))  # outermost cbtrace.copy ranges
    b = _Buckets(forest, key, roots, copy_root, module_of, copy_of, costs, engine,
                 rcp, rcp_root)
    m_cols, m_figs = _module_rows(forest, b, calls, lab, labels, module_of, copy_root)
    u_cols, u_figs = _unattributed_rows(forest, b, every_step)
    return _finish(m_cols, m_figs, u_cols, u_figs, b.dtypes, device_name, with_shapes)


def working_ops(forest: Forest, op_flops: np.ndarray, op_bytes: np.ndarray) -> np.ndarray:
    """Per host event: is it an op whose cost counts? (``op_flops`` / ``op_bytes``: per cost code)

    Kineto nests the ops a call dispatches to inside it. Under autocast ``aten::linear`` sees
    the fp32 weights, calls ``aten::_to_copy`` for each operand and then ``aten::linear`` again
    on the bf16 copies, which calls ``aten::addmm``; ``aten::matmul`` calls ``aten::mm``; on
    CUDA ``aten::embedding`` calls ``index_select``, which calls ``gather``. Each FLOP and byte
    is counted once, at the op that did the work, so its dtype is the one its operands had
    when it ran:

    - an op with FLOPs only dispatched when the ops inside it (each by this same rule) count
      at least its FLOPs: they are counted, it is not; otherwise it did the work itself (CPU
      ``aten::addmm`` copies the bias with ``aten::copy_``, then multiplies) and nothing below
      it counts;
    - an op without FLOPs (data movement) dispatched when the ops inside it count no more bytes
      than it does (``_to_copy`` -> ``copy_``, which writes the bf16 copy). Formulas see shapes,
      not strides: ``gather``'s index in an embedding is a (tokens, d) view of one id per
      token, so where the inside counts more, the op's own formula (the gathered rows) is kept;
    - ops without a formula and free ops (views, ``aten::to``, ``aten::reshape``) are
      transparent: what runs inside them counts.
    """
    n = len(forest)
    formula = forest.cost > 0  # code 0: a free op, -1: no formula
    code = np.maximum(forest.cost, 0)
    own_f = np.where(formula, op_flops[code], 0.0) if len(op_flops) else np.zeros(n)
    own_b = np.where(formula, op_bytes[code], 0.0) if len(op_bytes) else np.zeros(n)
    below_f, below_b = np.zeros(n + 1), np.zeros(n + 1)  # counted in the children's subtrees
    has_below = np.zeros(n + 1, bool)  # an op with a formula in a child's subtree; [-1]: top
    works = np.zeros(n, bool)
    for idx in reversed(forest.levels()):
        f, b = own_f[idx], own_b[idx]
        inside = has_below[idx] & (below_f[idx] >= f) & ((f > 0) | (below_b[idx] <= b))
        works[idx] = formula[idx] & ~inside
        up = forest.parent[idx]
        np.add.at(below_f, up, np.where(works[idx], f, below_f[idx]))
        np.add.at(below_b, up, np.where(works[idx], b, below_b[idx]))
        np.logical_or.at(has_below, up, formula[idx] | has_below[idx])
    return works & ~forest.strict_any(works)


class _Buckets:
    """Per owner key: host time, device time and span, kernels, FLOPs, bytes, ops without
    a formula, FLOPs and bytes per dtype (``acc``, aligned with the sorted ``keys``)."""

    def __init__(self, forest: Forest, key, roots, copy_root, module_of, copy_of, costs,
                 engine=None, rcp=None, rcp_root=None):
        s, n, ar = forest.strings, len(forest), np.arange(len(forest))
        is_op = string_mask(s, _OPS.__contains__)[forest.cat] if n else np.zeros(0, bool)
        aten = string_mask(s, lambda x: x.startswith("aten::"))[forest.name] if n else is_op
        table = np.array([c[:3] for c in costs or []], np.float64).reshape(-1, 3)
        f_anc = forest.strict_any(forest.cost >= 0)
        rcp = np.full(n, -1, np.int64) if rcp is None else rcp
        rcp_root = np.zeros(n, bool) if rcp_root is None else rcp_root
        # host time: backward roots, overhead ranges, recomputations, top-level ops outside
        # every module
        top_op = (is_op & ~forest.strict_any(is_op) & (roots < 0) & (copy_of < 0)
                  & (module_of < 0) & (rcp < 0))
        cpu_at = np.flatnonzero((roots == ar) | copy_root | top_op | rcp_root)
        # a backward op's host time less the input copies of cbtrace's gradient hooks in it and
        # the engine's gradient adds (those count for the module that owns them: the parent)
        eng = np.zeros(n, bool) if engine is None else engine
        adds = np.flatnonzero(eng & ~forest.strict_any(eng))
        nest = np.r_[np.flatnonzero((copy_root | rcp_root) & (roots >= 0) & (roots != ar)),
                     adds]
        # a backward op run inside another (a reentrant checkpoint's): out of the enclosing one
        par = np.maximum(forest.parent, 0)
        inner = np.flatnonzero((roots == ar) & (forest.parent >= 0) & (roots[par] >= 0))
        nest_key = np.r_[key[roots[nest]], key[roots[par[inner]]]]
        nest_dur = np.r_[forest.dur[nest], forest.dur[inner]]
        # device time: the launcher's owner, else unattributed in the step of the event
        la = forest.launcher
        d_key = np.where(la >= 0, key[np.maximum(la, 0)] if n else 0,
                         _key(UFWD, forest.step_at(forest.d_ts)))
        # FLOPs and bytes: once, at the ops that did the work (working_ops); ops without a
        # formula count where nothing in their subtree or above them has one
        cost_at = np.flatnonzero(working_ops(forest, table[:, 0], table[:, 2]))
        nof_at = np.flatnonzero(is_op & aten & ~forest.subtree_any(forest.cost >= 0) & ~f_anc
                                & ~forest.strict_any(aten))
        self.keys, inv = np.unique(np.r_[key[cpu_at], d_key, key[cost_at], key[nof_at],
                                         nest_key, key[adds]], return_inverse=True)
        i_cpu, i_dev, i_cost, i_nof, i_nest, i_add = np.split(
            inv.ravel(), np.cumsum([len(cpu_at), len(d_key), len(cost_at), len(nof_at),
                                    len(nest_key)]))
        nb, d_ts, d_dur = len(self.keys), forest.d_ts, forest.d_dur
        acc = {"cpu": np.bincount(i_cpu, forest.dur[cpu_at], nb)
               - np.bincount(i_nest, nest_dur, nb)
               + np.bincount(i_add, forest.dur[adds], nb),
               "gpu": np.bincount(i_dev, d_dur, nb),
               "comm": np.bincount(i_dev, np.where(forest.d_comm, d_dur, 0.0), nb),
               "comm_exp": np.bincount(i_dev, forest.d_exposed, nb),
               "kernels": np.bincount(i_dev, minlength=nb).astype(float),
               "nof": np.bincount(i_nof, minlength=nb).astype(float),
               "first": np.full(nb, np.inf), "last": np.full(nb, -np.inf)}
        np.minimum.at(acc["first"], i_dev, d_ts)
        np.maximum.at(acc["last"], i_dev, d_ts + d_dur)
        self.dtypes = sorted({c[3] for c in costs or [] if c[3]})
        dcode = np.array([self.dtypes.index(c[3]) if c[3] else -1 for c in costs or []], np.int64)
        cc = forest.cost[cost_at]
        for j, name in enumerate(("flops", "flops_x", "bytes")):
            acc[name] = np.bincount(i_cost, table[cc, j], nb)
        with_dt = dcode[cc] >= 0 if len(cc) else np.zeros(0, bool)
        for name, j in (("dt_flops", 0), ("dt_bytes", 2)):   # (keys, dtypes)
            acc[name] = np.zeros((nb, max(len(self.dtypes), 1)))
            np.add.at(acc[name], (i_cost[with_dt], dcode[cc][with_dt]), table[cc, j][with_dt])
        # busy: gpu less the time a key's own events overlap one another (kernels on several
        # streams); a module row's inclusive figure is regrouped by _subtree_overlap
        self.d_key = d_key
        self.overlap = np.flatnonzero(intervals.overlapping(forest.d_dev, d_ts, d_dur))
        acc["busy"] = acc["gpu"].copy()
        rest = self.overlap[~np.isin(d_key[self.overlap] % KINDS, (FWD, BWD, RCP))]
        if len(rest):
            owner, delta = _union_less_sum(i_dev[rest], forest.d_dev[rest], d_ts[rest],
                                           d_dur[rest])
            np.add.at(acc["busy"], owner, delta)
        self.acc = acc

    def lookup(self, keys: np.ndarray) -> dict:
        """The accumulators of each key (empty ones where a key has nothing)."""
        nb = len(self.keys)
        pos = np.minimum(np.searchsorted(self.keys, keys), max(nb - 1, 0))
        hit = (self.keys[pos] == keys) if nb else np.zeros(len(keys), bool)
        out = {}
        for k, v in self.acc.items():
            fill = np.inf if k == "first" else -np.inf if k == "last" else 0.0
            col = np.full((len(keys),) + v.shape[1:], fill)
            col[hit] = v[pos[hit]]
            out[k] = col
        return out


class _Calls:
    """The module calls of a trace: their range events (``mods``), the index of each among them
    (``mi``, by event), their parent call, fqn, depth, parent fqn and call index."""

    def __init__(self, forest: Forest, lab, labels, module_of, source, class_map):
        par = forest.parent
        self.source = source
        self.mods = mods = np.flatnonzero(lab >= 0)
        self.mi = np.full(len(forest) + 1, -1, np.int64)
        self.mi[mods] = np.arange(len(mods))
        self.mparent = self.mi[np.where(par[mods] >= 0, module_of[par[mods]], -1)]  # -1: top
        self.fqn, self.depth, self.parent_fqn = _names(mods, self.mparent, lab, labels, source,
                                                       class_map)
        self.step = forest.step_of_host[mods]
        self.call_index = _call_index(forest.ts[mods], self.step, self.fqn)
        self.n_events = len(forest)

    def per_node(self, by_call: dict) -> np.ndarray:
        """``by_call`` ((fqn, call_index) -> int) per host event: at each call's range event,
        else 0."""
        out = np.zeros(self.n_events, np.int64)
        for m, f, i in zip(self.mods, self.fqn, self.call_index):
            out[m] = by_call.get((f, int(i)), 0)
        return out


def _module_rows(forest: Forest, b: _Buckets, calls: _Calls, lab, labels, module_of,
                 copy_root):
    """Per module call its fwd row, then its bwd row if it has backward figures (host order)."""
    mods, mi, mparent = calls.mods, calls.mi, calls.mparent
    fqn, depth, parent_fqn, source = calls.fqn, calls.depth, calls.parent_fqn, calls.source
    mtree = _ModTree(mparent, depth)
    fself, bself, rself = (b.lookup(_key(k, mods)) for k in (FWD, BWD, RCP))
    fincl, bincl, rincl = (mtree.inclusive(f) for f in (fself, bself, rself))
    for incl, fix in zip((fincl, bincl, rincl), _subtree_overlap(forest, b, calls)):
        incl["busy"] += fix
    # cpu: the call's range minus cbtrace's input copies inside it; self: minus child calls
    copies = np.flatnonzero(copy_root)
    copy_us = np.zeros(len(mods) + 1)  # [-1]: copies outside every module
    np.add.at(copy_us, mi[module_of[copies]], forest.dur[copies])
    cpu_incl = forest.dur[mods] - mtree.subtree_sum(copy_us[:-1])
    child_cpu = np.zeros(len(mods) + 1)
    np.add.at(child_cpu, mparent, cpu_incl)
    step_m, call_index = calls.step, calls.call_index

    has_b, has_r = ((x["cpu"] != 0) | (x["kernels"] != 0) | (x["flops"] != 0)
                    for x in (bincl, rincl))
    mrow = np.r_[np.arange(len(mods)), np.flatnonzero(has_b), np.flatnonzero(has_r)]
    ph = np.r_[np.zeros(len(mods)), np.ones(has_b.sum()), np.full(has_r.sum(), 2)].astype(int)
    order = np.lexsort((ph, mrow))  # per call: fwd, bwd, recompute
    mrow, ph = mrow[order], ph[order]

    def pick(f, bw, rc=None):
        p = ph.reshape((-1,) + (1,) * (f.ndim - 1))
        rc = np.zeros_like(f) if rc is None else rc
        return np.where(p == 1, bw[mrow], np.where(p == 2, rc[mrow], f[mrow]))

    h = mods[mrow]
    cols = dict(step=step_m[mrow], fqn=[fqn[m] for m in mrow], source=source or "unattributed",
                call_index=call_index[mrow], depth=depth[mrow],
                parent_fqn=[parent_fqn[m] for m in mrow],
                module_label=[labels[lab[x]] for x in h], pid=forest.pid[h], tid=forest.tid[h],
                ts_us=forest.ts[h], dur_us=forest.dur[h], ev_index=forest.idx[h],
                phase=PHASES[ph],
                cpu=pick(cpu_incl, bincl["cpu"], rincl["cpu"]),
                cpu_self=pick(cpu_incl - child_cpu[:-1], bself["cpu"], rself["cpu"]),
                gpu_self=pick(fself["gpu"], bself["gpu"], rself["gpu"]))
    return cols, {k: pick(fincl[k], bincl[k], rincl[k]) for k in fincl}


def _subtree_overlap(forest: Forest, b: _Buckets, calls: _Calls) -> np.ndarray:
    """Per phase (fwd, bwd, recompute) and module call: the union of its subtree's device
    events' intervals, per device, less their summed durations (<= 0; ``busy`` = ``gpu`` plus
    this). Only events that overlap another (``_Buckets.overlap``) are regrouped: per level of
    the call tree, deepest first, each call's subtree's overlapping events form one group per
    device."""
    out = np.zeros((3, len(calls.mods)))
    ov = b.overlap
    kind, ident = b.d_key[ov] % KINDS, b.d_key[ov] // KINDS - 1
    depth = np.r_[calls.depth, -1]  # [-1]: above the top
    for p, k in enumerate((FWD, BWD, RCP)):
        sel = ov[kind == k]
        cur = calls.mi[ident[kind == k]]
        for level in range(int(depth[cur].max(initial=-1)), -1, -1):
            at = np.flatnonzero(depth[cur] == level)
            if not len(at):
                continue
            ev = sel[at]
            owner, delta = _union_less_sum(cur[at], forest.d_dev[ev], forest.d_ts[ev],
                                           forest.d_dur[ev])
            np.add.at(out[p], owner, delta)
            cur[at] = calls.mparent[cur[at]]
    return out


def _union_less_sum(owner, dev, ts, dur) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct owner: the union of its intervals per device less their summed durations
    (<= 0): (owners, deltas)."""
    pairs, gid = np.unique(np.c_[owner, dev], axis=0, return_inverse=True)
    gid = gid.ravel()
    delta = intervals.busy(gid, ts, dur, len(pairs)) - np.bincount(gid, dur, len(pairs))
    return pairs[:, 0], np.minimum(delta, 0.0)


def _unattributed_rows(forest: Forest, b: _Buckets, every_step: bool):
    """Unattributed fwd / bwd and overhead rows, per step (fwd: every step)."""
    steps = sorted({st for st, _, _ in forest.steps}) or ([-1] if every_step else [])
    kinds, ids = b.keys % KINDS, b.keys // KINDS - 1
    u_kind, u_step = [], []
    for kind in (UFWD, UBWD, OVH):
        have = set(ids[kinds == kind].tolist()) | (set(steps) if kind == UFWD else set())
        u_kind += [kind] * len(have)
        u_step += sorted(have)
    u_kind, m = np.array(u_kind, np.int64), len(u_kind)
    figs = b.lookup(_key(u_kind, u_step))
    cols = dict(step=np.array(u_step, np.int64),
                fqn=[OVERHEAD if k == OVH else UNATTRIBUTED for k in u_kind.tolist()],
                source=np.where(u_kind == OVH, "cbtrace", "unattributed"),
                call_index=np.zeros(m, np.int64), depth=np.full(m, -1, np.int64),
                parent_fqn=[None] * m, module_label=[None] * m,
                pid=np.full(m, -1, np.int64), tid=np.full(m, -1, np.int64),
                ts_us=np.full(m, np.nan), dur_us=np.full(m, np.nan),
                ev_index=np.full(m, -1, np.int64), phase=np.where(u_kind == UBWD, "bwd", "fwd"),
                cpu=figs["cpu"], cpu_self=figs["cpu"], gpu_self=figs["gpu"])
    return cols, figs


class _ModTree:
    """Sums over the module-call tree (parent index per module, -1 at the top)."""

    def __init__(self, mparent: np.ndarray, depth: np.ndarray):
        self.parent = mparent
        self.levels = by_level(depth)

    def subtree_sum(self, v: np.ndarray) -> np.ndarray:
        out = np.r_[v, np.zeros((1,) + v.shape[1:])]
        for idx in reversed(self.levels):
            np.add.at(out, self.parent[idx], out[idx])
        return out[:-1]

    def inclusive(self, f: dict) -> dict:
        out = {k: self.subtree_sum(v) for k, v in f.items() if k not in ("first", "last")}
        first, last = np.r_[f["first"], np.inf], np.r_[f["last"], -np.inf]
        for idx in reversed(self.levels):
            np.minimum.at(first, self.parent[idx], first[idx])
            np.maximum.at(last, self.parent[idx], last[idx])
        out["first"], out["last"] = first[:-1], last[:-1]
        return out


def _names(mods, mparent, lab, labels, source, class_map):
    """fqn, depth and parent fqn per module call (top-down: parents precede children)."""
    fqn, depth, parent_fqn = [None] * len(mods), np.zeros(len(mods), np.int64), [None] * len(mods)
    for k, (m, pm) in enumerate(zip(mods.tolist(), mparent.tolist())):
        name = labels[lab[m]]
        if class_map and name in class_map:
            fqn[k] = class_map[name]
        elif source == "nn.Module" and pm >= 0:
            fqn[k] = f"{fqn[pm]}.{name}"
        else:
            fqn[k] = name
        if pm >= 0:
            depth[k] = depth[pm] + 1
            parent_fqn[k] = fqn[pm]
    return fqn, depth, parent_fqn


def _call_index(ts, step, fqn) -> np.ndarray:
    """n-th call of each (step, fqn), by start time."""
    codes = {}
    fc = np.array([codes.setdefault(f, len(codes)) for f in fqn], np.int64)
    order = np.lexsort((np.arange(len(ts)), ts))
    grp = np.lexsort((np.arange(len(order)), fc[order], step[order]))  # stable: by time within
    g = order[grp]
    k_step, k_fqn = step[g], fc[g]
    new = np.r_[True, (k_step[1:] != k_step[:-1]) | (k_fqn[1:] != k_fqn[:-1])] if len(g) else \
        np.zeros(0, bool)
    start = np.maximum.accumulate(np.where(new, np.arange(len(g)), 0)) if len(g) else new
    out = np.zeros(len(ts), np.int64)
    out[g] = np.arange(len(g)) - start
    return out


def _finish(cols, figs, ucols, ufig, dtypes, device_name, with_shapes) -> dict:
    """Both row sets -> the final columns (ms, spans, dtype, mfu / mbu)."""
    out = {}
    for k in cols:
        a, b = cols[k], ucols[k]
        if isinstance(a, str):
            a = np.full(len(cols["step"]), a, object)
        out[k] = list(a) + list(b) if isinstance(a, list) or isinstance(b, list) else np.r_[a, b]
    f = {k: np.concatenate([figs[k], ufig[k]]) for k in figs}
    kernels = f["kernels"].astype(np.int64)
    gpu_ms, busy_ms = f["gpu"] / 1e3, f["busy"] / 1e3
    nan = np.nan
    flops = f["flops"] if with_shapes else np.full(len(gpu_ms), nan)
    dtype = _compute_dtypes(f["dt_flops"], f["dt_bytes"], dtypes)
    pf, pb = _peaks(device_name, dtype)
    gpu_s = busy_ms / 1e3  # the rates are per second of device-busy time
    res = dict(step=out["step"], fqn=out["fqn"], source=out["source"],
               call_index=out["call_index"], depth=out["depth"], parent_fqn=out["parent_fqn"],
               module_label=out["module_label"], pid=out["pid"], tid=out["tid"],
               ts_us=out["ts_us"], dur_us=out["dur_us"], ev_index=out["ev_index"],
               phase=out["phase"], cpu_ms=out["cpu"] / 1e3, cpu_self_ms=out["cpu_self"] / 1e3,
               gpu_ms=gpu_ms, gpu_self_ms=out["gpu_self"] / 1e3, gpu_busy_ms=busy_ms,
               gpu_span_ms=np.where(kernels > 0, (f["last"] - f["first"]) / 1e3, 0.0),
               comm_ms=f["comm"] / 1e3, comm_exposed_ms=f["comm_exp"] / 1e3,
               kernel_count=kernels, flops=flops,
               flops_executed=f["flops_x"] if with_shapes else np.full(len(gpu_ms), nan),
               bytes=f["bytes"] if with_shapes else np.full(len(gpu_ms), nan),
               ops_without_formula=f["nof"].astype(np.int64), compute_dtype=dtype,
               mfu=np.where(kernels > 0, metrics.mfu(flops, gpu_s, pf), nan),
               mbu=np.where((kernels > 0) & with_shapes, metrics.mbu(f["bytes"], gpu_s, pb), nan))
    hfu = np.where(kernels > 0, metrics.hfu(res["flops_executed"], gpu_s, pf), nan)
    res["figures_suspect"] = np.fromiter(
        (metrics.suspect(*x) for x in zip(res["mfu"].tolist(), hfu.tolist(), res["mbu"].tolist())),
        bool, len(gpu_ms))
    return res


def _peaks(device_name, dtypes: list) -> tuple[np.ndarray, np.ndarray]:
    """Peak FLOP/s and bandwidth per row by replay's rule (``PeakLookup``); NaN without one."""
    lookup = PeakLookup(device_name)
    by_dtype = {}
    for d in set(dtypes):
        p = lookup(d)
        by_dtype[d] = (np.nan, np.nan) if p is None else (p.flops_per_s or np.nan,
                                                         p.bytes_per_s or np.nan)
    return (np.array([by_dtype[d][0] for d in dtypes], float),
            np.array([by_dtype[d][1] for d in dtypes], float))


def _compute_dtypes(flops, nbytes, dtypes: list) -> list:
    """``dominant_dtype`` per row of per-dtype FLOPs and bytes (rows, dtypes); once per
    distinct row, since steps and layers repeat the same figures."""
    if not dtypes or not len(flops):
        return [None] * len(flops)
    n = len(dtypes)
    uniq, inv = np.unique(np.c_[flops, nbytes], axis=0, return_inverse=True)
    picked = [dominant_dtype(zip(dtypes, u[:n], u[n:])) for u in uniq.tolist()]
    return [picked[i] for i in inv.ravel().tolist()]
