"""icicle.html: one self-contained file (CSS, JS and data inline; no network at all).

The data sits in ``<script type="application/json">`` with ``<``, ``>`` and ``&`` written as
``\\u003c`` etc., so a module named ``</script><script>...`` cannot end the element; the page
puts every name in the DOM with ``textContent``. A CSP meta tag forbids any request.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

STATIC = Path(__file__).parent / "static"
_PLACEHOLDER = re.compile(r"\{\{(TITLE|CSS|JS|DATA)\}\}")


def json_for_script(data) -> str:
    """JSON safe inside a <script> element: no "<", ">" or "&" survive literally."""
    s = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def static_text(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def render_html(data: dict) -> str:
    """The icicle page for an icicle model (see ``icicle_model.build``)."""
    js, css = static_text("icicle.js"), static_text("icicle.css")
    assert "</script" not in js.lower() and "</style" not in css.lower()
    parts = {"TITLE": html.escape(f"cbtrace · {data['title']}"), "CSS": css, "JS": js,
             "DATA": json_for_script(data)}
    # one pass, so text inside the data can never be taken for a placeholder
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], static_text("icicle.html"))


def model_of(records, manifest, name: str = "run") -> dict:
    """Icicle model of a run's records (ModuleRecords) and its Manifest."""
    from cbtrace.plugins.reporters import icicle_model
    from cbtrace.schema.modules import records_to_frame

    return icicle_model.build(records_to_frame(list(records)), manifest, name=name)


class IcicleReporter:
    """Writes ``out_dir/icicle.html``."""

    filename = "icicle.html"

    def report(self, records, manifest, out_dir) -> list[Path]:
        from cbtrace.rundir.files import atomic_write_bytes

        out = Path(out_dir) / self.filename
        page = render_html(model_of(records, manifest, name=Path(out_dir).name))
        atomic_write_bytes(out, page.encode("utf-8"))
        return [out]

    def close(self) -> None:
        pass
