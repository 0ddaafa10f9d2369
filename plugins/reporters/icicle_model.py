"""The JSON model behind every icicle view (HTML, SVG, TensorBoard tab).

All layout, colours and number formatting happen here, once, in Python; the browser code
only maps [x0, x1] to pixels, zooms, searches and sorts. Built from a modules DataFrame
(columns of ``cbtrace.schema.modules.ModuleRecord``; any may be missing or null).
"""
from __future__ import annotations

from cbtrace.plugins.reporters import fmt, palette
from cbtrace.plugins.reporters.icicle_tree import (available_modes, build_tree, layout, own_value,
                                            preorder, record_rows, values)

MODE_LABELS = {"isolated": "isolated", "insitu": "in-situ", "calls": "calls"}
MODE_NOTES = {
    "isolated": "Width = isolated time (each module replayed standalone); "
                "(self) = a parent's own kernels.",
    "insitu": "Width = in-situ time (measured inside the captured step).",
    "calls": "Width = number of captured calls in each subtree: this run has no timings "
             "(captured but not replayed, or timings not joined).",
}
# (header, record field, formatter) of the table under the chart
COLUMNS = [
    ("module", "fqn", lambda v: v if v else "(root)"),
    ("type", "module_type", fmt.text),
    ("call", "call_index", fmt.count),
    ("isolated", "isolated_ms", fmt.ms),
    ("in-situ", "insitu_ms", fmt.ms),
    ("error", "error_pct", lambda v: fmt.pct(v, fraction=False)),
    ("self", "residual_ms", fmt.ms),
    ("FLOPs", "flops", fmt.flops),
    ("bytes", "bytes", fmt.nbytes),
    ("MFU", "mfu", fmt.pct),
    ("MBU", "mbu", fmt.pct),
    ("bound", "bound", fmt.text),
    ("kernels", "kernel_count", fmt.count),
    ("peak mem", "peak_mem_bytes", fmt.nbytes),
    ("status", "status", fmt.text),
]


ALWAYS = {"module", "type", "status", "isolated", "in-situ", "MFU", "MBU", "bound"}
# columns and a colour scheme a run has only when it was replayed with --modes
SPEEDUP_COLUMNS = [
    ("speedup", "speedup", lambda v: fmt.MISSING if v is None else f"{v:.2f}x"),
    ("saving", "opportunity_ms", fmt.ms),
    ("best", "best_mode", fmt.text),
]
SCHEMES = [["metric", "MFU / MBU"], ["bound", "bound"]]
SPEEDUP_SCHEME = ["speedup", "speedup"]


def has_speedups(rows: list[dict]) -> bool:
    """Whether any call has a speedup figure (a replay with --modes)."""
    return any(r.get("speedup") is not None for r in rows)


def _mode_text(ms, status) -> str:
    """A mode's time when it ran ok, else its status ("error: ...", "unavailable: ...")."""
    return fmt.ms(ms) if status == "ok" else fmt.text(status)


def _mode_lines(r: dict) -> list[tuple[str, str]]:
    """Tooltip lines of the other modes (all missing, so left out, without --modes)."""
    compile_s = r.get("compile_s")
    graphs = r.get("compile_graphs")
    took = fmt.MISSING if compile_s is None else (
        f"{compile_s:.2f} s" + ("" if graphs is None else f", {fmt.count(graphs)} graph(s)"))
    speedup = r.get("speedup")
    return [
        ("eager step", fmt.ms(r.get("eager_step_ms"))),
        ("compiled", _mode_text(r.get("compile_ms"), r.get("compile_status"))),
        ("compile time", took),
        ("CUDA graph", _mode_text(r.get("cudagraph_ms"), r.get("cudagraph_status"))),
        ("best mode", fmt.text(r.get("best_mode"))),
        ("speedup", fmt.MISSING if speedup is None else f"{speedup:.2f}x"),
        ("saving per step", fmt.ms(r.get("opportunity_ms"))),
    ]


def _num(v):
    """Floats rounded to 6 significant digits (enough to sort on; keeps the page small)."""
    return float(f"{v:.6g}") if isinstance(v, float) else v


