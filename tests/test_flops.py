"""FLOP/byte formulas: hand-worked figures, FlopCounterMode cross-checks, Kineto events."""
import gzip
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from cbtrace.cost import flops
from cbtrace.cost.flops import OpCost, is_free, op_cost, registered_ops, trace_op_cost
from cbtrace.cost.opcount import OpCounter

F32 = ["float32", "float32", "float32"]


def test_names_are_normalised():
    assert flops.normalize_name("aten.mm.default") == "aten::mm"
    assert flops.normalize_name("aten::add.Tensor") == "aten::add"
    assert flops.normalize_name(torch.ops.aten.addmm.default) == "aten::addmm"
    assert flops.normalize_name("mm") == "aten::mm"
    assert op_cost("aten.mm.default", [(2, 3), (3, 4)], F32) == op_cost("aten::mm", [(2, 3), (3, 4)], F32)


def test_second_registration_raises():
    flops.flop_formula("test::only_once")(lambda x: OpCost(0, 0, 0))
    try:
        with pytest.raises(ValueError, match="registered twice"):
            flops.flop_formula("test::only_once")(lambda x: OpCost(0, 0, 0))
        with pytest.raises(ValueError, match="registered twice"):
            flops.flop_formula("aten::view")(lambda x: OpCost(0, 0, 0))   # a free op
    finally:
        flops._FORMULAS.pop("test::only_once")


def test_declared_params_match_torch_schemas():
    # trace_op_cost maps "Concrete Inputs" to names by these positions: they must be the schema's.
    wrong = []
    for name, params in registered_ops().items():
        if params is None:
            continue
        schemas = torch._C._jit_get_schemas_for_operator(name)
        if not any([a.name for a in s.arguments][: len(params)] == list(params) for s in schemas):
            wrong.append(name)
    assert wrong == []
    assert len(registered_ops()) > 150


def test_matmul_family_by_hand():
    # mm (64x128)@(128x32): 2*64*128*32 = 524288 FLOPs; bytes (64*128 + 128*32 + 64*32)*4 = 57344
    assert op_cost("aten::mm", [(64, 128), (128, 32)], F32) == OpCost(524288, 524288, 57344)
    # bf16 bytes halve: 28672
    assert op_cost("aten::mm", [(64, 128), (128, 32)], ["bfloat16"] * 2).bytes == 28672
    # linear on (4, 16, 128) with weight (32, 128): M = 64 -> same 524288 FLOPs as the mm
    assert op_cost("aten::linear", [(4, 16, 128), (32, 128), (32,)], F32).flops == 524288
    # addmm counts no bias FLOPs (FlopCounterMode convention): 2*8*4*5 = 320
    assert op_cost("aten::addmm", [(5,), (8, 4), (4, 5)], F32).flops == 320
    # matmul (3, 1, 8, 4) @ (6, 4, 2): batch broadcast (3, 6), 2*18*8*4*2 = 2304
    assert op_cost("aten::matmul", [(3, 1, 8, 4), (6, 4, 2)], F32).flops == 2304
    # baddbmm (b=2, 3x4 @ 4x5): 2*2*3*4*5 = 240
    assert op_cost("aten::baddbmm", [(2, 3, 5), (2, 3, 4), (2, 4, 5)], F32).flops == 240


def _meta(*shape):
    return torch.empty(*shape, device="meta")


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64), st.integers(1, 4))
def test_mm_bmm_addmm_agree_with_flopcountermode(m, k, n, b):
    cases = [("aten::mm", (_meta(m, k), _meta(k, n)), torch.mm),
             ("aten::bmm", (_meta(b, m, k), _meta(b, k, n)), torch.bmm),
             ("aten::addmm", (_meta(n), _meta(m, k), _meta(k, n)), torch.addmm)]
    for name, args, fn in cases:
        with FlopCounterMode(display=False) as fc:
            fn(*args)
        assert op_cost(name, [tuple(a.shape) for a in args], F32).flops == fc.get_total_flops()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 2]), st.integers(1, 3), st.integers(1, 3),
       st.integers(0, 2), st.integers(1, 2), st.integers(5, 12), st.booleans())
