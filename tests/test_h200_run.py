"""A real run captured and replayed on an H200 (NanoGPT GPT-2-small bf16, batch 8), checked in
under tests/data/h200_nanogpt_run: its capture trace attributes and annotates on any machine."""
import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from cbtrace.rundir.read import read_modules
from cbtrace.rundir.read import find_trace

RUN = Path(__file__).parent / "data" / "h200_nanogpt_run"


@pytest.fixture()
def run(tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(RUN, dst)
    return dst


def test_attribution_conserves_device_time_on_h200_capture(run):
    import cbtrace

    trace = find_trace(run)
    df = cbtrace.attribute(trace, aggregate=False)
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    dev = sum(e.get("dur", 0) for e in events if e.get("ph") == "X"
              and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")) / 1e3
    assert df["gpu_self_ms"].sum() == pytest.approx(dev, rel=1e-3)
    fwd = df[(df["source"] == "cbtrace") & (df["phase"] == "fwd") & ~df["fqn"].str.startswith("<")]
    assert len(fwd) == len(read_modules(run))


def test_insitu_join_matches_replay_within_a_few_percent(run):
    from cbtrace.attribution.join import error_table, join_insitu

    df = join_insitu(run)
    assert df["insitu_ms"].notna().all()
    table = error_table(df)
    for cls in ("Block", "Linear", "LayerNorm", "GELU", "MLP", "CausalSelfAttention"):
        assert abs(table.loc[cls, "median"]) <= 5.0, table


def test_annotate_h200_capture_keeps_original(run):
    import cbtrace

    trace = find_trace(run)
    before = hashlib.sha256(trace.read_bytes()).hexdigest()
    out = cbtrace.annotate(run=run, pftrace=False)
    assert hashlib.sha256(trace.read_bytes()).hexdigest() == before
    assert out.name == f"annotated_{trace.name}"
    with gzip.open(out) as f:
        ann = json.load(f)["traceEvents"]
    mods = [e for e in ann if e.get("name", "").startswith("cbtrace::")
            and e.get("cat") == "user_annotation"]
    assert len(mods) == 150
    lm = [e for e in mods if e["args"].get("fqn") == "lm_head"][0]["args"]
    assert lm["isolated_ms"] > 0.5 and lm["mfu"] > 0.3 and lm["bound"] in ("compute", "launch")
    assert any(e.get("ph") == "C" for e in ann)
