"""The recommenders that look like production (plugins/providers/dcn.py, hstu.py): every preset
builds at its stated sizes, the tiny ones capture and replay on the CPU with 0 errors, and the
EmbeddingBag lookups replay jagged bags of variable length."""
import pytest
import torch
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace.capture.from_spec import run_step
from cbtrace.model.spec import resolve
from cbtrace.plugins.providers import dcn
from cbtrace.state import state_digest, state_fingerprint

FAST = {**FAST_REPLAY, "budget_s": 0.002, "min_runs": 2}  # the recommenders' many calls


def meta_model(spec):
    provider = resolve(spec)
    with torch.device("meta"):
        return provider, provider.build_model("meta")


@pytest.mark.parametrize("preset,tables", [("default", 64), ("large", 256), ("tiny", 8)])
def test_dcn_presets_have_varied_tables_and_a_cross_net(preset, tables):
    provider, model = meta_model(f"dcn:{preset}")
    bags = [m for m in model.modules() if isinstance(m, nn.EmbeddingBag)]
    assert len(bags) == len(provider.tables()) == tables
    assert {b.mode for b in bags} == {"sum", "mean"}
    assert len({b.embedding_dim for b in bags}) >= 2 and len({b.num_embeddings for b in bags}) > tables // 2
    lo, hi = zip(*(t.ids_per_bag for t in provider.tables()))
    assert 0 in lo and min(hi) > max(lo)  # some tables allow empty bags; every range is a range
    assert len(model.cross_net.layers) >= 2
    if preset != "tiny":
        mb = [b.num_embeddings * b.embedding_dim * 2 / 2**20 for b in bags]  # bf16
        assert 0.9 <= min(mb) < 3 and 20 < max(mb) <= 50  # a few MB to tens of MB each
        assert provider.batch_size() >= 4096


def test_dcn_bag_lengths_are_zipf_like_and_the_batch_is_seeded():
    provider = resolve("dcn:tiny")
    values, lengths = provider.jagged_ids(4096, torch.Generator().manual_seed(0))
    again, _ = provider.jagged_ids(4096, torch.Generator().manual_seed(0))
    assert torch.equal(values, again)
    per_table = lengths.view(len(provider.tables()), -1)
    for t, n in zip(provider.tables(), per_table):
        lo, hi = t.ids_per_bag
        assert n.min() >= lo and n.max() <= hi
        counts = torch.bincount(n - lo)
        assert counts.argmax() == 0 and counts[0] > counts[-1]  # the shortest bag is the mode
        if hi - lo >= 8:
            assert n.float().median() < n.float().mean()  # and a long tail
    assert values.numel() == int(lengths.sum())


def test_dcn_cross_layer_is_the_low_rank_formula():
    layer = dcn.LowRankCrossLayer(6, 2)
    x0, xl = torch.randn(3, 6), torch.randn(3, 6)
    want = x0 * (xl @ layer.V.weight.T @ layer.U.weight.T + layer.U.bias) + xl
    torch.testing.assert_close(layer(x0, xl), want)


def test_hstu_presets_build():
    provider, model = meta_model("hstu")
    c = provider.config()
    assert len(model.layers) == c.n_layers and c.max_len >= 1024 and c.batch_size >= 32
    tiny = resolve("hstu:tiny")
    model, (items, ts, offsets, lengths) = tiny.model_and_batch("cpu")
    assert offsets[-1].item() == items.numel() == ts.numel() == sum(lengths)
    assert len(set(lengths)) > 1 and max(lengths) == tiny.config().max_len
    assert model(items, ts, offsets, lengths).shape == (items.numel(), tiny.config().d_model)


def test_hstu_attention_is_causal_and_per_user():
    """An item changes the outputs at and after its own position in its own history only."""
    provider = resolve("hstu:tiny")
    model, (items, ts, offsets, lengths) = provider.model_and_batch("cpu")
    before = model(items, ts, offsets, lengths)
    at = int(offsets[1]) + 1  # the second item of the second user
    changed = items.clone()
    changed[at] = (changed[at] + 1) % provider.config().num_items
    diff = (model(changed, ts, offsets, lengths) - before).abs().sum(1) > 0
    user = torch.zeros(items.numel(), dtype=torch.bool)
    user[at:int(offsets[2])] = True
    assert torch.equal(diff, user)


@pytest.mark.parametrize("spec", ["dcn:tiny", "hstu:tiny"])
def test_tiny_presets_capture_and_replay_with_no_error(spec, tmp_path):
    provider = resolve(spec)
    model, batch = provider.model_and_batch("cpu")
    model.eval()
    before = state_fingerprint(model)
    with cbtrace.capture(model, tmp_path / "run", trace=False):
        run_step(provider, model, batch, "forward")
    df = cbtrace.replay(tmp_path / "run", model=model, **FAST)
    bad = df[df["status"] != "ok"][["fqn", "status", "status_reason"]]
    assert bad.empty, bad.to_string()
    assert state_fingerprint(model) == before
    if spec.startswith("dcn"):
        assert (df["module_type"] == "EmbeddingBag").sum() == len(provider.tables())
        assert {"LowRankCrossLayer", "CrossNet", "SparseArch"} <= set(df["module_type"])
        # the lookups replay jagged bags: variable lengths, as captured
        for fqn in df.loc[df["module_type"] == "EmbeddingBag", "fqn"]:
            (ids, offsets), _ = cbtrace.load_inputs(tmp_path / "run", fqn)
            bag_lengths = torch.diff(offsets, append=torch.tensor([ids.numel()]))
            assert offsets[0] == 0 and len(offsets) == provider.batch_size()
            assert bag_lengths.min() >= 0 and len(set(bag_lengths.tolist())) > 1, fqn
    else:
        assert {"PointwiseAttention", "RelativeBias", "HSTULayer"} <= set(df["module_type"])


def test_dcn_weights_depend_on_the_seed():
    one, again = resolve("dcn:tiny").model_and_batch()[0], resolve("dcn:tiny").model_and_batch()[0]
    other = resolve("dcn:tiny", seed=1).model_and_batch()[0]
    assert state_digest(one, sampled=False) == state_digest(again, sampled=False)
    assert state_digest(one, sampled=False) != state_digest(other, sampled=False)


@pytest.mark.parametrize("spec", ["dcn:tiny", "hstu:tiny"])
def test_forward_reads_no_tensor_value_on_the_host(spec):
    """The forward runs on meta tensors: no .item() or data-dependent shape, so on a GPU it
    waits on nothing and a CUDA graph can capture it."""
    model, batch = resolve(spec).model_and_batch("cpu")
    model = model.to("meta")
    batch = tuple(x.to("meta") if torch.is_tensor(x) else x for x in batch)
    with torch.no_grad():
        assert model(*batch).is_meta
