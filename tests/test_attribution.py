"""Attribution on a small CPU capture-like trace recorded by tests/data/record_attribution_traces.py."""
import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from cbtrace.attribution.attribute import attribute, insitu_for_run, summarize
from cbtrace.attribution.identity import class_index_map, hierarchy_path
from cbtrace.errors import CbtraceError

TRACE = Path(__file__).parent / "data" / "cbtrace_capture_cpu.pt.trace.json.gz"


@pytest.fixture(scope="module")
def df():
    return attribute(TRACE)


@pytest.fixture(scope="module")
def raw():
    return json.loads(gzip.decompress(TRACE.read_bytes()))["traceEvents"]


def _row(df, step, fqn, phase="fwd", call_index=0):
    r = df[(df.step == step) & (df.fqn == fqn) & (df.phase == phase) & (df.call_index == call_index)]
    assert len(r) == 1, (step, fqn, phase, call_index)
    return r.iloc[0]


def test_hand_checked_numbers(df):
    # step 2 in the trace: cbtrace::blocks.0.fc1 dur 131.295 us, its cbtrace.copy range 32.240 us
    assert _row(df, 2, "blocks.0.fc1").cpu_ms == pytest.approx((131.295 - 32.240) / 1e3)
    # head is called twice: 169.396 - 55.063 and 114.554 - 33.503
    assert _row(df, 2, "head", call_index=0).cpu_ms == pytest.approx((169.396 - 55.063) / 1e3)
    assert _row(df, 2, "head", call_index=1).cpu_ms == pytest.approx((114.554 - 33.503) / 1e3)
    # fc1: addmm of (32 tokens x 32) @ (32 x 64): 2*32*32*64 FLOPs; backward: two matmuls
    assert _row(df, 2, "blocks.0.fc1").flops == 2 * 32 * 32 * 64
    assert _row(df, 2, "blocks.0.fc1", "bwd").flops >= 2 * (2 * 32 * 32 * 64)
    assert _row(df, 2, "blocks.0.fc1").compute_dtype == "float32"


def test_identity_columns(df):
    assert set(df.step) == {1, 2, 3}
    r = _row(df, 1, "blocks.1.norm")
    assert (r.source, r.depth, r.parent_fqn) == ("cbtrace", 3, "blocks.1")
    root = _row(df, 1, "")
    assert root.depth == 0 and pd.isna(root.parent_fqn)
    assert r.ts_us > root.ts_us and r.dur_us > 0 and r.ev_index >= 0 and r.pid > 0


def test_slice_identity_finds_the_event(df, raw):
    for r in df[(df.phase == "fwd") & (df.depth >= 0)].itertuples():
        ev = raw[r.ev_index]
        assert ev["name"] == f"cbtrace::{r.fqn}" and ev["ts"] == r.ts_us and ev["dur"] == r.dur_us


def test_cpu_conservation_and_overhead(df, raw):
    for step in (1, 2, 3):
        s = df[df.step == step]
        mods = s[s.depth >= 0]
        for phase in ("fwd", "bwd"):
            m = mods[mods.phase == phase]
            root = m[m.depth == 0].cpu_ms.sum()
            assert m.cpu_self_ms.sum() == pytest.approx(root, rel=1e-9)
        # the root's raw range = modules' self time + cbtrace overhead (all copies sit inside it)
        root_raw = _row(df, step, "").dur_us / 1e3
        ovh = _row(df, step, "<cbtrace-overhead>").cpu_ms
        assert mods[mods.phase == "fwd"].cpu_self_ms.sum() + ovh == pytest.approx(root_raw)
    copies = [e["dur"] for e in raw if e.get("name", "").startswith("cbtrace.copy::")]
    assert df[df.fqn == "<cbtrace-overhead>"].cpu_ms.sum() == pytest.approx(sum(copies) / 1e3)


def test_backward_mapped_to_forward_modules(df):
    for fqn in ("emb", "blocks.0.fc1", "blocks.1.norm", "head"):
        assert _row(df, 2, fqn, "bwd").cpu_self_ms > 0
    assert _row(df, 2, "head", "bwd", call_index=1).cpu_ms > 0
    # AccumulateGrad and the loss have no forward op inside a module: their own row
    assert _row(df, 2, "<unattributed>", "bwd").cpu_ms > 0


def test_aggregates_over_steps(df):
    g = df[(df.fqn == "blocks.0") & (df.phase == "fwd")]
    assert len(g) == 3
    assert (g.cpu_ms_median == g.cpu_ms.median()).all()
    assert (g.cpu_ms_min == g.cpu_ms.min()).all() and (g.cpu_ms_max == g.cpu_ms.max()).all()
    s = summarize(df)
    assert len(s) == len(df) // 3 and not s.duplicated(["rank", "fqn", "call_index", "phase"]).any()


def test_insitu_for_run(tmp_path):
    from cbtrace.rundir import write_manifest

    shutil.copy(TRACE, tmp_path / TRACE.name)
    write_manifest(tmp_path, {"trace": TRACE.name})
    out = insitu_for_run(tmp_path)
    assert list(out.columns) == ["fqn", "call_index", "cpu_ms", "gpu_ms", "gpu_span_ms", "insitu_ms"]
    assert len(out) == 15  # 14 modules, head called twice; the first step only
    assert (out.insitu_ms == out.cpu_ms).all()  # CPU trace: no device events


def test_capture_run_names_nn_module_events(tmp_path, shared_traces):
    from cbtrace.rundir import write_manifest, write_modules

    mods = pd.DataFrame({"fqn": ["", "emb", "encoder", "encoder.layers.0", "encoder.layers.1", "head"],
                         "call_id": [0, 1, 2, 3, 4, 5],
                         "module_type": ["Net", "Embedding", "TransformerEncoder",
                                         "TransformerEncoderLayer", "TransformerEncoderLayer", "Linear"]})
    assert class_index_map(mods)["TransformerEncoderLayer_1"] == "encoder.layers.1"
    write_manifest(tmp_path, {})
    write_modules(tmp_path, mods)
    trace = next((shared_traces / "generated/torch2.13cpu_transformer2").glob("*.json.gz"))
    df = attribute(trace, capture_run=tmp_path, aggregate=False)
    assert {"emb", "encoder.layers.1", ""} <= set(df[df.source == "nn.Module"].fqn)


def test_hierarchy_path():
    assert hierarchy_path("TOP(Net)::forward.layer1(Sequential)::forward.0(Block)::forward") == "layer1.0"
    assert hierarchy_path("") is None


def test_cli_writes_parquet_and_prints(tmp_path):
    from cbtrace.cli import cli

    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(cli, ["attribute", str(TRACE), "--out", str(out), "--top", "5"])
    assert res.exit_code == 0, res.output
    assert "blocks" in res.output and f"to {out}" in res.output
    assert len(pd.read_parquet(out)) == len(attribute(TRACE))


def test_errors(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"traceEvents": []}')
    with pytest.raises(CbtraceError, match="x.json: the trace has no events"):
        attribute(p)
    with pytest.raises(CbtraceError, match="no .json or .json.gz"):
        attribute(_empty_dir(tmp_path))


def _empty_dir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d
