"""diff_icicle.html: run B's icicle, coloured by how each call changed against run A.

The icicle model is built from B's records (``icicle_model.build``: widths are B's times); each
node's colours, label and table cells are then replaced from the diff (``workflows/diff.py``).
The page's two colour schemes become "time Δ" and "memory Δ" on one diverging scale: red
slower / more memory, green faster / less, deeper with the ratio (full at 2x); a change the diff
does not count (within the runs' spread, noise or thresholds) stays neutral.
"""
from __future__ import annotations

import math
from pathlib import Path

from cbtrace.plugins.reporters import fmt, icicle_model, palette
from cbtrace.plugins.reporters.icicle import json_for_script, render_html

SLOWER, FASTER, NEUTRAL = "#d73027", "#1a9850", "#f2f2f2"  # ColorBrewer RdYlGn ends
ONLY_B = "#b7a6dc"                                          # a call run A does not have
MIN_SHADE = 0.35  # a counted change is at least this deep, however small
SCHEMES = {"metric": ("time", "isolated_ms"), "bound": ("memory", "peak_mem_bytes")}
FILENAME = "diff_icicle.html"


def _finite(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _pct(rel) -> str:
    if rel is None or (isinstance(rel, float) and math.isnan(rel)):
        return fmt.MISSING
    return "new" if math.isinf(rel) else f"{100 * rel:+.1f}%"


def delta_color(rel: float | None, counted: bool) -> str:
    """The diverging colour of a relative change B / A - 1; neutral unless ``counted``."""
    if rel is None or not counted or rel == 0:
        return NEUTRAL
    t = 1.0 if math.isinf(rel) or rel <= -1 else min(abs(math.log2(1 + rel)), 1.0)
    return palette.lerp_color(NEUTRAL, SLOWER if rel > 0 else FASTER, max(t, MIN_SHADE))


def _scheme(d: dict | None, metric: str, col: str) -> str:
    if d is None or d["match"] == "only_b":
        return ONLY_B
    counted = metric in d["regressed"].split(",") or metric in d["improved"].split(",")
    return delta_color(d[f"{col}_rel"], counted)


# (header, diff column, formatter) of the table under the chart; "isolated" keeps the page's
# default sort (by B's time)
COLUMNS = [
    ("module", "fqn", lambda v: v if v else "(root)"),
    ("type", "module_type", fmt.text),
    ("call", "call_index", fmt.count),
    ("match", "match", fmt.text),
    ("regressed", "regressed", fmt.text),
    ("isolated", "isolated_ms_b", fmt.ms),
    ("A time", "isolated_ms_a", fmt.ms),
    ("Δ time", "isolated_ms_rel", _pct),
    ("peak mem", "peak_mem_bytes_b", fmt.nbytes),
    ("A mem", "peak_mem_bytes_a", fmt.nbytes),
    ("Δ mem", "peak_mem_bytes_rel", _pct),
]


def _label(d: dict) -> str:
    if d["match"] == "only_b":
        return "only in B"
    parts = [] if d["isolated_ms_rel"] is None else [f"{_pct(d['isolated_ms_rel'])}"]
    if "memory" in d["regressed"] or "memory" in d["improved"]:
        parts.append(f"mem {_pct(d['peak_mem_bytes_rel'])}")
    return " · ".join(parts)


def _tip(d: dict) -> list[list[str]]:
    return [["B against A", d["verdict"] + (f" ({d['regressed']})" if d["regressed"] else "")],
            ["matched by", d["match"] + (f" (A: {d['fqn_a'] or '(root)'})"
                                         if d["match"] == "position" else "")],
            ["time A → B", f"{fmt.ms(d['isolated_ms_a'])} → {fmt.ms(d['isolated_ms_b'])} "
                           f"({_pct(d['isolated_ms_rel'])})"],
            ["peak mem A → B", f"{fmt.nbytes(d['peak_mem_bytes_a'])} → "
                               f"{fmt.nbytes(d['peak_mem_bytes_b'])} "
                               f"({_pct(d['peak_mem_bytes_rel'])})"],
            ["work changed", ", ".join(f"{c} {_pct(d[f'{c}_rel'])}"
                                       for c in (d.get("work_changed") or "").split(",") if c)
                             or "none"]]


def _recolour(node: dict, d: dict | None) -> None:
    """A module node's colours, label, tooltip and cells from its diff row (None: B only);
    "(self)" and "(step)" nodes keep the page's colours."""
    if node["k"] != "module":
        return
    for scheme, (metric, col) in SCHEMES.items():
        node["bg"][scheme] = _scheme(d, metric, col)
        node["fg"][scheme] = palette.text_color(node["bg"][scheme])
    if d is None:
        node["m"], node["cells"] = "only in B", None
        return
    node["m"] = _label(d)
    node["tip"] = _tip(d) + node["tip"]
    node["cells"] = [
        [_finite(d[c]) if isinstance(d[c], float) else d[c], f(d[c])] for _, c, f in COLUMNS]


def diff_model(diff, df_b, manifest_b=None, *, name_a: str = "A", name_b: str = "B") -> dict:
    """The icicle model of run B (``icicle_model.build``) recoloured by the diff frame."""
    data = icicle_model.build(df_b, manifest_b, name=name_b)
    data["schemes"] = [s for s in data["schemes"] if s[0] in SCHEMES]  # no speedup button here
    rows = diff.astype(object).where(diff.notna(), None).to_dict("records")
    by_b = {int(r["call_id_b"]): r for r in rows if r["call_id_b"] is not None}
    for node in data["nodes"]:
        _recolour(node, by_b.get(int(node["id"][1:])) if node["k"] == "module" else None)
    verdicts = diff["verdict"].value_counts().to_dict()
    data["title"] = f"diff · {name_a} → {name_b}"
    counts = (f"{verdicts.get('regressed', 0)} regressed, {verdicts.get('improved', 0)} "
              f"improved, {verdicts.get('only_a', 0)} only in A (not drawn)")
    data["subtitle"] = " · ".join(s for s in (counts, data["subtitle"]) if s)
    data["columns"] = [c[0] for c in COLUMNS]
    for m in data["modes"]:
        data["notes"][m] = (data["notes"][m].replace("Width =", "Width = B's", 1) +
                            " Colour: B against A (time Δ or memory Δ): red slower or more "
                            "memory, green faster or less, deeper up to 2x; grey: not counted "
                            "(within the runs' spread and the diff's thresholds).")
    data["legend_diff"] = [["slower / more memory (2x)", SLOWER],
                           ["faster / less memory (2x)", FASTER],
                           ["not counted", NEUTRAL], ["only in B", ONLY_B],
                           ["no figures", palette.NO_FIGURES],
                           ["(self): a parent's own kernels", palette.RESIDUAL]]
    return data


# The page's scheme buttons and legend speak of MFU and bound: after mounting, relabel the
# buttons and put the diff's legend in place of the page's (which is re-drawn on each render,
# so it is hidden rather than rewritten).
_PATCH = """<style>.cb-legend:not(.cbd-legend){display:none}</style>
<script>
(function () {
  var data = JSON.parse(document.getElementById("cbtrace-data").textContent);
  var names = {metric: "time \\u0394", bound: "memory \\u0394"};
  document.querySelectorAll(".cb-scheme").forEach(function (b) {
    b.textContent = names[b.dataset.scheme];
  });
  var old = document.querySelector(".cb-legend");
  var mine = document.createElement("div");
  mine.className = "cb-legend cbd-legend";
  data.legend_diff.forEach(function (item) {
    var s = document.createElement("span"), box = document.createElement("span"),
        label = document.createElement("span");
    s.className = "cb-swatch-item";
    box.className = "cb-swatch";
    box.style.background = item[1];
    label.textContent = item[0];
    s.appendChild(box);
    s.appendChild(label);
    mine.appendChild(s);
  });
  old.parentNode.insertBefore(mine, old.nextSibling);
})();
</script>
</body>"""


def render_diff_html(data: dict) -> str:
    """The icicle page (``icicle.render_html``) with the diff's scheme names and legend."""
    page = render_html(data)
    assert page.count("</body>") == 1 and "</script" not in json_for_script(data).lower()
    return page.replace("</body>", _PATCH)


def write_diff_icicle(diff, run_a, run_b, out_dir) -> Path:
    """Write ``out_dir/diff_icicle.html`` for the diff of run B against run A; its path."""
    from cbtrace.rundir.files import atomic_write_bytes
    from cbtrace.rundir.read import load_run

    manifest_b, df_b = load_run(run_b)
    data = diff_model(diff, df_b, manifest_b, name_a=Path(run_a).name, name_b=Path(run_b).name)
    out = Path(out_dir) / FILENAME
    atomic_write_bytes(out, render_diff_html(data).encode("utf-8"))
    return out
