"""A call whose CUDA graph runs other kernels than the call run eagerly (wav2vec2's grouped,
weight-normed Conv1d: 1.7 ms in its graph, 11.2 ms of eager kernels, as in the step) is timed by
the next timer, and the row says why (replay/measure/steps.py)."""
import types

import pytest
import torch

from cbtrace.replay.config import ReplayConfig
from cbtrace.replay.measure import steps
from cbtrace.replay.timer.contract import CallRunner, Timing


class Fixed:
    """A timer that reads ``ms`` for any call; counts its calls."""

    def __init__(self, name: str, ms: float):
        self.name, self.ms, self.calls = name, ms, 0

    def unavailable_reason(self, device):
        return None

    def measure(self, call, n_copies, device, cfg):
        self.calls += 1
        return Timing(median_ms=self.ms, p10_ms=self.ms, p90_ms=self.ms, runs=10,
                      timer=self.name)


def _timed(monkeypatch, graph_ms: float, device_ms: float | None, kernels: int = 19):
    monkeypatch.setattr(steps, "in_step_cache_state", lambda c: None)
    backends = {"graph": Fixed("graph", graph_ms), "stream": Fixed("stream", 11.0)}
    step = steps.Timed(["graph", "stream"], backends, ReplayConfig())
    call = types.SimpleNamespace(row={"device_ms": device_ms, "kernel_count": kernels},
                                 timed=CallRunner(run=lambda i: None),
                                 n_copies=1, device=torch.device("cpu"), context_note=None,
                                 context_key=None, rec=types.SimpleNamespace(fqn="pos_conv"),
                                 value_free=False)
    return step.run(call), backends


def test_a_compiled_call_may_run_faster_than_the_eager_kernels(monkeypatch):
    monkeypatch.setattr(steps, "in_step_cache_state", lambda c: None)
    backends = {"graph": Fixed("graph", 1.7), "stream": Fixed("stream", 11.0)}
    step = steps.Timed(["graph", "stream"], backends, ReplayConfig(), eager_kernels=False)
    call = types.SimpleNamespace(row={"device_ms": 11.2, "kernel_count": 19},
                                 timed=CallRunner(run=lambda i: None), n_copies=1,
                                 device=torch.device("cpu"), context_note=None,
                                 context_key=None, rec=types.SimpleNamespace(fqn="blk"),
                                 value_free=False)
    out = step.run(call)  # fused kernels: the eager call's device_ms says nothing of them
    assert out["timer"] == "graph" and backends["stream"].calls == 0


def test_a_graph_far_faster_than_its_eager_kernels_is_timed_eagerly(monkeypatch):
    out, backends = _timed(monkeypatch, graph_ms=1.7, device_ms=11.2)
    assert out["timer"] == "stream" and out["isolated_ms"] == 11.0
    assert "other kernels" in out["timer_fallback"] and "11.2 ms" in out["timer_fallback"]
    assert backends["graph"].calls == backends["stream"].calls == 1


@pytest.mark.parametrize("graph_ms, device_ms, kernels", [
    (9.0, 11.2, 19), (1.7, None, 19), (1.7, 0.0, 19), (1.7, float("nan"), 19),
    (0.0008, 0.0019, 1),   # a microsecond call: the profiler's cost doubles its kernels' time
    (0.006, 0.016, 8)])    # eight 2 us kernels: 8 us of kernels once the profiler's cost is off
def test_a_graph_near_its_kernels_or_without_a_profiled_figure_stands(monkeypatch, graph_ms,
                                                                      device_ms, kernels):
    # kernels alone in another cache state differ by tens of percent, not by half; a call of a
    # microsecond or two reads its kernels' profiled time doubled by the profiler's own cost
    out, backends = _timed(monkeypatch, graph_ms=graph_ms, device_ms=device_ms, kernels=kernels)
    assert out["timer"] == "graph" and out["timer_fallback"] is None
    assert backends["stream"].calls == 0
