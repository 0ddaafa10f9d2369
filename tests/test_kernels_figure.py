"""A graph-timed call of many kernels takes its kernels' busy time as its figure
(``ReplayConfig.kernels_figure_min``): a graph figure holds the device's gap between each two
kernels, the step's busy time none. The GPU's parts (the profiled runs, the SM clock) are stood
in for; the rest is the replay's own code."""
import dataclasses
import types

import pytest
import torch
from torch import nn

import cbtrace
from cbtrace.replay.config import ReplayConfig
from cbtrace.replay.measure import steps
from cbtrace.replay.measure.profiler_pass import AsTimed
from cbtrace.replay.timer.contract import CallRunner, Timing, TimerUnavailable


class Graph:
    name = "graph"

    def __init__(self, refuse: bool = False):
        self.refuse, self.runs_asked = refuse, []

    def unavailable_reason(self, device):
        return None

    def measure(self, call, n_copies, device, cfg):
        if self.refuse:
            raise TimerUnavailable("graph capture failed: operation not permitted")
        self.runs_asked.append((cfg.min_runs, cfg.budget_s))
        return Timing(median_ms=0.0371, p10_ms=0.0369, p90_ms=0.0374, runs=40, timer="graph")


class Stream(Graph):
    name = "stream"

    def measure(self, call, n_copies, device, cfg):
        return Timing(median_ms=0.0402, p10_ms=0.04, p90_ms=0.0405, runs=12, timer="stream")


def _call(fqn: str, kernels: int):
    """A conv of ``kernels`` kernels timed alone: no context, no table copies."""
    rec = types.SimpleNamespace(fqn=fqn, input_meta="[]", training=False, grad_enabled=False,
                                autocast_dtype=None)
    run = types.SimpleNamespace(timed=lambda: CallRunner(run=lambda i: None, n_copies=4))
    return types.SimpleNamespace(
        row={"device_ms": 0.0352, "kernel_count": kernels, "flops": 1e9, "flops_executed": 1e9,
             "bytes": 4096.0, "unknown_ops": 0, "compute_dtype": None},
        n_copies=4, context_key=None, timed=None, run=run, device=torch.device("cuda"),
        context_note=None, rec=rec, value_free=False, module=nn.Conv2d(8, 8, 1))


@pytest.fixture
def profiled(monkeypatch):
    """The profiled runs asked for; each run's busy time 35.0, 35.1, ... us."""
    asked = []

    def fake_profile(runner, device, runs):
        asked.append(runs)
        each = tuple(0.0350 + 0.0001 * i for i in range(runs))
        return AsTimed(4, sum(each) / runs, each)

    monkeypatch.setattr(steps, "profile_as_timed", fake_profile)
    monkeypatch.setattr(steps, "in_step_cache_state", lambda c: None)
    clocks = iter([1700.0, 1900.0] * 8)  # after the profiled runs, else after the graph's
    monkeypatch.setattr(steps, "sm_clock_mhz", lambda device: next(clocks))
    return asked


def test_a_call_of_many_kernels_takes_its_kernels_busy_time_after_its_graph(profiled):
    graph = Graph()
    got = steps.Timed(["graph"], {"graph": graph}, ReplayConfig()).run(_call("layer4.0.conv3", 4))
    assert got["timer"] == "graph" and profiled == [10]  # context_kernel_runs: a spread
    # its graph only a check then: a few runs, no budget
    assert graph.runs_asked == [(steps.CHECK_RUNS, 0.0)]
    assert got["isolated_ms"] == pytest.approx(0.03545) and got["runs"] == 10
    assert got["isolated_ms_p10"] == pytest.approx(0.03509)
    assert got["isolated_ms_p90"] == pytest.approx(0.03581)
    assert got["device_ms"] == pytest.approx(0.03545) and got["kernel_count"] == 4
    assert got["timed_clock_mhz"] == 1700.0  # the clock its figure's runs left
    assert ("its kernels' busy time (4 kernels), 10 profiled runs (graph: 0.0371 ms, 40 runs)"
            in got["timer_notes"]) and "profiled as timed" in got["timer_notes"]


@pytest.mark.parametrize("kernels, settings", [(3, {}), (6, {"kernels_figure_min": 0}),
                                                (6, {"cold": True})])
