"""--reuse-timing (replay/measure/reuse.py TimingReuse): calls that are the same work and cannot
depend on values are timed once, checked once, copied after; everything else is timed as usual."""
from __future__ import annotations

import pytest
import torch
from helpers.settings import FAST_REPLAY

import cbtrace
from cbtrace.capture.from_spec import capture_model
from cbtrace.replay.measure.reuse import TimingReuse, value_free

FAST = {**FAST_REPLAY, "budget_s": 0.002}  # nanogpt:tiny's many calls, replayed in each test


class Router(torch.nn.Module):
    """An MoE-style gate: which expert runs depends on the values (topk)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.gate(x).topk(1, dim=-1).values * x


def test_repeated_blocks_are_timed_once_and_checked(tmp_path, monkeypatch):
    """On CPU timings the 3 % check may pass or fail: whatever it decides, a copied row carries
    its source's time and no runs of its own, and value-dependent calls are never copied."""
    from cbtrace.replay import engine

    # a busy CPU times its slow calls again, and a check row timed again is no check any more
    monkeypatch.setattr(engine, "recheck", lambda done, by_id, every=False: [])
    cap = capture_model("nanogpt:tiny", tmp_path / "r", device="cpu")
    df = cbtrace.replay(cap.out, model_spec="nanogpt:tiny", reuse_timing=True, **FAST)
    assert (df["status"] == "ok").all()
    notes = df["timer_notes"].fillna("")
    for _, row in df[notes.str.contains("timed as")].iterrows():
        ref = row["timer_notes"].split("timed as ")[1].split(" ")[0]
        src = df[df["fqn"] == ref].iloc[0]
        assert row["runs"] == 0 and row["isolated_ms"] == src["isolated_ms"]
        assert row["timing_copied_from"] == ref
        assert row["module_type"] == src["module_type"] and row["fqn"] != ref
    checks = df[notes.str.contains("timing-reuse check")]
    assert len(checks) >= 1 and checks["runs"].gt(0).all()
    emb = df[df["module_type"] == "Embedding"]  # they read ids: never copied
    assert not emb["timer_notes"].fillna("").str.contains("timed as").any()
    assert (emb["runs"] > 0).all()
    df0 = cbtrace.replay(cap.out, model_spec="nanogpt:tiny", **FAST)  # off by default
    assert (df0["runs"] > 0).all() and not df0["timer_notes"].fillna("").str.contains(
        "timed as").any()


def test_a_passed_check_copies_the_rest_of_the_group(tmp_path, monkeypatch):
    """With a timer that reads every call alike the check always passes: of the five
    LayerNorms of nanogpt:tiny (same shapes), the first is timed, the second checks it and the
    other three copy it; the groups of two (each block's Linears) have nothing left to copy."""
    from cbtrace.replay.measure import steps
    from cbtrace.replay.timer.contract import Timing

    def alike(call, n_copies, device, chain, backends, cfg):
        return Timing(median_ms=1.0, p10_ms=1.0, p90_ms=1.0, runs=5, timer="cpu"), None

    monkeypatch.setattr(steps.choice, "measure", alike)
    cap = capture_model("nanogpt:tiny", tmp_path / "r", device="cpu")
    df = cbtrace.replay(cap.out, model_spec="nanogpt:tiny", reuse_timing=True, **FAST)
    norms = df[df["module_type"] == "LayerNorm"].sort_values("call_id")
    notes = norms["timer_notes"].fillna("")
    assert len(norms) == 5
    assert notes.str.contains("timing-reuse check").sum() == 1
    assert notes.str.contains("reused for the rest").sum() == 1
    copied = norms[notes.str.contains("timed as")]
    assert len(copied) == 3 and (copied["runs"] == 0).all()
    linears = df[df["module_type"] == "Linear"]
    assert not linears["timer_notes"].fillna("").str.contains("timed as").any()
    assert not df[df["module_type"] == "Embedding"]["timer_notes"].fillna("").str.contains(
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
    # their gates (plain Linears of one shape) are value-free: the second checks the first,
    # the third copies it only if the check passed
    gates = df[df["fqn"].str.endswith("gate")].sort_values("call_id")
    notes = gates["timer_notes"].fillna("")
    assert len(gates) == 3 and notes.str.contains("timing-reuse check").sum() <= 1
    copied = gates[notes.str.contains("timed as")]
    assert copied.empty or (copied["fqn"].tolist() == [gates["fqn"].iloc[2]]
                            and notes.str.contains("reused for the rest").any())
    # a copy and its source are never timed again apart (the CPU's end-of-replay recheck)
    for _, row in copied.iterrows():
        assert row["isolated_ms"] == gates["isolated_ms"].iloc[0]


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


def test_a_copy_names_its_source_in_a_column():
    r = TimingReuse(tol=0.03)
    r.record("k", "h.0", {"isolated_ms": 1.0})
    r.record("k", "h.1", {"isolated_ms": 1.0})
    fqn, fields = r.lookup("k")
    assert fqn == "h.0" and fields == {"isolated_ms": 1.0, "timing_copied_from": "h.0"}


def test_recheck_reads_the_column_not_the_note():
    """A copy and its source are left out of the CPU's recheck by ``timing_copied_from``; a
    note that merely reads like a copy's decides nothing."""
    from types import SimpleNamespace

    from cbtrace.replay.engine import recheck

    by_id = {i: SimpleNamespace(fqn=f, parent_call_id=0 if i else None)
             for i, f in enumerate(["", "h.0", "h.1", "h.2"])}
    row = dict(status="ok", isolated_ms=1.0, noisy=True)
    done = {0: dict(status="ok", isolated_ms=5.0), 1: dict(row),
            2: dict(row, timing_copied_from="h.0", timer_notes="timed as h.0 (--reuse-timing)"),
            3: dict(row, timer_notes="timed as h.0 (--reuse-timing)")}
    assert recheck(done, by_id) == [3]
    assert recheck(done, by_id, every=True) == [0, 3]  # cpu_windows > 1: every call timed


def test_profile_and_replay_commands_take_the_flag(tmp_path):
    import subprocess
    import sys

    import pandas as pd

    run = tmp_path / "r"
    out = subprocess.run([sys.executable, "-m", "cbtrace", "profile", "--model", "nanogpt:tiny",
                          "--out", str(run), "--reuse-timing"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    notes = pd.read_parquet(run / "modules.parquet")["timer_notes"].fillna("")
    assert notes.str.contains("timing-reuse check").any()
    out = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run)],
                         capture_output=True, text=True, timeout=600)  # without: all timed
    assert out.returncode == 0, out.stderr[-2000:]
    df = pd.read_parquet(run / "modules.parquet")
    assert not df["timer_notes"].fillna("").str.contains("timing-reuse").any()
    assert (df["runs"] > 0).all()
