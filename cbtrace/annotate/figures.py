"""Per-module figures for trace slices: which slice is which module call, and its numbers.

Two sources, both optional:
- ``modules``: the run's modules.parquet (isolated replay figures), keyed by (fqn, call_index);
- ``insitu``: the attribution table (one row per trace slice), keyed by the slice's
  (pid, tid, ts in ns) -- the identity attribution reports for every slice.
"""
from __future__ import annotations

import math
import re

from cbtrace.cost.metrics import binding_utilisation

# Args written on each module slice (omitted when unknown).
FIGURE_KEYS = ("fqn", "call_index", "module_type", "isolated_ms", "insitu_ms", "error_pct",
               "flops", "mfu", "hfu", "mbu", "bound", "peak_mem_bytes", "status")
# Colour buckets (trace-format colour names, `cname`) by utilisation: first whose floor is met.
BUCKETS = ((0.6, "good"), (0.3, "olive"), (0.1, "yellow"), (0.03, "bad"), (0.0, "terrible"))
NO_FIGURE_CNAME = "grey"
# How ``colour`` picks its metric, for the trace's metadata.
COLOUR_METRIC = "mfu, or mbu for modules with no FLOPs, memory-bound ones, or ones with mbu > mfu"
CBTRACE_PREFIX = "cbtrace::"
NN_MODULE_PREFIX = "nn.Module: "
_INSTANCE = re.compile(r"_\d+$")


def clean(v):
    """None for NaN/None, plain Python numbers otherwise (numpy scalars -> int/float)."""
    if v is None:
        return None
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def colour(mfu, mbu, flops, bound=None) -> tuple[str | None, str]:
    """(metric used, cname): the utilisation that binds the module (``binding_utilisation``,
    the icicle's rule too), bucketed."""
    has_flops = bool(flops) and not (isinstance(flops, float) and math.isnan(flops))
    metric, value = binding_utilisation(mfu, mbu, has_flops, bound)
    if metric is None:
        return None, NO_FIGURE_CNAME
    return metric, next(c for floor, c in BUCKETS if value >= floor)


def slice_key(pid, tid, ts_us) -> tuple[str, str, int]:
    return (str(pid), str(tid), round(float(ts_us) * 1000))


def _rows(df) -> list[dict]:
    if df is None or len(df) == 0:
        return []
    return [{k: clean(v) for k, v in r.items()} for r in df.to_dict("records")]


class Figures:
    """Looks up the figures of a module slice."""

    def __init__(self, modules=None, insitu=None, own_trace: bool = False):
        self.own_trace = own_trace  # the trace is the run's own capture trace
        self.calls = {(r["fqn"], int(r["call_index"])): r for r in _rows(modules)}
        self.slices, self.bwd = {}, {}
        for r in _rows(insitu):
            if r.get("fqn") is not None and r.get("ts_us") is not None:
                into = self.bwd if r.get("phase") == "bwd" else self.slices
                into.setdefault(slice_key(r.get("pid"), r.get("tid"), r["ts_us"]), r)
        self.parents = {r.get("parent_fqn") for r in self.calls.values()}
        self.parents |= {r.get("parent_fqn") for r in self.slices.values()}

    def is_leaf(self, fqn: str) -> bool:
        return fqn not in self.parents

    def insitu_row(self, ev: dict, table=None) -> dict | None:
        key = slice_key(ev.get("pid"), ev.get("tid"), ev.get("ts", 0))
        return (self.slices if table is None else table).get(key)

    def figures(self, ev: dict, fqn: str | None, call_index: int | None) -> dict:
        """Args for one slice; ``fqn``/``call_index`` are the guesses from its name and order."""
        ins = self.insitu_row(ev)
        if ins is not None:
            fqn = ins.get("fqn", fqn)
            call_index = ins.get("call_index", call_index)
        out = {"fqn": fqn, "call_index": call_index}
        name = ev.get("name", "")
        if name.startswith(NN_MODULE_PREFIX):
            out["module_type"] = _INSTANCE.sub("", name[len(NN_MODULE_PREFIX):])
        run = self.calls.get((fqn, call_index)) if call_index is not None else None
        if run is not None:
            out.update({k: run.get(k) for k in FIGURE_KEYS if k not in out or out[k] is None})
            if not self.own_trace:
                out["insitu_ms"] = out["error_pct"] = None
        if ins is not None:
            out["insitu_ms"] = _insitu_ms(ins)
            for k in ("flops", "mfu", "mbu"):
                if out.get(k) is None:
                    out[k] = ins.get(k)
            if run is not None and ins.get("mfu") is not None:
                out["insitu_mfu"] = ins["mfu"]
            if (bwd := self.insitu_row(ev, self.bwd)) is not None:
                out["insitu_bwd_ms"] = _insitu_ms(bwd)  # the module's backward, in situ
        if out.get("insitu_ms") is None and isinstance(ev.get("dur"), (int, float)):
            out["insitu_ms"] = ev["dur"] / 1000.0  # the slice's own (host) duration
        iso, insitu = out.get("isolated_ms"), out.get("insitu_ms")
        if out.get("error_pct") is None and iso is not None and insitu:
            out["error_pct"] = 100.0 * (iso / insitu - 1.0)
        out["bytes"] = (run or {}).get("bytes", (ins or {}).get("bytes"))
        return {k: v for k, v in out.items() if v is not None}