def test_conv_agrees_with_flopcountermode(n, groups, cin_g, k, pad, stride, size, transposed):
    cin, cout = cin_g * groups, 2 * groups
    x = _meta(n, cin, size, size)
    w = _meta(cin, cout // groups, k, k) if transposed else _meta(cout, cin_g, k, k)
    with FlopCounterMode(display=False) as fc:
        out = torch.ops.aten.convolution(x, w, None, [stride] * 2, [pad] * 2, [1, 1], transposed, [0, 0], groups)
    cost = op_cost("aten::convolution", [x.shape, w.shape, None], F32, scalars=dict(
        stride=[stride] * 2, padding=[pad] * 2, dilation=[1, 1], transposed=transposed,
        output_padding=[0, 0], groups=groups))
    assert cost.flops == fc.get_total_flops()
    assert cost.bytes == (x.numel() + w.numel() + out.numel()) * 4


def test_conv_needs_stride_and_padding():
    # ResNet traces from torch 1.9 have no Concrete Inputs: output size unknown -> no figure.
    assert op_cost("aten::conv2d", [(1, 3, 8, 8), (4, 3, 3, 3), None], F32) is None
    # with them: out 4x4 (stride 2, pad 1) -> 2 * 1*16 * 4 * 9 * 3 = 3456
    assert op_cost("aten::conv2d", [(1, 3, 8, 8), (4, 3, 3, 3), None], F32,
                   scalars={"stride": [2, 2], "padding": [1, 1]}).flops == 3456


def test_sdpa_dense_and_executed():
    q = (2, 4, 8, 16)   # (B, H, S, D)
    # dense: QK^T 2*2*4*8*8*16 = 16384, PV the same -> 32768
    dense = op_cost("aten::_scaled_dot_product_flash_attention", [q, q, q], F32)
    assert (dense.flops, dense.flops_executed) == (32768, 32768)
    # causal S=8: 8*9/2 = 36 of 64 scores kept -> executed 32768 * 36/64 = 18432; mfu keeps dense
    causal = op_cost("aten::_scaled_dot_product_flash_attention", [q, q, q], F32, scalars={"is_causal": True})
    assert (causal.flops, causal.flops_executed) == (32768, 18432)
    # Sq=4 < Sk=8, top-left mask: rows keep 1+2+3+4 = 10 of 32 -> 2*2*4*4*8*(16+16) * 10/32 = 5120
    kv = (2, 4, 8, 16)
    short = op_cost("aten::_scaled_dot_product_efficient_attention", [(2, 4, 4, 16), kv, kv], F32,
                    scalars={"is_causal": True})
    assert (short.flops, short.flops_executed) == (16384, 5120)
    # flash forward kernel takes (B, S, H, D) and agrees with the (B, H, S, D) entry point
    bshd = (2, 8, 4, 16)
    assert op_cost("aten::_flash_attention_forward", [bshd] * 3, F32,
                   scalars={"is_causal": True}).flops_executed == 18432
    # backward: 2.5x forward (torch sdpa_backward_flop) = 81920
    assert op_cost("aten::_scaled_dot_product_flash_attention_backward", [q] * 4, F32).flops == 81920


def test_sdpa_forward_and_backward_through_opcounter():
    # FlopCounterMode reads 0 for the CPU kernel (_scaled_dot_product_flash_attention_for_cpu);
    # we count forward 32768 + backward 2.5 * 32768 = 114688.
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    with OpCounter() as oc:
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    attention = [op for op in oc.cost().ops if "scaled_dot_product" in op.name]
    assert [op.name for op in attention] == ["aten::_scaled_dot_product_flash_attention_for_cpu",
                                             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert sum(op.cost.flops for op in attention) == 114688


def test_elementwise_norm_softmax_constants():
    x = (8, 256)   # 2048 elements
    assert op_cost("aten::relu", [x], ["float32"]).flops == 2048
    assert op_cost("aten::gelu", [x], ["float32"]).flops == 5 * 2048
    assert op_cost("aten::gelu", [x], ["float32"], scalars={"approximate": "tanh"}).flops == 9 * 2048
    assert op_cost("aten::silu_", [x], ["float32"]).flops == 4 * 2048
    # add broadcasting (8, 256) + (256,): 2048 FLOPs; bytes (2048 + 256 + 2048) * 4 = 17408
    assert op_cost("aten::add", [x, (256,)], F32) == OpCost(2048, 2048, 17408)
    # layer norm with weight and bias: 7 per element = 14336
    assert op_cost("aten::native_layer_norm", [x, None, (256,), (256,)], F32,
                   scalars={"normalized_shape": [256]}).flops == 14336
    assert op_cost("aten::rms_norm", [x, None, (256,)], F32).flops == 4 * 2048
    assert op_cost("aten::_softmax", [x], ["float32"]).flops == 5 * 2048
    # batch norm eval without affine: 2 per element
    assert op_cost("aten::_native_batch_norm_legit_no_training", [x, None, None, (256,), (256,)],
                   ["float32"] * 5).flops == 2 * 2048
    # sum over dim 1 of (8, 256): 2048 adds, 8 outputs -> bytes 2048*4 + 8*4 = 8224
    assert op_cost("aten::sum", [x], ["float32"], scalars={"dim": [1]}) == OpCost(2048, 2048, 8224)


def test_embedding_bytes_count_gathered_rows_only():
    # table 10000 x 64 fp32 (2.56 MB); 30 indices (int64) -> rows 30*64*4 = 7680 read, 7680 written
    cost = op_cost("aten::embedding", [(10000, 64), (30,)], ["float32", "int64"])
    assert cost == OpCost(0, 0, 7680 + 30 * 8 + 7680)
    # bag, mode sum, 3 bags (offsets of 3): adds 30*64 = 1920; out 3*64*4 = 768
    bag = op_cost("aten::_embedding_bag", [(10000, 64), (30,), (3,)], ["float32", "int64", "int64"],
                  scalars={"mode": 0})
    assert bag == OpCost(1920, 1920, 7680 + 240 + 24 + 768)
    # mean adds a divide per output element: 1920 + 3*64 = 2112
    assert op_cost("aten::_embedding_bag", [(10000, 64), (30,), (3,)], ["float32", "int64", "int64"],
                   scalars={"mode": 1}).flops == 2112


def test_losses_and_free_ops():
    # cross entropy on (512, 1000): log_softmax 5*512000 + nll 512 = 2560512
    assert op_cost("aten::cross_entropy_loss", [(512, 1000), (512,)], ["float32", "int64"]).flops == 2560512
    assert op_cost("aten::nll_loss_forward", [(512, 1000), (512,)], ["float32", "int64"]).flops == 512
    for name in ("aten::view", "aten::t", "aten::transpose", "aten::expand", "aten::as_strided",
                 "aten::detach", "aten::_unsafe_view", "aten::to", "aten::reshape"):
        assert is_free(name) and op_cost(name, [(4, 4)], ["float32"]) == OpCost(0, 0, 0)
    assert op_cost("aten::linalg_inv", [(4, 4)], ["float32"]) is None


def test_trace_op_cost_parses_kineto_args():
    # exact args of an aten::addmm in shared/traces/generated (torch 2.13 CPU)
    cost = trace_op_cost("aten::addmm", [[256], [512, 256], [256, 256], [], []],
                         ["float", "float", "float", "Scalar", "Scalar"], ["", "", "", "1", "1"])
    assert cost.flops == 2 * 512 * 256 * 256
    sdpa_dims = [[8, 4, 64, 64]] * 3 + [[]] * 5
    sdpa_types = ["float", "float", "float", "", "Scalar", "Scalar", "", "Scalar"]
    causal = trace_op_cost("aten::scaled_dot_product_attention", sdpa_dims, sdpa_types,
                           ["", "", "", "", "0.1", "True", "", "False"])
    plain = trace_op_cost("aten::scaled_dot_product_attention", sdpa_dims, sdpa_types,
                          ["", "", "", "", "0.1", "False", "", "False"])
    assert causal.flops == plain.flops == plain.flops_executed == 4 * 8 * 4 * 64 * 64 * 64
    assert causal.flops_executed == plain.flops * (64 * 65 / 2) / (64 * 64)
    bf16 = trace_op_cost("aten::mm", [[4, 8], [8, 2]], ["c10::BFloat16", "c10::BFloat16"], None)
    assert bf16.bytes == (32 + 16 + 8) * 2
    assert trace_op_cost("aten::cat", [[], []], ["TensorList", "Scalar"], None) is None
    assert trace_op_cost("aten::no_such_op", [[2]], ["float"], None) is None


def _kineto_ops(trace: dict):
    """aten op events (other cpu_op events, e.g. autograd nodes, are transparent wrappers)."""
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e["name"].startswith("aten::")]


def outermost_costs(events):
    """Sum trace_op_cost over the outermost ops that have a formula (free ops are transparent)."""
    events = sorted(events, key=lambda e: (e.get("tid"), e["ts"], -e["dur"]))
    stack, total, executed, unknown = [], 0.0, 0.0, []
    for e in events:
        while stack and (stack[-1]["tid"] != e.get("tid") or e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]):
            stack.pop()
        if not any(s.get("_counted") for s in stack) and not is_free(e["name"]):
            a = e.get("args", {})
            cost = trace_op_cost(e["name"], a.get("Input Dims", []), a.get("Input type", []),
                                 a.get("Concrete Inputs"))
            if cost is None:
                unknown.append(e["name"])
            else:
                e["_counted"] = True
                total, executed = total + cost.flops, executed + cost.flops_executed
        stack.append(e)
    return total, executed, unknown


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.lin = nn.Linear(64, 32)
        self.bag = nn.EmbeddingBag(100, 32, mode="mean")
        self.norm = nn.LayerNorm(32)

    def forward(self, img, x, idx):
        c = self.conv(img)
        h = self.norm(self.lin(x) + self.bag(idx).unsqueeze(1))
        q = h.view(2, 4, 4, 8).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return c.sum() + a.sum() + F.gelu(h).mean() + torch.softmax(h, -1).sum()