def test_a_call_of_few_kernels_with_the_setting_off_or_cold_keeps_its_graph(profiled, kernels,
                                                                           settings):
    """Cold: its graph flushes the L2 before each run, which profiled runs do not."""
    graph = Graph()
    step = steps.Timed(["graph"], {"graph": graph}, ReplayConfig(**settings))
    got = step.run(_call("layer4.0.conv3", kernels))
    assert got["isolated_ms"] == 0.0371 and got["runs"] == 40 and profiled == []
    assert "busy time" not in (got["timer_notes"] or "")
    assert graph.runs_asked[0][0] != steps.CHECK_RUNS or graph.runs_asked[0][1] > 0


def test_a_profile_that_gives_no_figure_has_the_graph_timed_in_full(profiled, monkeypatch):
    monkeypatch.setattr(steps, "profile_as_timed", lambda runner, device, runs: None)
    graph = Graph()
    got = steps.Timed(["graph"], {"graph": graph}, ReplayConfig()).run(_call("conv", 5))
    full = (ReplayConfig().timing().min_runs, ReplayConfig().budget_s)
    assert graph.runs_asked == [(steps.CHECK_RUNS, 0.0), full]
    assert got["isolated_ms"] == 0.0371 and got["runs"] == 40
    assert "busy time" not in (got["timer_notes"] or "")


def test_a_lookup_of_many_kernels_on_table_copies_is_profiled_for_a_spread(profiled):
    """A call on table copies is profiled before its timing, as timed; of many kernels, in
    enough runs for its figure's spread, its graph then a check."""
    graph = Graph()
    call = _call("sparse.t_0", 4)
    call.timed = CallRunner(run=lambda i: None, n_copies=4)  # its table copies, nothing before
    got = steps.Timed(["graph"], {"graph": graph}, ReplayConfig()).run(call)
    assert profiled == [10] and graph.runs_asked == [(steps.CHECK_RUNS, 0.0)]
    assert got["isolated_ms"] == pytest.approx(0.03545)


def test_with_reused_timings_the_second_call_checks_and_the_rest_copy(profiled):
    step = steps.Timed(["graph"], {"graph": Graph()}, ReplayConfig(reuse_timing=True))
    calls = [_call(f"layer4.{i}.conv3", 4) for i in range(4)]
    for c in calls:
        c.value_free = True
    got = [step.run(c) for c in calls]
    assert profiled == [10, 10]  # the first and the one that checks it, each its own runs
    assert [g["runs"] for g in got] == [10, 10, 0, 0]
    assert all("timed as layer4.0.conv3 (--reuse-timing)" in g["timer_notes"] for g in got[2:])


def test_resume_tells_rows_of_another_kernels_figure_setting():
    from cbtrace.replay.engine import timing_settings
    assert timing_settings(ReplayConfig())["kernels_figure_min"] == 4
    assert timing_settings(ReplayConfig(kernels_figure_min=0)) != timing_settings(ReplayConfig())


def test_a_call_the_graph_refuses_keeps_its_back_to_back_figure(profiled, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # after the refusal
    step = steps.Timed(["graph", "stream"], {"graph": Graph(refuse=True), "stream": Stream()},
                       ReplayConfig())
    got = step.run(_call("encoder", 40))
    assert got["timer"] == "stream" and got["isolated_ms"] == 0.0402 and profiled == []


def test_a_call_like_one_so_profiled_takes_its_runs_and_says_whose(profiled):
    step = steps.Timed(["graph"], {"graph": Graph()}, ReplayConfig())
    a, b = step.run(_call("layer4.1.conv3", 4)), step.run(_call("layer4.2.conv3", 4))
    assert profiled == [10] and a["isolated_ms"] == b["isolated_ms"]
    assert a["runs"] == 10 and b["runs"] == 0
    assert "layer4.1.conv3's kernels' busy time (4 kernels)" in b["timer_notes"]
    assert "profiled as timed as layer4.1.conv3" in b["timer_notes"]


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="kernels_figure_min must be >= 0"):
        ReplayConfig(kernels_figure_min=-1)


