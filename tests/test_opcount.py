"""OpCounter on real modules: closed-form FLOPs and module-level bytes worked out by hand."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from cbtrace.cost.opcount import OpCounter


def count(module, *args, outputs=False, **kwargs):
    with OpCounter(params={id(p): n for n, p in module.named_parameters()}) as oc:
        out = module(*args, **kwargs)
    return oc.cost(outputs=out) if outputs else oc.cost()


def test_linear():
    cost = count(nn.Linear(64, 32), torch.randn(8, 64))
    # 2*M*K*N = 2*8*64*32 = 32768
    assert cost.flops == cost.flops_executed == 32768
    # read x 8*64*4 = 2048, W 32*64*4 = 8192, b 32*4 = 128; write y 8*32*4 = 1024
    assert (cost.bytes_read, cost.bytes_written, cost.bytes) == (10368, 1024, 11392)
    assert cost.params_touched == ("bias", "weight") and cost.unknown_ops == 0
    assert cost.compute_dtype == "float32"


def test_linear_agrees_with_flopcountermode_on_3d_input():
    lin, x = nn.Linear(48, 24), torch.randn(2, 5, 48)
    with FlopCounterMode(display=False) as fc:
        lin(x)
    assert count(lin, x).flops == fc.get_total_flops() == 2 * 10 * 48 * 24


def test_conv2d_strided_grouped():
    conv, x = nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), torch.randn(2, 4, 16, 16)
    cost = count(conv, x)
    # out 8x8; 2 * N * H*W * C_out * k*k * C_in/groups = 2 * 2 * 64 * 8 * 9 * 2 = 36864
    assert cost.flops == 36864
    with FlopCounterMode(display=False) as fc:
        conv(x)
    assert cost.flops == fc.get_total_flops()
    # read x 2*4*256*4 = 8192, W 8*2*9*4 = 576, b 32; write 2*8*64*4 = 4096
    assert (cost.bytes_read, cost.bytes_written) == (8800, 4096)


def test_matmul_and_bmm():
    class MatMul(nn.Module):
        def forward(self, a, b):
            return a @ b

    # (3, 7, 5) @ (5, 6) folds into one mm: 2 * 21 * 5 * 6 = 1260
    assert count(MatMul(), torch.randn(3, 7, 5), torch.randn(5, 6)).flops == 1260
    # (3, 7, 5) @ (3, 5, 6) is a bmm: same 1260; reads (105 + 90) * 4, writes 126 * 4
    cost = count(MatMul(), torch.randn(3, 7, 5), torch.randn(3, 5, 6))
    assert (cost.flops, cost.bytes_read, cost.bytes_written) == (1260, 780, 504)


class Attention(nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(causal):
    b, h, s, d = 2, 4, 32, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    cost = count(Attention(causal), q, k, v)
    dense = 2 * b * h * s * s * d * 2        # QK^T 262144 + PV 262144 = 524288
    assert cost.flops == dense == 524288
    # causal: 32*33/2 = 528 of 1024 scores -> 524288 * 528 / 1024 = 270336
    assert cost.flops_executed == (270336 if causal else dense)
    # reads q, k, v once each (3 * 4096 * 4 = 49152); returned output 4096 * 4 = 16384
    assert cost.bytes_read == 49152
    assert count(Attention(causal), q, k, v, outputs=True).bytes_written == 16384


def test_embedding_bag_counts_unique_gathered_rows():
    bag = nn.EmbeddingBag(100_000, 64, mode="sum")
    idx = torch.tensor([[1, 2, 3, 4, 5], [5, 6, 7, 8, 9], [10, 11, 12, 13, 1]])   # 15 lookups, 13 unique
    cost = count(bag, idx, outputs=True)
    # one add per gathered element: 15 * 64 = 960
    assert cost.flops == 960
    # table read: 13 unique rows * 64 * 4 = 3328 (not 25.6 MB); indices 15*8 = 120, the offsets
    # the module makes itself (arange) are internal; output 3 * 64 * 4 = 768
    assert cost.bytes_read == 3328 + 120
    assert cost.bytes_written == 768
    mean = count(nn.EmbeddingBag(100_000, 64, mode="mean"), idx)
    assert mean.flops == 960 + 3 * 64      # + the divide per output element


def test_embedding_bag_per_sample_weights_and_offsets():
    bag = nn.EmbeddingBag(1000, 8, mode="sum")
    idx, offsets = torch.tensor([3, 4, 5, 6, 7, 8]), torch.tensor([0, 2])
    cost = count(bag, idx, offsets, per_sample_weights=torch.rand(6))
    assert cost.flops == 6 * 8 * 2       # an add and a multiply per gathered element


def test_tied_weight_counted_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 32)

        def forward(self, idx):
            return self.emb(idx) @ self.emb.weight.t()   # gathered rows, then the whole table

    cost = count(Tied(), torch.tensor([[1, 2, 3]]))
    # table 1000*32*4 = 128000 once (the full read covers the gathered rows) + indices 3*8 = 24
    assert cost.bytes_read == 128000 + 24
    assert cost.flops == 2 * 3 * 32 * 1000
    assert cost.params_touched == ("emb.weight",)


def test_module_bytes_are_not_the_sum_over_ops():
    mlp = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    cost = count(mlp, torch.randn(16, 256))
    # intermediates stay inside: read x 16384 + 2 * (W 262144 + b 1024), write y 16384
    assert (cost.bytes_read, cost.bytes_written) == (16384 + 2 * 263168, 16384)
    assert cost.op_bytes > cost.bytes     # each op reads/writes the intermediates again
    assert cost.flops == 2 * (2 * 16 * 256 * 256) + 16 * 256


def test_batchnorm_buffers_updated_in_place_are_written():
    bn = nn.BatchNorm1d(32).train()
    cost = count(bn, torch.randn(8, 32), outputs=True)
    # training: stats 3 + normalise 2 + affine 2 = 7 per element, 7 * 256 = 1792;
    # + 1 for num_batches_tracked += 1
    assert cost.flops == 1792 + 1
    # y 8*32*4 = 1024 + running_mean and running_var 2 * 32*4 = 256 (+ num_batches_tracked 8)
    assert cost.bytes_written == 1024 + 256 + 8


def test_unknown_and_free_ops():
    class Odd(nn.Module):
        def forward(self, x):
            y = x.t().contiguous().view(-1).reshape(4, 4)   # free views + one clone
            return torch.linalg.inv(y)                      # no formula

    cost = count(Odd(), torch.randn(4, 4))
    assert cost.unknown_ops >= 1 and any("linalg" in n for n in cost.unknown_names)
    assert not any(n in cost.unknown_names for n in ("aten::t", "aten::view", "aten::_unsafe_view"))


def test_compute_dtype_under_autocast():
    lin = nn.Linear(64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cost = count(lin, torch.randn(32, 64))
    assert cost.compute_dtype == "bfloat16"


def test_autocast_linear_counts_its_bf16_matmul_once():
    # a dispatch mode sees what ran: the three casts and one bf16 addmm, never the aten::linear
    # wrapper that saw fp32 weights (issue 12: a trace nests both; insitu.working_ops)
    lin = nn.Linear(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cost = count(lin, torch.randn(4, 8, 32), outputs=True)
    assert [(op.name, op.dtype) for op in cost.ops if op.cost.flops] == [("aten::addmm", "bfloat16")]
    assert {op.name for op in cost.ops} == {"aten::_to_copy", "aten::addmm"}
    assert cost.flops == 2 * 32 * 32 * 64 and cost.compute_dtype == "bfloat16"


def test_dominant_dtype_is_the_one_with_most_flops():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Linear(256, 256).to(torch.bfloat16)

        def forward(self, x):
            return self.big(x.to(torch.bfloat16)).float() * 2.0   # the mul runs in fp32

    assert count(Mixed(), torch.randn(64, 256)).compute_dtype == "bfloat16"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_compute_dtype_on_gpu():
    lin, x = nn.Linear(256, 256).cuda(), torch.randn(64, 256, device="cuda")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert count(lin, x).compute_dtype == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert count(lin, x).compute_dtype == "float32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])


def test_meta_tensors_are_counted_without_data():
    lin = nn.Linear(64, 32, device="meta")
    cost = count(lin, torch.empty(8, 64, device="meta"))
    assert (cost.flops, cost.bytes_read, cost.bytes_written) == (32768, 10368, 1024)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_on_gpu_counts_once():
    q = torch.randn(4, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    cost = count(Attention(True), q, q, q)
    # dense 2 * 2*4*8*256*256*64 = 536870912; causal keeps 256*257/2 of 256^2 -> 269484032
    assert cost.flops == 536870912 and cost.flops_executed == 269484032
    assert cost.compute_dtype == "bfloat16" and cost.unknown_ops == 0
