"""PNG screenshot of a run's icicle, taken in real headless Chromium (for READMEs and papers).

    python benchmarks/screenshot.py RUN|ICICLE.html OUT.png [--width 1400] [--full]
                                           [--zoom FQN] [--scheme metric|bound]

Renders the icicle of RUN into a temporary file (RUN is not touched), or takes an icicle.html
already rendered (e.g. one a GPU run sent back), opens it over file://
with every network request blocked, and captures the chart and legend (``--full``: the whole
page with the table). Needs the ``playwright`` Python package and a Chromium binary
(``CBTRACE_CHROMIUM``, default /usr/bin/chromium).
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str:
    return os.environ.get("CBTRACE_CHROMIUM", "/usr/bin/chromium")


def launch(playwright):
    """Headless Chromium with the flags our tests and screenshots use."""
    return playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)


def block_network(page) -> list[str]:
    """Abort every request that is not file:// or data:; returns the list of attempted URLs."""
    attempted: list[str] = []

    def handle(route):
        url = route.request.url
        if url.startswith(("file://", "data:")):
            route.continue_()
        else:
            attempted.append(url)
            route.abort()

    page.route("**/*", handle)
    return attempted


def screenshot_html(html_path, out_png, *, width: int = 1400, full: bool = False,
                    zoom: str | None = None, scheme: str = "metric") -> Path:
    """Screenshot an icicle.html; ``zoom`` is a module fqn to zoom on first."""
    from playwright.sync_api import sync_playwright

    out_png = Path(out_png)
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900},
                                    device_scale_factor=2)
            attempted = block_network(page)
            page.goto(Path(html_path).resolve().as_uri())
            page.wait_for_selector(".cb-node")
            if scheme != "metric":
                page.click(f".cb-scheme[data-scheme='{scheme}']")
            if zoom is not None:
                exact = re.compile("^" + re.escape(zoom or "(root)") + "$")
                row = page.locator(".cb-table tbody tr", has=page.locator(
                    "td:first-child", has_text=exact)).first
                row.click()
            page.mouse.move(0, 0)
            if full:
                page.screenshot(path=str(out_png), full_page=True)
            else:
                top = page.locator(".cb-table").bounding_box()["y"]
                page.screenshot(path=str(out_png), full_page=True,
                                clip={"x": 0, "y": 0, "width": width, "height": top})
            if attempted:
                raise RuntimeError(f"{html_path}: page tried the network: {attempted[:3]}")
        finally:
            browser.close()
    return out_png


def screenshot_run(run, out_png, **kw) -> Path:
    """Render RUN's icicle to a temporary file and screenshot it."""
    from cbtrace.plugins.reporters.icicle import render_html
    from cbtrace.plugins.reporters.icicle_model import build
    from cbtrace.rundir.read import load_run

    manifest, df = load_run(run)
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "icicle.html"
        page.write_text(render_html(build(df, manifest, name=Path(run).name)), encoding="utf-8")
        return screenshot_html(page, out_png, **kw)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/screenshot.py",
                                 description="PNG screenshot of a run's icicle.")
    ap.add_argument("run", help="run directory, or an icicle .html")
    ap.add_argument("out_png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--full", action="store_true", help="whole page, with the table")
    ap.add_argument("--zoom", default=None, help="module fqn to zoom on")
    ap.add_argument("--scheme", default="metric", choices=["metric", "bound"])
    a = ap.parse_args(argv)
    shoot = screenshot_html if a.run.endswith(".html") else screenshot_run
    print(shoot(a.run, a.out_png, width=a.width, full=a.full, zoom=a.zoom, scheme=a.scheme))


if __name__ == "__main__":
    main()
