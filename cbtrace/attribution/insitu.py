"""Per-module in-situ time, kernels and FLOPs of one loaded trace (one rank).

Every host event gets one owner: cbtrace overhead (inside a ``cbtrace.copy::`` range), the
backward of a module (inside an autograd evaluate_function op, see backward.py), the innermost
enclosing module call (forward), or nobody. A device event belongs to the owner of the host event
that launched it; one with no launcher, or whose launcher has no owner, is unattributed. Each
device event is counted exactly once, so per step::

    sum(gpu_self_ms of module rows) + unattributed + overhead == sum of device event durations
"""
from __future__ import annotations

import math

from cbtrace.attribution import backward, identity
from cbtrace.attribution.insitu_flops import peak_of, utilization
from cbtrace.attribution.tree import Forest

UNATTRIBUTED = "<unattributed>"
OVERHEAD = "<cbtrace-overhead>"
_OPS = ("cpu_op", "Operator")


class _Acc:
    __slots__ = ("cpu", "gpu", "kernels", "first", "last", "flops", "flops_x", "bytes", "nof",
                 "dtypes")

    def __init__(self):
        self.cpu = self.gpu = self.flops = self.flops_x = self.bytes = 0.0
        self.kernels = self.nof = 0
        self.first, self.last = math.inf, -math.inf
        self.dtypes: dict = {}

    def add_device(self, ts, dur):
        self.gpu += dur
        self.kernels += 1
        self.first, self.last = min(self.first, ts), max(self.last, ts + dur)

    def add_cost(self, cost):
        flops, flops_x, nbytes, dtype = cost
        self.flops += flops
        self.flops_x += flops_x
        self.bytes += nbytes
        if dtype and flops:
            self.dtypes[dtype] = self.dtypes.get(dtype, 0.0) + flops

    def merge(self, o: "_Acc"):
        """Add a child's inclusive figures (cpu is handled by the caller)."""
        self.gpu += o.gpu
        self.kernels += o.kernels
        self.first, self.last = min(self.first, o.first), max(self.last, o.last)
        self.flops += o.flops
        self.flops_x += o.flops_x
        self.bytes += o.bytes
        self.nof += o.nof
        for k, v in o.dtypes.items():
            self.dtypes[k] = self.dtypes.get(k, 0.0) + v