def _tooltip(r: dict) -> list[list[str]]:
    """Every figure of one module call, as [label, text] lines (missing extras left out)."""
    iso = fmt.ms(r.get("isolated_ms"))
    if r.get("isolated_ms_p10") is not None and r.get("isolated_ms_p90") is not None:
        iso += f"  (p10 {fmt.ms(r['isolated_ms_p10'])}, p90 {fmt.ms(r['isolated_ms_p90'])})"
    status = fmt.text(r.get("status"))
    if r.get("status_reason"):
        status += f": {r['status_reason']}"
    if r.get("aggregated"):
        status += " (aggregated from children)"
    lines = [
        ("module", r.get("fqn") or "(root)"),
        ("type", fmt.text(r.get("module_class") or r.get("module_type"))),
        ("call", f"#{fmt.count(r.get('call_index'))}  (call id {fmt.count(r.get('call_id'))})"),
        ("status", status),
        ("isolated", iso),
        ("in-situ", fmt.ms(r.get("insitu_ms"))),
        ("isolation error", fmt.pct(r.get("error_pct"), fraction=False)),
        ("self (own kernels)", fmt.ms(r.get("residual_ms"))),
        ("FLOPs", fmt.flops(r.get("flops"))),
        ("FLOPs executed", fmt.flops(r.get("flops_executed"))),
        ("bytes moved", fmt.nbytes(r.get("bytes"))),
        ("MFU", fmt.pct(r.get("mfu"))),
        ("HFU", fmt.pct(r.get("hfu"))),
        ("MBU", fmt.pct(r.get("mbu"))),
        ("bound", fmt.text(r.get("bound"))),
        ("kernels per call", fmt.count(r.get("kernel_count"))),
        ("launch overhead", fmt.ms(r.get("launch_overhead_ms"))),
        ("peak memory", fmt.nbytes(r.get("peak_mem_bytes"))),
        ("parameters", fmt.nbytes(r.get("param_bytes"))),
        ("inputs", fmt.text(r.get("input_shapes"))),
        ("timer", fmt.text(r.get("timer"))),
        ("compute dtype", fmt.text(r.get("compute_dtype"))),
        *_mode_lines(r),
    ]
    return [list(x) for x in lines if x[0] in ALWAYS or x[1] != fmt.MISSING]


def _value_text(v: float, mode: str) -> str:
    if mode == "calls":
        return "1 call" if v == 1 else f"{v:,.0f} calls"
    return fmt.ms(v)


def _colors(node: dict, speedup: bool = False) -> tuple[dict, dict, str, str]:
    """({scheme: bg}, {scheme: fg}, metric label, speedup label) of a node; the speedup
    scheme only when the run has speedups."""
    r = node["row"]
    schemes = ["metric", "bound"] + (["speedup"] if speedup else [])
    if r is None:
        bg = palette.RESIDUAL if node["kind"] == "residual" else palette.NO_FIGURES
        return {s: bg for s in schemes}, {s: "#000000" for s in schemes}, "", ""
    metric, label = palette.metric_color(r.get("mfu"), r.get("mbu"), bool(r.get("flops")),
                                         r.get("bound"))
    bg = {"metric": metric, "bound": palette.bound_color(r.get("bound"))}
    fast = ""
    if speedup:
        bg["speedup"], fast = palette.speedup_color(r.get("speedup"), r.get("best_mode"))
    return bg, {s: palette.text_color(c) for s, c in bg.items()}, label, fast


def _shown(node: dict, vals: dict, mode: str) -> str:
    """The figure printed on a box: the module's own time, else its drawn width."""
    own = own_value(node, mode) if mode != "calls" else None
    return _value_text(own if own is not None else vals[mode][node["id"]], mode)


