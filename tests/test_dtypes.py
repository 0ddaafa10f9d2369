"""The one dtype table (cost/dtypes.py) and the one compute-dtype rule (cost/compute_dtype.py)."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from cbtrace.cost import dtypes
from cbtrace.cost.compute_dtype import dominant_dtype, op_dtype
from cbtrace.cost.dtypes import (CLI_DTYPES, is_floating, itemsize, kineto_name, name_of,
                                 peak_key, torch_dtype)


def test_every_spelling_names_one_dtype():
    for spelling in (torch.bfloat16, "torch.bfloat16", "bfloat16", "bf16", "c10::BFloat16"):
        assert name_of(spelling) == "bfloat16"
    assert name_of(torch.half) == name_of("half") == name_of("c10::Half") == "float16"
    assert name_of("long int") == name_of(torch.long) == "int64"
    assert name_of(torch.quint8) == "quint8" and name_of(None) is None  # not in the table
    assert [itemsize(d) for d in ("float", "c10::BFloat16", "long int", "bool", "complex64")] == [4, 2, 8, 1, 8]
    assert itemsize("not a dtype") == 4


def test_kineto_names_tell_tensors_from_scalars():
    # the "Input type" strings torch 2.13's profiler writes for tensors of these dtypes
    assert [kineto_name(t) for t in ("float", "c10::BFloat16", "long int", "short unsigned int",
                                     "c10::Float8_e4m3fn", "bool")] == [
        "float32", "bfloat16", "int64", "uint16", "float8_e4m3fn", "bool"]
    assert [kineto_name(t) for t in ("Scalar", "ScalarList", "TensorList", "", "bf16")] == [None] * 5


def test_floating_and_peak_keys():
    assert [is_floating(d) for d in ("c10::Half", "tf32", "float8_e5m2", "int64", "complex64")] == [
        True, True, True, False, False]
    # the keys of the peak table (cost/peaks.py)
    assert [peak_key(d) for d in (torch.float32, "float", "tf32", "bfloat16", "half",
                                  "float8_e4m3fn", "fp8")] == ["fp32", "fp32", "tf32", "bf16", "fp16", "fp8", "fp8"]
    assert peak_key("float64") is None and peak_key("int64") is None and peak_key(None) is None
    assert all(peak_key(d) is None or peak_key(d) in dtypes.PEAK_KEYS for d in dtypes.DTYPES)


def test_torch_dtype_of_cli_names_and_every_torch_dtype():
    assert [torch_dtype(n) for n in CLI_DTYPES] == [torch.float32, torch.float32, torch.bfloat16,
                                                    torch.bfloat16, torch.float16, torch.float16]
    assert torch_dtype("tf32") is torch.float32 and torch_dtype("c10::Half") is torch.float16
    # the input store writes name_of(t.dtype) and reads it back with torch_dtype
    for dt in {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}:
        assert torch_dtype(name_of(dt)) is dt, dt
    with pytest.raises(ValueError, match=r"'fp42'.*fp32, float32, bf16, bfloat16, fp16, float16"):
        torch_dtype("fp42")


def test_a_second_spelling_registration_raises():
    with pytest.raises(ValueError, match="'bf16' registered twice"):
        dtypes.register_dtype(dtypes.DType("brainfloat", 2, True, "bf16", aliases=("bf16",)))


def test_trace_side_does_not_import_torch():
    code = ("import sys; import cbtrace.cost.dtypes, cbtrace.cost.compute_dtype, cbtrace.cost.flops, "
            "cbtrace.cost.peaks, cbtrace.attribution.op_costs, cbtrace.attribution.insitu; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


# --- the compute-dtype rule ----------------------------------------------------------------

def test_op_dtype_is_the_first_floating_operand():
    assert op_dtype(["int64", None, torch.bfloat16, "float32"]) == "bfloat16"
    assert op_dtype([kineto_name(t) for t in ("long int", "c10::Half")]) == "float16"
    assert op_dtype(["float32", "float32"], tf32=True) == "tf32"
    assert op_dtype(["bfloat16"], tf32=True) == "bfloat16"   # TF32 only changes fp32 math
    assert op_dtype(["int64", "bool"]) is None and op_dtype([]) is None


def test_dominant_dtype_hand_worked():
    # mm (64x256 @ 256x256, bf16): 2*64*256*256 = 8_388_608 FLOPs, (16384 + 65536 + 16384) * 2 B;
    # native_layer_norm (64x256, fp32, weight and bias): 7 * 16384 = 114_688 FLOPs
    ops = [("bfloat16", 8_388_608, 196_608), ("float32", 114_688, 133_632), (None, 1e12, 0)]
    assert dominant_dtype(ops) == "bfloat16"
    # totals per dtype decide, not single ops: 114_688 + 8_300_000 fp32 > 8_388_608 bf16
    assert dominant_dtype(ops[::-1] + [("float32", 8_300_000, 0)]) == "float32"
    # no FLOPs anywhere (an Embedding and a copy): the most bytes decide
    assert dominant_dtype([("float32", 0, 4096), ("bfloat16", 0, 8192)]) == "bfloat16"
    # ties go to the name sorting first, whatever the order; nothing moved -> no dtype
    assert dominant_dtype([("float32", 10, 0), ("bfloat16", 10, 0)]) == "bfloat16"
    assert dominant_dtype([("float32", 0, 0)]) is None and dominant_dtype([]) is None


# --- replay and attribution agree -----------------------------------------------------------

class _Block(nn.Module):
    """A bf16 matmul, then a LayerNorm in fp32: 8.4M bf16 FLOPs against 115k fp32 ones."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256, bias=False).bfloat16()
        self.norm = nn.LayerNorm(256)

    def forward(self, x):
        return self.norm(self.fc(x.bfloat16()).float())