def rows(forest: Forest, *, class_map: dict | None = None, device_name: str | None = None,
         with_shapes: bool = True) -> list[dict]:
    """One dict per (module call, phase) plus unattributed and overhead rows, per step."""
    host, par, n = forest.host, forest.parent, len(forest.host)
    source = identity.choose_source(forest)
    labels, is_copy = {}, [False] * n
    for i in range(n):
        lab, ov = identity.label(forest, i, source)
        if lab is not None:
            labels[i] = lab
        is_copy[i] = ov
    module_of, copy_of, op_anc, f_anc = [-1] * n, [-1] * n, [False] * n, [False] * n
    for i in range(n):
        p = par[i]
        module_of[i] = i if i in labels else (module_of[p] if p >= 0 else -1)
        copy_of[i] = (copy_of[p] if p >= 0 and copy_of[p] >= 0 else (i if is_copy[i] else -1))
        if p >= 0:
            op_anc[i] = op_anc[p] or host[p].cat in _OPS
            f_anc[i] = f_anc[p] or isinstance(host[p].cost, tuple)
    roots = backward.backward_roots(forest)
    seq_owner = backward.forward_owner_by_seq(forest, module_of, roots, copy_of)
    b_owner = backward.backward_owner(forest, roots, seq_owner)
    step_of = forest.step_of_host

    def owner(i):
        if copy_of[i] >= 0:
            return ("ovh", step_of[i])
        r = roots[i]
        if r >= 0:
            m = b_owner[r]
            return ("bwd", m) if m >= 0 else ("ubwd", step_of[r])
        m = module_of[i]
        return ("fwd", m) if m >= 0 else ("ufwd", step_of[i])

    acc: dict = {}

    def get(key):
        a = acc.get(key)
        if a is None:
            a = acc[key] = _Acc()
        return a

    # host time: backward roots, overhead ranges, top-level ops outside every module
    for i, e in enumerate(host):
        if roots[i] == i or (is_copy[i] and copy_of[i] == i):
            get(owner(i)).cpu += e.dur
        elif e.cat in _OPS and not op_anc[i] and roots[i] < 0 and copy_of[i] < 0 and module_of[i] < 0:
            get(owner(i)).cpu += e.dur
    # device time
    for d, l in zip(forest.device, forest.launcher):
        key = owner(l) if l >= 0 else ("ufwd", forest.step_at(d.ts))
        get(key).add_device(d.ts, d.dur)
    # FLOPs: the outermost op with a formula; ops with none anywhere in their subtree are counted
    sub_f = [False] * n
    for i in range(n - 1, -1, -1):
        if isinstance(host[i].cost, tuple):
            sub_f[i] = True
        if sub_f[i] and par[i] >= 0:
            sub_f[par[i]] = True
    for i, e in enumerate(host):
        if isinstance(e.cost, tuple):
            if not f_anc[i]:
                get(owner(i)).add_cost(e.cost)
        elif (e.cat in _OPS and e.name.startswith("aten::") and not sub_f[i] and not f_anc[i]
              and not _aten_anc(host, par, i)):
            get(owner(i)).nof += 1

    mods = sorted(labels)  # host order: parents before children on each thread
    mparent = {m: (module_of[par[m]] if par[m] >= 0 else -1) for m in mods}
    copy_in = dict.fromkeys(mods, 0.0)
    for c in range(n):
        if is_copy[c] and copy_of[c] == c:
            m = module_of[c]
            while m >= 0:
                copy_in[m] += host[c].dur
                m = mparent[m]
    cpu_incl = {m: host[m].dur - copy_in[m] for m in mods}
    fwd = {m: get(("fwd", m)) for m in mods}
    bwd = {m: acc.get(("bwd", m)) for m in mods}
    self_fig = {}
    for m in mods:  # self figures before the roll-up
        f, b = fwd[m], bwd[m]
        self_fig[m] = (f.gpu, b.cpu if b else 0.0, b.gpu if b else 0.0)
    child_cpu = dict.fromkeys(mods, 0.0)
    for m in reversed(mods):
        pm = mparent[m]
        if pm < 0:
            continue
        child_cpu[pm] += cpu_incl[m]
        fwd[pm].merge(fwd[m])
        if bwd[m] is not None:
            pb = bwd[pm] or get(("bwd", pm))
            bwd[pm] = pb
            pb.merge(bwd[m])
            pb.cpu += bwd[m].cpu
    fqn, depth, call_index, counts = {}, {}, {}, {}
    for m in mods:
        pm = mparent[m]
        lab = labels[m]
        if class_map and lab in class_map:
            fqn[m] = class_map[lab]
        elif source == "nn.Module" and pm >= 0:
            fqn[m] = f"{fqn[pm]}.{lab}"
        else:
            fqn[m] = lab
        depth[m] = depth[pm] + 1 if pm >= 0 else 0
    for m in sorted(mods, key=lambda m: host[m].ts):
        k = (step_of[m], fqn[m])
        call_index[m] = counts.get(k, 0)
        counts[k] = call_index[m] + 1

    out = []
    src = source or "unattributed"
    for m in mods:
        e = host[m]
        base = dict(step=step_of[m], fqn=fqn[m], source=src, call_index=call_index[m],
                    depth=depth[m], parent_fqn=fqn[mparent[m]] if mparent[m] >= 0 else None,
                    module_label=labels[m], pid=e.pid, tid=e.tid, ts_us=e.ts, dur_us=e.dur,
                    ev_index=e.idx)
        out.append(_row(base, "fwd", fwd[m], cpu_incl[m], cpu_incl[m] - child_cpu[m],
                        self_fig[m][0], device_name, with_shapes))
        b = bwd[m]
        if b is not None and (b.cpu or b.kernels or b.flops):
            out.append(_row(base, "bwd", b, b.cpu, self_fig[m][1], self_fig[m][2], device_name,
                            with_shapes))
    steps = sorted({s for s, _, _ in forest.steps}) or [-1]
    for kind, fq, phase in (("ufwd", UNATTRIBUTED, "fwd"), ("ubwd", UNATTRIBUTED, "bwd"),
                            ("ovh", OVERHEAD, "fwd")):
        for s in sorted({k[1] for k in acc if k[0] == kind} | (set(steps) if kind == "ufwd" else set())):
            a = acc.get((kind, s)) or _Acc()
            base = dict(step=s, fqn=fq, source="cbtrace" if kind == "ovh" else "unattributed",
                        call_index=0, depth=-1, parent_fqn=None, module_label=None, pid=-1, tid=-1,
                        ts_us=math.nan, dur_us=math.nan, ev_index=-1)
            out.append(_row(base, phase, a, a.cpu, a.cpu, a.gpu, device_name, with_shapes))
    return out


def _aten_anc(host, par, i) -> bool:
    p = par[i]
    while p >= 0:
        if host[p].name.startswith("aten::"):
            return True
        p = par[p]
    return False


def _row(base: dict, phase: str, a: _Acc, cpu_us: float, cpu_self_us: float, gpu_self_us: float,
         device_name, with_shapes) -> dict:
    gpu_ms = a.gpu / 1e3
    dtype = max(a.dtypes, key=a.dtypes.get) if a.dtypes else None
    pf, pb = peak_of(device_name, dtype)
    nan = math.nan
    flops = a.flops if with_shapes else nan
    return dict(base, phase=phase, cpu_ms=cpu_us / 1e3, cpu_self_ms=cpu_self_us / 1e3,
                gpu_ms=gpu_ms, gpu_self_ms=gpu_self_us / 1e3,
                gpu_span_ms=(a.last - a.first) / 1e3 if a.kernels else 0.0,
                kernel_count=a.kernels, flops=flops,
                flops_executed=a.flops_x if with_shapes else nan,
                bytes=a.bytes if with_shapes else nan, ops_without_formula=a.nof,
                compute_dtype=dtype,
                mfu=utilization(flops, gpu_ms, pf) if a.kernels else nan,
                mbu=utilization(a.bytes, gpu_ms, pb) if a.kernels and with_shapes else nan)
