"""The built-in providers' weights (plugins/providers/weights.py): each parameter chunk from its
own generator, so the same seed gives the same weights whatever the thread count, with the
init distributions the models declare."""
import math

import pytest
import torch
from torch import nn

from cbtrace.model.spec import resolve
from cbtrace.plugins.providers import weights
from cbtrace.state import state_digest


def build(spec, seed=0, threads=None):
    old = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        return resolve(spec, seed=seed).model_and_batch("cpu")[0]
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("spec", ["nanogpt:tiny", "dlrm:tiny"])
def test_weights_depend_on_the_seed_only_not_on_threads_or_chunking(spec, monkeypatch):
    monkeypatch.setattr(weights, "CHUNK", 1000)  # many chunks per tensor, spread over threads
    one, four = build(spec, threads=1), build(spec, threads=4)
    assert state_digest(one, sampled=False) == state_digest(four, sampled=False)
    assert state_digest(one, sampled=False) != state_digest(build(spec, seed=1), sampled=False)
    assert all(torch.isfinite(p).all() for p in one.parameters())


def test_chunks_of_one_tensor_draw_different_numbers(monkeypatch):
    monkeypatch.setattr(weights, "CHUNK", 1000)
    w = build("dlrm:tiny").sparse_arch.embedding_bags.t_cat_0.weight.detach().view(-1)
    assert not torch.equal(w[:1000], w[1000:2000])


def test_nanogpt_init_is_nanogpts():
    m = build("nanogpt:tiny")
    c = m.config
    assert m.lm_head.weight is m.transformer.wte.weight  # tied, as in nanoGPT
    block = m.transformer.h[0]
    assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))
    assert not block.ln_1.bias.any() and not block.attn.c_attn.bias.any()
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    proj = torch.cat([b.attn.c_proj.weight.view(-1) for b in m.transformer.h])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * c.n_layer), rel=0.05)


def test_dlrm_init_is_pytorchs_default():
    m = build("dlrm:tiny")
    lin = m.dense_arch.model[0]
    bound = 1 / math.sqrt(lin.in_features)
    for t in (lin.weight, lin.bias):
        assert t.abs().max().item() <= bound and t.abs().max().item() > 0.8 * bound
    emb = torch.cat([b.weight.view(-1) for b in m.sparse_arch.embedding_bags.values()])
    assert emb.mean().item() == pytest.approx(0.0, abs=0.02)
    assert emb.std().item() == pytest.approx(1.0, rel=0.02)


def test_a_parameter_without_a_rule_is_refused():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    from cbtrace.plugins.providers.dlrm import torch_default_init

    with pytest.raises(ValueError, match="no init for 1.weight"):
        weights.build(lambda: model, "cpu", 0, torch_default_init)


def test_skip_init_only_inside_and_standalone_models_init_as_before():
    from cbtrace.plugins.providers.nanogpt import GPT, PRESETS

    with weights.skip_init():
        lin = nn.Linear(4, 4)
    assert torch._C._is_torch_function_mode_enabled() is False
    torch.manual_seed(0)
    a = GPT(PRESETS["tiny"]["config"])
    torch.manual_seed(0)
    b = GPT(PRESETS["tiny"]["config"])
    assert state_digest(a, sampled=False) == state_digest(b, sampled=False)
    assert a.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert lin.weight.shape == (4, 4)


def test_the_model_builds_on_meta_for_module_naming():
    provider = resolve("dlrm:large")
    with torch.device("meta"):
        model = provider.build_model("meta")
    assert all(p.is_meta for p in model.parameters())
    assert len(list(model.modules())) >= 1000
