"""GPU paths of capture and replay (run on the H200 with -m gpu; skipped elsewhere)."""
import time

import pytest
import torch
from helpers.settings import FAST_REPLAY

import cbtrace
from cbtrace.rundir.read import find_trace, read_modules
from cbtrace.capture.from_spec import capture_model
from cbtrace.model.spec import resolve
from cbtrace.state import state_fingerprint

pytestmark = pytest.mark.gpu
FAST = {**FAST_REPLAY, "budget_s": 0.02, "min_runs": 5, "warmup_runs": 2}


def tiny_cuda_capture(run):
    """nanogpt:tiny in bf16 on the GPU, captured into ``run``; returns the live model."""
    provider = resolve("nanogpt:tiny")
    model, batch = provider.model_and_batch("cuda", torch.bfloat16)
    model.eval()
    with cbtrace.capture(model, run):
        provider.run(model, batch)
    return model


def test_capture_and_replay_on_cuda_with_graph_timer(tmp_path):
    model = tiny_cuda_capture(tmp_path / "r")
    args, _ = cbtrace.load_inputs(tmp_path / "r", "transformer.h.0.attn")
    assert args[0].is_cuda and args[0].dtype == torch.bfloat16
    before = state_fingerprint(model)
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST)
    assert state_fingerprint(model) == before
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"][["fqn", "status_reason"]]
    assert (df["timer"] == "graph").mean() > 0.9
    work = df[df["module_type"].isin(["Linear", "LayerNorm", "Block", "GPT"])]
    assert (work["kernel_count"] > 0).all()  # (Dropout in eval launches nothing)
    lin = df[df["module_type"] == "Linear"]
    assert (lin["mfu"] > 0).all() and (lin["compute_dtype"] == "bfloat16").all()


def test_cold_mode_times_one_call_per_graph(tmp_path):
    model = tiny_cuda_capture(tmp_path / "r")
    warm = cbtrace.replay(tmp_path / "r", model=model, **FAST).set_index("call_id")
    t0 = time.perf_counter()
    cold = cbtrace.replay(tmp_path / "r", model=model, cold=True,
                          **{**FAST, "cold_budget_s": 0.1}).set_index("call_id")
    wall = time.perf_counter() - t0
    g = cold[cold["timer"] == "graph"]
    assert len(g) and g["timer_notes"].str.contains(r"\bK=1\b").all()
    # do_bench's durations: 25 ms of warm-up and 100 ms of timed runs per call
    assert wall > len(cold[cold["status"] == "ok"]) * 0.125
    assert (g["runs"] > FAST["min_runs"]).all()
    assert warm.loc[g.index, "timer_notes"].str.contains(r"\bK=20\b").any()
    assert (g["isolated_ms"] > 0).all()


def test_real_oom_is_skipped_and_parent_aggregated(tmp_path):
    class Hog(torch.nn.Module):
        n = 1

        def forward(self, x):
            torch.empty(int(Hog.n), dtype=torch.uint8, device=x.device)
            return x + 1

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hog = Hog()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.lin(self.hog(x))

    model = torch.nn.Sequential(Parent()).cuda()
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(8, 64, device="cuda"))
    Hog.n = 4 * torch.cuda.get_device_properties(0).total_memory  # cannot fit
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST).set_index("fqn")
    assert df.loc["0.hog", "status"] == "skipped" and "OOM" in df.loc["0.hog", "status_reason"]
    assert df.loc["0.lin", "status"] == "ok"
    assert df.loc["0", "status"] == "skipped"
    torch.cuda.empty_cache()
    x = torch.ones(1024, device="cuda")  # the device is still usable afterwards
    assert float(x.sum()) == 1024.0


def test_dlrm_capture_replay_cuda(tmp_path):
    cap = capture_model("dlrm:tiny", tmp_path / "r", device="cuda", dtype="bf16")
    df = cbtrace.replay(cap.out, **FAST)
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"][["fqn", "status_reason"]]
    bags = df[df["module_type"] == "EmbeddingBag"]
    assert (bags["bytes"] > 0).all() and (bags["flops"] > 0).all()
    assert find_trace(cap.out) is not None
    assert (read_modules(cap.out)["insitu_host_ms"] >= 0).all()  # host issue times, unhooked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("share", [0.2, 0.0])  # copies on the GPU; none fits: on the host
