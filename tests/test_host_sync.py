"""Host-synchronising calls and calls a CUDA graph cannot hold (issue 28, build item 1): the
stream timer (K calls back to back), host_syncs, error_basis (span or busy) and bound = host."""
from __future__ import annotations

import pytest
import torch

from cbtrace.plugins.backends import stream
from cbtrace.plugins.backends.cpu import CpuTimer
from cbtrace.plugins.backends.events import EventsTimer
from cbtrace.plugins.backends.graph import GraphTimer
from cbtrace.plugins.backends.stats import graph_calls
from cbtrace.plugins.backends.stream import StreamTimer, window_sampler
from cbtrace.replay import timers
from cbtrace.replay.timing import CallRunner, TimerUnavailable, TimingConfig

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
    # one sync before each window opens and one at the end: none between the calls
    assert len(syncs) == 3
    first_window = log[log.index("event"):log.index("event", log.index("event") + 1) + 1]
    assert first_window.count("event") == 2 and "flush" not in first_window
    assert sample(2, 1) == [1.0]
    assert [i for _, i in [x for x in log if isinstance(x, tuple)][-4:]] == [2, 0, 1, 2]


def test_k_fills_a_window_of_a_few_ms():
    k = lambda ms: graph_calls(per_call_ms=ms, k_max=stream.K_MAX,  # noqa: E731
                               max_replay_ms=stream.WINDOW_MS)
    assert k(0.001) == stream.K_MAX
    assert k(0.1) == int(stream.WINDOW_MS / 0.1)
    assert k(7.0) == 1  # a call longer than the window: one call a window
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
