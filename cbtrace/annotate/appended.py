"""Events appended to an annotated trace: the ``cbtrace`` process (isolated replay laid out like
the module tree, one track per depth), counter tracks, and the run's metadata.

All events are Chrome-trace dicts (``ph`` X / C / M): the JSON and .pftrace writers share them.
Their X events nest in integer nanoseconds as Perfetto reads them (``perfetto_ns``,
``nest_in_ns``): Perfetto drops a complete event that overlaps a sibling by even 1 ns.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict

from cbtrace.annotate.figures import (BUCKETS, COLOUR_METRIC, FIGURE_KEYS, NO_FIGURE_CNAME, clean,
                                      colour)
from cbtrace.calltree import CallTree

PID = "cbtrace"
META_TID = 0          # the "run" track: one slice carrying the metadata as args
COUNTER = "achieved"  # counter tracks: "achieved TFLOP/s", "achieved GB/s"
INSITU_TID0 = 100     # tracks holding the in-situ module slices (one per source thread)


def metadata(source: str, version: str, *, device: str | None = None, run_id: str | None = None,
             peaks: dict | None = None) -> dict:
    """Trace-level metadata: device, peaks used, cbtrace version, run id, colour buckets."""
    out = {"cbtrace_version": version, "source_trace": source, "run_id": run_id,
           "device": device, "peaks": peaks,
           "colour_metric": COLOUR_METRIC,
           "colour_buckets": [{"min": f, "cname": c} for f, c in BUCKETS] +
                             [{"min": None, "cname": NO_FIGURE_CNAME}]}
    return {k: v for k, v in out.items() if v is not None}


def _names(depths: int, label: str) -> list[dict]:
    ev = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": label}},
          {"ph": "M", "name": "process_sort_index", "pid": PID, "tid": 0,
           "args": {"sort_index": -1}},
          {"ph": "M", "name": "thread_name", "pid": PID, "tid": META_TID,
           "args": {"name": "run"}}]
    for d in range(depths):
        ev.append({"ph": "M", "name": "thread_name", "pid": PID, "tid": d + 1,
                   "args": {"name": f"isolated depth {d}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": d + 1,
                   "args": {"sort_index": d + 1}})
    return ev


def isolated_layout(rows: list[dict], t0: float) -> list[dict]:
    """X events: each call at its parent's start + its earlier siblings' widths, dur = isolated.

    A node's width is max(its isolated time, its children's widths), so slices on one depth
    track never overlap even when children add up to more than their parent.
    """
    by_id = {int(r["call_id"]): r for r in rows}
    tree = CallTree({c: int(r.get("parent_call_id", -1)) for c, r in by_id.items()})
    width: dict[int, float] = {}
    for c in tree.post_order:
        own = (by_id[c].get("isolated_ms") or 0.0) * 1000.0
        width[c] = max(own, sum(width[k] for k in tree.children[c]))
    start = dict(zip(tree.roots, _side_by_side(t0, [width[c] for c in tree.roots])))
    out: list[dict] = []
    for c in tree.pre_order:
        kids = tree.children[c]
        start.update(zip(kids, _side_by_side(start[c], [width[k] for k in kids])))
        out.append(_isolated_slice(by_id[c], start[c], width[c]))
    return out


def _side_by_side(ts: float, widths: list[float]) -> list[float]:
    """Start times of slices laid end to end from ``ts``."""
    out = []
    for w in widths:
        out.append(ts)
        ts += w
    return out


def _isolated_slice(r: dict, ts: float, width: float) -> dict:
    iso = r.get("isolated_ms")
    metric, cname = colour(r.get("mfu"), r.get("mbu"), r.get("flops"), r.get("bound"))
    args = {k: r.get(k) for k in FIGURE_KEYS if r.get(k) is not None}
    args["colour_metric"] = metric or "none"
    return {"ph": "X", "pid": PID, "tid": int(r.get("depth", 0)) + 1,
            "name": r["fqn"] or "<root>", "cat": "cbtrace_isolated", "ts": ts,
            "dur": iso * 1000.0 if iso is not None else width, "cname": cname, "args": args}


def counters(slices: list[dict], is_leaf) -> list[dict]:
    """Counter events along the step: achieved TFLOP/s and GB/s of the leaf module slices.

    One event carries both series, so viewers show the tracks "achieved TFLOP/s" and
    "achieved GB/s"; each leaf raises them at its start and drops them to 0 at its end.
    """
    out = []
    for s in sorted(slices, key=lambda s: s["ts"]):
        a = s["args"]
        fqn, ms = a.get("fqn"), a.get("insitu_ms")
        if fqn is None or not ms or not is_leaf(fqn):
            continue
        if a.get("flops") is None and a.get("bytes") is None:
            continue
        rates = {"TFLOP/s": float(a.get("flops") or 0) / (ms * 1e-3) / 1e12,
                 "GB/s": float(a.get("bytes") or 0) / (ms * 1e-3) / 1e9}
        end = s["ts"] + (s["dur"] or ms * 1000.0)
        out.append({"ph": "C", "pid": PID, "name": COUNTER, "ts": s["ts"], "args": rates})
        out.append({"ph": "C", "pid": PID, "name": COUNTER, "ts": end,
                    "args": {k: 0.0 for k in rates}})
    return out


def insitu_copy(slices: list[dict]) -> tuple[list[dict], list[dict]]:
    """(thread names, X events): the module slices again, on cbtrace tracks of their own.

    Perfetto drops a JSON slice that overlaps a sibling on its thread without nesting, which
    happens to ``cbtrace::`` ranges opened inside hook python_function slices; this copy
    (named by fqn, coloured like the isolated tracks) always shows.
    """
    tids: dict[tuple, int] = {}
    events = []
    for s in slices:
        tid = tids.setdefault((s["pid"], s["tid"]), INSITU_TID0 + len(tids))
        a = s["args"]
        metric, cname = colour(a.get("mfu"), a.get("mbu"), a.get("flops"), a.get("bound"))
        events.append({"ph": "X", "pid": PID, "tid": tid, "cat": "cbtrace_insitu",
                       "name": _label(a.get("fqn"), s["name"]), "ts": s["ts"], "dur": s["dur"],
                       "cname": cname, "args": {**a, "colour_metric": metric or "none"}})
    names = [{"ph": "M", "name": "thread_name", "pid": PID, "tid": t,
              "args": {"name": f"in situ (pid {p} tid {q})"}} for (p, q), t in tids.items()]
    return names, events


def appended_events(*, rows: list[dict], slices: list[dict], is_leaf, t0: float | None,
                    meta: dict) -> list[dict]:
    """Everything appended to traceEvents: names, metadata slice, isolated layout, counters."""
    t0 = t0 or 0.0
    layout = isolated_layout(rows, t0) if rows else []
    depths = 1 + max((e["tid"] for e in layout), default=0)
    span = max((e["ts"] + e["dur"] for e in layout), default=t0 + 1.0) - t0
    run = {"ph": "X", "pid": PID, "tid": META_TID, "cat": "cbtrace_meta", "ts": t0,
           "dur": max(span, 1.0), "name": f"cbtrace run {meta.get('run_id', '')}".strip(),
           "args": {k: _flat(v) for k, v in meta.items()}}
    names, copy = insitu_copy(slices)
    return _names(depths - 1, "cbtrace") + names + nest_in_ns([run] + layout + copy) + \
        counters(slices, is_leaf)


def perfetto_ns(us) -> int:
    """A JSON ts or dur (µs) as Perfetto's JSON importer stores it: an integer ×1000, a float
    ``llround(us * 1000.0)`` (trace_processor importers/json/json_utils CoerceToTs)."""
    if isinstance(us, int):
        return us * 1000
    x = float(us) * 1000.0
    r = math.floor(abs(x))
    r += abs(x) - r >= 0.5  # llround: halves away from zero
    return int(math.copysign(r, x))


def nest_in_ns(events: list[dict]) -> list[dict]:
    """X events, their ``dur`` trimmed by a nanosecond or two where, in Perfetto's integer ns
    (``perfetto_ns``), one would overlap another on its track without nesting: a slice that
    starts inside another and ends after it is either a child running over (it is cut at the
    parent's end) or a sibling that started early (the earlier one is cut at its start),
    whichever overlap is smaller. Events are changed in place; the list is returned."""
    tracks = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)):
            start = perfetto_ns(e["ts"])
            end = start + max(perfetto_ns(e.get("dur") or 0), 0)
            tracks[(e.get("pid"), e.get("tid"))].append([start, end, e])
    for spans in tracks.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list = []
        for span in spans:
            start, end = span[0], span[1]
            while stack and stack[-1][1] <= start:
                stack.pop()
            while stack and end > stack[-1][1]:  # overlaps the innermost open slice
                top = stack[-1]
                if top[1] - start <= end - top[1]:
                    top[1] = start  # a sibling that started early: the earlier one ends here
                    _set_dur(top)
                    stack.pop()
                else:
                    span[1] = end = top[1]  # a child running over: cut at its parent's end
                    _set_dur(span)
            stack.append(span)
    return events


def _set_dur(span: list) -> None:
    """``dur`` (µs) whose Perfetto ns is exactly end - start (small values round-trip)."""
    ns = span[1] - span[0]
    span[2]["dur"] = ns / 1000.0
    assert perfetto_ns(span[2]["dur"]) == ns


def _flat(v):
    """Nested metadata as a JSON string: trace viewers show scalar args best."""
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else clean(v)


def _label(fqn, name: str) -> str:
    return name if fqn is None else (fqn or "<root>")
