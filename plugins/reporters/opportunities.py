"""The PT2 opportunity ranking: which modules a step would save most on, compiled or graphed.

Per module (fqn), its calls summed: what eager costs the step (``eager_step_ms``), what the
compiled and the graphed call would cost (``replay.modes.opportunity.mode_costs``), the saving in
each call's best mode placed in the step, whose host runs ahead of its device
(``opportunity_ms``), the speedup, the best mode, compile time and graphs. A parent's saving contains its children's (compiling the parent compiles them), so
the last line sets the sums over the root's children and over the leaves beside the root's own.
"""
from __future__ import annotations

from cbtrace.plugins.reporters import fmt
from cbtrace.plugins.reporters.icicle_tree import record_rows
from cbtrace.replay.modes.opportunity import mode_costs

HEADER = ("#", "module", "type", "calls", "eager", "compile", "cudagraph", "saving", "speedup",
          "best", "compile s", "graphs")
MODES = ("compile", "cudagraph")


def has_opportunities(rows: list[dict]) -> bool:
    """Whether any call was replayed in another mode (its best mode is known)."""
    return any(r.get("best_mode") for r in rows)


def _mode_sum(calls: list[dict], mode: str):
    """A mode's summed step cost over a module's calls: ms, "error" if a call failed in it,
    None if it was not measured."""
    status = [c.get(f"{mode}_status") for c in calls]
    if all(s is None for s in status):
        return None
    if any(s is not None and s.startswith("error") for s in status):
        return "error"
    costs = [mode_costs(c).get(mode) for c in calls]
    return sum(costs) if all(v is not None for v in costs) else None


def module_opportunities(rows: list[dict]) -> list[dict]:
    """One dict per module (fqn) with a best mode, largest saving first: fqn, type, calls,
    eager_ms, compile, cudagraph (ms, "error" or None), opportunity_ms, speedup, best,
    compile_s, compile_graphs."""
    by_fqn: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("best_mode"):
            by_fqn.setdefault(r.get("fqn") or "", []).append(r)
    out = []
    for fqn, calls in by_fqn.items():
        eager = sum(c["eager_step_ms"] for c in calls)
        saving = sum(c.get("opportunity_ms") or 0.0 for c in calls)
        best = sorted({c["best_mode"] for c in calls}, key=("eager", *MODES).index)
        out.append(dict(
            fqn=fqn, type=calls[0].get("module_type"), calls=len(calls), eager_ms=eager,
            compile=_mode_sum(calls, "compile"), cudagraph=_mode_sum(calls, "cudagraph"),
            opportunity_ms=saving, speedup=eager / (eager - saving) if eager > saving else None,
            best="/".join(best),
            compile_s=_sum(c.get("compile_s") for c in calls),
            compile_graphs=_sum(c.get("compile_graphs") for c in calls)))
    return sorted(out, key=lambda m: -m["opportunity_ms"])


def _sum(values):
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None


def overlap(rows: list[dict]) -> dict:
    """Summed opportunity_ms over the roots' children, over the leaves, and of the roots."""
    ids = {r["call_id"] for r in rows}
    roots = {r["call_id"] for r in rows if r.get("parent_call_id") not in ids}
    parents = {r.get("parent_call_id") for r in rows}

    def total(keep) -> float:
        return sum(r.get("opportunity_ms") or 0.0 for r in rows if keep(r))

    return dict(children=total(lambda r: r.get("parent_call_id") in roots),
                leaves=total(lambda r: r["call_id"] not in parents),
                root=total(lambda r: r["call_id"] in roots))


def _cell(v) -> str:
    return fmt.text(v) if isinstance(v, str) or v is None else fmt.ms(v)


def _table(rows: list[tuple], left=frozenset({1, 2, 9})) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def skipped(rows: list[dict]) -> list[str]:
    """A line per mode that skipped calls (past --modes-budget-s), with the first reason."""
    lines = []
    for mode in MODES:
        why = [r[f"{mode}_status"] for r in rows
               if (r.get(f"{mode}_status") or "").startswith("skipped")]
        if why:
            lines.append(f"  {mode} skipped on {len(why)} of {len(rows)} calls: "
                         f"{why[0].removeprefix('skipped: ')}")
    return lines