def test_replay_takes_the_dtype_with_most_flops():
    from cbtrace.cost.opcount import OpCounter

    block, x = _Block(), torch.randn(64, 256)
    with OpCounter() as oc:
        block(x)
    cost = oc.cost()
    assert {op.name: op.dtype for op in cost.ops}["aten::native_layer_norm"] == "float32"
    assert cost.compute_dtype == "bfloat16"
    emb, ids = nn.Embedding(1000, 64).bfloat16(), torch.arange(32)
    with OpCounter() as oc:   # no FLOPs: the gathered bf16 rows are the bytes
        emb(ids)
    assert oc.cost().compute_dtype == "bfloat16"


def _op(name, ts, dur, dims, types, concrete=None):
    args = {"Input Dims": dims, "Input type": types}
    if concrete is not None:
        args["Concrete Inputs"] = concrete
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": args}


def _range(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts,
            "dur": dur}


def test_attribution_takes_the_dtype_with_most_flops(tmp_path):
    from cbtrace.attribution.attribute import attribute

    bf16, fp32 = "c10::BFloat16", "float"
    events = [
        _range("ProfilerStep#1", 0, 100), _range("cbtrace::block", 10, 50),
        _op("aten::mm", 12, 10, [[64, 256], [256, 256]], [bf16, bf16]),
        _op("aten::native_layer_norm", 30, 10, [[64, 256], [], [256], [256], []],
            [fp32, "ScalarList", fp32, fp32, "Scalar"], ["", "[256]", "", "", "1e-05"]),
        _range("cbtrace::emb", 70, 20),
        _op("aten::embedding", 72, 5, [[1000, 64], [32], [], [], []],
            [bf16, "long int", "Scalar", "Scalar", "Scalar"], ["", "", "-1", "False", "False"]),
    ]
    p = tmp_path / "mixed.json"
    p.write_text(json.dumps({"traceEvents": events}))
    df = attribute(p, aggregate=False)
    rows = {r.fqn: r for r in df[df.step == 1].itertuples()}
    assert rows["block"].flops == 2 * 64 * 256 * 256 + 7 * 64 * 256
    assert rows["block"].compute_dtype == "bfloat16"
    assert rows["emb"].flops == 0 and rows["emb"].compute_dtype == "bfloat16"  # by bytes


def test_meta_bytes_sums_the_tensors_a_record_describes():
    from cbtrace.cost.dtypes import meta_bytes

    metas = '[{"shape": [8, 1024, 768], "dtype": "bfloat16"}, {"shape": [4], "dtype": "int64"}]'
    assert meta_bytes(metas) == 8 * 1024 * 768 * 2 + 4 * 8
    assert meta_bytes("[]") == meta_bytes(None) == meta_bytes("not json") == 0