def _insitu_ms(row: dict) -> float | None:
    """Device span when the slice launched device work, else host time (as insitu_for_run)."""
    gpu = row.get("gpu_span_ms")
    return gpu if gpu else row.get("insitu_ms", row.get("cpu_ms"))


class SliceAnnotator:
    """``on_event`` for the streaming rewrite: adds figures to module slices, keeps counters."""

    def __init__(self, figures: Figures):
        self.fig = figures
        self.steps: list[tuple[object, float, float, int]] = []  # (pid, start, end, step)
        self.counts: dict[tuple, int] = {}
        self.slices: dict[str, list[dict]] = {"cbtrace": [], "nn.Module": []}
        self.first_ts: float | None = None

    def _step(self, ev) -> int:
        ts = ev.get("ts", 0)
        for pid, a, b, n in reversed(self.steps):
            if pid == ev.get("pid") and a <= ts <= b:
                return n
        return -1

    def __call__(self, ev: dict) -> dict | None:
        name = ev.get("name")
        if ev.get("ph") != "X" or not isinstance(name, str):
            return None
        if name.startswith("ProfilerStep#") and isinstance(ev.get("dur"), (int, float)):
            n = int(name[13:]) if name[13:].isdigit() else len(self.steps)
            self.steps.append((ev.get("pid"), ev["ts"], ev["ts"] + ev["dur"], n))
            return None
        if name.startswith(CBTRACE_PREFIX):
            kind, fqn = "cbtrace", name[len(CBTRACE_PREFIX):]
            key = (ev.get("cat"), ev.get("pid"), fqn, self._step(ev))
            ci = self.counts.get(key, 0)
            self.counts[key] = ci + 1
        elif name.startswith(NN_MODULE_PREFIX):
            kind, fqn, ci = "nn.Module", None, None
        else:
            return None
        figs = self.fig.figures(ev, fqn, ci)
        ev.setdefault("args", {}).update({k: v for k, v in figs.items() if k != "bytes"})
        self._remember(kind, ev, figs)
        return ev

    def _remember(self, kind, ev, figs) -> None:
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)):
            return
        self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
        if ev.get("cat") == "gpu_user_annotation":
            return  # the same call's device-side range: counted once, on the host slice
        self.slices[kind].append({"ts": ts, "dur": ev.get("dur", 0), "pid": ev.get("pid"),
                                  "tid": ev.get("tid"), "name": ev.get("name"), "args": figs})

    def module_slices(self) -> list[dict]:
        """The slices of one kind: cbtrace ranges win over nn.Module events."""
        return self.slices["cbtrace"] or self.slices["nn.Module"]
