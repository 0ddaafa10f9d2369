"""The plain step: one more profiled step with a range per captured call and nothing else, whose
times the in-situ columns take on a GPU (capture/plain_step.py, attribution/join.py)."""
import gzip
import json
import types

import pandas as pd
import pytest
import torch
from torch import nn

import cbtrace
from cbtrace.attribution import join
from cbtrace.attribution.attribute import attribute_file
from cbtrace.capture.plain_step import plain_trace
from cbtrace.rundir.layout import PLAIN_TRACE

CUDA = torch.cuda.is_available()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x)) + self.act(x))  # act called twice


def _calls(df) -> list:
    rows = df[(df["phase"] == "fwd") & (df["depth"] >= 0)]
    return sorted(zip(rows["fqn"], rows["call_index"]))


def test_the_plain_step_has_a_range_per_captured_call_and_nothing_of_capture(tmp_path):
    model, x = Net(), torch.randn(4, 8)
    with cbtrace.capture(model, tmp_path / "run") as cap:
        model(x)
    fqns = [r.fqn for r in cap.records]
    path, _ = plain_trace(model, fqns, lambda: model(x), tmp_path / "run")
    assert path == tmp_path / "run" / PLAIN_TRACE
    names = {e.get("name", "") for e in json.loads(gzip.decompress(path.read_bytes()))
             ["traceEvents"]}
    assert not any(n.startswith("cbtrace.copy::") for n in names)  # no input copies
    assert _calls(attribute_file(path)) == _calls(attribute_file(cap.trace_path))
    assert ("act", 1) in _calls(attribute_file(path))  # a module called twice: two calls
    # hooks gone: the model runs as before, with no range of cbtrace's
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_plain_steps_run_in_profiler_steps_and_a_calls_figure_is_their_median(tmp_path):
    model, x = Net(), torch.randn(4, 8)
    with cbtrace.capture(model, tmp_path / "run") as cap:
        model(x)
    fqns = [r.fqn for r in cap.records]
    path, _ = plain_trace(model, fqns, lambda: model(x), tmp_path / "run", steps=3)
    df = attribute_file(path)
    fwd = df[(df["phase"] == "fwd") & (df["depth"] >= 0)]
    assert sorted(set(fwd["step"])) == [0, 1, 2]
    for _, one in fwd.groupby("step"):  # each step holds every call, numbered within it
        assert _calls(one) == _calls(attribute_file(cap.trace_path))
    table = join.insitu_for_run(tmp_path / "run", None, trace=path, median_steps=True)
    want = fwd.groupby(["fqn", "call_index"])["cpu_ms"].median()  # a CPU trace: host times
    got = table.set_index(["fqn", "call_index"])["insitu_ms"]
    assert sorted(got.index) == sorted(want.index) and ("act", 1) in got.index
    assert (got - want[got.index]).abs().max() < 1e-12
    # without medians: the first step's own figures
    first = join.insitu_for_run(tmp_path / "run", None, trace=path)
    step0 = fwd[fwd["step"] == 0].set_index(["fqn", "call_index"])["cpu_ms"]
    assert (first.set_index(["fqn", "call_index"])["cpu_ms"] - step0).abs().max() < 1e-12


def test_each_plain_train_step_starts_from_the_gradients_the_first_found(tmp_path):
    """A second backward would add into the first's gradients (other kernels than the user's
    step runs after zeroing them): each step starts from the gradients found, None here."""
    model, x = Net(), torch.randn(4, 8)
    with cbtrace.capture(model, tmp_path / "run") as cap:
        model(x)
    fresh = []
    model.a.weight.register_hook(lambda g: fresh.append(model.a.weight.grad is None))
    plain_trace(model, [r.fqn for r in cap.records], lambda: model(x).sum().backward(),
                tmp_path / "run", steps=3)
    assert fresh == [True, True, True]
    assert all(p.grad is None for p in model.parameters())  # as the steps found them
    with pytest.raises(ValueError, match="steps must be >= 1"):
        plain_trace(model, [], lambda: model(x), tmp_path / "run", steps=0)


