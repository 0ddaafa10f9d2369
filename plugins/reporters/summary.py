"""Terminal summary: the modules that take the most time, with MFU / MBU and bound.

Ranked by SELF time (a leaf's own time; a parent's residual, i.e. its own kernels), so the
rows add up to the step and a parent never hides its children. Calls of the same module are
summed; its MFU and MBU are time-weighted means (= total FLOPs / total time / peak).
"""
from __future__ import annotations

from pathlib import Path

from cbtrace.plugins.reporters import fmt
from cbtrace.plugins.reporters.icicle_tree import (TIME_COLUMN, available_modes, build_tree,
                                            record_rows, values)

HEADER = ("#", "module", "type", "calls", "self", "% step", "total", "MFU", "MBU", "bound",
          "error")


def self_times(rows: list[dict], mode: str) -> dict[str, dict]:
    """fqn -> {"self_ms", "total_ms", "calls", "type", "mfu", "mbu", "bound", "error_pct"}."""
    nodes, root = build_tree(rows)
    val = values(nodes, root, mode)
    out: dict[str, dict] = {}
    for r in rows:  # in call order, not the nodes' pre-order: sums and tie ranks as always
        nid = f"c{r['call_id']}"
        own = val.get(f"r{r['call_id']}", val[nid])  # a parent's self time is its residual
        total = r.get(TIME_COLUMN[mode]) or 0.0
        a = out.setdefault(r.get("fqn") or "", {
            "self_ms": 0.0, "total_ms": 0.0, "calls": 0, "type": r.get("module_type"),
            "mfu_t": 0.0, "mbu_t": 0.0, "t_mfu": 0.0, "t_mbu": 0.0, "bounds": [],
            "err_t": 0.0, "t_err": 0.0})
        a["self_ms"] += own
        a["total_ms"] += total
        a["calls"] += 1
        for k in ("mfu", "mbu"):
            if r.get(k) is not None:
                a[f"{k}_t"] += r[k] * total
                a[f"t_{k}"] += total
        if r.get("error_pct") is not None:
            a["err_t"] += r["error_pct"] * total
            a["t_err"] += total
        if r.get("bound"):
            a["bounds"].append(r["bound"])
    for a in out.values():
        a["mfu"] = a["mfu_t"] / a["t_mfu"] if a["t_mfu"] else None
        a["mbu"] = a["mbu_t"] / a["t_mbu"] if a["t_mbu"] else None
        a["error_pct"] = a["err_t"] / a["t_err"] if a["t_err"] else None
        a["bound"] = max(set(a["bounds"]), key=a["bounds"].count) if a["bounds"] else None
    return out


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    left = {1, 2, 9}  # text columns
    lines = []
    for j, r in enumerate(rows):
        cells = [str(c).ljust(w) if i in left else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_table(df, *, top: int = 15) -> str:
    """Text table of the ``top`` modules by self time (isolated, else in-situ)."""
    rows = record_rows(df)
    modes = [m for m in available_modes(rows) if m != "calls"]
    if not modes:
        return (f"{len(rows)} module calls captured; no timings yet "
                "(run `cbtrace replay` or `cbtrace profile` first).")
    mode = modes[0]
    agg = self_times(rows, mode)
    step = sum(a["self_ms"] for a in agg.values()) or 1.0
    ranked = sorted(agg.items(), key=lambda kv: -kv[1]["self_ms"])[:top]
    body = [HEADER] + [
        (i + 1, fqn or "(root)", a["type"] or "-", a["calls"], fmt.ms(a["self_ms"]),
         f"{100 * a['self_ms'] / step:.1f}%", fmt.ms(a["total_ms"]), fmt.pct(a["mfu"]),
         fmt.pct(a["mbu"]), a["bound"] or "-", fmt.pct(a["error_pct"], fraction=False))
        for i, (fqn, a) in enumerate(ranked)]
    title = (f"Top {len(ranked)} of {len(agg)} modules by self time ({mode}; "
             f"step {fmt.ms(step)}; self = own time without children)")
    return title + "\n" + _table(body) + suspect_line(rows)


STATUSES = ("ok", "error", "skipped", "timeout")


def status_text(df, *, first: int = 3) -> str:
    """How the calls ended ("calls: ok 31, error 2, skipped 0, timeout 0"), the first reasons of
    the others, and the flagged calls (noisy timing, NaN/Inf outputs)."""
    counts = df["status"].value_counts().to_dict()
    lines = ["calls: " + ", ".join(f"{s} {counts.get(s, 0)}" for s in STATUSES)]
    bad = df[df["status"] != "ok"]
    for r in bad.head(first).itertuples():
        lines.append(f"  {r.status}: {r.fqn or '(root)'}: {r.status_reason}")
    if len(bad) > first:
        lines.append(f"  ... {len(bad) - first} more (modules.parquet: status, status_reason)")
    for col, what in (("nonfinite_outputs", "outputs hold NaN or Inf"),
                      ("noisy", "timed on a busy machine (noisy)")):
        flagged = df[df[col].fillna(False).astype(bool)] if col in df else df.iloc[:0]
        if len(flagged):
            names = ", ".join((f or "(root)") for f in flagged["fqn"].head(first))
            lines.append(f"flagged: {len(flagged)} call(s) {what}: {names}"
                         f"{' ...' if len(flagged) > first else ''}")
    return "\n".join(lines)


def suspect_line(rows: list[dict]) -> str:
    """A line naming the calls whose MFU, HFU or MBU read above 100 % ("" when none): such a
    figure is a bug in what it divides, printed rather than capped."""
    bad = [r for r in rows if r.get("figures_suspect")]
    if not bad:
        return ""
    names = ", ".join(f"{r.get('fqn') or '(root)'} (MFU {fmt.pct(r.get('mfu'))}, MBU "
                      f"{fmt.pct(r.get('mbu'))})" for r in bad[:5])
    return (f"\nSUSPECT: {len(bad)} call(s) read above 100 % of the device's peak: {names}"
            f"{' ...' if len(bad) > 5 else ''}")


class SummaryReporter:
    """Writes ``out_dir/summary.txt`` (the same table ``cbtrace report`` prints)."""

    filename = "summary.txt"

    def report(self, records, manifest, out_dir) -> list[Path]:
        from cbtrace.rundir.files import atomic_write_bytes
        from cbtrace.schema.modules import records_to_frame

        out = Path(out_dir) / self.filename
        atomic_write_bytes(out, (summary_table(records_to_frame(records)) + "\n").encode())
        return [out]

    def close(self) -> None:
        pass
