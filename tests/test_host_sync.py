"""Host-synchronising calls and calls a CUDA graph cannot hold (issue 28, build item 1): the
stream timer (K calls back to back), host_syncs, error_basis (span or busy) and bound = host."""
from __future__ import annotations

import pytest
import torch

from cbtrace.plugins.backends import stream
from cbtrace.plugins.backends.cpu import CpuTimer
from cbtrace.plugins.backends.events import EventsTimer
from cbtrace.plugins.backends.graph import GraphTimer
from cbtrace.plugins.backends.stream import StreamTimer, window_sampler
from cbtrace.replay.timer import choice as timers
from cbtrace.replay.timer.contract import CallRunner, TimerUnavailable, TimingConfig

CUDA = torch.cuda.is_available()


class FakeEvent:
    """A CUDA event stand-in: record() notes the log's length; elapsed_time is calls between."""

    def __init__(self, log):
        self.log, self.at = log, None

    def record(self, stream=None):
        self.at = len(self.log)
        self.log.append("event")

    def elapsed_time(self, end) -> float:
        return float(sum(1 for x in self.log[self.at:end.at] if x != "event"))


def test_a_window_issues_k_calls_back_to_back_and_divides_by_k():
    log: list = []
    syncs = []
    sample = window_sampler(lambda i: log.append(("run", i)), 4, 3,
                            flush=lambda: log.append("flush"), sync=lambda: syncs.append(len(log)),
                            pairs=lambda n: [(FakeEvent(log), FakeEvent(log)) for _ in range(n)])
    got = sample(0, 2)
    assert got == [1.0, 1.0]  # each window: 4 calls (1 ms each in the fake's clock) / K = 4
    runs = [x for x in log if isinstance(x, tuple)]
    assert [i for _, i in runs] == [0, 1, 2, 0, 1, 2, 0, 1]  # copies rotate across windows
    # flush, sync, start, 4 calls, end (x2), one sync at the end: none between the calls
    assert log[:7] == ["flush", "event", ("run", 0), ("run", 1), ("run", 2), ("run", 0), "event"]
    assert syncs == [1, 8, 14] and log[1] == log[8] == "event" and len(log) == 14
    assert sample(2, 1) == [1.0]
    assert [i for _, i in [x for x in log if isinstance(x, tuple)][-4:]] == [2, 0, 1, 2]


def test_k_fills_a_window_of_a_few_ms_and_takes_long_calls_several_at_a_time():
    k = stream.window_calls
    assert k(0.001) == stream.K_MAX
    assert k(0.1) == int(stream.WINDOW_MS / 0.1)
    assert k(7.0) == stream.K_MIN  # a call longer than the window: K_MIN, the tail shared out
    assert k(200.0) == int(stream.K_MIN_WINDOW_MS / 200.0)  # fewer where K_MIN would run long
    assert k(2000.0) == 1
    assert k(0.0) == stream.K_MAX


class Ranked:
    """A backend that can run anywhere, with a built-in timer's name and rank."""

    def __init__(self, real):
        self.name, self.fallback_rank = real.name, real.fallback_rank

    def unavailable_reason(self, device):
        return None


def test_auto_falls_back_graph_then_stream_then_events_then_cpu():
    backends = {t.name: Ranked(t) for t in (CpuTimer(), EventsTimer(), GraphTimer(),
                                            StreamTimer())}
    cpu = torch.device("cpu")
    assert timers.chain("auto", cpu, backends) == ["graph", "stream", "events", "cpu"]
    assert timers.chain("graph", cpu, backends) == ["graph", "stream", "events", "cpu"]
    assert timers.chain("stream", cpu, backends) == ["stream", "events", "cpu"]


def test_the_builtins_register_the_stream_timer():
    from cbtrace.plugins.backends import hooks

    table = {}
    hooks.register_backends(register=lambda name, obj: table.setdefault(name, obj))
    assert list(table) == ["graph", "stream", "events", "cpu"]
    assert isinstance(table["stream"], StreamTimer)