def test_state_guard_undoes_writes_from_its_gpu_or_host_copies(monkeypatch, share):
    from cbtrace import state

    monkeypatch.setattr(state, "DEVICE_COPY_SHARE", share)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).cuda()
    before = state_fingerprint(model)
    guard = state.StateGuard(model)
    assert {saved.device.type for *_, saved, _, _ in guard.params} == (
        {"cuda"} if share else {"cpu"})
    with guard.call(), torch.no_grad():
        model[0].weight.add_(1)                         # written in place
        model[1].weight.data = model[1].weight * 2      # storage swapped
    assert state_fingerprint(model) == before
    with guard.call(), torch.no_grad():                 # and again, from the same copies
        model[0].weight.mul_(3)
    assert state_fingerprint(model) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_free_memory_counts_what_torch_holds_unused(monkeypatch):
    from cbtrace.device import free_memory

    dev, gib, mib = torch.device("cuda"), 1 << 30, 1 << 20
    torch.cuda.synchronize()
    # from a known base: earlier tests' CUDA graphs may still hold private pools, whose free
    # blocks count in free_memory() but which empty_cache cannot hand back
    base = free_memory(dev, exact=True)
    x = torch.empty(gib, dtype=torch.uint8, device=dev)  # 1 GiB, then cached, not used
    del x
    driver = torch.cuda.mem_get_info(dev)[0]
    assert driver <= base - gib + mib, (base, driver)             # the driver does not see it
    counted = free_memory(dev)
    assert counted >= base - mib, (base, driver, counted)          # torch can hand it out
    emptied, empty_cache = [], torch.cuda.empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (emptied.append(1), empty_cache()))
    exact = free_memory(dev, exact=True)                           # the driver's figure after
    assert emptied and abs(torch.cuda.mem_get_info(dev)[0] - exact) < mib  # empty_cache
    # whether empty_cache hands the 1 GiB back is torch's: alone it did; after the whole GPU
    # suite, on the H200, it kept it (exact was base - 1 GiB), so this test does not ask it


def test_inputs_made_on_side_streams_are_captured_as_they_were(tmp_path, monkeypatch):
    """Modules called on two side streams, their inputs written there just before: each call's
    stored inputs are the values it received, the copy buffers are planned (allocated) on the
    caller's stream, not the helper thread's own, and the caller's stream is left as it was."""
    from cbtrace.store import tensor_store

    planned_on, buffer_like = [], tensor_store._buffer_like

    def recording(src):
        planned_on.append(torch.cuda.current_stream())
        return buffer_like(src)

    monkeypatch.setattr(tensor_store, "_buffer_like", recording)

    class TwoStreams(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
            self.s1, self.s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def forward(self, x):
            seen = {}
            for name, s, lin in (("a", self.s1, self.a), ("b", self.s2, self.b)):
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    y = x * (2.0 if name == "a" else 3.0)  # made on this stream
                    seen[name] = y.clone()
                    lin(y)
                    y.mul_(0)  # overwritten right after the call, on the same stream
                torch.cuda.current_stream().wait_stream(s)
            return seen

    model = TwoStreams().cuda()
    x = torch.randn(4096, 256, device="cuda")
    before = torch.cuda.current_stream()
    with cbtrace.capture(model, tmp_path / "r"):
        seen = model(x)
    assert torch.cuda.current_stream() == before
    # the root's input on the default stream, then a's and b's on their side streams
    assert planned_on == [before, model.s1, model.s2], planned_on
    torch.cuda.synchronize()
    for name in ("a", "b"):
        args, _ = cbtrace.load_inputs(tmp_path / "r", name)
        assert torch.equal(args[0], seen[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_profiler_warmed_early_still_sees_the_kernels_of_a_later_session():
    from torch.profiler import ProfilerActivity, profile

    from cbtrace import device

    device.warm_profiler("cuda")
    assert device._profiler_warm  # once per process: a second call returns at once
    x = torch.ones(1 << 20, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        (x * 2).sum()
        torch.cuda.synchronize()
    assert any(e.device_type == torch.autograd.DeviceType.CUDA for e in p.events())