def test_recorded_cpu_trace_matches_opcounter(tmp_path):
    """The same step, counted from a record_shapes=True trace and by OpCounter, gives equal FLOPs."""
    from torch.profiler import ProfilerActivity, profile

    net = SmallNet()
    args = (torch.randn(2, 3, 8, 8), torch.randn(2, 4, 64), torch.randint(0, 100, (2, 5)))
    with torch.no_grad():
        with OpCounter() as oc:
            net(*args)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            net(*args)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    total, executed, unknown = outermost_costs(_kineto_ops(json.loads((tmp_path / "t.json").read_text())))
    counted = oc.cost()
    assert unknown == [] and counted.unknown_ops == 0
    # conv 2*2*16*8*27 = 13824, linear 2*8*64*32 = 32768, causal SDPA dense 4096 / executed 2560, ...
    assert total == counted.flops == 56707
    assert executed == counted.flops_executed == 56707 - 4096 + 2560


def test_shared_generated_trace(shared_traces):
    path = next((shared_traces / "generated" / "torch2.13cpu_transformer2").glob("*.json.gz"))
    ops = _kineto_ops(json.load(gzip.open(path, "rt")))
    total, _, unknown = outermost_costs(ops)
    # 2 encoder layers (d=256, ff=512), seq 64 x batch 8 = 512 tokens, vocab 1000: forward linears
    # alone are 2*512*256*(768+256+512+512)*2 layers + 2*512*256*1000 = 1.36 GFLOP per step
    assert total > 3 * 1.36e9 * 3   # 3 active steps, forward + backward (~3x forward)
    assert unknown == []


