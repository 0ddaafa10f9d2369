"""The cbtrace tab in TensorBoard: runs under the logdir, their icicle and table, trace links.

Thin, in the style of TensorBoard's ``example_basic`` plugin: JSON routes built from the
runs' modules.parquet and an ES-module frontend (``static/index.js``) that reuses the
icicle code of ``icicle.html``. No CDN; names from the browser go through ``logdir.py``.

Layout that the tab (and torch-tb-profiler) find, for ``tensorboard --logdir DIR``::

    DIR/<run>/manifest.json + modules.parquet          a cbtrace run (any depth under DIR)
    DIR/<run>/<worker>.pt.trace.json.gz                capture trace (torch-tb-profiler run <run>)
    DIR/<run>/annotated_<worker>.pt.trace.json.gz      annotated trace: download link in this
                                                       tab; worker "annotated_<worker>" in the
                                                       PYTORCH_PROFILER tab

Routes (under /data/plugin/cbtrace): /index.js /icicle.js /icicle.css (static), /runs,
/data?run=R (icicle model), /trace?run=R&name=F (download). Bad names -> 400, unknown -> 404.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from cbtrace.plugins.reporters import logdir as ld

PLUGIN_NAME = "cbtrace"
STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"/index.js": "text/javascript", "/icicle.js": "text/javascript",
                "/icicle.css": "text/css"}
RUNS_TTL_S = 5.0  # is_active() runs on every plugins listing: rescan the logdir at most this often


class CbtracePlugin(base_plugin.TBPlugin):
    plugin_name = PLUGIN_NAME

    def __init__(self, context):
        self._logdir = context.logdir or ""
        self._lock = threading.Lock()
        self._cache: tuple[float, list[str]] = (-1e9, [])

    def _runs(self) -> list[str]:
        with self._lock:
            t, runs = self._cache
            if time.monotonic() - t > RUNS_TTL_S:
                runs = ld.find_runs(self._logdir)
                self._cache = (time.monotonic(), runs)
            return runs

    def get_plugin_apps(self):
        apps = {route: self._static for route in STATIC_FILES}
        apps.update({"/runs": self._serve_runs, "/data": self._serve_data,
                     "/trace": self._serve_trace})
        return apps

    def is_active(self):
        return bool(self._runs())

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="cbtrace")

    @wrappers.Request.application
    def _static(self, request):
        route = request.path[request.path.rindex("/"):]
        body = (STATIC / route.lstrip("/")).read_bytes()
        return http_util.Respond(request, body, STATIC_FILES[route])

    @wrappers.Request.application
    def _serve_runs(self, request):
        from cbtrace.rundir.read import read_manifest

        out = []
        for run in self._runs():
            path = Path(self._logdir) / run
            try:
                name, traces = read_manifest(path).title, ld.annotated_traces(path)
                entry = {"run": run, "name": name, "traces": traces}
            except Exception as e:  # a broken run is listed with its error, not hidden
                entry = {"run": run, "name": None, "traces": [], "error": str(e)}
            out.append(entry)
        return http_util.Respond(request, {"runs": out, "logdir": self._logdir},
                                 "application/json")

    def _error(self, request, e: Exception):
        code = 400 if isinstance(e, ld.BadName) else 404
        return http_util.Respond(request, {"error": str(e)}, "application/json", code=code)

    @wrappers.Request.application
    def _serve_data(self, request):
        from cbtrace.errors import CbtraceError
        from cbtrace.plugins.reporters import icicle_model
        from cbtrace.rundir.read import load_run

        try:
            run_dir = ld.resolve_run(self._logdir, request.args.get("run"), self._runs())
        except (ld.BadName, ld.NotFound) as e:
            return self._error(request, e)
        try:
            manifest, df = load_run(run_dir)
            data = icicle_model.build(df, manifest, name=run_dir.name)
        except (CbtraceError, ValueError) as e:
            return http_util.Respond(request, {"error": str(e)}, "application/json", code=500)
        data["traces"] = ld.annotated_traces(run_dir)
        return http_util.Respond(request, data, "application/json")

    @wrappers.Request.application
    def _serve_trace(self, request):
        try:
            path = ld.resolve_trace(self._logdir, request.args.get("run"),
                                    request.args.get("name"), self._runs())
        except (ld.BadName, ld.NotFound) as e:
            return self._error(request, e)
        return http_util.Respond(
            request, path.read_bytes(), "application/octet-stream",
            headers=[("Content-Disposition", f'attachment; filename="{path.name}"')])


class CbtraceTBLoader(base_plugin.TBLoader):
    """Entry point (group ``tensorboard_plugins``, name ``cbtrace``)."""

    def load(self, context):
        return CbtracePlugin(context)