def _node_json(node: dict, nodes: dict, xs: dict, vals: dict, modes: list[str],
               columns: list, speedup: bool) -> dict:
    bg, fg, label, fast = _colors(node, speedup)
    r = node["row"]
    if r is not None:
        tip = _tooltip(r)
        for m in modes:
            own = own_value(node, m) if m != "calls" else None
            if own is not None and vals[m][node["id"]] > own * 1.001 + 1e-9:
                tip.append(["note", f"its children's {MODE_LABELS[m]} times add up to "
                                    f"{fmt.ms(vals[m][node['id']])}, more than its own; "
                                    "drawn that wide"])
        fqn, typ = r.get("fqn") or "", r.get("module_type") or ""
    else:
        parent = nodes[node["parent"]]["row"] if node["parent"] else None
        owner = (parent or {}).get("fqn") or "(root)"
        what = f"own kernels of {owner}" if node["kind"] == "residual" else "all root calls"
        tip = [[node["name"], what]] + [[MODE_LABELS[m], _value_text(vals[m][node["id"]], m)]
                                        for m in modes]
        fqn, typ = "", ""
    out = {
        "id": node["id"], "p": node["parent"], "d": node["depth"], "k": node["kind"],
        "n": node["name"], "q": fqn, "t": typ,
        "x": {m: [round(a, 7), round(b, 7)] for m in modes for a, b in [xs[m][node["id"]]]},
        "v": {m: _shown(node, vals, m) for m in modes},
        "bg": bg, "fg": fg, "m": label, "tip": tip,
        "cells": None if r is None else [[_num(r.get(f)), f_(r.get(f))] for _, f, f_ in columns],
    }
    if speedup:
        out["s"] = fast  # the box label in the speedup scheme
    return out


def _describe(manifest, fallback: str) -> tuple[str, str]:
    """(title, subtitle) of a run: its model, where it was replayed, torch, when captured."""
    if manifest is None:
        return fallback, ""
    device = (f"replayed on {manifest.replay.device_name}" if manifest.replay is not None
              else manifest.device_name)
    facts = [device, manifest.environment.torch_version, manifest.created]
    if manifest.synthetic_figures:
        facts.append("synthetic figures (test data)")
    return manifest.title, " · ".join(f for f in facts if f)


def build(df, manifest=None, *, name: str = "run") -> dict:
    """The icicle model of a modules DataFrame: nodes with layout per size mode, colours, table.

    ``manifest``: the run's Manifest (title and subtitle), or None (``name`` is the title).
    """
    rows = record_rows(df)
    if not rows:
        raise ValueError(f"{name}: the modules table is empty")
    nodes, root = build_tree(rows)
    modes = available_modes(rows)
    xs = {m: layout(nodes, root, m) for m in modes}
    vals = {m: values(nodes, root, m) for m in modes}
    title, subtitle = _describe(manifest, name)
    order = preorder(nodes, root)
    missing = {m: sum(1 for r in rows if r.get(col) is None)
               for m, col in (("isolated", "isolated_ms"), ("insitu", "insitu_ms"))}
    notes = dict(MODE_NOTES)
    for m, k in missing.items():
        if k and m in modes:
            notes[m] += f" {k} call(s) without a figure are drawn with zero width."
    speedup = has_speedups(rows)
    columns = COLUMNS + (SPEEDUP_COLUMNS if speedup else [])
    legend = {"mfu": list(palette.MFU_SCALE), "mbu": list(palette.MBU_SCALE),
              "bound": palette.BOUND_COLORS, "none": palette.NO_FIGURES,
              "residual": palette.RESIDUAL}
    if speedup:
        legend.update(speedup=list(palette.SPEEDUP_SCALE), speedup_max=palette.SPEEDUP_MAX)
    return {
        "format": "cbtrace-icicle/1",
        "title": title, "subtitle": subtitle, "root": root,
        "modes": modes, "mode_labels": {m: MODE_LABELS[m] for m in modes},
        "notes": {m: notes[m] for m in modes},
        "schemes": SCHEMES + ([SPEEDUP_SCHEME] if speedup else []),
        "columns": [c[0] for c in columns],
        "legend": legend,
        "nodes": [_node_json(nodes[n], nodes, xs, vals, modes, columns, speedup) for n in order],
    }