def test_shared_gpu_trace_events(shared_traces):
    """Matmul events of an HTA A100 training trace: our figure = FlopCounterMode on meta tensors."""
    path = shared_traces / "hta" / "tests" / "data" / "trace_filter" / "sampled_rank-0.json.gz"
    ops = _kineto_ops(json.load(gzip.open(path, "rt")))
    fns = {"aten::mm": torch.mm, "aten::bmm": torch.bmm, "aten::addmm": torch.addmm}
    checked = 0
    for e in ops:
        if e["name"] not in fns:
            continue
        a = e["args"]
        cost = trace_op_cost(e["name"], a["Input Dims"], a["Input type"], a.get("Concrete Inputs"))
        tensors = [_meta(*d) for d, t in zip(a["Input Dims"], a["Input type"]) if t == "float"]
        with FlopCounterMode(display=False) as fc:
            fns[e["name"]](*tensors)
        assert cost.flops == fc.get_total_flops(), e
        checked += 1
    assert checked > 100
    # one by hand: aten::bmm [[2048, 160, 45], [2048, 45, 20]] -> 2*2048*160*45*20 = 589824000
    assert trace_op_cost("aten::bmm", [[2048, 160, 45], [2048, 45, 20]], ["float", "float"], None).flops == 589824000


def _quiet_quantized():
    import warnings

    warnings.filterwarnings("ignore", message=".*quantize.*deprecated", category=UserWarning)


