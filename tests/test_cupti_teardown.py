"""cbtrace's profiler sessions stop with CUPTI torn down (device.cupti_torn_down): set only for
the session, only where torch would not keep CUPTI up, never over the user's own setting."""
import os

import pytest
import torch

from cbtrace import device


@pytest.fixture
def cuda13(monkeypatch):
    """A machine with CUDA 13 as far as the guard can tell; neither variable set."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.delenv("DISABLE_CUPTI_LAZY_REINIT", raising=False)
    return monkeypatch


def test_the_session_stops_with_teardown_and_the_variable_goes_after(cuda13):
    with device.cupti_torn_down():
        assert os.environ["TEARDOWN_CUPTI"] == "1"
    assert "TEARDOWN_CUPTI" not in os.environ
    with pytest.raises(RuntimeError), device.cupti_torn_down():
        raise RuntimeError("the session failed")
    assert "TEARDOWN_CUPTI" not in os.environ


@pytest.mark.parametrize("name,value", [("TEARDOWN_CUPTI", "0"), ("TEARDOWN_CUPTI", "1"),
                                        ("DISABLE_CUPTI_LAZY_REINIT", "1")])
def test_a_variable_already_set_is_left_as_it_is(cuda13, name, value):
    cuda13.setenv(name, value)
    with device.cupti_torn_down():
        assert os.environ[name] == value
        if name != "TEARDOWN_CUPTI":
            assert "TEARDOWN_CUPTI" not in os.environ
    assert os.environ[name] == value


def test_old_cuda_or_no_gpu_sets_nothing(cuda13):
    cuda13.setattr(torch.version, "cuda", "12.4")
    with device.cupti_torn_down():
        assert "TEARDOWN_CUPTI" not in os.environ
    cuda13.setattr(torch.version, "cuda", "13.0")
    cuda13.setattr(torch.cuda, "is_available", lambda: False)
    with device.cupti_torn_down():
        assert "TEARDOWN_CUPTI" not in os.environ


def test_a_value_torch_set_during_the_session_stays(cuda13):
    # torch.profiler sets TEARDOWN_CUPTI=0 itself where CUDA graphs need CUPTI kept up
    with device.cupti_torn_down():
        os.environ["TEARDOWN_CUPTI"] = "0"
    assert os.environ["TEARDOWN_CUPTI"] == "0"


@pytest.mark.gpu
def test_graphs_and_sessions_after_a_teardown_still_run_and_profile():
    """A CUDA graph captured before a torn-down session replays after it, and cbtrace's
    profiled passes after such sessions read the eager kernels they ran. A session set up
    afresh does not always record them (an H100 read a graph's kernels 1, 0, 1 times in three
    sessions, and in another process lost a whole session's eager kernels): a pass whose
    session launched kernels and recorded none is taken again (``lost_device_events``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    from cbtrace.replay.measure.profiler_pass import profile_call

    x = torch.ones(1 << 20, device="cuda")
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(1.0)  # warm-up off the default stream, as graph capture asks
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        x.add_(1.0)
    y = torch.ones(1 << 20, device="cuda")
    kernels = []
    for _ in range(3):
        with device.cupti_torn_down(), profile(activities=[ProfilerActivity.CPU,
                                                            ProfilerActivity.CUDA]):
            g.replay()
            torch.cuda.synchronize()
        # as a profiled pass runs its call: a torn-down session of its own
        kernels.append(profile_call(lambda: y.mul_(1.0), "cuda", runs=2).kernel_count)
    g.replay()
    torch.cuda.synchronize()
    assert float(x[0]) == 5.0  # capture runs nothing: four replays
    assert kernels == [1, 1, 1], kernels


@pytest.mark.parametrize("fails", [False, True])
def test_capture_holds_the_teardown_from_the_profilers_start_to_its_stop(tmp_path, monkeypatch,
                                                                         fails):
    import contextlib
    import importlib

    import cbtrace

    recorder = importlib.import_module("cbtrace.capture.recorder")
    seen = []

    @contextlib.contextmanager
    def watched():
        seen.append("enter")
        try:
            yield
        finally:
            seen.append("exit")

    real_profile = torch.profiler.profile

    class Profile(real_profile):
        def __enter__(self):
            seen.append("start")
            return super().__enter__()

        def __exit__(self, *exc):
            seen.append("stop")
            return super().__exit__(*exc)

    monkeypatch.setattr(recorder, "cupti_torn_down", watched)
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with contextlib.suppress(RuntimeError), cbtrace.capture(model, tmp_path / "r"):
        model(torch.randn(2, 4))
        if fails:
            raise RuntimeError("the step failed")
    assert seen == ["enter", "start", "stop", "exit"], seen
