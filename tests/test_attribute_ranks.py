"""Across-rank attribution (issue 16, parts 3 and 4): ranks read by worker processes, the
across-rank view naming a planted straggler, NCCL kernels and their exposed time on real HTA
traces, and real module names from ``--model`` without a capture run."""
import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers.module_traces import module_trace
from helpers.paths import REPO

from cbtrace.attribution import comm
from cbtrace.attribution.attribute import attribute, summary_text
from cbtrace.attribution.ranks import across_ranks
from cbtrace.errors import ProviderError

DATA = Path(__file__).parent / "data"
RECORDER = DATA / "record_attribution_traces.py"
STRAGGLER = f"{RECORDER}:straggler_model"
NCCL = "hta/tests/data/nccl_parser_config/nccl_data.json.gz"
KINETO = ("USDT", "STAGE")  # Kineto's own log lines


def _recorder():
    spec = importlib.util.spec_from_file_location("record_attribution_traces", RECORDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cbtrace(*args):
    """(returncode, stdout, stderr lines that are not Kineto's) of ``cbtrace ARGS``."""
    out = subprocess.run([sys.executable, "-m", "cbtrace", *args], capture_output=True,
                         text=True, cwd=REPO, timeout=600)
    return out.returncode, out.stdout, [ln for ln in out.stderr.splitlines()
                                        if ln.strip() and not ln.startswith(KINETO)]


def _events(path: Path) -> list:
    data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    return [e for e in json.loads(data)["traceEvents"] if e.get("ph") == "X"]


@pytest.fixture(scope="module")
def rank_dir(tmp_path_factory):
    """rank0 / rank1 CPU traces of ``Pipeline``; rank 1's ``stages.1`` does 1,000 extra matmuls
    (with 50, a loaded 2-core VM once made rank 0's plain call the slower one)."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("ranks")
    _recorder().record_ranks(out, ranks=2, slow_rank=1, slow=1000)
    return out


# ---------------------------------------------------------------- the across-rank view

def test_across_ranks_names_the_straggler(rank_dir):
    df = attribute(rank_dir, model=STRAGGLER, workers=1)
    assert sorted(set(df["rank"])) == [0, 1] and set(df.step) == {1, 2, 3}
    a = across_ranks(df)
    assert list(a.columns) == ["fqn", "call_index", "phase", "metric", "ranks", "min_ms",
                               "median_ms", "max_ms", "slowest_rank", "spread"]
    r = a[(a.fqn == "stages.1") & (a.phase == "fwd")].iloc[0]
    assert r.metric == "cpu_ms" and r.ranks == 2 and r.slowest_rank == 1
    assert r.max_ms > 3 * r.min_ms and r.spread == pytest.approx(r.max_ms / r.median_ms - 1)
    assert r.median_ms == pytest.approx((r.min_ms + r.max_ms) / 2)  # 2 ranks
    # sorted by how long the slowest rank holds the others up: the straggler's chain first
    assert a.fqn.iloc[0] in ("", "stages", "stages.1")
    # each rank's figure is its median over steps
    mine = df[(df.fqn == "stages.1") & (df["rank"] == 1)].cpu_ms.median()
    assert r.max_ms == pytest.approx(mine)


def test_cli_prints_the_across_rank_view(rank_dir):
    rc, out, err = cbtrace("attribute", str(rank_dir), "--model", STRAGGLER, "--top", "5")
    assert rc == 0 and not err, err
    head, across = out.split("across 2 ranks", 1)
    assert "ranks [0, 1]" in head and "slowest_rank" in across and "spread" in across
    line = next(ln for ln in across.splitlines() if ln.split()[:1] == ["stages.1"])
    assert line.split()[3] == "cpu_ms" and line.split()[-2] == "1"  # slowest rank: 1


def test_one_rank_prints_no_across_view(rank_dir, tmp_path):
    shutil.copy(rank_dir / "rank0.pt.trace.json", tmp_path)
    rc, out, _ = cbtrace("attribute", str(tmp_path))
    assert rc == 0 and "across" not in out and "comm_ms" not in out


def test_across_ranks_uses_device_time_where_there_is_some():
    df = pd.DataFrame({
        "rank": [0, 1, 0, 1], "step": [1, 1, 1, 1], "fqn": ["a", "a", "b", "b"],
        "call_index": 0, "phase": "fwd", "kernel_count": [2, 2, 0, 0],
        "cpu_ms": [5.0, 1.0, 1.0, 3.0], "cpu_self_ms": 0.0, "gpu_ms": [2.0, 4.0, 0.0, 0.0],
        "gpu_busy_ms": [2.0, 4.0, 0.0, 0.0], "gpu_self_ms": 0.0, "gpu_span_ms": 0.0,
        "comm_ms": 0.0, "comm_exposed_ms": 0.0})
    a = across_ranks(df).set_index("fqn")
    assert a.loc["a", "metric"] == "gpu_busy_ms" and a.loc["a", "slowest_rank"] == 1
    assert (a.loc["a", "min_ms"], a.loc["a", "median_ms"], a.loc["a", "max_ms"]) == (2, 3, 4)
    assert a.loc["a", "spread"] == pytest.approx(4 / 3 - 1)
    assert a.loc["b", "metric"] == "cpu_ms" and a.loc["b", "slowest_rank"] == 1
    assert list(a.index) == ["a", "b"]  # max - median: 1 ms each; ties keep the first


# ---------------------------------------------------------------- worker processes

def test_workers_give_the_same_table(shared_traces, rank_dir):
    d = shared_traces / "param/et_replay/tests/inputs/dlrm_kineto"
    one = attribute(d, workers=1)
    two = attribute(d, workers=2)
    assert sorted(set(one["rank"])) == list(range(8))
    pd.testing.assert_frame_equal(one, two)
    # names from --model travel to the workers too
    pd.testing.assert_frame_equal(attribute(rank_dir, model=STRAGGLER, workers=1),
                                  attribute(rank_dir, model=STRAGGLER, workers=2))


def test_workers_and_names_are_checked(rank_dir, tmp_path):
    with pytest.raises(ValueError, match="workers must be >= 1"):
        attribute(rank_dir, workers=0)
    with pytest.raises(ValueError, match="capture_run and model"):
        attribute(rank_dir, model=STRAGGLER, capture_run=tmp_path)
    rc, _, err = cbtrace("attribute", str(rank_dir), "--workers", "0")
    assert rc == 2 and len(err) == 1 and "--workers" in err[0]
    rc, _, err = cbtrace("attribute", str(rank_dir), "-o", "d=3")
    assert rc == 2 and err == ["Error: --option needs --model (see cbtrace attribute --help)"]


# ---------------------------------------------------------------- communication kernels

def test_exposed_time_is_interval_arithmetic():
    # one NCCL kernel [0, 10) on stream 1 of device 0; compute on streams 2 and 3 covers
    # [2, 6) and [8, 10); compute on its own stream or on device 1 does not count
    ts = np.array([0.0, 2.0, 3.0, 8.0, 0.0, 0.0, 20.0])
    dur = np.array([10.0, 2.0, 3.0, 4.0, 10.0, 10.0, 5.0])
    is_comm = np.array([True, False, False, False, False, False, True])
    compute = ~is_comm
    device = np.array([0, 0, 0, 0, 0, 1, 0])
    stream = np.array([1, 2, 2, 3, 1, 2, 1])
    out = comm.exposed(ts, dur, is_comm, compute, device, stream)
    assert out.tolist() == [4.0, 0, 0, 0, 0, 0, 5.0]
    lo, hi = comm.union(np.array([5.0, 0.0, 1.0, 9.0]), np.array([6.0, 2.0, 3.0, 9.5]))
    assert lo.tolist() == [0.0, 5.0, 9.0] and hi.tolist() == [3.0, 6.0, 9.5]
    assert comm.covered(lo, hi, np.array([-1.0, 2.5, 7.0]), np.array([1.0, 9.25, 8.0])).tolist() \
        == [1.0, 0.5 + 1.0 + 0.25, 0.0]
    assert comm.is_comm_kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert comm.is_comm_op("c10d::allreduce_") and comm.is_comm_op("record_param_comms")
    assert not comm.is_comm_op("aten::mm") and not comm.is_comm_kernel("volta_sgemm_128x64_nn")


def _naive_exposed(events) -> float:
    """Exposed µs of every NCCL kernel, one event at a time (the slow reference)."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    total = 0.0
    for c in (e for e in kernels if "nccl" in e["name"].lower()):
        a, b = c["ts"], c["ts"] + c["dur"]
        cover = sorted((max(k["ts"], a), min(k["ts"] + k["dur"], b)) for k in kernels
                       if "nccl" not in k["name"].lower() and k["pid"] == c["pid"]
                       and k["tid"] != c["tid"] and k["ts"] < b and k["ts"] + k["dur"] > a)
        covered, reach = 0.0, a
        for lo, hi in cover:
            if hi > reach:
                covered += hi - max(lo, reach)
                reach = hi
        total += c["dur"] - covered
    return total


def test_nccl_kernels_belong_to_the_issuing_module(shared_traces):
    path = shared_traces / NCCL
    events = _events(path)
    nccl = [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    df = attribute(path)
    roots = df[df.depth <= 0]  # module roots and unattributed rows: every kernel once
    assert roots.comm_ms.sum() * 1e3 == pytest.approx(sum(e["dur"] for e in nccl), rel=1e-9)
    assert roots.comm_exposed_ms.sum() * 1e3 == pytest.approx(_naive_exposed(events), rel=1e-6)
    assert (df.comm_exposed_ms <= df.comm_ms + 1e-12).all() and (df.comm_ms <= df.gpu_ms + 1e-9).all()
    assert 0 < roots.comm_exposed_ms.sum() < roots.comm_ms.sum()
    assert "comm_exposed_ms_median" in summary_text(df)  # shown where there is communication
    # the collectives' annotations are ops, not modules: DDP's broadcasts are its forward's
    assert not df.fqn.str.startswith("nccl:").any()
    ddp = df[(df.fqn == "DistributedDataParallel.forward") & (df.phase == "fwd")]
    bcast = [e for e in nccl if "Broadcast" in e["name"]]
    assert ddp.comm_ms.sum() * 1e3 == pytest.approx(sum(e["dur"] for e in bcast), rel=1e-9)
    # DDP's gradient all-reduce runs in AccumulateGrad hooks, which no module call owns
    ub = df[(df.fqn == "<unattributed>") & (df.phase == "bwd")]
    ar = [e for e in nccl if "AllReduce" in e["name"]]
    assert ub.comm_ms.sum() * 1e3 == pytest.approx(sum(e["dur"] for e in ar), rel=1e-9)


def test_nccl_per_rank_on_a_two_rank_directory(shared_traces, tmp_path):
    for r in (0, 1):
        shutil.copy(shared_traces / f"hta/tests/data/trace_filter/sampled_rank-{r}.json.gz",
                    tmp_path)
    df = attribute(tmp_path, workers=2)
    assert sorted(set(df["rank"])) == [0, 1]
    for r in (0, 1):
        events = _events(tmp_path / f"sampled_rank-{r}.json.gz")
        total = sum(e["dur"] for e in events if e.get("cat") == "kernel"
                    and "nccl" in e["name"].lower())
        roots = df[(df["rank"] == r) & (df.depth <= 0)]
        assert total > 0 and roots.comm_ms.sum() * 1e3 == pytest.approx(total, rel=1e-9)
        assert roots.comm_exposed_ms.sum() <= roots.comm_ms.sum()
    a = across_ranks(df)
    assert (a.ranks <= 2).all() and set(a.metric) <= {"gpu_busy_ms", "cpu_ms"}
    assert (a.min_ms <= a.median_ms).all() and (a.median_ms <= a.max_ms).all()


# ---------------------------------------------------------------- --model: names without a capture


@pytest.fixture(scope="module")
def gpt_trace(tmp_path_factory):
    pytest.importorskip("torch")
    return module_trace("nanogpt:tiny", tmp_path_factory.mktemp("gpt") / "gpt.pt.trace.json")


def test_model_names_like_a_capture_run(gpt_trace, tmp_path):
    from cbtrace.capture.from_spec import capture_model

    run = capture_model("nanogpt:tiny", tmp_path / "run", device="cpu").out
    by_model = attribute(gpt_trace, model="nanogpt:tiny")
    by_run = attribute(gpt_trace, capture_run=run)
    assert list(by_model.fqn) == list(by_run.fqn)
    mods = by_model[by_model.source == "nn.Module"]
    assert "transformer.h.1.attn.resid_dropout" in set(mods.fqn)  # attn_dropout is never called
    assert not mods.fqn.str.contains(r"(?:^|\.)[A-Z]\w*_\d+(?:$|\.)").any()  # no Class_N left


def test_model_of_another_model_is_refused(gpt_trace, tmp_path):
    rc, out, err = cbtrace("attribute", str(gpt_trace), "--model", "dlrm:tiny")
    assert rc == 1 and len(err) == 1 and not out, err
    assert err[0].startswith("Error: dlrm:tiny: its modules (first calls of a forward on the "
                             f"meta device) do not match the nn.Module events of {gpt_trace} "
                             "(the model calls SimpleDeepFMNN_0 (<root>) where the trace calls")
    rc, out, err = cbtrace("attribute", str(gpt_trace), "--model", "nanogpt:tiny")
    assert rc == 0 and "transformer.h.0.mlp" in out and "GPT_0" not in out
    # other options that change the module tree: refused too
    with pytest.raises(ProviderError, match=r"the model calls Block_2 \(transformer.h.2\) "
                       "where the trace calls LayerNorm_4"):
        attribute(gpt_trace, model="nanogpt")  # GPT-2 small: 12 blocks, built without weights


USER_MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x):
        if x.abs().sum().item() > 0:  # needs values: cannot run on meta
            for layer in self.layers:
                x = layer(x)
        return x


def net(n=2):
    return Net(n), (torch.ones(2, 4),)
'''


def test_model_whose_forward_needs_values_falls_back_to_declaration_order(tmp_path):
    pytest.importorskip("torch")
    user = tmp_path / "user.py"
    user.write_text(USER_MODELS)
    trace = module_trace(f"{user}:net", tmp_path / "net.pt.trace.json")
    df = attribute(trace, model=f"{user}:net")
    mods = df[df.source == "nn.Module"]
    assert list(mods.fqn) == ["", "layers.0", "layers.1"]
    with pytest.raises(ProviderError, match=r"declaration order \(named_modules\(\)\); the "
                       r"forward did not run on meta .*\(the trace has 2 Linear modules, the "
                       r"model 3\)"):
        attribute(trace, model=f"{user}:net", model_options={"n": 3})


def test_step_windows_count_comm_like_one_pass(shared_traces):
    path = shared_traces / NCCL
    key = ["step", "phase", "depth", "fqn", "call_index", "ts_us"]
    a = attribute(path, aggregate=False).sort_values(key, na_position="first")
    b = attribute(path, aggregate=False, steps_per_window=1).sort_values(key, na_position="first")
    np.testing.assert_allclose(a.comm_ms, b.comm_ms, rtol=1e-9)
    np.testing.assert_allclose(a.comm_exposed_ms, b.comm_exposed_ms, rtol=1e-9, atol=1e-9)