def test_dynamic_quantized_linear_counts_like_its_float_version():
    _quiet_quantized()
    torch.manual_seed(0)
    fp = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    q = torch.ao.quantization.quantize_dynamic(fp, {nn.Linear}, dtype=torch.qint8)
    x = torch.randn(4, 64)
    with OpCounter() as qc:
        q(x)
    with OpCounter() as fc:
        fp(x)
    names = [op.name for op in qc.cost().ops]
    assert names.count("quantized::linear_dynamic") == 2
    # by hand: 2*4*64*32 + 4*32 (relu) + 2*4*32*8
    assert qc.cost().flops == fc.cost().flops == 16384 + 128 + 2048
    assert qc.cost().unknown_ops == 0
    first = qc.cost().ops[0].cost
    assert first.bytes == 4 * 64 * 4 + 32 * 64 * 1 + 4 * 32 * 4  # float X, int8 weight, float Y


def test_quantized_conv_counts_like_its_float_version():
    _quiet_quantized()
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 9)
    qx = torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)
    qconv = torch.ao.nn.quantized.Conv2d(4, 8, 3, stride=2, padding=1)
    with OpCounter() as qc:
        qconv(qx)
    with OpCounter() as fc:
        nn.Conv2d(4, 8, 3, stride=2, padding=1)(x)
    assert [op.name for op in qc.cost().ops] == ["quantized::conv2d"]
    # by hand: 2 * N 2 * out 5x5 * C_out 8 * k 3x3 * C_in 4
    assert qc.cost().flops == fc.cost().flops == 2 * 2 * 25 * 8 * 9 * 4


def test_packed_weight_missing_gives_no_figure():
    """A Kineto event has no dims for the packed weight: no figure, never a wrong one."""
    assert op_cost("quantized::linear_dynamic", [(4, 64), None, None], ["float32"]) is None
    assert trace_op_cost("quantized::linear_dynamic", [[4, 64], [], []],
                         ["float", "ScriptObject", "Scalar"], ["", "", "True"]) is None


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_fast_path_ops_count_like_the_unfused_path(activation):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0,
                                       activation=activation).eval()
    x = torch.randn(4, 10, 32)
    with torch.no_grad(), OpCounter() as fused:  # eval without grad: PyTorch's fast path
        layer(x)
    with OpCounter() as unfused:  # grad enabled: the module-by-module path
        layer(x)
    assert [op.name for op in fused.cost().ops] == ["aten::_transformer_encoder_layer_fwd"]
    assert fused.cost().unknown_ops == 0
    # the unfused path adds the in-projection bias separately (T * 3E = 3840 FLOPs)
    assert unfused.cost().flops - fused.cost().flops == 40 * 96
    with torch.no_grad(), OpCounter() as mha:
        layer.self_attn(x, x, x, need_weights=False)
    assert [op.name for op in mha.cost().ops] == ["aten::_native_multi_head_attention"]
    # by hand, T = 40 tokens, E = 32: qkv 2*T*E*3E + attention 4*B*S*S*E + out 2*T*E*E
    assert mha.cost().flops == 2 * 40 * 32 * 96 + 4 * 4 * 10 * 10 * 32 + 2 * 40 * 32 * 32
