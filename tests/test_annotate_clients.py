"""Annotated traces open in real clients: HTA, torch-tb-profiler's loader, and its routes served
by a real TensorBoard server."""
from __future__ import annotations

import json
import shutil
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers.annotate_data import record_capture_trace, write_fake_run
from helpers.servers import serve, stop

from cbtrace.annotate.write import annotate

WORKER = "annotated_worker0"


@pytest.fixture(scope="module")
def annotated(tmp_path_factory):
    """A TensorBoard-style log dir: run1/ holds the original and its annotated version."""
    root = tmp_path_factory.mktemp("tb")
    trace = record_capture_trace(root / "cap")
    run = write_fake_run(root / "cbrun", trace)
    out = annotate(run, pftrace=False)
    logdir = root / "logs" / "run1"
    logdir.mkdir(parents=True)
    shutil.copy(out, logdir / out.name)
    return logdir / out.name


def test_hta_loads_annotated_trace(annotated, tmp_path):
    from hta.trace_analysis import TraceAnalysis

    d = tmp_path / "hta"
    d.mkdir()
    shutil.copy(annotated, d / annotated.name)
    analysis = TraceAnalysis(trace_dir=str(d))
    df = analysis.t.get_trace(0)
    names = set(analysis.t.symbol_table.sym_table)
    assert {"cbtrace::blocks.0.lin1", "cbtrace::head"} <= names
    assert "cbtrace" in set(df["pid"].astype(str))  # the isolated-replay process
    assert analysis.t.meta_data[0]["cbtrace"]["run_id"]


def test_tb_profiler_loader_parses_annotated_trace(annotated, tmp_path):
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    data = RunProfileData.parse(WORKER, None, str(annotated), str(tmp_path))
    profile = RunGenerator(WORKER, None, data).generate_run_profile()
    assert "Module" in [v.display_name for v in profile.views]
    tree = profile.get_module_view()["data"]
    assert tree[0]["name"] == "Net_0" and tree[0]["children"]


def _get(url: str, timeout: float = 10):
    """(status, body); the plugin gzips some bodies without a Content-Encoding urllib reads."""
    import gzip

    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
        return r.status, gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body


@pytest.mark.slow
def test_tensorboard_server_serves_annotated_trace(annotated):
    tb = Path(sys.executable).with_name("tensorboard")

    def argv(port):
        return [str(tb), "--logdir", str(annotated.parent.parent), "--host", "127.0.0.1",
                "--port", str(port)]

    def ready(port):
        runs = json.loads(_get(f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/runs")[1])
        return "run1" in runs["runs"] and not runs["loading"]

    proc, port = serve(argv, ready, timeout=90)
    base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
    try:
        q = {"run": "run1", "view": "Module"}
        workers = json.loads(_get(f"{base}/workers?" + urllib.parse.urlencode(q))[1])
        assert WORKER in workers
        q["worker"] = WORKER
        spans = json.loads(_get(f"{base}/spans?" + urllib.parse.urlencode(q))[1])
        if spans:
            q["span"] = spans[0]
        status, body = _get(f"{base}/module?" + urllib.parse.urlencode(q))
        assert status == 200 and json.loads(body)["data"][0]["name"] == "Net_0"
        status, body = _get(f"{base}/trace?" + urllib.parse.urlencode(q))
        trace = json.loads(body)
        assert trace["cbtrace"]["run_id"]
        assert any(e.get("args", {}).get("fqn") == "head" for e in trace["traceEvents"])
    finally:
        stop(proc)