def modes_note(df) -> str:
    """The skipped lines of a replay's modes ("" when none was skipped)."""
    return "\n".join(skipped(record_rows(df)))


def failures(rows: list[dict], first: int = 3) -> list[str]:
    """Lines naming the first calls a mode failed on, and why; then the skipped calls."""
    lines = skipped(rows)
    for mode in MODES:
        bad = [r for r in rows if (r.get(f"{mode}_status") or "").startswith("error")]
        for r in bad[:first]:
            lines.append(f"  {mode} failed: {r.get('fqn') or '(root)'}: {r[f'{mode}_status']}")
        if len(bad) > first:
            lines.append(f"  ... {len(bad) - first} more {mode} failures "
                         f"(modules.parquet: {mode}_status)")
    return lines


def opportunity_table(df, *, top: int = 20) -> str:
    """Text ranking of the ``top`` modules by saving per step, and the overlap line."""
    rows = record_rows(df)
    if not has_opportunities(rows):
        return ("no compile or cudagraph figures in this run: replay it with "
                "`cbtrace replay RUN --modes compile,cudagraph`")
    ranked = module_opportunities(rows)
    body = [HEADER] + [
        (i + 1, m["fqn"] or "(root)", m["type"] or "-", m["calls"], fmt.ms(m["eager_ms"]),
         _cell(m["compile"]), _cell(m["cudagraph"]), fmt.ms(m["opportunity_ms"]),
         "-" if m["speedup"] is None else f"{m['speedup']:.2f}x", m["best"],
         "-" if m["compile_s"] is None else f"{m['compile_s']:.1f}",
         fmt.count(m["compile_graphs"]))
        for i, m in enumerate(ranked[:top])]
    o = overlap(rows)
    title = (f"Top {min(top, len(ranked))} of {len(ranked)} modules by saving per step "
             "(eager = max(device, host issue); compile = max(compiled device time, its host "
             "issue); cudagraph = one-call graph replay, launch included; saving = what the "
             "step loses, its host running ahead of its device; calls summed)")
    tail = (f"saving summed over the root's children {fmt.ms(o['children'])}, over the leaves "
            f"{fmt.ms(o['leaves'])}; the root's own {fmt.ms(o['root'])}. A parent's saving "
            "contains its children's: levels overlap, do not add them.")
    return "\n".join([title, _table(body), tail, *failures(rows)])


REL_TOL, ABS_TOL_MS = 0.15, 0.1  # how far an estimate may miss the measured saving and still hold


def within(estimated: float, measured: float) -> bool:
    """Whether an estimated saving is within 15 % (or 0.1 ms) of the measured one."""
    return abs(estimated - measured) <= max(REL_TOL * abs(measured), ABS_TOL_MS)


def verified_table(checked, types: dict | None = None) -> str:
    """Estimated vs measured saving per module compiled in place (``opportunity.InPlace``
    rows), and how many are within the bound."""
    types = types or {}

    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    body = [("module", "type", "estimated", "measured", "+-", "error", "error %", "eager step",
             "compiled step", "compile s", "within")]
    for r in checked:
        m, e = r.measured_ms, r.error_ms
        pct = None if e is None or not m else 100 * e / abs(m)
        ok = "-" if e is None else ("yes" if within(r.estimated_ms, m) else "no")
        body.append((r.fqn or "(root)", types.get(r.fqn) or "-", fmt.ms(r.estimated_ms),
                     fmt.ms(m), fmt.ms(r.noise_ms), fmt.ms(e), f(pct, "+.1f"),
                     fmt.ms(r.eager_ms),
                     fmt.ms(r.compiled_ms), f(r.compile_s, ".1f"),
                     ok if r.status == "ok" else r.status[:80]))
    done = [r for r in checked if r.error_ms is not None]
    good = sum(within(r.estimated_ms, r.measured_ms) for r in done)
    title = ("Compiled in place: the whole step eager and with each module compiled (windows of "
             "K steps back to back, eager and compiled in turn, medians; +-: half the p10..p90 "
             "of the paired savings); saving = eager step - compiled step")
    tail = (f"within {REL_TOL:.0%} or {ABS_TOL_MS} ms of the measured saving: {good} of "
            f"{len(done)} modules ({len(checked) - len(done)} not measured)")
    return "\n".join([title, _table(body, left={0, 1, 10}), tail])