def test_a_backward_of_many_kernels_takes_its_kernels_busy_time(tmp_path, monkeypatch):
    """A backward's profiled runs (each after its untimed forward; before its timing, as many as
    a forward's figure takes, where the graph times it first) give its figure where they hold
    at least ``kernels_figure_min`` kernels, its graph then only a check whose figure stays in
    the notes. On this CPU the graph timer and the profile are stood in for."""
    from cbtrace.replay.modes import backward as backward_mode
    from cbtrace.replay.timer import choice

    measure = choice.measure
    checks = []  # each backward timing: whether it ran as a check (a few runs, no budget)

    def as_graph(run, n_copies, device, chain, backends, tcfg):
        checks.append(tcfg.min_runs == tcfg.max_runs == steps.CHECK_RUNS and tcfg.budget_s == 0)
        t, why = measure(run, n_copies, device, chain, backends, tcfg)
        return dataclasses.replace(t, timer="graph", median_ms=0.05), why

    init = backward_mode.BackwardStep.__init__

    def graph_first(self, cfg, chain, backends):  # as on a GPU; on this CPU the graph refuses
        init(self, cfg, ["graph", *chain], backends)

    asked = []

    def fake_profile(runner, device, runs=3):
        asked.append(runs)
        runner.before(0)
        runner.run(0)
        each = (0.040, 0.041, 0.042, *[0.041] * (runs - 3))
        return AsTimed(6, 0.041, each)

    # the backward's timer alone: the forward's is the CPU's
    monkeypatch.setattr(backward_mode, "choice", types.SimpleNamespace(measure=as_graph))
    monkeypatch.setattr(backward_mode, "profile_as_timed", fake_profile)
    monkeypatch.setattr(backward_mode.BackwardStep, "__init__", graph_first)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32)).train()
    run = tmp_path / "r"
    with cbtrace.capture(model, run):
        model(torch.randn(16, 64)).sum().backward()
    for setting, want in (({}, 0.041), ({"kernels_figure_min": 7}, 0.05),
                          ({"kernels_figure_min": 0}, 0.05), ({"cold": True}, 0.05)):
        df = cbtrace.replay(run, model=model, backward=True, budget_s=0.05, cold_budget_s=0.05,
                            **setting)
        assert (df["bwd_status"] == "ok").all(), df[["status", "status_reason"]].to_string()
        assert df["bwd_ms"].tolist() == pytest.approx([want] * len(df)), setting
        # profiled first, as many runs as a forward's figure takes, where its kernels may give
        # its figure (not cold, kernels_figure_min not 0); of enough kernels, its graph a check
        may = not setting.get("cold") and setting.get("kernels_figure_min") != 0
        assert set(asked) == {10 if may else 3}, setting
        assert set(checks) == {want == 0.041}, setting
        asked.clear()
        checks.clear()
        assert (df["bwd_kernel_count"] == 6).all() and (df["bwd_device_ms"] == 0.041).all()
        notes = df["bwd_timer_notes"].fillna("")
        said = notes.str.contains("its kernels' busy time (6 kernels), 10 profiled runs "
                                  "(graph: 0.05 ms", regex=False)
        assert said.all() if want == 0.041 else not said.any(), notes
        if want == 0.041:
            assert (df["bwd_ms_p10"] >= 0.040).all() and (df["bwd_ms_p90"] <= 0.042).all()


