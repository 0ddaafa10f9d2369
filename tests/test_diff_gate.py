"""`cbtrace diff` as a CI gate on a CPU: work counts catch a planted change exactly, identical
runs differ in nothing but time (how often a loaded CPU's time flags them, bench_diff_gate.py
measures), and a diff with nothing to compare fails instead of passing.

Real runs on this CPU: a two-layer transformers BERT (hidden 32, intermediate 37; built from a
config, nothing downloaded) captured and replayed three times as it is (A, A2, A3) and once
with layer 1's feed-forward three times wider (B: intermediate 37 -> 111).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace.cli.main import COMMANDS
from cbtrace.workflows.diff import DiffError, diff_runs

transformers = pytest.importorskip("transformers")

# times steady enough to compare: two windows a call (the default), the faster kept
REPLAY = {**FAST_REPLAY, "budget_s": 0.02, "min_runs": 20, "cpu_windows": 2}
HIDDEN, FF, WIDE = 32, 37, 111
FFN = "encoder.layer.1"
# the widened Linears, the GELU between them (its work triples too) and every call up to the root
PLANTED = {"", "encoder", FFN, f"{FFN}.intermediate", f"{FFN}.intermediate.dense",
           f"{FFN}.intermediate.intermediate_act_fn", f"{FFN}.output", f"{FFN}.output.dense"}


def _bert(wide: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=FF,
                                  max_position_embeddings=16)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    if wide:
        layer = model.encoder.layer[1]
        layer.intermediate.dense = nn.Linear(HIDDEN, WIDE)
        layer.output.dense = nn.Linear(WIDE, HIDDEN)
    return model


def _capture(model, out: Path, *, replay: bool = True) -> Path:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with cbtrace.capture(model, out, trace=False), torch.no_grad():
        model(ids)
    if replay:
        cbtrace.replay(out, model=model, **REPLAY)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gate")
    plain = _bert(wide=False)
    out = {name: _capture(plain, base / name) for name in ("A", "A2", "A3")}
    out["B"] = _capture(_bert(wide=True), base / "B")
    return out


@pytest.fixture
def cli(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "diff", ("cbtrace.cli.commands.diff", "Compare two runs."))

    def run(*args) -> tuple[int, str, str]:
        return run_cli(["diff", *args, "--no-icicle"], capsys)
    return run


def test_planted_wider_feed_forward_is_flagged_exactly(runs):
    df = diff_runs(runs["A"], runs["B"]).set_index("fqn")
    flagged = df[df["regression"]]
    assert set(flagged.index) == PLANTED, flagged[["regressed", "work_changed"]]
    assert flagged["regressed"].str.contains("work").all()
    for name in (f"{FFN}.intermediate.dense", f"{FFN}.output.dense"):
        assert df.loc[name, "flops_rel"] == pytest.approx(WIDE / FF - 1)  # 3x the FLOPs
        assert "flops" in df.loc[name, "work_changed"].split(",")
    assert (df.loc[list(set(df.index) - PLANTED), "work_changed"] == "").all()
    assert df.loc["encoder.layer.0.intermediate.dense", "flops_rel"] == 0


def test_cli_fails_on_the_planted_regression(runs, cli):
    code, out, err = cli(runs["A"], runs["B"], "--fail-on-regression")
    assert code == 1, err
    lines = out.splitlines()
    assert lines[0] == f"Regressions: {len(PLANTED)} of 42 calls compared (B against A)"
    assert lines[1].split()[:4] == ["module", "call", "match", "regressed"]
    assert lines[1].rstrip().endswith("work changed")
    assert {ln.split()[0] for ln in lines[3:3 + len(PLANTED)]} == {
        f or "(root)" for f in PLANTED}
    dense = next(ln for ln in lines if ln.startswith(f"{FFN}.intermediate.dense "))
    assert "flops +200%" in dense
    assert cli(runs["A"], runs["B"])[0] == 0  # without the flag


@pytest.mark.parametrize("a, b", [("A", "A2"), ("A2", "A3"), ("A3", "A")])
def test_identical_runs_differ_in_time_alone(runs, cli, a, b):
    df = diff_runs(runs[a], runs[b])
    assert len(df) == 42 and (df["match"] == "name").all()
    assert (df["work_changed"] == "").all() and (df["peak_mem_bytes_delta"] == 0).all()
    # time is the only figure a loaded CPU can move between identical runs: whatever is flagged
    # is flagged for time alone, and the gate fails exactly then (bench_diff_gate.py measures how
    # often identical runs are flagged)
    flagged = df[df["regression"]]
    assert (flagged["regressed"] == "time").all(), flagged[["fqn", "regressed"]]
    code, out, _ = cli(runs[a], runs[b], "--fail-on-regression")
    assert code == (1 if len(flagged) else 0), out
    assert out.startswith("Regressions: none among 42 calls compared.") == flagged.empty, out


def test_a_run_without_figures_fails_in_one_line(runs, cli, tmp_path):
    bare = _capture(_bert(wide=False), tmp_path / "bare", replay=False)
    for a, b in ((runs["A"], bare), (bare, runs["A"])):
        code, out, err = cli(a, b, "--fail-on-regression")
        assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.strip() == (f"Error: {bare}: no replayed figures (never replayed, or no "
                               f"call ended ok); run cbtrace replay {bare} first")
    with pytest.raises(DiffError, match="no replayed figures"):
        diff_runs(runs["A"], bare)


def test_another_model_entirely_fails_in_one_line(runs, cli, tmp_path):
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with cbtrace.capture(other, tmp_path / "mlp", trace=False):
        other(torch.randn(2, 8))
    cbtrace.replay(tmp_path / "mlp", model=other, **REPLAY)
    for a, b in ((runs["A"], tmp_path / "mlp"), (tmp_path / "mlp", runs["A"])):
        code, out, err = cli(a, b, "--fail-on-regression")
        assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
        assert "no call matches" in err and str(b) in err
