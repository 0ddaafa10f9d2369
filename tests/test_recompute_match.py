"""Activation checkpointing: each recomputation in the backward is matched to the forward call it
redoes by the checkpoint region both ran in, not by position: a module called both inside and
outside a checkpoint in one step (in either order, reentrant or not) has its own call flagged."""
import json
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import cbtrace
from cbtrace.attribution.attribute import attribute_file
from cbtrace.attribution.join import insitu_columns
from cbtrace.capture import boundaries
from cbtrace.rundir.read import load_run

MODES = [pytest.param(False, id="nonreentrant"), pytest.param(True, id="reentrant")]


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Shared(nn.Module):
    """One Block called once per entry of ``plan``: checkpointed where it is True."""

    def __init__(self, plan, reentrant):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(16, 1)
        self.plan, self.reentrant = plan, reentrant

    def forward(self, x):
        for ckpt in self.plan:
            x = checkpoint(self.block, x, use_reentrant=self.reentrant) if ckpt else self.block(x)
        return self.head(x)


def _hooked_step(model):
    """A train step with pre hooks that use boundaries as capture does: forward calls become
    records noted with their region, calls in the backward are matched to them."""
    recs, matched, recomputes = [], [], boundaries.Recomputes()
    names = {m: n for n, m in model.named_modules()}

    def pre(module, args):
        fqn = names[module]
        backward, region = boundaries.checkpoint_state()
        if backward:
            rec = recomputes.recompute(fqn, region)
            matched.append(boundaries.recompute_range(fqn, rec))
            return
        index = sum(r.fqn == fqn for r in recs)
        rec = types.SimpleNamespace(fqn=fqn, call_index=index, call_id=len(recs),
                                    recomputed=False)
        recs.append(rec)
        recomputes.forward(rec, region)

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    try:
        model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    finally:
        for h in handles:
            h.remove()
    recomputes.mark()
    return recs, matched


def _flagged(recs):
    return sorted((r.fqn, r.call_index) for r in recs if r.recomputed)


PARTS = ("block", "block.fc1", "block.act", "block.fc2")


@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("plan", [(True, False), (False, True)], ids=["ckpt-first", "ckpt-last"])
def test_a_module_called_inside_and_outside_a_checkpoint(reentrant, plan):
    recs, matched = _hooked_step(Shared(plan, reentrant))
    k = plan.index(True)  # the checkpointed call of each part
    assert _flagged(recs) == sorted((f, k) for f in PARTS)
    # each recomputation names that call (the range attribution charges it to)
    assert sorted(matched) == sorted(f"{boundaries.RECOMPUTE}{f}#{k}" for f in PARTS)


@pytest.mark.parametrize("reentrant", MODES)
def test_two_regions_and_a_plain_call(reentrant):
    """Checkpointed on calls 0 and 2, plainly on 1: each region's recomputation its own call."""
    recs, matched = _hooked_step(Shared((True, False, True), reentrant))
    assert _flagged(recs) == sorted((f, k) for f in PARTS for k in (0, 2))
    assert sorted(matched) == sorted(f"{boundaries.RECOMPUTE}{f}#{k}" for f in PARTS
                                     for k in (0, 2))


def test_outside_a_checkpoint_there_is_no_region():
    seen = []
    lin = nn.Linear(4, 4)
    lin.register_forward_pre_hook(lambda m, a: seen.append(boundaries.checkpoint_state()))
    x = torch.randn(2, 4, requires_grad=True)
    lin(x).sum().backward()
    with torch.no_grad():
        lin(x)
    assert seen == [(False, None), (False, None)]


def test_a_recomputation_of_no_region_seen_takes_the_last_unmatched_call():
    """A checkpoint the forward did not see as one (another implementation): the order rule."""
    recomputes = boundaries.Recomputes()
    recs = [types.SimpleNamespace(fqn="b", call_index=i, call_id=i, recomputed=False)
            for i in range(3)]
    for r in recs:
        recomputes.forward(r, None)
    assert [recomputes.recompute("b", None).call_index for _ in range(4)] == [2, 1, 0, 2]
    assert recomputes.recompute("unknown", None) is None
    recomputes.mark()
    assert all(r.recomputed for r in recs)


def _event(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


@pytest.mark.parametrize("suffix, call", [("#0", 0), ("#1", 1), ("", 1)])
def test_attribution_charges_a_recomputation_to_the_call_its_range_names(tmp_path, suffix, call):
    """Two forward calls of ``block``, one recomputation in the backward: ``#k`` names the
    call; a range without it (an older capture) keeps the order rule (the last call)."""
    events = [_event("cbtrace::block", 0, 10), _event("aten::mm", 1, 5, "cpu_op"),
              _event("cbtrace::block", 20, 10), _event("aten::mm", 21, 5, "cpu_op"),
              _event("autograd::engine::evaluate_function: MmBackward0", 40, 30, "cpu_op"),
              _event(f"{boundaries.RECOMPUTE}block{suffix}", 41, 10),
              _event("aten::mm", 42, 7, "cpu_op")]
    trace = tmp_path / "t.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    df = attribute_file(trace)
    rows = df[df["depth"] >= 0]
    assert sorted(zip(rows["fqn"], rows["call_index"], rows["phase"])) == sorted(
        [("block", 0, "fwd"), ("block", 1, "fwd"), ("block", call, "recompute")])


# ---- through cbtrace.capture and the in-situ stage ------------------------------------------

def _capture(tmp_path, plan, reentrant):
    torch.manual_seed(0)
    model, x = Shared(plan, reentrant), torch.randn(8, 16, requires_grad=True)
    run = tmp_path / "run"
    with cbtrace.capture(model, run) as cap:
        model(x).sum().backward()
    return run, cap


@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("plan", [(True, False), (False, True)], ids=["ckpt-first", "ckpt-last"])
def test_capture_flags_and_times_the_checkpointed_call(tmp_path, reentrant, plan):
    run, cap = _capture(tmp_path, plan, reentrant)
    k = plan.index(True)
    assert [(r.fqn, r.call_index) for r in cap.records if r.fqn in PARTS] == [
        (f, i) for i in range(2) for f in PARTS]  # each call once
    assert _flagged(cap.records) == sorted((f, k) for f in PARTS)
    manifest, df = load_run(run)
    cols = insitu_columns(run, manifest, df)
    rcp = {(f, int(i)): cols[c]["recompute_insitu_ms"]
           for f, i, c in zip(df["fqn"], df["call_index"], df["call_id"])}
    # the recomputation is charged to the checkpointed call (its region's outermost module)
    assert rcp[("block", k)] > 0
    assert rcp[("block", 1 - k)] is None and rcp[("head", 0)] is None