def test_a_shared_module_gets_no_range_of_its_own(tmp_path):
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = self.a  # one module, two paths
            self.c = nn.ReLU()

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    model, x = Shared(), torch.randn(2, 8)
    (tmp_path / "all").mkdir()
    (tmp_path / "some").mkdir()
    path, _ = plain_trace(model, ["", "a", "b", "c"], lambda: model(x), tmp_path / "all")
    assert _calls(attribute_file(path)) == [("", 0), ("c", 0)]
    # one of its paths left out of the capture: still shared, still no range of its own
    path, _ = plain_trace(model, ["", "a", "c"], lambda: model(x), tmp_path / "some")
    assert _calls(attribute_file(path)) == [("", 0), ("c", 0)]


def _join(monkeypatch, tmp_path, with_plain: bool, listed: bool = True, plain_kernels: int = 1,
          recomputed: bool = False, bwd: bool = False):
    """insitu_columns over a modules table of three graph-timed calls; the captured step's
    busy times 1.0 ms each, the plain step's 0.8 ms (none for m2)."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    if with_plain:
        (run / PLAIN_TRACE).write_bytes(b"{}")  # read through insitu_for_run, stood in below
    hooked = pd.DataFrame(dict(fqn=["m0", "m1", "m2"], call_index=0, gpu_ms=1.0,
                               gpu_span_ms=1.2, kernel_count=1, insitu_ms=1.0))
    plain = pd.DataFrame(dict(fqn=["m0", "m1"], call_index=0, gpu_ms=0.8, gpu_span_ms=0.9,
                              kernel_count=plain_kernels, insitu_ms=0.8))

    def insitu_for_run(run_dir, manifest, phase="fwd", grad_sums=None, trace=None,
                       median_steps=False):
        assert trace is None or trace == run / PLAIN_TRACE
        assert median_steps == (trace is not None)  # the plain steps' medians, per call
        return plain if trace is not None else hooked

    monkeypatch.setattr(join, "insitu_for_run", insitu_for_run)
    df = pd.DataFrame(dict(call_id=[0, 1, 2], fqn=["m0", "m1", "m2"], call_index=0,
                           timer="graph", timer_fallback=None, isolated_ms=0.84,
                           device_ms=0.8, kernel_count=1, noisy=False,
                           bwd_ms=0.84 if bwd else None, insitu_host_ms=None,
                           recomputed=recomputed))
    files = {PLAIN_TRACE: "sha256"} if listed else {}
    return join.insitu_columns(run, types.SimpleNamespace(device="cuda:0", files=files), df)


def test_the_join_takes_the_plain_steps_times_and_keeps_the_captured_ones(monkeypatch, tmp_path):
    out = _join(monkeypatch, tmp_path, with_plain=True)
    assert out[0]["insitu_ms"] == 0.8 and out[0]["insitu_hooked_ms"] == 1.0
    assert out[0]["error_pct"] == pytest.approx(5.0)  # 0.84 against the plain step's 0.8
    assert out[0]["insitu_span_ms"] == 0.9
    # a call the plain step has no figure for keeps the captured step's
    assert out[2]["insitu_ms"] == 1.0 and out[2]["error_pct"] == pytest.approx(-16.0)


@pytest.mark.parametrize("case", [dict(with_plain=False),      # none profiled
                                  dict(with_plain=True, listed=False),  # not this capture's
                                  dict(with_plain=True, plain_kernels=0)])  # no device events
def test_without_a_plain_step_to_trust_the_captured_steps_times_stand(monkeypatch, tmp_path,
                                                                      case):
    out = _join(monkeypatch, tmp_path, **case)
    assert out[0]["insitu_ms"] == 1.0 and out[0]["insitu_hooked_ms"] is None
    assert out[0]["error_pct"] == pytest.approx(-16.0)


def test_the_backward_comes_from_the_plain_step_unless_the_step_recomputed(monkeypatch,
                                                                          tmp_path):
    out = _join(monkeypatch, tmp_path, with_plain=True, bwd=True)
    assert out[0]["bwd_insitu_ms"] == 0.8 and out[0]["bwd_insitu_hooked_ms"] == 1.0
    assert out[2]["bwd_insitu_ms"] == 1.0  # none in the plain step: the captured step's
    # activation checkpointing: the recomputation has ranges only in the captured step
    again = _join(monkeypatch, tmp_path / "ckpt", with_plain=True, bwd=True, recomputed=True)
    assert again[0]["bwd_insitu_ms"] == 1.0 and again[0]["bwd_insitu_hooked_ms"] is None


def test_a_capture_over_a_run_drops_the_plain_step_it_left(tmp_path):
    model, x = Net(), torch.randn(4, 8)
    with cbtrace.capture(model, tmp_path / "run") as cap:
        model(x)
    plain_trace(model, [r.fqn for r in cap.records], lambda: model(x), tmp_path / "run")
    with cbtrace.capture(model, tmp_path / "run", overwrite=True):
        model(x)
    assert not (tmp_path / "run" / PLAIN_TRACE).exists()  # not this capture's step


def test_a_cpu_capture_profiles_a_plain_step_for_the_backward_only(tmp_path):
    """A CPU's forward in-situ times are unprofiled repeats; its backward's come from a plain
    step rather than the captured one, whose gradient hooks copy every call's gradients."""
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.rundir.read import load_run

    cap = capture_model("nanogpt:tiny", tmp_path / "fwd", device="cpu")
    assert not (cap.out / PLAIN_TRACE).exists()
    cap = capture_model("nanogpt:tiny", tmp_path / "train", device="cpu", step="train")
    assert (cap.out / PLAIN_TRACE).is_file()
    manifest, df = load_run(cap.out)
    assert PLAIN_TRACE in manifest.files
    df["bwd_ms"] = 1.0  # as after a replay with --backward
    cols = join.insitu_columns(cap.out, manifest, df)
    leaf = int(df.loc[df["fqn"] == "lm_head", "call_id"].iloc[0])
    assert cols[leaf]["bwd_insitu_ms"] > 0 and cols[leaf]["bwd_insitu_hooked_ms"] > 0
    assert cols[leaf]["insitu_hooked_ms"] is None  # the forward: the host times, as before


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_a_capture_from_a_spec_profiles_the_plain_step_and_signs_it(tmp_path):
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.rundir.read import read_manifest

    from cbtrace.capture.from_spec import PLAIN_STEPS

    cap = capture_model("nanogpt:tiny", tmp_path / "run", device="cuda")
    assert (cap.out / PLAIN_TRACE).is_file()
    assert PLAIN_TRACE in read_manifest(cap.out).files  # checksummed with the run's files
    df = attribute_file(cap.out / PLAIN_TRACE)
    assert sorted(set(df.loc[df["depth"] >= 0, "step"])) == list(range(PLAIN_STEPS[True]))
    for _, one in df[df["step"] >= 0].groupby("step"):  # every step holds every call
        assert _calls(one) == _calls(attribute_file(cap.trace_path))
        assert one.loc[one["depth"] >= 0, "kernel_count"].sum() > 0
    # the SM clock the step left, the same on every row
    rows = pd.read_parquet(cap.out / "modules.parquet")
    assert rows["step_clock_mhz"].notna().all() and rows["step_clock_mhz"].nunique() == 1
    assert 200 < rows["step_clock_mhz"].iloc[0] < 4000


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_profile_reads_the_clock_after_each_timing_and_compares_it_with_the_steps(tmp_path):
    from cbtrace.workflows.profile_model import profile

    df = profile("nanogpt:tiny", tmp_path / "run", device="cuda")
    ok = df[df["status"] == "ok"]
    assert ok["timed_clock_mhz"].between(200, 4000).all()
    want = 100 * (ok["step_clock_mhz"] / ok["timed_clock_mhz"] - 1)
    assert (ok["clock_error_pct"] - want).abs().max() < 1e-6


def test_a_cpu_plain_step_that_waited_off_the_cpu_is_taken_again_on_one_thread(monkeypatch,
                                                                               tmp_path):
    """On a busy CPU each parallel op of the step waits for a worker thread that is not
    running; the CPU timer then times on one thread, and the plain step is taken again so."""
    from cbtrace.capture import from_spec

    threads, calls = torch.get_num_threads(), []
    real = from_spec.plain_trace

    def traced(*args, **kwargs):
        calls.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(from_spec, "plain_trace", traced)
    monkeypatch.setattr(from_spec.time, "thread_time", lambda: 0.0)  # the step never ran
    cap = from_spec.capture_model("nanogpt:tiny", tmp_path / "run", device="cpu", step="train")
    assert calls == ([threads, 1] if threads > 1 else [threads])
    assert torch.get_num_threads() == threads and (cap.out / PLAIN_TRACE).is_file()