class RMSNorm(nn.Module):
    """Llama's, in Python: several small kernels forward and more backward."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype)


@pytest.mark.gpu
def test_on_a_gpu_a_call_of_many_kernels_takes_its_profiled_busy_time(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = nn.Sequential(RMSNorm(1024), nn.Linear(1024, 1024)).cuda().train()
    x = torch.randn(4096, 1024, device="cuda")
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(x).float().pow(2).mean().backward()
    # kernels_figure_min 3: the RMSNorm's backward ran 3 kernels under torch 2.11 on an H100
    df = cbtrace.replay(tmp_path / "r", model=model, backward=True, progress=False,
                        budget_s=0.05, kernels_figure_min=3).set_index("fqn")
    assert (df.status == "ok").all() and (df.bwd_status == "ok").all()
    norm = df.loc["0"]
    assert norm.timer == "graph" and norm.kernel_count >= 3, norm.timer_notes
    assert "its kernels' busy time (" in norm.timer_notes and norm.runs == 10
    assert norm.isolated_ms == pytest.approx(norm.device_ms)  # its figure, its device time
    assert norm.isolated_ms_p10 <= norm.isolated_ms <= norm.isolated_ms_p90
    assert norm.bwd_kernel_count >= 3 and "its kernels' busy time (" in norm.bwd_timer_notes
    assert norm.bwd_ms == pytest.approx(norm.bwd_device_ms)
    # the graph's own figure, gaps and all, stays in the notes
    assert "(graph: " in norm.timer_notes and "(graph: " in norm.bwd_timer_notes


@pytest.mark.parametrize("on_copies", [False, True])
def test_a_short_call_takes_its_kernels_busy_time_where_asked(profiled, on_copies):
    """A call of a few microseconds (``small_call_max_ms``): a graph slot holds the device's
    gap before its kernel too, the step's busy time none. Timed alone it is profiled after its
    graph; on copies of its table or parameters, before it; its graph a check either way."""
    graph = Graph()
    call = _call("head.fc", 1)
    if on_copies:
        call.timed = CallRunner(run=lambda i: None, n_copies=4)  # nothing before each run
    cfg = ReplayConfig(kernels_figure_min=0, small_call_max_ms=0.05)
    got = steps.Timed(["graph"], {"graph": graph}, cfg).run(call)
    assert profiled == [10] and graph.runs_asked == [(steps.CHECK_RUNS, 0.0)]
    assert got["isolated_ms"] == pytest.approx(0.03545) and got["runs"] == 10
    assert "its kernels' busy time (4 kernels)" in got["timer_notes"]


@pytest.mark.parametrize("settings", [{"small_call_max_ms": 0.03}, {"cold": True,
                                                                    "small_call_max_ms": 0.05}])
def test_a_call_over_the_short_limit_or_cold_keeps_its_graph(profiled, settings):
    graph = Graph()
    got = steps.Timed(["graph"], {"graph": graph}, ReplayConfig(kernels_figure_min=0, **settings)
                      ).run(_call("head.fc", 1))  # its kernels 35.2 us
    assert got["isolated_ms"] == 0.0371 and profiled == []


def test_the_short_limit_is_checked_and_kept_with_the_rows():
    from cbtrace.replay.engine import timing_settings
    with pytest.raises(ValueError, match="small_call_max_ms must be >= 0"):
        ReplayConfig(small_call_max_ms=-1.0)
    assert timing_settings(ReplayConfig())["small_call_max_ms"] == 0.01
    assert timing_settings(ReplayConfig(small_call_max_ms=0.0)) != timing_settings(ReplayConfig())
    assert timing_settings(ReplayConfig(table_kernels_figure=True)) != timing_settings(
        ReplayConfig())


def test_a_profiled_session_taken_once_more_runs_the_same_slots_again(monkeypatch):
    """A CUDA session that lost every kernel is taken once more (``_profile_rows``): the
    call's runs then go through its slots a second time, where the second pass once ran out
    of slots and the row ended 'error: StopIteration'."""
    from cbtrace.replay.measure import profiler_pass
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda *a: None)
    monkeypatch.setattr(profiler_pass, "_profile_rows",
                        lambda call, device, runs: [call() for _ in range(2 * runs)] and [])
    monkeypatch.setattr(profiler_pass, "own_device_work",
                        lambda rows, runs: (2 * runs, [0.01] * runs))
    seen = []
    got = profiler_pass.profile_as_timed(CallRunner(run=seen.append, n_copies=4), "cuda", 3)
    assert seen == [0, 1, 2, 3, 1, 2, 3] and got.kernel_count == 2


@pytest.mark.parametrize("on", [False, True])
def test_a_lookup_on_table_copies_takes_its_kernels_busy_time_where_asked(profiled, on):
    """``table_kernels_figure``: a lookup on table copies, at any length, takes its kernels'
    figure (profiled for a spread, its graph a check); off, its graph's."""
    graph = Graph()
    call = _call("sparse.t_0", 1)
    call.timed, call.context_key = CallRunner(run=lambda i: None, n_copies=8), ("tables", 8)
    cfg = ReplayConfig(kernels_figure_min=0, table_kernels_figure=on)
    got = steps.Timed(["graph"], {"graph": graph}, cfg).run(call)
    if on:
        assert profiled == [10] and graph.runs_asked == [(steps.CHECK_RUNS, 0.0)]
        assert got["isolated_ms"] == pytest.approx(0.03545)
        assert "its kernels' busy time (4 kernels)" in got["timer_notes"]
    else:
        assert profiled == [ReplayConfig().profile_runs] and got["isolated_ms"] == 0.0371
        assert graph.runs_asked[0][0] != steps.CHECK_RUNS
