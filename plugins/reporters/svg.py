"""icicle.svg: a static icicle for docs and papers (no JS; every name XML-escaped).

Same model as the HTML page (``icicle_model.build``): one size mode, the MFU/MBU or bound
colours, labels truncated to the box at ~6.4 px per character of 11 px sans-serif, and a
``<title>`` per box so browsers still show the figures on hover.
"""
from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

WIDTH = 1200      # px
ROW = 20          # px per tree level
PAD = 10
HEAD = 46         # title + subtitle
CHAR_PX = 6.4     # mean advance of 11 px sans-serif


def _fit(text: str, width: float) -> str:
    """``text`` cut to fit ``width`` px, with an ellipsis; "" if not even 3 characters fit."""
    room = int((width - 6) / CHAR_PX)
    if room < 3:
        return ""
    return text if len(text) <= room else text[: room - 1] + "…"


def _legend(data: dict, scheme: str, y: float) -> list[str]:
    out, x = [], PAD
    L = data["legend"]
    if scheme == "metric":
        items = [("grad-mfu", "MFU 0–100%"),
                 ("grad-mbu", "MBU 0–100% (no FLOPs or memory-bound)")]
        for gid, label in items:
            out.append(f'<rect x="{x}" y="{y}" width="60" height="12" fill="url(#{gid})" '
                       'stroke="#ccc"/>')
            out.append(f'<text x="{x + 66}" y="{y + 10}">{escape(label)}</text>')
            x += 66 + CHAR_PX * len(label) + 18
        swatches = []
    else:
        swatches = list(L["bound"].items())
    swatches += [("no figures", L["none"]), ("(self): own kernels", L["residual"])]
    for label, color in swatches:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{color}" stroke="#ccc"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}">{escape(label)}</text>')
        x += 16 + CHAR_PX * len(label) + 18
    return out


def render_svg(data: dict, *, mode: str | None = None, scheme: str = "metric",
               width: int = WIDTH) -> str:
    """The icicle of an icicle model as an SVG document."""
    mode = mode or data["modes"][0]
    if mode not in data["modes"]:
        raise ValueError(f"mode: '{mode}' is not one of {data['modes']}")
    inner = width - 2 * PAD
    max_depth = max(n["d"] for n in data["nodes"])
    chart_h = (max_depth + 1) * ROW
    height = HEAD + chart_h + 50
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" '
        'font-size="11">',
        "<defs>",
        *(f'<linearGradient id="grad-{k}"><stop offset="0" stop-color="{data["legend"][k][0]}"/>'
          f'<stop offset="1" stop-color="{data["legend"][k][1]}"/></linearGradient>'
          for k in ("mfu", "mbu")),
        "</defs>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{PAD}" y="20" font-size="15" font-weight="bold">'
        f'{escape(data["title"])}</text>',
        f'<text x="{PAD}" y="36" fill="#666">{escape(data["subtitle"])}'
        f'{" · " if data["subtitle"] else ""}width = {escape(data["mode_labels"][mode])}</text>',
    ]
    for n in data["nodes"]:
        x0, x1 = n["x"][mode]
        w = (x1 - x0) * inner
        if w < 0.5:
            continue
        x, y = PAD + x0 * inner, HEAD + n["d"] * ROW
        tip = "\n".join(f"{a}: {b}" for a, b in n["tip"])
        out.append(f'<g><title>{escape(n["q"] or n["n"])}\n{escape(tip)}</title>'
                   f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW - 1}" '
                   f'fill={quoteattr(n["bg"][scheme])} stroke="#fff" stroke-width="0.5"/>')
        label = _fit(f"{n['n']} · {n['v'][mode]}" + (f" · {n['m']}" if n["m"] else ""), w)
        if label:
            out.append(f'<text x="{x + 3:.2f}" y="{y + 14}" fill={quoteattr(n["fg"][scheme])}>'
                       f'{escape(label)}</text>')
        out.append("</g>")
    out += _legend(data, scheme, HEAD + chart_h + 14)
    out.append("</svg>")
    return "\n".join(out) + "\n"


class SvgReporter:
    """Writes ``out_dir/icicle.svg`` (the first size mode with data, MFU/MBU colours)."""

    filename = "icicle.svg"

    def report(self, records, manifest, out_dir) -> list[Path]:
        from cbtrace.plugins.reporters.icicle import model_of
        from cbtrace.rundir.files import atomic_write_bytes

        out = Path(out_dir) / self.filename
        data = model_of(records, manifest, Path(out_dir).name)
        atomic_write_bytes(out, render_svg(data).encode())
        return [out]

    def close(self) -> None:
        pass
