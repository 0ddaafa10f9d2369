"""The cbtrace TensorBoard tab against a REAL `tensorboard` server and REAL headless Chromium.

The logdir holds two synthetic runs (real module trees, made-up figures) at different depths,
an annotated trace (a real Kineto trace from shared/ when present), a directory that is not a
run, and a symlink to a run outside the logdir (which must stay invisible).
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cbtrace.plugins.reporters import logdir as ld
from helpers.sample_runs import write_sample_run
from helpers.servers import serve, stop

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
REAL_TRACE = (SHARED / "traces/generated/torch2.13cpu_transformer2/"
              "cpuworker.1795949533002516587.pt.trace.json.gz")
TRACE_NAME = "annotated_cpuworker.1795949533002516587.pt.trace.json.gz"
START_TIMEOUT_S = 60


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    base = tmp_path_factory.mktemp("tb")
    root = base / "logdir"
    write_sample_run(root / "dl", "dlrm")
    write_sample_run(root / "exp" / "a" / "tr", "transformer")
    if REAL_TRACE.is_file():
        shutil.copy(REAL_TRACE, root / "dl" / TRACE_NAME)
    else:  # CI without shared/: a minimal valid Kineto-style trace
        (root / "dl" / TRACE_NAME).write_bytes(gzip.compress(b'{"traceEvents": []}'))
    (root / "notarun").mkdir()
    (root / "notarun" / "manifest.json").write_text("{}")
    outside = write_sample_run(base / "outside", "dlrm")
    (root / "link").symlink_to(outside, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def server(logdir):
    exe = Path(sys.executable).parent / "tensorboard"
    if not exe.exists():
        pytest.skip(f"no tensorboard binary beside {sys.executable}")
    def argv(port):
        return [str(exe), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)]

    def ready(port):
        return _get(f"http://127.0.0.1:{port}/data/plugins_listing")[0] == 200

    proc, port = serve(argv, ready, timeout=START_TIMEOUT_S)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        stop(proc)


# ---------------------------------------------------------------- without a server


def test_find_runs_at_any_depth_and_not_through_symlinks(logdir):
    assert ld.find_runs(logdir) == ["dl", "exp/a/tr"]
    assert ld.find_runs(logdir / "dl") == ["."]
    assert ld.find_runs(logdir / "nope") == [] and ld.find_runs("") == []
    assert ld.annotated_traces(logdir / "dl") == [TRACE_NAME]
    for bad in ["", "../x", "/etc", "dl/../../x", "C:/x", "a\\..\\b", "a\x00b", None]:
        with pytest.raises(ld.BadName):
            ld.resolve_run(logdir, bad)
    for unknown in ["link", "notarun", "exp", "exp/a"]:
        with pytest.raises(ld.NotFound):
            ld.resolve_run(logdir, unknown)
    with pytest.raises(ld.BadName):
        ld.resolve_trace(logdir, "dl", "modules.parquet")


def test_inactive_without_runs(tmp_path):
    from tensorboard.plugins.base_plugin import TBContext

    from cbtrace.plugins.reporters.tensorboard_plugin import CbtraceTBLoader

    plugin = CbtraceTBLoader().load(TBContext(logdir=str(tmp_path)))
    assert plugin.plugin_name == "cbtrace" and not plugin.is_active()
    assert plugin.frontend_metadata().es_module_path == "/index.js"
    write_sample_run(tmp_path / "deep" / "run", "dlrm", timings=False)
    assert CbtraceTBLoader().load(TBContext(logdir=str(tmp_path))).is_active()
    assert not CbtraceTBLoader().load(TBContext(logdir="")).is_active()


# ---------------------------------------------------------------- real tensorboard


def test_tab_listed_and_runs_served(server):
    status, body = _get(server + "/data/plugins_listing")
    tab = json.loads(body)["cbtrace"]
    assert status == 200 and tab["enabled"] is True
    assert tab["loading_mechanism"] == {"type": "IFRAME",
                                        "module_path": "/data/plugin/cbtrace/index.js"}
    runs = json.loads(_get(server + "/data/plugin/cbtrace/runs")[1])["runs"]
    assert [r["run"] for r in runs] == ["dl", "exp/a/tr"]
    assert runs[0]["traces"] == [TRACE_NAME] and runs[1]["traces"] == []
    status, body = _get(server + "/data/plugin/cbtrace/data?run=exp/a/tr")
    data = json.loads(body)
    assert status == 200 and data["format"] == "cbtrace-icicle/1"
    assert any(n["q"] == "encoder.layers.3.linear2" for n in data["nodes"])


def test_trace_download(server, logdir):
    status, body = _get(f"{server}/data/plugin/cbtrace/trace?run=dl&name={TRACE_NAME}")
    assert status == 200 and body == (logdir / "dl" / TRACE_NAME).read_bytes()


@pytest.mark.parametrize("path", [
    "/data/plugin/cbtrace/data?run=../../../../etc",
    "/data/plugin/cbtrace/data?run=%2e%2e%2f%2e%2e%2fetc",
    "/data/plugin/cbtrace/data?run=/etc",
    "/data/plugin/cbtrace/data?run=dl/../../outside",
    "/data/plugin/cbtrace/data?run=link",
    "/data/plugin/cbtrace/data?run=notarun",
    "/data/plugin/cbtrace/data",
    "/data/plugin/cbtrace/trace?run=dl&name=../../../../etc/passwd",
    "/data/plugin/cbtrace/trace?run=dl&name=%2Fetc%2Fpasswd",
    "/data/plugin/cbtrace/trace?run=dl&name=manifest.json",
    "/data/plugin/cbtrace/trace?run=../dl&name=" + TRACE_NAME,
    "/data/plugin/cbtrace/trace?run=dl&name=annotated_x.pt.trace.json.gz",
    "/data/plugin/cbtrace/..%2f..%2f..%2fetc%2fpasswd",
    "/data/plugin/cbtrace/static/../../../etc/passwd",
    "/data/plugin/cbtrace/%2e%2e/%2e%2e/etc/passwd",
])
def test_path_traversal_refused(server, path):
    status, body = _get(server + path)
    assert status in (400, 404), (path, status)
    assert b"root:" not in body and b"synthetic" not in body


# ---------------------------------------------------------------- real browser


@pytest.mark.browser
def test_tab_in_chromium(server, tmp_path):
    if not Path("/usr/bin/chromium").exists() and "CBTRACE_CHROMIUM" not in os.environ:
        pytest.skip("no Chromium at /usr/bin/chromium (set CBTRACE_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    from helpers.servers import launch

    outside, errors = [], []

    def guard(route):
        if route.request.url.startswith(server):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.route("**/*", guard)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server + "/#cbtrace")
            tab = page.frame_locator("iframe[src*='name=cbtrace']")
            tab.locator(".cb-node").first.wait_for(timeout=30_000)
            assert tab.locator(".cb-run-select option").all_text_contents() == [
                "dl — dlrm (synthetic figures)", "exp/a/tr — transformer (synthetic figures)"]
            link = tab.locator(".cb-trace-link")
            assert link.inner_text() == TRACE_NAME
            assert link.get_attribute("href") == f"./trace?run=dl&name={TRACE_NAME}"

            n_all = tab.locator(".cb-node").count()
            top = tab.locator(".cb-node", has_text="top ·").first
            top_id = top.get_attribute("data-id")
            top.click()
            assert tab.locator(".cb-view").get_attribute("data-zoom") == top_id
            assert tab.locator(".cb-zoomed").get_attribute("data-id") == top_id
            assert tab.locator(".cb-crumb").all_text_contents() == ["(DLRM)", "top"]
            assert tab.locator(".cb-node").count() < n_all

            tab.locator(".cb-run-select").select_option("exp/a/tr")
            tab.locator(".cb-root.cb-tb[data-run='exp/a/tr']").wait_for(timeout=15_000)
            assert tab.locator(".cb-title").inner_text() == "transformer (synthetic figures)"
            assert tab.locator(".cb-node", has_text="encoder ·").count() == 1
            png = tmp_path / "tensorboard_tab.png"
            page.screenshot(path=str(png))
            assert png.stat().st_size > 10_000
            keep = os.environ.get("CBTRACE_SCREENSHOT_DIR")
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(png, Path(keep) / png.name)
        finally:
            browser.close()
    assert errors == []
    assert outside == []
