"""Icicle model, HTML, SVG, summary and reporters; the page itself in real headless Chromium.

Run directories are built from REAL module trees (a small transformer, a DLRM-like model)
with synthetic figures (sample_runs), since real replays need a GPU.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings

from helpers.paths import REPO
from hypothesis import strategies as st

from cbtrace.plugins.reporters import palette

from cbtrace.plugins.reporters import icicle_model
from cbtrace.plugins.reporters.icicle import json_for_script, render_html
from helpers.sample_runs import write_sample_run
from cbtrace.plugins.reporters.summary import self_times, summary_table
from cbtrace.plugins.reporters.svg import render_svg
from cbtrace.plugins.reporters.icicle_tree import build_tree, layout, preorder, record_rows
from cbtrace.schema.modules import ModuleRecord, frame_to_records, records_to_frame
from cbtrace.rundir.read import load_run

EVIL = "<script>alert(1)</script>"
EVIL_IMG = "<img src=x onerror=alert(2)>"


def _evil_modules():
    from torch import nn

    return {EVIL: nn.ReLU(), EVIL_IMG: nn.Identity()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {
        "transformer": write_sample_run(base / "transformer", "transformer", extra=_evil_modules()),
        "dlrm": write_sample_run(base / "dlrm", "dlrm"),
        "bare": write_sample_run(base / "bare", "dlrm", timings=False),
    }


def _frame(run):
    return load_run(run)[1]


def _model(run, name: str) -> dict:
    """The icicle model of a run directory, as reporters build it."""
    manifest, df = load_run(run)
    return icicle_model.build(df, manifest, name=name)


def _records(run):
    """(ModuleRecords, Manifest): what a reporter receives."""
    manifest, df = load_run(run)
    return frame_to_records(df), manifest


def _rec(call_id, fqn, parent, *, k=0, ms=None, **kw):
    return ModuleRecord(
        fqn=fqn, call_index=k, call_id=call_id, parent_call_id=parent,
        parent_fqn=None, depth=0, module_type="Linear", module_class="torch.nn.Linear",
        param_bytes=0, buffer_bytes=0, input_bytes=0, input_shapes="[]", input_meta="[]",
        output_meta="[]", training=False, grad_enabled=False, autocast_dtype=None,
        inputs_ref="{}", isolated_ms=ms, **kw)


# ---------------------------------------------------------------- tree and layout


def test_tree_two_roots_repeat_calls_and_residual():
    # a (3 ms) holds b twice (1 ms each) and 1 ms of its own; c (2 ms) is a 2nd root;
    # a's residual_ms is ignored when its own time is known (it is recomputed from widths)
    recs = [_rec(0, "a", -1, ms=3.0, residual_ms=-7.0), _rec(1, "a.b", 0, ms=1.0),
            _rec(2, "a.b", 0, k=1, ms=1.0), _rec(3, "c", -1, ms=2.0)]
    rows = record_rows(records_to_frame(recs))
    nodes, root = build_tree(rows)
    assert root == "root" and nodes[root]["children"] == ["c0", "c3"]
    assert nodes["c2"]["name"] == "b #1" and nodes["c2"]["depth"] == 2
    assert nodes["c0"]["children"] == ["c1", "c2", "r0"]
    xs = layout(nodes, root, "isolated")
    # total = 3 + 2 = 5 ms; a spans 3/5, its children 1/5 each, then its residual 1/5
    assert xs["c0"] == pytest.approx((0, 3 / 5))
    assert xs["c2"] == pytest.approx((1 / 5, 2 / 5))
    assert xs["r0"] == pytest.approx((2 / 5, 3 / 5))
    assert xs["c3"] == pytest.approx((3 / 5, 1))
    calls = layout(nodes, root, "calls")
    assert calls["c0"] == pytest.approx((0, 3 / 4))  # a + 2 calls of b, out of 4 calls


def test_tree_residuals_follow_their_subtree_and_a_missing_parent_makes_a_root():
    # a > a.b > a.b.c, then d whose parent (99) was not captured: two roots, so a "(step)"
    recs = [_rec(0, "a", -1, ms=3.0), _rec(1, "a.b", 0, ms=2.0), _rec(2, "a.b.c", 1, ms=1.0),
            _rec(3, "d", 99, ms=1.0)]
    nodes, root = build_tree(record_rows(records_to_frame(recs)))
    order = preorder(nodes, root)
    assert order == ["root", "c0", "c1", "c2", "r1", "r0", "c3"]
    assert [nodes[n]["depth"] for n in order] == [0, 1, 2, 3, 3, 2, 1]
    assert [nodes[n]["parent"] for n in order] == [None, "root", "c0", "c1", "c1", "c0", "root"]
    assert nodes["c3"]["name"] == "d" and nodes["c2"]["name"] == "c"


def test_tree_of_a_deep_chain():
    recs = [_rec(i, f"m{i}", i - 1, ms=1.0) for i in range(5000)]
    nodes, root = build_tree(record_rows(records_to_frame(recs)))
    assert root == "c0" and nodes["c4999"]["depth"] == 4999 and nodes["r0"]["depth"] == 1
    assert layout(nodes, root, "isolated")["c4999"] == pytest.approx((0, 1))


def test_noisy_children_widen_the_parent_once():
    # replay noise: p measured 1 ms, its child q 5 ms; residual_ms as replay writes it (-4)
    recs = [_rec(0, "p", -1, ms=1.0, residual_ms=-4.0), _rec(1, "p.q", 0, ms=5.0),
            _rec(2, "r", -1, ms=5.0, residual_ms=None)]
    data = icicle_model.build(records_to_frame(recs), name="noisy")
    by = {n["id"]: n for n in data["nodes"]}
    assert by["c0"]["x"]["isolated"] == pytest.approx([0, 0.5])  # 5 of 10 ms, not 1 and not 9
    assert by["r0"]["x"]["isolated"][1] - by["r0"]["x"]["isolated"][0] == 0
    assert by["c0"]["v"]["isolated"] == "1 ms"  # the box still says what was measured
    assert any(k == "note" and "more than its own" in v for k, v in by["c0"]["tip"])
    assert by["root"]["v"]["isolated"] == "10 ms"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.one_of(st.none(), st.floats(0, 50))),
                min_size=1, max_size=25))
def test_layout_children_nest_and_never_overlap(spec):
    recs = [_rec(i, f"m{i}", (p % i) if i else -1, ms=ms) for i, (p, ms) in enumerate(spec)]
    nodes, root = build_tree(record_rows(records_to_frame(recs)))
    for mode in ("isolated", "calls"):
        xs = layout(nodes, root, mode)
        for nid, n in nodes.items():
            x0, x1 = xs[nid]
            assert 0 <= x0 <= x1 <= 1 + 1e-9
            prev = x0
            for c in n["children"]:
                c0, c1 = xs[c]
                assert c0 >= prev - 1e-9 and c1 <= x1 + 1e-9
                prev = c1


def test_model_modes_and_fallback(runs):
    data = _model(runs["transformer"], "t")
    assert data["modes"] == ["isolated", "insitu", "calls"]
    assert data["title"] == "transformer (synthetic figures)"
    bare = _model(runs["bare"], "b")
    assert bare["modes"] == ["calls"]
    assert "no timings" in bare["notes"]["calls"]
    leaf = next(n for n in bare["nodes"] if n["q"] == "top.2")
    assert leaf["v"]["calls"] == "1 call"


def test_relu_shows_bandwidth_not_a_flat_colour(runs):
    data = _model(runs["dlrm"], "d")
    relu = next(n for n in data["nodes"] if n["t"] == "ReLU")
    assert relu["m"].startswith("MBU ") and relu["bg"]["metric"] != palette.NO_FIGURES
    lin = next(n for n in data["nodes"] if n["q"] == "top.2")  # compute-bound Linear
    assert lin["m"].startswith("MFU ")
    # memory-bound with FLOPs (a LayerNorm) is coloured by MBU too
    assert palette.metric_color(0.01, 0.6, True, "memory")[1] == "MBU 60.0%"
    assert palette.metric_color(None, None, False) == (palette.NO_FIGURES, "")
    assert palette.lerp_color("#000000", "#ffffff", 0.5) == "#808080"
    assert palette.text_color("#0b3d91") == "#ffffff" and palette.text_color("#fdebd6") == "#000000"


# ---------------------------------------------------------------- HTML, SVG, summary


def test_html_is_self_contained_and_escapes_names(runs):
    page = render_html(_model(runs["transformer"], "t"))
    assert EVIL not in page and EVIL_IMG not in page
    assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in page
    for ref in ("http://", "https://", "src=\"", "href=\""):
        assert ref not in page.replace("http://www.w3.org", ""), ref
    assert json.loads(json_for_script({"a": "</script>&"})) == {"a": "</script>&"}


def test_svg_is_xml_with_escaped_labels(runs):
    data = _model(runs["transformer"], "t")
    svg = render_svg(data)
    root = ET.fromstring(svg)
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any(t.startswith("encoder · ") for t in texts)
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(t.startswith(EVIL) for t in titles)  # parsed back as text, not markup
    assert "<script" not in svg
    with pytest.raises(ValueError, match="mode"):
        render_svg(data, mode="nope")
    ET.fromstring(render_svg(_model(runs["bare"], "b"), scheme="bound"))


def test_summary_self_times_add_up_to_the_step(runs):
    df = _frame(runs["dlrm"])
    rows = record_rows(df)
    agg = self_times(rows, "isolated")
    root = next(r for r in rows if r["parent_call_id"] == -1)
    assert sum(a["self_ms"] for a in agg.values()) == pytest.approx(root["isolated_ms"])
    text = summary_table(df, top=5)
    lines = text.splitlines()
    assert lines[0].startswith("Top 5 of 24 modules by self time (isolated")
    assert len(lines) == 3 + 5 and "top.2" in lines[3]  # title, header, rule, 5 rows
    assert "no timings" in summary_table(_frame(runs["bare"]))


# ---------------------------------------------------------------- reporters via the hook


def test_builtin_reporters_are_registered_and_write(runs, tmp_path):
    from cbtrace import registry

    reps = registry.reporters()
    assert {"icicle", "svg", "summary"} <= set(reps)
    written = [p for name in ("icicle", "svg", "summary")
               for p in reps[name].report(*_records(runs["dlrm"]), tmp_path)]
    assert sorted(p.name for p in written) == ["icicle.html", "icicle.svg", "summary.txt"]
    assert all(p.stat().st_size > 500 for p in written)


def test_plugin_reporter_registered_through_the_hook(runs, tmp_path):
    from cbtrace import registry
    from cbtrace.hookspecs import hookimpl
    from cbtrace.workflows.report import ReportError, report_run

    class CsvReporter:
        closed = False

        def report(self, records, manifest, out_dir):
            out = Path(out_dir) / "modules.csv"
            rows = [f"{r.fqn},{r.isolated_ms}" for r in records]
            out.write_text("\n".join([f"# {manifest.title}", "fqn,isolated_ms", *rows]))
            return [out]

        def close(self):
            CsvReporter.closed = True

    class Plugin:
        @hookimpl
        def register_reporters(self, register):
            register("csv", CsvReporter())

    registry.load()
    registry.pm.register(Plugin(), name="test-csv")
    try:
        paths = report_run(runs["dlrm"], out_dir=tmp_path, names=["csv"])
        assert [p.name for p in paths] == ["modules.csv"] and CsvReporter.closed
        assert "top.2" in paths[0].read_text()
    finally:
        registry.pm.unregister(name="test-csv")
    with pytest.raises(ReportError, match="unknown reporter"):
        report_run(runs["dlrm"], out_dir=tmp_path, names=["csv"])


# ---------------------------------------------------------------- in a real browser


def _keep_screenshot(png: Path, name: str) -> None:
    """Copy a screenshot to $CBTRACE_SCREENSHOT_DIR when the lead sets it."""
    keep = os.environ.get("CBTRACE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(keep) / name)


@pytest.fixture(scope="module")
def browser():
    if not Path("/usr/bin/chromium").exists() and "CBTRACE_CHROMIUM" not in os.environ:
        pytest.skip("no Chromium at /usr/bin/chromium (set CBTRACE_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    from helpers.servers import launch

    pw = sync_playwright().start()
    b = launch(pw)
    yield b
    b.close()
    pw.stop()


@pytest.mark.browser
def test_icicle_offline_in_chromium(browser, runs, tmp_path):
    from cbtrace.plugins.reporters.icicle import IcicleReporter
    from helpers.servers import block_network

    html = IcicleReporter().report(*_records(runs["transformer"]), tmp_path)[0]
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    dialogs, errors = [], []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))
    attempted = block_network(page)
    page.goto(html.as_uri())
    page.wait_for_selector(".cb-node")
    chart_w = page.locator(".cb-chart").bounding_box()["width"]
    n_nodes = page.locator(".cb-node").count()
    assert n_nodes > 30

    # the hostile names render as text, in the table and in the chart, and nothing ran
    cells = page.locator(".cb-table tbody td:first-child").all_text_contents()
    assert EVIL in cells and EVIL_IMG in cells
    evil_id = page.locator(".cb-table tbody tr", has_text=EVIL).first.get_attribute("data-id")
    assert page.locator(f".cb-node[data-id='{evil_id}']").count() == 1
    assert page.evaluate("document.querySelectorAll('.cb-root script, .cb-root img').length") == 0

    # hover shows all figures of a module
    enc = page.locator(".cb-node", has_text="encoder ·").first
    enc.hover()
    tip = page.locator(".cb-tip")
    assert tip.is_visible()
    for label in ("isolated", "in-situ", "MFU", "MBU", "bound", "FLOPs", "bytes moved"):
        assert tip.locator("th", has_text=label).count() >= 1

    # click zooms: the module spans the whole chart, the path grows; the path goes back
    enc_id = enc.get_attribute("data-id")
    enc.click()
    assert page.locator(".cb-root").get_attribute("data-zoom") == enc_id
    zoomed = page.locator(".cb-zoomed")
    assert zoomed.get_attribute("data-id") == enc_id
    assert zoomed.bounding_box()["width"] == pytest.approx(chart_w, abs=1)
    assert page.locator(".cb-crumb").all_text_contents() == ["(TinyLM)", "encoder"]
    assert page.locator(".cb-node").count() < n_nodes
    page.locator("button.cb-crumb").first.click()
    assert page.locator(".cb-node").count() == n_nodes

    # toggles: in-situ width, bound colours
    page.click(".cb-mode[data-mode='insitu']")
    assert page.locator(".cb-root").get_attribute("data-mode") == "insitu"
    page.click(".cb-scheme[data-scheme='bound']")
    assert page.locator(".cb-legend").inner_text().count("compute") == 1

    # search highlights matches and filters the table
    page.fill(".cb-search", "linear1")
    assert page.locator(".cb-matches").inner_text() == "4 matches"
    assert page.locator(".cb-node.cb-match").count() == 4
    assert page.locator(".cb-table tbody tr").count() == 4
    page.fill(".cb-search", "")

    # sortable table
    th = page.locator(".cb-table th", has_text="FLOPs")
    th.click()
    assert page.locator(".cb-table th", has_text="FLOPs").get_attribute("aria-sort") == "descending"
    first = page.locator(".cb-table tbody tr").first.locator("td").first.inner_text()
    assert first == "(root)"  # the root carries the most FLOPs
    page.locator(".cb-table th", has_text="FLOPs").click()
    assert page.locator(".cb-table th", has_text="FLOPs").get_attribute("aria-sort") == "ascending"

    png = tmp_path / "icicle_transformer.png"
    page.screenshot(path=str(png), full_page=True)
    _keep_screenshot(png, "icicle_transformer.png")
    page.close()
    assert attempted == [] and dialogs == [] and errors == []


@pytest.mark.browser
def test_screenshot_script_makes_a_png(browser, runs, tmp_path):
    png = tmp_path / "dlrm.png"
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "screenshot.py"),
                          str(runs["dlrm"]), str(png), "--width", "1200"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    _keep_screenshot(png, "icicle_dlrm.png")
    assert not (runs["dlrm"] / "icicle.html").exists()  # the run is left untouched


def test_summary_names_calls_whose_figures_exceed_the_peak():
    from cbtrace.plugins.reporters.summary import summary_table
    from cbtrace.replay.derive import add_utilisation

    fast = _rec(0, "", -1, ms=1e-6, flops=1e9, bytes=1e6, compute_dtype="bfloat16")
    add_utilisation(fast, "NVIDIA H200")  # 1 GFLOP in 1 ns: ~1000x the peak
    assert fast.mfu > 1 and fast.figures_suspect
    text = summary_table(records_to_frame([fast]))
    assert "SUSPECT: 1 call(s) read above 100 % of the device's peak: (root) (MFU" in text
    ok = _rec(0, "", -1, ms=1.0, flops=1e9, bytes=1e6, compute_dtype="bfloat16")
    add_utilisation(ok, "NVIDIA H200")
    assert not ok.figures_suspect and "SUSPECT" not in summary_table(records_to_frame([ok]))
