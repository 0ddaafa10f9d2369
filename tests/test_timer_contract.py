"""The timer contract (replay/timer/contract.py): a typed CallRunner, and timing settings derived
from ReplayConfig in one place."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from cbtrace.plugins.backends.cpu import CpuTimer
from cbtrace.replay.config import ReplayConfig
from cbtrace.replay.timer.contract import CallRunner, TimingConfig, as_runner

BACKENDS = Path(__file__).resolve().parent.parent / "plugins" / "backends"
FAST = TimingConfig(budget_s=0.0, min_runs=4, warmup_runs=2, warmup_min_s=0.0)


def test_a_runner_is_checked_and_a_bare_function_becomes_one():
    with pytest.raises(ValueError, match="n_copies"):
        CallRunner(run=lambda i: None, n_copies=0)
    with pytest.raises(ValueError, match="stage and unstage"):
        CallRunner(run=lambda i: None, stage=lambda j: None)
    fn = lambda i: i * 2  # noqa: E731
    r = as_runner(fn, 3)
    assert r.run is fn and r.n_copies == 3 and r(2) == 4
    assert r.before is None and r.stage is None and r.expected_ms is None and r.graph_ok
    assert as_runner(r, 5) is r


def test_the_cpu_timer_runs_a_context_in_warm_up_and_an_input_rewrite_only_when_timed():
    for warms in (False, True):
        log = []
        call = CallRunner(run=lambda i: log.append(("run", i)), n_copies=2,
                          before=lambda i: log.append(("before", i)), warms_inputs=warms)
        t = CpuTimer().measure(call, 2, "cpu", FAST)
        warm_up = log[:log.index(("run", 1)) + 1]  # two warm-up runs, copies 0 and 1
        assert [k for k, _ in warm_up] == (["run"] * 2 if warms else ["before", "run"] * 2)
        timed = log[len(warm_up):]
        # a busy machine's retry on one thread adds pairs of its own
        assert timed[::2] == [("before", i) for _, i in timed[1::2]]
        assert len(timed) >= 2 * t.runs and {k for k, _ in timed[1::2]} == {"run"}
        assert ("warm inputs" in (t.notes or "")) == warms


def test_timers_use_the_runner_and_probe_no_attribute_of_the_call():
    for path in BACKENDS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("hasattr",
                                                                              "getattr"):
                target = node.args[0]
                assert not (isinstance(target, ast.Name) and target.id == "call"), path.name


def test_replay_config_shares_the_timing_defaults_and_derives_the_timing_settings():
    shared = ("budget_s", "min_runs", "converge_spread", "warmup_runs", "graph_k")
    default = ReplayConfig()
    assert all(getattr(default, f) == getattr(TimingConfig(), f) for f in shared)
    assert default.timing() == TimingConfig()
    cfg = ReplayConfig(budget_s=0.5, min_runs=3, converge_spread=0.05, warmup_runs=2, graph_k=4)
    assert {f: getattr(cfg.timing(), f) for f in shared} == {f: getattr(cfg, f) for f in shared}
    cold = ReplayConfig(cold=True, graph_k=4, converge_spread=0.05).timing()
    assert (cold.budget_s, cold.graph_k, cold.converge_spread) == (default.cold_budget_s, 1, 0.0)
    assert cold.converge_ci == 0.0 < default.converge_ci  # cold mode is never stopped early
    assert (cold.warmup_s, cold.settle_tol) == (default.cold_warmup_s, default.cold_settle_tol)
    assert set(f.name for f in dataclasses.fields(TimingConfig)) >= set(shared)


@pytest.mark.gpu
def test_gpu_the_graph_timer_declines_a_call_that_may_not_be_captured():
    from cbtrace.plugins.backends.graph import GraphTimer
    from cbtrace.replay.timer.contract import TimerUnavailable

    x = torch.randn(64, device="cuda")
    with pytest.raises(TimerUnavailable, match="may not be captured"):
        GraphTimer().measure(CallRunner(run=lambda i: x * 2, graph_ok=False), 1, "cuda", FAST)