@pytest.mark.parametrize("runner", [
    CallRunner(run=lambda i: None, before=lambda j: None),
    CallRunner(run=lambda i: None, stage=lambda j: None, unstage=lambda: None),
], ids=["before", "staged"])
def test_the_stream_timer_hands_calls_with_untimed_work_to_the_next(runner):
    with pytest.raises(TimerUnavailable, match="untimed work before each run"):
        StreamTimer().measure(runner, 1, torch.device("cpu"), TimingConfig())


def test_the_stream_timer_needs_cuda():
    assert "CUDA" in StreamTimer().unavailable_reason(torch.device("cpu"))
    if not CUDA:
        with pytest.raises(TimerUnavailable, match="stream timer"):
            StreamTimer().measure(CallRunner(run=lambda i: None), 1, "cpu", TimingConfig())


# ---- compared like with like: error_basis, error_pct ----------------------------------------

def _insitu(monkeypatch, timers_, isolated, gpu_ms, span_ms):
    """insitu_columns over a synthetic modules table and a synthetic in-situ table."""
    import types

    import pandas as pd

    from cbtrace.attribution import join

    n = len(timers_)
    table = pd.DataFrame(dict(fqn=[f"m{i}" for i in range(n)], call_index=[0] * n,
                              cpu_ms=[9.0] * n, gpu_ms=gpu_ms, gpu_span_ms=span_ms,
                              kernel_count=[1] * n, insitu_ms=gpu_ms))
    monkeypatch.setattr(join, "insitu_for_run", lambda run, manifest, phase="fwd": table)
    df = pd.DataFrame(dict(call_id=list(range(n)), fqn=list(table["fqn"]), call_index=[0] * n,
                           timer=timers_, timer_fallback=[None] * n, isolated_ms=isolated,
                           device_ms=gpu_ms, kernel_count=[1] * n, noisy=[False] * n,
                           bwd_ms=[None] * n, insitu_host_ms=[None] * n))
    return join.insitu_columns("run", types.SimpleNamespace(device="cuda:0", files={}), df)


def test_a_call_timed_back_to_back_is_compared_with_its_span(monkeypatch):
    out = _insitu(monkeypatch, ["stream", "graph", "events", "stream", None],
                  isolated=[7.0, 1.1, 2.0, 0.5, None], gpu_ms=[3.5, 1.0, 2.0, 0.5, 1.0],
                  span_ms=[7.0, 4.0, 2.5, 0.0, 1.0])
    assert out[0]["error_basis"] == "span" and out[0]["error_pct"] == pytest.approx(0.0)
    assert out[0]["insitu_ms"] == 3.5 and out[0]["insitu_span_ms"] == 7.0  # both kept
    # graph and events figures are device-busy time: compared with the kernels' own time
    assert out[1]["error_basis"] == "busy" and out[1]["error_pct"] == pytest.approx(10.0)
    assert out[1]["insitu_span_ms"] == 4.0
    assert out[2]["error_basis"] == "busy" and out[2]["error_pct"] == pytest.approx(0.0)
    # no kernel of its own in the step: no span, the busy figure
    assert out[3]["insitu_span_ms"] is None and out[3]["error_basis"] == "busy"
    # not timed: no error, so no basis
    assert out[4]["error_pct"] is None and out[4]["error_basis"] is None


def test_a_cpu_run_has_no_span_and_compares_busy_time():
    import types

    import pandas as pd

    from cbtrace.attribution import join

    df = pd.DataFrame(dict(call_id=[0], fqn=[""], call_index=[0], timer=["cpu"],
                           timer_fallback=[None], isolated_ms=[2.2], device_ms=[None],
                           kernel_count=[0], noisy=[False], bwd_ms=[None],
                           insitu_host_ms=[2.0]))
    out = join.insitu_columns("run", types.SimpleNamespace(device="cpu"), df)[0]
    assert out["insitu_span_ms"] is None and out["error_basis"] == "busy"
    assert out["error_pct"] == pytest.approx(10.0)


