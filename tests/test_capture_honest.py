"""Capture measures the step the user runs: activation checkpointing, PyTorch's fast paths,
nested-tensor inputs and TorchScript submodules, on small models written for each."""
import gzip
import json
import types
import warnings

import pytest
import torch
from helpers.settings import FAST_REPLAY
from torch import nn
from torch.utils.checkpoint import checkpoint

import cbtrace
from cbtrace.attribution.attribute import attribute_file
from cbtrace.attribution.join import insitu_columns
from cbtrace.capture.host_times import host_times
from cbtrace.rundir.read import find_trace, load_run


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Checkpointed(nn.Module):
    """Two blocks, each run through torch.utils.checkpoint (or not: mode None)."""

    def __init__(self, mode):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 1)
        self.mode = mode

    def forward(self, x):
        for b in self.blocks:
            x = b(x) if self.mode is None else checkpoint(
                b, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


def _train_capture(mode, run):
    torch.manual_seed(0)
    model, x = Checkpointed(mode), torch.randn(8, 16, requires_grad=True)

    def step():
        model(x).sum().backward()

    with cbtrace.capture(model, run) as cap:
        step()
    return model, step, cap


def _by_phase(run):
    df = attribute_file(find_trace(run, load_run(run)[0]))
    df = df[df["depth"] >= 0]
    return {ph: dict(zip(d["fqn"], d["flops"])) for ph, d in df.groupby("phase")}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    run = tmp_path_factory.mktemp("plain") / "r"
    _, _, cap = _train_capture(None, run)
    return cap, _by_phase(run)


@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_checkpointing_records_each_call_once_and_keeps_recompute_out_of_the_forward(
        tmp_path, mode, plain):
    plain_cap, plain_figs = plain
    model, step, cap = _train_capture(mode, tmp_path / "r")
    # each module call once, as without checkpointing: no second call, no error
    assert [(r.fqn, r.call_index) for r in cap.records] == [
        (r.fqn, r.call_index) for r in plain_cap.records]
    assert all(r.capture_error is None for r in cap.records)
    assert {r.fqn for r in cap.records if r.recomputed} == {
        f"blocks.{i}{s}" for i in (0, 1) for s in ("", ".fc1", ".act", ".fc2")}
    # the trace: the forward holds the same work as the plain step's; the recomputation is a
    # phase of its own, charged to each checkpointed block, and never to the forward
    figs = _by_phase(tmp_path / "r")
    assert figs["fwd"] == plain_figs["fwd"]
    for b in ("blocks.0", "blocks.1"):
        assert 0 < figs["recompute"][b] <= figs["fwd"][b]
    assert set(figs["recompute"]) == {"", "blocks.0", "blocks.1"}  # the root: its blocks' sum
    # every call has its backward; non-reentrant, the same work as the plain step's, call by
    # call (a reentrant checkpoint's block input is a detached leaf: its gradient adds work)
    assert set(figs["bwd"]) == set(plain_figs["bwd"])
    if mode == "nonreentrant":
        assert figs["bwd"] == plain_figs["bwd"]
    # the in-situ stage: recompute time in its own column, beside the forward's
    manifest, df = load_run(tmp_path / "r")
    cols = insitu_columns(tmp_path / "r", manifest, df)
    by_fqn = {f: cols[c] for f, c in zip(df["fqn"], df["call_id"])}
    assert by_fqn["blocks.0"]["recompute_insitu_ms"] > 0
    assert by_fqn["head"]["recompute_insitu_ms"] is None
    # the unprofiled repeats line up with the captured calls (recomputation skipped)
    times = host_times(model, cap.records, step, repeats=1, budget_s=0.0)
    assert times is not None and sorted(times) == [r.call_id for r in cap.records]


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor's note about norm_first
        return nn.TransformerEncoder(layer, 2).eval()


def _ops(trace_path) -> list[str]:
    with gzip.open(trace_path) as f:
        return [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("masked", [False, True])
def test_encoder_fast_path_taken_in_the_captured_step_and_replayed(tmp_path, masked):
    enc, x = _encoder(), torch.randn(4, 10, 32)
    kwargs = {}
    if masked:  # the encoder turns the batch into a nested tensor for its layers
        mask = torch.zeros(4, 10, dtype=torch.bool)
        mask[1, 6:], mask[2, 3:] = True, True
        kwargs["src_key_padding_mask"] = mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors' prototype note
        with torch.no_grad(), cbtrace.capture(enc, tmp_path / "r") as cap:
            enc(x, **kwargs)
        assert _ops(cap.trace_path).count("aten::_transformer_encoder_layer_fwd") == 2
        assert [r.fqn for r in cap.records] == ["", "layers.0", "layers.1"]
        assert all("fast path" in r.boundary for r in cap.records[1:])
        assert all("forward" not in vars(m) for m in enc.modules())  # nothing left behind
        if masked:
            assert '"t":"nested"' in cap.records[1].inputs_ref
        df = cbtrace.replay(tmp_path / "r", model=enc, **FAST_REPLAY)
    assert list(df["status"]) == ["ok"] * 3, df["status_reason"].tolist()


class WithTorchScript(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        inner = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
        self.inner = (torch.jit.script(inner) if kind == "script"
                      else torch.jit.trace(inner, torch.randn(4, 16)))
        self.post = nn.Linear(8, 2)

    def forward(self, x):
        return self.post(self.inner(self.pre(x)))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("kind", ["script", "trace"])
def test_torchscript_submodule_is_a_leaf_captured_and_replayed(tmp_path, kind):
    torch.manual_seed(0)
    model, x = WithTorchScript(kind), torch.randn(4, 16)
    with cbtrace.capture(model, tmp_path / "r") as cap:
        y = model(x)
    assert [r.fqn for r in cap.records] == ["", "pre", "inner", "post"]
    inner = cap.records[2]
    assert inner.boundary.startswith("TorchScript") and inner.capture_error is None
    assert json.loads(inner.input_shapes) == [[4, 16]]
    # no wrapper left on the instance (a scripted module caches its script method there)
    assert not isinstance(vars(model.inner).get("forward"), types.FunctionType)
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    assert list(df["status"]) == ["ok"] * 4, df["status_reason"].tolist()
    assert df.set_index("fqn").loc["inner", "flops"] == 2 * 4 * 16 * 16 + 2 * 4 * 16 * 8 + 4 * 16
    assert torch.equal(model(x), y)


def test_a_forward_set_on_the_instance_is_kept(tmp_path):
    enc, x = _encoder(), torch.randn(2, 5, 32)
    layer = enc.layers[0]
    calls = []
    plain = layer.forward

    def own(*args, **kwargs):  # e.g. a library's wrapper set on the instance
        calls.append(1)
        return plain(*args, **kwargs)

    layer.forward = own
    with torch.no_grad(), cbtrace.capture(enc, tmp_path / "r", trace=False) as cap:
        enc(x)
    assert [r.fqn for r in cap.records] == ["", "layers.0", "layers.1"] and calls == [1]
    assert vars(layer)["forward"] is own


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_jagged_nested_input_is_stored_and_replayed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    with torch.no_grad(), cbtrace.capture(model, tmp_path / "r", trace=False) as cap:
        model(x)
    ref = json.loads(cap.records[1].inputs_ref)["args"][0]
    assert ref["t"] == "nested" and ref["layout"] == "jagged"
    assert [p["shape"] for p in ref["parts"]] == [[3, 8], [5, 8]]
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    assert list(df["status"]) == ["ok"] * 2, df["status_reason"].tolist()
