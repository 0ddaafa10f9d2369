"""After a failed CUDA graph capture only the capturing device's default generator gets a fresh
state (the GPU test, tests/test_train_replay.py, checks random ops still run after one)."""
import contextlib

import pytest
import torch

from cbtrace.replay.timer import graph_capture


class FakeGenerator:
    """Records graphsafe_set_state; its state is a token of its own."""

    def __init__(self, index: int):
        self.index, self.set_to = index, []

    def clone_state(self):
        return ("clone", self.index)

    def graphsafe_set_state(self, state):
        self.set_to.append(state)


class FakeGraph:
    def pool(self):
        return (0, 1)

    def capture_begin(self, **kwargs):
        pass

    def capture_end(self):
        raise RuntimeError("operation failed due to a previous error during capture")


class FakeStream:
    def __init__(self, index: int):
        self.device = torch.device("cuda", index)


@pytest.fixture
def gens(monkeypatch):
    gens = tuple(FakeGenerator(i) for i in range(3))
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    routed = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool",
                        lambda device, pool: routed.append((device, pool)), raising=False)
    return gens, routed


def test_only_the_current_devices_generator_is_reset(gens, monkeypatch):
    gens, routed = gens
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    graph_capture.end_pool_routing(FakeGraph())
    assert [g.set_to for g in gens] == [[], [("clone", 1)], []]
    assert routed == [(1, (0, 1))]


def test_the_stream_device_is_the_capturing_one(gens, monkeypatch):
    """A capture on a stream of device 2 while device 0 is current fails: device 2's generator
    and pool routing are undone, device 0's generator is left alone."""
    gens, routed = gens
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    asked = []  # the capture first asks the stream's device how much memory is free
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: asked.append(device) or (8, 8))
    g = FakeGraph()
    with pytest.raises(RuntimeError, match="during capture"):
        with graph_capture.capturing(g, FakeStream(2)):
            pass
    graph_capture.end_pool_routing(g)
    assert [g.set_to for g in gens] == [[], [], [("clone", 2)]]
    assert routed == [(2, (0, 1))]
    assert asked == [torch.device("cuda", 2)]


def test_a_generator_without_graph_safe_states_is_skipped(gens, monkeypatch):
    gens, _ = gens
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def refuse(state):
        raise RuntimeError("graphsafe_set_state not supported")
    monkeypatch.setattr(gens[0], "graphsafe_set_state", refuse)
    graph_capture.end_pool_routing(FakeGraph())  # no error
    assert [g.set_to for g in gens[1:]] == [[], []]
