"""--reuse-timing (replay/reuse.py TimingReuse): calls that are the same work and cannot depend
on values are timed once, checked once, copied after; everything else is timed as usual."""
from __future__ import annotations

import pytest
import torch

import cbtrace
from cbtrace.capture.from_spec import capture_model
from cbtrace.replay.reuse import TimingReuse, value_free

FAST = dict(budget_s=0.002, min_runs=3, warmup_runs=1, profile_runs=1, progress=False)


class Router(torch.nn.Module):
    """An MoE-style gate: which expert runs depends on the values (topk)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.gate(x).topk(1, dim=-1).values * x


def test_repeated_blocks_are_timed_once_and_checked(tmp_path):
    cap = capture_model("nanogpt:tiny", tmp_path / "r", device="cpu")
    df = cbtrace.replay(cap.out, model_spec="nanogpt:tiny", reuse_timing=True, **FAST)
    assert (df["status"] == "ok").all()
    notes = df["timer_notes"].fillna("")
    copied = df[notes.str.contains("timed as")]
    checks = df[notes.str.contains("timing-reuse check")]
    blocks = df[df["module_type"] == "Block"].sort_values("call_id")
    assert len(blocks) == 2
    # each group: the first timed, the second checks it; the rest copied only after a pass
    for _, row in copied.iterrows():
        ref = row["timer_notes"].split("timed as ")[1].split(" ")[0]
        src = df[df["fqn"] == ref].iloc[0]
        assert row["runs"] == 0 and row["isolated_ms"] == src["isolated_ms"]
        assert row["module_type"] == src["module_type"] and row["fqn"] != ref
    assert len(checks) >= 1 and checks["runs"].gt(0).all()
    passed = checks["timer_notes"].str.contains("reused for the rest")
    if passed.any():
        assert len(copied) > 0
    # value-dependent calls are never copied: the embeddings read ids
    emb = df[df["module_type"] == "Embedding"]
    assert not emb["timer_notes"].fillna("").str.contains("timed as").any()
    assert (emb["runs"] > 0).all()
    # off by default: every call timed
    df0 = cbtrace.replay(cap.out, model_spec="nanogpt:tiny", **FAST)
    assert (df0["runs"] > 0).all() and not df0["timer_notes"].fillna("").str.contains(
        "timed as").any()


def test_value_reading_ops_and_integer_inputs_are_not_value_free():
    f = '[{"dtype": "float32", "shape": [2]}]'
    assert value_free(f, {"aten::mm", "aten::add"})
    assert not value_free(f, {"aten::mm", "aten::topk"})
    assert not value_free('[{"dtype": "int64"}]', {"aten::mm"})
    assert not value_free('[{"dtype": "float32"}, {"dtype": "bool"}]', set())


def test_routing_modules_are_timed_each(tmp_path):
    model = torch.nn.Sequential(*[Router() for _ in range(3)])
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(8, 16))
    df = cbtrace.replay(tmp_path / "r", model=model, reuse_timing=True, **FAST)
    routers = df[df["module_type"] == "Router"]
    assert len(routers) == 3 and (routers["runs"] > 0).all()
    # their gates (plain Linears of one shape) are value-free and may be copied
    gates = df[df["fqn"].str.endswith("gate")]
    assert gates["timer_notes"].fillna("").str.contains("timing-reuse check").sum() == 1


@pytest.mark.parametrize("second, verified", [(1.02, True), (1.05, False)])
def test_check_decides_the_group(second, verified):
    r = TimingReuse(tol=0.03)
    key = ("sig", 1)
    assert r.lookup(key) is None
    assert r.record(key, "h.0", {"isolated_ms": 1.0}) is None
    assert r.lookup(key) is None  # the second is timed: the check
    note = r.record(key, "h.1", {"isolated_ms": second})
    assert ("reused for the rest" in note) is verified and "h.0" in note
    assert (r.lookup(key) is not None) is verified
    assert r.lookup(None) is None and r.record(None, "x", {"isolated_ms": 1}) is None
