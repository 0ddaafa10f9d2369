"""Calls the step ran under torch.compile (issue 28, build item 4): capture marks them
``step_compiled`` under the user's module paths, replay times them compiled by default (their
eager time in ``eager_ms``) and eagerly with ``eager_only``. One tiny model; capture runs compiled
parts eagerly, so only the replays compile (inductor on CPU, a fraction of a second a module)."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import cbtrace
from cbtrace import module_tree
from cbtrace.cli.main import cli
from cbtrace.replay.modes.compile_cudagraph import AS_IN_STEP
from helpers.settings import FAST_REPLAY



class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


BLOCK = {"block", "block.fc1", "block.act", "block.fc2"}


def _net():
    torch.manual_seed(0)
    return Net().eval()


def _capture(model, run, **kw):
    with torch.no_grad(), cbtrace.capture(model, run, trace=False, **kw) as cap:
        model(torch.randn(4, 8))
    return {r.fqn: r for r in cap.records}


def test_compiled_paths_name_the_users_modules():
    whole = torch.compile(_net())
    assert module_tree.compiled_paths(whole) == {"", "inp", "out", *BLOCK}
    block = _net()
    block.block = torch.compile(block.block)
    assert module_tree.compiled_paths(block) == BLOCK
    in_place = _net()
    in_place.block.compile()  # compiled without a wrapper
    assert module_tree.compiled_paths(in_place) == BLOCK
    assert module_tree.has_compiled(in_place)
    assert module_tree.compiled_paths(_net()) == set() and not module_tree.has_compiled(_net())


def test_capture_of_a_compiled_model_marks_every_call_with_plain_fqns(tmp_path):
    recs = _capture(torch.compile(_net()), tmp_path / "r")
    assert set(recs) == {"", "inp", "out", *BLOCK}  # no _orig_mod. prefix
    assert all(r.step_compiled for r in recs.values())


@pytest.mark.parametrize("how", ["wrapped", "in_place"])
def test_capture_of_a_compiled_block_marks_its_calls_only(tmp_path, how):
    model = _net()
    if how == "wrapped":
        model.block = torch.compile(model.block)
    else:
        model.block.compile()
    recs = _capture(model, tmp_path / "r")
    assert set(recs) == {"", "inp", "out", *BLOCK}
    assert {f for f, r in recs.items() if r.step_compiled} == BLOCK
    assert [recs[f].call_index for f in sorted(recs)] == [0] * 7  # each call recorded once


def test_capture_of_a_plain_model_marks_nothing(tmp_path):
    recs = _capture(_net(), tmp_path / "r")
    assert len(recs) == 7 and not any(r.step_compiled for r in recs.values())


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    """A model with its block compiled, captured to depth 1 (one compiled row: the block) and
    replayed eagerly, then as the step ran it; a plain model replayed as usual."""
    path = tmp_path_factory.mktemp("compiled")
    model = _net()
    model.block = torch.compile(model.block)
    _capture(model, path / "c", max_depth=1)
    eager = cbtrace.replay(path / "c", model=model, eager_only=True, **FAST_REPLAY)
    # two CPU windows (the default): the block's second is timed compiled too
    compiled = cbtrace.replay(path / "c", model=model, **{**FAST_REPLAY, "cpu_windows": 2})
    plain_model = _net()
    _capture(plain_model, path / "p", max_depth=1)
    plain = cbtrace.replay(path / "p", model=plain_model, **FAST_REPLAY)
    return tuple({r["fqn"]: r for r in df.to_dict("records")} for df in (eager, compiled, plain))


def test_a_step_compiled_row_is_timed_compiled_by_default(replays):
    _, rows, _ = replays
    block = rows["block"]
    assert block["status"] == "ok" and block["step_compiled"]
    assert AS_IN_STEP in block["timer_notes"]
    assert block["compile_graphs"] >= 1 and block["compile_s"] > 0  # it compiled
    assert block["eager_ms"] > 0 and block["isolated_ms"] > 0  # both figures, side by side
    assert block["compile_status"] is None  # not a mode asked for: no opportunity row
    for fqn in ("", "inp", "out"):  # the step ran them eagerly
        assert rows[fqn]["status"] == "ok" and not rows[fqn]["step_compiled"]
        assert _missing(rows[fqn]["eager_ms"])
        assert AS_IN_STEP not in _notes(rows[fqn])


def test_a_call_timed_again_is_timed_as_the_step_ran_it():
    """The second CPU window's plan: the time step, then the loop's AsInStep, whose compiled
    entries are warm (a compiled row's windows are then both compiled)."""
    from cbtrace import registry
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.plan import default_plan, time_plan
    from cbtrace.replay.measure.steps import Timed
    from cbtrace.replay.modes.compile_cudagraph import AsInStep

    for cfg in (ReplayConfig(reuse_timing=True), ReplayConfig(eager_only=True)):
        cpu, backends = torch.device("cpu"), registry.backends()
        plan = default_plan(cfg, cpu, backends)
        again = time_plan(cfg, cpu, backends, plan)
        assert isinstance(again[0], Timed) and again[0].reuse is None  # every call timed
        assert again[1:] == [s for s in plan if isinstance(s, AsInStep)]
        assert len(again) == (1 if cfg.eager_only else 2)


def test_eager_only_times_it_eagerly(replays):
    rows, _, _ = replays
    block = rows["block"]
    assert block["status"] == "ok" and block["isolated_ms"] > 0
    assert AS_IN_STEP not in _notes(block)
    assert _missing(block["eager_ms"]) and _missing(block["compile_s"])


def test_a_plain_models_rows_are_unchanged(replays):
    _, _, rows = replays
    assert set(rows) == {"", "inp", "block", "out"}
    for row in rows.values():
        assert row["status"] == "ok" and not row["step_compiled"]
        assert _missing(row["eager_ms"]) and _missing(row["compile_s"])
        assert AS_IN_STEP not in _notes(row)


def test_the_cli_flag_is_documented():
    # through the group, as a user runs it: click keeps a command's help option from its
    # first invocation, and a bare command's has no -h
    out = CliRunner().invoke(cli, ["replay", "--help"]).output
    assert "--eager-only" in out


def test_modes_compile_leaves_a_step_compiled_row_to_isolated_ms(tmp_path):
    model = _net()
    model.block = torch.compile(model.block)
    _capture(model, tmp_path / "r", max_depth=1)
    df = cbtrace.replay(tmp_path / "r", model=model, modes=("compile",), **FAST_REPLAY)
    rows = {r["fqn"]: r for r in df.to_dict("records")}
    block = rows["block"]
    assert AS_IN_STEP in _notes(block) and block["eager_ms"] > 0
    assert block["compile_status"].startswith("skipped: the step ran it compiled")
    assert rows["out"]["compile_status"] == "ok" and rows["out"]["compile_ms"] > 0


def test_a_failed_compile_keeps_the_eager_figure_and_says_why(tmp_path, monkeypatch):
    from cbtrace.replay.modes import compile_cudagraph as modes

    def broken(mode):
        def entry(module, *args, **kwargs):
            raise RuntimeError("no compiler here")
        return entry

    monkeypatch.setattr(modes, "compiled_entry", broken)
    model = _net()
    model.block = torch.compile(model.block)
    _capture(model, tmp_path / "r", max_depth=1)
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    block = {r["fqn"]: r for r in df.to_dict("records")}["block"]
    assert block["status"] == "ok" and block["isolated_ms"] > 0 and _missing(block["eager_ms"])
    assert "the step ran it compiled; timed eagerly: error: RuntimeError: no compiler here" in (
        _notes(block))


def _notes(row) -> str:
    return "" if _missing(row["timer_notes"]) else row["timer_notes"]


def _missing(v) -> bool:
    return v is None or v != v  # None, or NaN in a pandas column of floats
