"""The autograd engine's gradient sums: counted on the replayed backward (``bwd_grad_sums``), and
left by the in-situ attribution with the call they belong to."""
import math

import pandas as pd
import pytest
import torch
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace.attribution.join import insitu_for_run, own_grad_sums
from cbtrace.replay.modes.backward import grad_targets, grad_sums
from cbtrace.rundir.read import load_run


class TanhGelu(nn.Module):
    """transformers' NewGELUActivation: its input used three times."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    """A residual block: x feeds the LayerNorm and the add (a sum of the block's, not the
    LayerNorm's), the GELU sums its own input's three gradients."""

    def __init__(self, d=64):
        super().__init__()
        self.ln, self.fc, self.act, self.proj = (nn.LayerNorm(d), nn.Linear(d, 4 * d),
                                                 TanhGelu(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block = nn.Linear(16, 64), Block()

    def forward(self, x):
        return self.block(self.inp(x)).sum()


@pytest.mark.parametrize("leaf_input", [True, False])
def test_grad_sums_count_each_tensor_used_more_than_once(leaf_input):
    def inputs():
        x = torch.randn(4, 64, requires_grad=True)
        return x if leaf_input else x * 1  # a non-leaf: its producer is not the call's

    for module, want in ((TanhGelu(), 2), (nn.Linear(64, 64), 0), (nn.LayerNorm(64), 0),
                         (Block(), 3)):  # the GELU's 2, and x into the LayerNorm and the add
        x = inputs()
        out = module(x)
        assert grad_sums([out], grad_targets([x]), module) == want, type(module).__name__


class Halves(nn.Module):
    """Two outputs of one autograd node (chunk's split): nothing summed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x).chunk(2, dim=1)


def test_outputs_of_one_node_are_walked_once():
    x = torch.randn(4, 64, requires_grad=True)
    module = Halves()
    outs = list(module(x))
    assert outs[0].grad_fn is outs[1].grad_fn
    assert grad_sums(outs, grad_targets([x]), module) == 0


def test_a_calls_own_adds_stay_with_it_in_situ(tmp_path):
    torch.manual_seed(0)
    model = Net().train()
    x = torch.randn(256, 16)
    with cbtrace.capture(model, tmp_path / "run"):
        model(x).backward()
    df = cbtrace.replay(tmp_path / "run", model=model, device="cpu", backward=True,
                        **FAST_REPLAY).set_index("fqn")
    assert df.loc["block.act", "bwd_grad_sums"] == 2
    assert df.loc["block.ln", "bwd_grad_sums"] == 0
    manifest, rows = load_run(tmp_path / "run")
    own = own_grad_sums(rows)
    assert own[("block.act", 0)] == 2 and ("block.ln", 0) not in own
    before = insitu_for_run(tmp_path / "run", manifest, "bwd").set_index("fqn")
    after = insitu_for_run(tmp_path / "run", manifest, "bwd", own).set_index("fqn")
    # the GELU's two adds move from the block's own time into the GELU's; inclusive figures of
    # the block and the LayerNorm (whose add is the residual's, the block's) do not move
    assert after.loc["block.act", "cpu_ms"] > before.loc["block.act", "cpu_ms"]
    for fqn in ("block", "block.ln", ""):
        assert after.loc[fqn, "cpu_ms"] == pytest.approx(before.loc[fqn, "cpu_ms"])
    # the forward's rows do not depend on the sums (the in-situ stage reads a trace once for both)
    pd.testing.assert_frame_equal(insitu_for_run(tmp_path / "run", manifest, "fwd"),
                                  insitu_for_run(tmp_path / "run", manifest, "fwd", own))
