"""Training steps as people write them: dropout in train mode and in-place activations, replayed
forward and backward with no error (CPU here; the graph timer's case is GPU-marked)."""
import pytest
import torch
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace.state import state_fingerprint

FAST = {**FAST_REPLAY, "host_runs": 1, "backward": True}


class Block(nn.Module):
    """Linear -> BatchNorm -> in-place ReLU -> Dropout -> Linear, as CNN and MLP blocks are."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.fc1, self.bn = nn.Linear(16, 32), nn.BatchNorm1d(32)
        self.act, self.drop, self.fc2 = nn.ReLU(inplace=True), nn.Dropout(p), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.bn(self.fc1(x)))))


def _train_run(tmp_path, device="cpu"):
    torch.manual_seed(0)
    model = Block().to(device).train()
    x = torch.randn(8, 16, device=device)
    with cbtrace.capture(model, tmp_path / "run"):
        model(x).square().mean().backward()
    return model, tmp_path / "run"


def test_inplace_relu_and_dropout_backward_replay_without_error(tmp_path):
    model, run = _train_run(tmp_path)
    before = state_fingerprint(model)
    df = cbtrace.replay(run, model=model, device="cpu", **FAST).set_index("fqn")
    assert state_fingerprint(model) == before
    assert (df.status == "ok").all(), df.status_reason.dropna().to_dict()
    assert (df.bwd_status == "ok").all(), df.bwd_status_reason.dropna().to_dict()
    assert df.loc["act", "bwd_ms"] > 0 and df.loc["drop", "bwd_ms"] > 0
    # the dropout ran with the step's p: its outputs hold zeros where the inputs did not
    assert model.drop.p == 0.1


def test_dropout_replays_with_the_steps_probability(tmp_path):
    model, run = _train_run(tmp_path)
    args, _ = cbtrace.load_inputs(run, "drop")
    out = model.drop(args[0].detach().abs() + 1)  # no zero among the inputs
    zeros = (out == 0).float().mean().item()
    assert 0.0 < zeros < 0.4  # p = 0.1 of 256 elements: dropout is on, in train mode


@pytest.mark.gpu
def test_dropout_and_inplace_relu_under_the_graph_timer(tmp_path):
    model, run = _train_run(tmp_path, "cuda")
    df = cbtrace.replay(run, model=model, device="cuda", timer="graph", **FAST).set_index("fqn")
    assert (df.status == "ok").all(), df.status_reason.dropna().to_dict()
    assert (df.bwd_status == "ok").all(), df.bwd_status_reason.dropna().to_dict()
    assert df.loc["drop", "timer"] == "graph", df.loc["drop", "timer_fallback"]
    assert df.loc["drop", "bwd_timer"] == "graph", df.loc["drop", "bwd_timer_notes"]


class SyncsUnderCapture(nn.Module):
    """Dropout, then a host read: its graph capture fails after a random op was captured."""

    def forward(self, x):
        y = nn.functional.dropout(x, 0.5, training=True)
        return y * float(y.sum().item() > -1e9)


@pytest.mark.gpu
def test_a_failed_capture_leaves_random_ops_usable(tmp_path):
    model = nn.Sequential(SyncsUnderCapture(), nn.Dropout(0.1)).cuda().train()
    x = torch.randn(64, 64, device="cuda")
    with cbtrace.capture(model, tmp_path / "run"):
        model(x)
    df = cbtrace.replay(tmp_path / "run", model=model, device="cuda", timer="graph",
                        **{**FAST, "backward": False}).set_index("fqn")
    assert (df.status == "ok").all(), df.status_reason.dropna().to_dict()
    assert df.loc["0", "timer"] != "graph" and "graph capture failed" in df.loc["0", "timer_fallback"]
    assert df.loc["1", "timer"] == "graph"
    torch.nn.functional.dropout(x, 0.5, training=True)  # the caller's random ops still run