def test_error_basis_and_error_pct_are_pure():
    from cbtrace.cost import metrics

    assert metrics.error_basis("stream", 2.0) == "span"
    assert metrics.error_basis("stream", None) == "busy"
    assert metrics.error_basis("stream", 0.0) == "busy"
    assert metrics.error_basis("graph", 2.0) == "busy"
    assert metrics.error_basis(None, 2.0) == "busy"
    assert metrics.error_pct(3.0, 2.0) == pytest.approx(50.0)
    assert metrics.error_pct(3.0, 0.0) is None and metrics.error_pct(None, 2.0) is None


# ---- host_syncs ----------------------------------------------------------------------------

def test_host_syncs_is_none_on_a_cpu():
    import types

    from cbtrace.replay.measure.steps import HostIssue

    assert HostIssue().run(types.SimpleNamespace(device=torch.device("cpu"))) == dict(
        host_ms=None, host_syncs=None)


def test_syncs_are_counted_from_torchs_warnings_and_the_mode_is_restored(monkeypatch):
    import warnings

    from cbtrace.replay.measure import steps

    mode = ["default"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m))
    found: list = []
    with pytest.warns(UserWarning, match="the call's own"):  # passed on, not swallowed
        with steps.counting_syncs(found):
            assert mode[0] == "warn"
            for _ in range(3):  # the same line thrice: each counts
                warnings.warn(steps.SYNC_WARNING)
            warnings.warn("the call's own")
    assert found == [3] and mode[0] == "default"
    with pytest.raises(RuntimeError), steps.counting_syncs(found):
        raise RuntimeError("the module failed")
    assert mode[0] == "default" and found == [3]


# ---- bound = host --------------------------------------------------------------------------

H200_BF16, H200_BW = 989.5e12, 4.8e12


def test_bound_is_host_when_issuing_takes_the_host_at_least_the_device_time():
    from cbtrace.cost import metrics as m

    # a GEMM's worth of FLOPs, but the host needs 7 ms to issue what the device runs in 3.8 ms
    big = (2 * 4096 ** 3, 3 * 4096 ** 2 * 2)
    assert m.bound(*big, 7e-3, H200_BF16, H200_BW, host_s=7e-3, device_s=3.8e-3) == "host"
    assert m.bound(*big, 3.8e-3, H200_BF16, H200_BW, host_s=3.8e-3, device_s=3.8e-3) == "host"
    assert m.bound(*big, 0.2e-3, H200_BF16, H200_BW, host_s=0.1e-3,
                   device_s=0.2e-3) == "compute"
    assert m.bound(*big, 0.2e-3, H200_BF16, H200_BW, host_s=None, device_s=0.2e-3) == "compute"


def _rec(**kw):
    """What add_utilisation reads and writes of a replayed row."""
    import types

    base = dict(compute_dtype="bf16", flops=2 * 4096 ** 3, flops_executed=None,
                bytes=3 * 4096 ** 2 * 2, kernel_count=100, mfu=None, hfu=None, mbu=None,
                bound=None)
    return types.SimpleNamespace(**{**base, **kw})


def test_a_call_timed_back_to_back_is_host_bound_against_its_profiled_device_time():
    from cbtrace.replay.derive import add_utilisation

    # the stream timer's figure holds the host's time: device_ms (the profiled pass) decides
    r = _rec(timer="stream", isolated_ms=7.18, host_ms=6.95, device_ms=3.79)
    add_utilisation(r, "NVIDIA H200")
    assert r.bound == "host"
    r = _rec(timer="stream", isolated_ms=3.9, host_ms=1.0, device_ms=3.79)
    add_utilisation(r, "NVIDIA H200")
    assert r.bound == "compute"
    # a graph-timed figure is device time itself: host_ms against isolated_ms
    r = _rec(timer="graph", isolated_ms=0.2, host_ms=0.25, device_ms=0.19, kernel_count=1)
    add_utilisation(r, "NVIDIA H200")
    assert r.bound == "host"
    r = _rec(timer="graph", isolated_ms=0.2, host_ms=0.05, device_ms=0.19, kernel_count=1)
    add_utilisation(r, "NVIDIA H200")
    assert r.bound == "compute"


