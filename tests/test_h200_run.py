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


TRAIN = Path(__file__).parent / "data" / "h200_nanogpt_train.pt.trace.json.gz"


def test_train_step_backward_attribution_on_h200_trace():
    """The capture trace of a GPT-2-small bf16 batch-8 training step on an H200 (session 6):
    every module with a backward gets it, kernel for kernel as replay runs it alone (the
    LayerNorm without the residual's gradient add, which goes to its block; the Linear with
    its bias reduction, which the engine runs outside the node's op), and nothing is lost."""
    import numpy as np

    from cbtrace.attribution.attribute import attribute_file

    t = attribute_file(TRAIN)
    bwd = t[(t["phase"] == "bwd") & (t["depth"] >= 0)].set_index("fqn")
    assert len(bwd) == 125  # of 150 calls; dropouts at p=0 have no backward
    assert {f"transformer.h.{i}.{m}" for i in range(12) for m in ("ln_1", "ln_2", "mlp.gelu")
            } <= set(bwd.index)
    assert bwd.loc["transformer.h.0.ln_1", "kernel_count"] == 2  # grad input, gamma/beta
    assert bwd.loc["transformer.h.0.attn.c_attn", "kernel_count"] == 4  # 2 mm, memset, reduce
    assert 0.105 < bwd.loc["transformer.h.0.attn.c_attn", "gpu_ms"] < 0.120
    block = bwd.loc["transformer.h.0"]
    kids = bwd[bwd["parent_fqn"] == "transformer.h.0"]["gpu_ms"].sum()
    assert block["gpu_ms"] == pytest.approx(kids + block["gpu_self_ms"])
    assert block["gpu_self_ms"] > 0.005  # the residuals' gradient adds, in the block
    assert np.isfinite(bwd["gpu_ms"]).all() and (bwd["gpu_ms"] > 0).all()