# ---- on a GPU ------------------------------------------------------------------------------

GPU_REPLAY = dict(budget_s=0.02, min_runs=5, warmup_runs=2, profile_runs=1, cold_budget_s=0.01,
                  progress=False)


class ReadsBack(torch.nn.Module):
    """A data-dependent branch on the host (.item()), as detection heads and masks have."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)

    def forward(self, x):
        y = self.lin(x)
        if y.abs().max().item() >= 0:  # one host sync
            y = y * 2
        return y


class AsksCapture(torch.nn.Module):
    """Branches on whether it is being captured (as transformers' masks do)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing():
            return x
        return self.lin(x)


class Both(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.reads, self.asks = ReadsBack(), AsksCapture()

    def forward(self, x):
        return self.asks(self.reads(x))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_the_stream_timer_times_k_calls_back_to_back():
    x = torch.randn(256, 256, device="cuda")
    t = StreamTimer().measure(CallRunner(run=lambda i: (x @ x).sum().item()), 1, "cuda",
                              TimingConfig(budget_s=0.02, min_runs=5))
    assert t.timer == "stream" and t.runs >= 5 and t.median_ms > 0
    assert "back to back" in t.notes and t.notes.startswith("K=")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_a_syncing_call_and_one_that_asks_about_capture_are_timed_back_to_back(tmp_path):
    import cbtrace
    from cbtrace.attribution.join import join_insitu

    model = Both().cuda().eval()
    x = torch.randn(64, 256, device="cuda")
    with cbtrace.capture(model, tmp_path / "r"):
        model(x)
    mode = torch.cuda.get_sync_debug_mode()
    df = cbtrace.replay(tmp_path / "r", model=model, **GPU_REPLAY)
    assert torch.cuda.get_sync_debug_mode() == mode  # never left set
    df = join_insitu(tmp_path / "r").set_index("fqn")
    assert (df["status"] == "ok").all(), df[["status", "status_reason"]]
    for fqn in ("", "reads", "asks"):  # capture refused: graph -> stream
        assert df.loc[fqn, "timer"] == "stream", (fqn, df.loc[fqn, "timer_fallback"])
        assert df.loc[fqn, "timer_fallback"].startswith("graph: ")
        assert "back to back" in df.loc[fqn, "timer_notes"]
        assert df.loc[fqn, "error_basis"] == "span"
        assert df.loc[fqn, "insitu_span_ms"] >= df.loc[fqn, "insitu_ms"] > 0
    assert df.loc["reads", "host_syncs"] >= 1 and df.loc["", "host_syncs"] >= 1
    assert df.loc["asks", "host_syncs"] == 0
    assert df.loc["reads.lin", "timer"] == "graph" and df.loc["reads.lin", "host_syncs"] == 0
    assert df.loc["reads.lin", "error_basis"] == "busy"


class _FakeTimer:
    """A timer of the chain that refuses a call when ``refuse(call)`` says why."""

    fallback_rank = None

    def __init__(self, name, refuse):
        self.name, self.refuse, self.runs = name, refuse, 0

    def unavailable_reason(self, device):
        return None

    def measure(self, call, n_copies, device, cfg):
        from cbtrace.replay.timer.contract import Timing, TimerUnavailable

        self.runs += 1
        why = self.refuse(call)
        if why:
            raise TimerUnavailable(why)
        return Timing(1.0, 0.9, 1.1, 5, self.name, notes=f"{self.name} ran")


def _in_a_context():
    """A call (a stand-in of Timed's input) whose timed runs each follow a context call."""
    import types

    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.prepare import CallUnderTest
    from cbtrace.replay.timer.contract import CallRunner
    from cbtrace.schema.modules import ModuleRecord

    rec = ModuleRecord(fqn="asks", call_index=0, call_id=1, parent_call_id=0, parent_fqn="",
                       depth=1, module_type="Linear", module_class="torch.nn.Linear",
                       param_bytes=0, buffer_bytes=0, input_bytes=0, input_shapes="[]",
                       input_meta="[]", output_meta="[]", training=False, grad_enabled=False,
                       autocast_dtype=None, inputs_ref="{}")
    plain = types.SimpleNamespace(timed=lambda: CallRunner(run=lambda j: None, n_copies=2))
    c = CallUnderTest(module=torch.nn.Linear(2, 2), rec=rec, run=plain, n_copies=2,
                      device=torch.device("meta"), cfg=ReplayConfig())
    c.timed = CallRunner(run=lambda j: None, n_copies=2, before=lambda j: None)
    c.context_note = "context: 1 call before (reads)"
    return c


@pytest.mark.parametrize("stream_refuses_plain", [False, True])
def test_a_call_the_graph_refuses_is_timed_back_to_back_without_its_context(
        stream_refuses_plain):
    """Its host's pace, which only a back-to-back window keeps, decides its time more than the
    cache state its context gives; single events time it only where no window can."""
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.steps import Timed

    backends = {
        "graph": _FakeTimer("graph", lambda call: "the call asks whether it is captured; timed "
                                                  "without a graph"),
        "stream": _FakeTimer("stream", lambda call: (
            "untimed work before each run cannot leave a back-to-back window"
            if call.before is not None or stream_refuses_plain else None)),
        "events": _FakeTimer("events", lambda call: None)}
    c = _in_a_context()
    got = Timed(["graph", "stream", "events"], backends, ReplayConfig()).run(c)
    if stream_refuses_plain:  # no window for it either way: events, in its context, once
        assert got["timer"] == "events" and "context: 1 call before" in got["timer_notes"]
        assert backends["events"].runs == 1
        return
    assert got["timer"] == "stream"
    assert got["timer_fallback"] == ("graph: the call asks whether it is captured; timed "
                                     "without a graph")
    assert "no context: timed back to back" in got["timer_notes"]
    assert "context: 1 call before" not in got["timer_notes"]
    assert backends["events"].runs == 0  # no timing in its context that the figure drops


def test_without_timers_after_the_stream_one_the_call_is_still_timed_without_its_context():
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.steps import Timed

    backends = {"graph": _FakeTimer("graph", lambda call: "capture refused"),
                "stream": _FakeTimer("stream", lambda call: (
                    "a context cannot leave a window" if call.before is not None else None))}
    got = Timed(["graph", "stream"], backends, ReplayConfig()).run(_in_a_context())
    assert got["timer"] == "stream" and "no context: timed back to back" in got["timer_notes"]
    assert got["timer_fallback"] == "graph: capture refused"


def test_a_call_no_timer_can_time_names_every_refusal():
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.steps import Timed
    from cbtrace.replay.timer.contract import TimerUnavailable

    backends = {"graph": _FakeTimer("graph", lambda call: "capture refused"),
                "stream": _FakeTimer("stream", lambda call: "no window"),
                "events": _FakeTimer("events", lambda call: "no events here")}
    with pytest.raises(TimerUnavailable) as got:
        Timed(["graph", "stream", "events"], backends, ReplayConfig()).run(_in_a_context())
    message = str(got.value)
    for reason in ("graph: capture refused", "stream: no window",
                   "without its context, stream: no window", "events: no events here"):
        assert reason in message, message
