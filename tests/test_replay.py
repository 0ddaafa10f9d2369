"""Isolated replay on CPU: state invariance, skip-and-aggregate, errors, resume."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.settings import FAST_REPLAY
from torch import nn

import cbtrace
from cbtrace import module_tree
from cbtrace.rundir.read import read_manifest, read_modules
from cbtrace.rundir.files import sha256_file
from cbtrace.capture.from_spec import capture_model
from cbtrace.model.spec import resolve
from cbtrace.state import state_fingerprint


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    return capture_model("nanogpt:tiny", tmp_path_factory.mktemp("g") / "run", device="cpu").out


@pytest.mark.parametrize("spec", ["nanogpt:tiny", "dlrm:tiny"])
def test_replay_leaves_model_state_untouched(tmp_path, spec):
    provider = resolve(spec)
    model, batch = provider.model_and_batch("cpu")
    model.train()  # dropout + RNG live
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        provider.run(model, batch)
    before = state_fingerprint(model)
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    assert state_fingerprint(model) == before
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"][["fqn", "status_reason"]]
    assert (df["timer"] == "cpu").all() and (df["isolated_ms"] > 0).all()
    assert (df["isolated_ms_p10"] <= df["isolated_ms"]).all()
    assert (df["isolated_ms"] <= df["isolated_ms_p90"]).all()


def test_batchnorm_running_stats_unchanged(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    model.train()
    x = torch.randn(2, 3, 8, 8)
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(x)
    stats = model[1].running_mean.clone(), model[1].running_var.clone()
    tracked = model[1].num_batches_tracked.clone()
    cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    assert torch.equal(model[1].running_mean, stats[0])
    assert torch.equal(model[1].running_var, stats[1])
    assert torch.equal(model[1].num_batches_tracked, tracked)
    assert model.training


def test_rebuilds_model_from_spec_and_fills_figures(gpt_run):
    df = cbtrace.replay(gpt_run, **FAST_REPLAY)
    ok = df[df["status"] == "ok"]
    assert len(ok) == len(df)
    lin = ok[ok["module_type"] == "Linear"]
    assert (lin["flops"] > 0).all() and (lin["bytes"] > 0).all()
    # parents whose children were all timed carry a residual
    root = df[df["fqn"] == ""].iloc[0]
    kids = df[df["parent_call_id"] == root["call_id"]]
    assert root["residual_ms"] == pytest.approx(root["isolated_ms"] - kids["isolated_ms"].sum())
    assert read_modules(gpt_run)["isolated_ms"].notna().all()


def test_cold_flag_reaches_every_row_and_the_manifest(gpt_run):
    df = cbtrace.replay(gpt_run, cold=True, **FAST_REPLAY)
    ok = df[df["status"] == "ok"]
    assert len(ok) and ok["timer_notes"].str.contains("cold").all()
    assert read_manifest(gpt_run).replay.cold is True
    df = cbtrace.replay(gpt_run, **FAST_REPLAY)  # and a plain replay clears the notes again
    assert not df["timer_notes"].fillna("").str.contains("cold").any()


def test_replay_settings_are_validated_and_cold_warm_up_counts_for_resume():
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.engine import timing_settings

    for bad in ("budget_s", "cold_budget_s", "cold_warmup_s", "cold_settle_tol"):
        with pytest.raises(ValueError, match=bad):
            ReplayConfig(**{bad: -1})
    cold, warm = ReplayConfig(cold=True), ReplayConfig(cold=True, cold_settle_tol=0.02)
    assert timing_settings(cold) != timing_settings(warm)
    assert timing_settings(ReplayConfig()) == timing_settings(ReplayConfig(cold_settle_tol=0.5))
    assert timing_settings(ReplayConfig()) == timing_settings(ReplayConfig(budget_s=1.0))
    assert timing_settings(ReplayConfig()) != timing_settings(ReplayConfig(cpu_windows=1))
    with pytest.raises(ValueError, match="cpu_windows must be >= 1"):
        ReplayConfig(cpu_windows=0)
    # which calls get a context, and how an input no module wrote is left, change the figure
    for other in (dict(context_rewrite="off"), dict(context_max_ms=0.04)):
        assert timing_settings(ReplayConfig()) != timing_settings(ReplayConfig(**other))
        # ... where a context can apply: rows timed without one keep their settings
        for alone in (dict(context=False), dict(cold=True)):
            assert timing_settings(ReplayConfig(**alone)) == timing_settings(
                ReplayConfig(**alone, **other))


def test_resume_redoes_rows_timed_with_other_settings(tmp_path):
    run = capture_model("nanogpt:tiny", tmp_path / "run", device="cpu").out
    first = cbtrace.replay(run, **FAST_REPLAY)
    again = cbtrace.replay(run, resume=True, **FAST_REPLAY)  # same settings: every row kept
    assert (again["isolated_ms"].values == first["isolated_ms"].values).all()
    cold = cbtrace.replay(run, resume=True, cold=True, **FAST_REPLAY)  # other settings: all redone
    ok = cold[cold["status"] == "ok"]
    assert len(ok) and ok["timer_notes"].str.contains("cold").all()


def test_skip_and_aggregate_under_memory_budget(tmp_path):
    cap = capture_model("nanogpt:tiny", tmp_path / "r", device="cpu")
    df0 = read_modules(cap.out)
    block = df0[df0["fqn"] == "transformer.h.0"].iloc[0]
    from cbtrace.replay.engine import footprint_bytes
    from cbtrace.schema.modules import frame_to_records

    recs = {r.fqn: r for r in frame_to_records(df0)}
    budget = footprint_bytes(recs["transformer.h.0"]) - 1
    too_big = {f for f, r in recs.items() if footprint_bytes(r) > budget}
    assert "transformer.h.0.attn" not in too_big and "" in too_big
    df = cbtrace.replay(cap.out, memory_budget_bytes=budget, **FAST_REPLAY)
    row = df[df["fqn"] == "transformer.h.0"].iloc[0]
    assert row["status"] == "skipped" and "budget" in row["status_reason"]
    assert bool(row["aggregated"])
    kids = df[df["parent_call_id"] == block["call_id"]]
    assert (kids["status"] == "ok").all()
    assert row["isolated_ms"] == pytest.approx(kids["isolated_ms"].sum())
    assert row["flops"] == pytest.approx(kids["flops"].sum())


def test_module_that_raises_is_recorded_and_replay_goes_on(tmp_path):
    class Flaky(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Flaky.calls += 1
            if Flaky.calls > 1:
                raise RuntimeError("boom on replay")
            return x + 1

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Flaky(), torch.nn.ReLU())
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(2, 4))
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY).set_index("fqn")
    assert df.loc["1", "status"] == "error" and "boom on replay" in df.loc["1", "status_reason"]
    assert df.loc["0", "status"] == "ok" and df.loc["2", "status"] == "ok"


def test_a_call_out_of_memory_runs_once_more_after_the_cache_goes_back(tmp_path, monkeypatch):
    """Its first OOM hands memory back and runs it again; an OOM every time is skipped, saying
    it was tried twice; the calls around it are not touched."""
    from cbtrace.device import OOM_RETRIED
    from cbtrace.replay import engine

    class Hungry(torch.nn.Module):
        fail_for = 0  # replay runs to fail, from the first

        def forward(self, x):
            if Hungry.fail_for > 0:
                Hungry.fail_for -= 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 98.00 MiB.")
            return x * 2

    freed = []
    real_free = engine.hand_back
    monkeypatch.setattr(engine, "hand_back", lambda device: freed.append(1) or real_free(device))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Hungry(), torch.nn.ReLU())
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(2, 4))
    Hungry.fail_for = 1  # the root's first run (replayed first) meets it
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    assert (df["status"] == "ok").all() and freed == [1]
    retried = df[df["timer_notes"].fillna("").str.contains(OOM_RETRIED, regex=False)]
    assert list(retried["parent_call_id"]) == [-1]  # the root alone
    Hungry.fail_for = 10**6
    df = cbtrace.replay(tmp_path / "r", model=model, resume=False, **FAST_REPLAY).set_index("fqn")
    assert df.loc["1", "status"] == "skipped"
    assert df.loc["1", "status_reason"].startswith("OOM: CUDA out of memory") and \
        "twice" in df.loc["1", "status_reason"]
    assert df.loc["2", "status"] == "ok"


def test_resume_after_killing_a_replay(tmp_path):
    cap = capture_model("dlrm:tiny", tmp_path / "r", device="cpu")
    n = len(read_modules(cap.out))
    cmd = [sys.executable, "-m", "cbtrace", "replay", str(cap.out), "--budget-s", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = Path(cap.out) / "replay.progress.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = [json.loads(x)["call_id"] for x in log.read_text().splitlines() if x.strip()]
    assert 3 <= len(done_before) < n
    out = subprocess.run(cmd[:-2] + ["--budget-s", "0.01", "--resume"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    ids = [r["call_id"] for r in rows if "timed twice" not in (r.get("timer_notes") or "")]
    assert sorted(ids) == list(range(n))  # every call exactly once: nothing redone (a busy
    # machine's slow calls may be timed again at the end, marked "timed twice")
    df = read_modules(cap.out)
    assert (df["status"] == "ok").all() and df["isolated_ms"].notna().all()


def test_embedding_copies_touch_other_rows():
    from cbtrace.replay.measure.copies import embedding_copies

    bag = torch.nn.EmbeddingBag(1000, 16, mode="sum")
    ids = torch.tensor([3, 7, 999, 0, 512])
    offsets = torch.tensor([0, 2])
    copies = embedding_copies(bag, (ids, offsets), {}, torch.device("cpu"))
    assert len(copies) > 8
    rows = [set(c[0][0].tolist()) for c in copies]
    assert all(r != rows[0] for r in rows[1:])                     # other rows each time
    for (a, k) in copies:
        assert a[0].dtype == ids.dtype and a[0].shape == ids.shape  # same workload
        assert int(a[0].min()) >= 0 and int(a[0].max()) < 1000      # valid ids
        assert torch.equal(a[1], offsets)
        assert bag(*a).shape == (2, 16)
    assert embedding_copies(torch.nn.Linear(2, 2), (torch.ones(2),), {}, torch.device("cpu")) is None
    ids32 = torch.tensor([[5], [999]], dtype=torch.int32).as_strided((2, 1), (1, 7))  # free stride
    for (a, _) in embedding_copies(torch.nn.Embedding(1000, 4), (ids32,), {}, torch.device("cpu")):
        assert a[0].dtype == torch.int32 and a[0].stride() == (1, 7)  # as captured


def test_copies_are_independent_and_keep_shape_strides_and_autograd_shape():
    from cbtrace.replay.measure.copies import copies_of

    x = torch.randn(3, 1, 4).as_strided((3, 1, 4), (4, 99, 1))  # contiguous; a size-1 dim's
    ids = torch.arange(6)                                        # stride is free
    leaf = torch.randn(2, 2, requires_grad=True)
    bumped = torch.randn(4, 4)[:, :2]                           # not contiguous
    inputs = ((x, ids, leaf, bumped, x), {"k": ids, "n": 3})
    copies = copies_of(inputs, 5)
    assert len(copies) == 5
    for (a, k) in copies:
        for mine, theirs in zip(a, inputs[0]):
            assert torch.equal(mine, theirs) and mine.stride() == theirs.stride()
            assert mine.data_ptr() != theirs.data_ptr()
        assert a[2].requires_grad and a[2].is_leaf
        assert a[0] is a[4] and k["k"] is a[1] and k["n"] == 3  # aliases stay aliases
    versions = [c[0][0]._version for c in copies]
    copies[1][0][0].fill_(0)
    copies[2][0][1].fill_(0)
    assert torch.equal(copies[0][0][0], x) and torch.equal(copies[3][0][1], ids)  # independent
    assert [c[0][0]._version for c in copies] == [v + (i == 1) for i, v in enumerate(versions)]
    starts = [c[0][1].data_ptr() for c in copies]  # 6 int64 each, padded to a block's start
    assert all((p - starts[0]) % 512 == 0 for p in starts) and len(set(starts)) == 5
    assert copies_of(inputs, 0) == []
    # a module may write a copy in place under grad mode, with a parameter (not a view's case)
    w = torch.ones(6, requires_grad=True)
    with torch.enable_grad():
        for c in copies_of((torch.randn(6),), 3):
            assert c[0].mul_(w).grad_fn is not None


def test_reassigned_buffers_and_swapped_parameters_are_restored(tmp_path):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(1))

        def forward(self, x):
            self.n = self.n + 1  # reassigns the buffer
            return x

    class DataSwap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            self.lin.weight.data = self.lin.weight.data * 2  # swaps the storage
            return self.lin(x)

    model = torch.nn.Sequential(Counter(), DataSwap())
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(2, 3))
    before = state_fingerprint(model)
    buf = model[0].n
    cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    assert state_fingerprint(model) == before
    assert model[0].n is buf


def test_a_tied_weight_written_in_place_is_restored_once_then_left_alone():
    from cbtrace.state import StateGuard

    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as GPT-2's wte and lm_head
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    before = state_fingerprint(model)
    guard = StateGuard(model)
    assert guard.params[0][3] is guard.params[1][3]        # one copy of the tied tensor
    with guard.call(), torch.no_grad():
        head.weight.mul_(2)
    assert state_fingerprint(model) == before and guard.restored == ["weight"]
    with guard.call():                                     # writes nothing: restores nothing
        emb(torch.tensor([1, 2]))
    assert guard.restored == ["weight"]


def test_a_call_checks_its_subtree_whole_and_the_rest_by_version():
    """Per call the guard walks the call's own subtree whole and every other parameter by its
    version counter (a 1,400-parameter model: 2.3 ms a call walked whole); a .data swap
    outside the subtree moves no counter and waits for ``undo``, which the replay runs last."""
    from cbtrace.state import StateGuard

    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(a, b)
    before = state_fingerprint(model)
    guard = StateGuard(model)
    with guard.call(a), torch.no_grad():
        b.weight.mul_(2)                                   # outside, in place: seen at once
    assert state_fingerprint(model) == before and guard.restored == ["weight"]
    with guard.call(a):
        a.weight.data = a.weight.data.t()                  # inside, swapped: seen at once
    assert state_fingerprint(model) == before and len(guard.restored) == 2
    with guard.call(a):
        b.bias.data = b.bias.data * 3                      # outside, swapped: left for undo
    assert state_fingerprint(model) != before and len(guard.restored) == 2
    guard.undo()
    assert state_fingerprint(model) == before and guard.restored[-1] == "bias"


def test_a_data_swap_that_keeps_the_address_is_restored():
    """A .data swap moves no version counter; one whose new tensor shows the old address (a
    transposed view of the same bytes, or the freed original's block handed out again) must
    still be seen. The guard holds the original's bytes, so only a view can share them."""
    from cbtrace.state import StateGuard

    lin = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(lin)
    before = state_fingerprint(model)
    guard = StateGuard(model)
    with guard.call():
        lin.weight.data = lin.weight.data.t()              # same address, other strides
    assert state_fingerprint(model) == before and guard.restored == ["weight"]
    ptr = lin.weight.data_ptr()
    with guard.call():
        lin.weight.data = lin.weight.data * 2              # the model lets go of its bytes,
        assert guard.params[0][4].data_ptr() == ptr != lin.weight.data_ptr()  # the guard not
    assert state_fingerprint(model) == before and guard.restored == ["weight", "weight"]


def test_replay_again_clears_stale_figures_and_refuses_corrupt_inputs(tmp_path):
    from cbtrace.errors import ReplayError

    cap = capture_model("dlrm:tiny", tmp_path / "r", device="cpu")
    cbtrace.replay(cap.out, **FAST_REPLAY)
    before = sha256_file(cap.out / "modules.parquet")
    shard = next((cap.out / "inputs").glob("*.parquet"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ReplayError, match="corrupt"):
        cbtrace.replay(cap.out, **FAST_REPLAY)
    assert sha256_file(cap.out / "modules.parquet") == before  # results kept
    from cbtrace.replay.engine import fresh_replay_fields
    from cbtrace.schema.modules import frame_to_records

    rec = fresh_replay_fields(frame_to_records(read_modules(cap.out))[0])
    assert rec.isolated_ms is None and rec.status is None and rec.insitu_ms is None


def test_inplace_op_on_a_non_leaf_input_replays_as_in_the_step(tmp_path):
    """A BatchNorm output feeding ReLU(inplace=True) in a training step: stored as a non-leaf,
    rebuilt as one (a leaf that requires grad would raise on the in-place op)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 4, 3)).train()
    x = torch.randn(2, 3, 10, 10)
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(x).sum().backward()
    (got,), _ = cbtrace.load_inputs(tmp_path / "r", "2")
    assert got.requires_grad and not got.is_leaf  # as the ReLU saw it
    bn = model[1].eval()(model[0](x)).detach()  # eval: the values, not the batch statistics
    assert got.shape == bn.shape and got.stride() == bn.stride()
    before = state_fingerprint(model.train())
    df = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY)
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"][["fqn", "status_reason"]]
    assert state_fingerprint(model) == before


def test_a_train_step_capture_says_replay_measured_the_forward(tmp_path):
    run = tmp_path / "r"
    subprocess.run([sys.executable, "-m", "cbtrace", "capture", "--model", "dlrm:tiny", "--device",
                    "cpu", "--step", "train", "--max-depth", "1", "--out", str(run)],
                   check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run), "--budget-s",
                          "0.002"], check=True, capture_output=True, text=True).stdout
    assert "captured with --step train" in out and "forward only" in out


class Sleeper(nn.Module):
    """A module that hangs (in Python) and one that gives NaN."""

    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(4, 4)
        self.hang = False  # set after capture: replay's calls then hang
        self.slept = 0     # hangs that ran their whole 60 s

    def forward(self, x):
        y = self.ok(x)
        if self.hang:
            time.sleep(60)
            self.slept += 1
        return y


class NaNs(nn.Module):
    def forward(self, x):
        return x / 0 * 0  # NaN everywhere


def test_a_hanging_call_times_out_and_replay_goes_on_with_honest_counts(tmp_path):
    model = nn.Sequential(Sleeper(), NaNs(), nn.Linear(4, 2)).eval()
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(3, 4))
    model[0].hang = True
    df = cbtrace.replay(tmp_path / "r", model=model, timeout_s=1.0, **FAST_REPLAY)
    assert model[0].slept == 0  # every 60 s sleep was cut short, however busy the machine
    by = df.set_index("fqn")
    assert by.loc["0", "status"] == "timeout" and "longer than 1 s" in by.loc["0", "status_reason"]
    assert by.loc["", "status"] == "timeout"  # the root runs the sleeper too
    assert by.loc["1", "status"] == "ok" and by.loc["1", "nonfinite_outputs"]
    assert by.loc["2", "status"] == "ok" and by.loc["0.ok", "status"] == "ok"
    from cbtrace.plugins.reporters.summary import status_text

    text = status_text(df)
    assert text.startswith("calls: ok 3, error 0, skipped 0, timeout 2")
    assert "flagged: 2 call(s) outputs hold NaN or Inf" in text  # NaNs and the Linear after it


def test_strict_exits_nonzero_on_any_non_ok_call_and_progress_shows_without_a_terminal(tmp_path):
    run = tmp_path / "r"
    subprocess.run([sys.executable, "-m", "cbtrace", "capture", "--model", "dlrm:tiny", "--device",
                    "cpu", "--max-depth", "1", "--out", str(run)], check=True, capture_output=True)
    ok = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run), "--budget-s", "0.002",
                         "--strict"], capture_output=True, text=True)
    assert ok.returncode == 0 and "calls: ok 5, error 0, skipped 0, timeout 0" in ok.stdout
    assert "cbtrace: replay: 5 calls" in ok.stderr  # not a terminal: plain progress lines
    bad = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run), "--budget-s",
                          "0.002", "--memory-budget", "1", "--strict"], capture_output=True,
                         text=True)
    assert bad.returncode == 1 and "skipped 5" in bad.stdout and "skipped: (root): footprint" in bad.stdout


def test_no_kineto_log_lines_reach_the_terminal(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cbtrace", "profile", "--model", "dlrm:tiny",
                          "--device", "cpu", "--max-depth", "1", "--out", str(tmp_path / "r")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    both = out.stdout + out.stderr
    assert "USDT" not in both and "STAGE:" not in both and "profiler_start" not in both


class Routed(nn.Module):
    """Value-dependent work: only the rows whose first feature is positive go through the
    Linear (as an MoE's router sends tokens to an expert)."""

    def __init__(self):
        super().__init__()
        self.expert = nn.Linear(16, 16)

    def forward(self, x):
        picked = x[x[:, 0] > 0]
        return self.expert(picked).sum() + x.sum()


def test_calls_of_the_same_work_reuse_one_profiled_pass_value_dependent_ones_do_not(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), Routed(), Routed()).eval()
    x = torch.randn(64, 16)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            self.m[0](x), self.m[1](x)
            a = self.m[2](x)
            b = self.m[3](x * torch.linspace(-1, 1, 64)[:, None])  # other rows picked
            return a + b

    root = Twice()
    with cbtrace.capture(root, tmp_path / "r", trace=False):
        root(x)
    df = cbtrace.replay(tmp_path / "r", model=root, **FAST_REPLAY).set_index("fqn")
    assert "profiled as m.0" in df.loc["m.1", "timer_notes"]  # same work: the pass reused
    assert df.loc["m.1", "kernel_count"] == df.loc["m.0", "kernel_count"]
    assert df.loc["m.2", "flops"] != df.loc["m.3", "flops"]  # routing: other work...
    # ...profiled on its own (a busy CPU may time it again, from its own pass: "profiled as m.3")
    assert "profiled as m.2" not in str(df.loc["m.3", "timer_notes"])


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def test_a_call_of_the_same_key_as_a_value_free_one_takes_its_count(tmp_path, monkeypatch):
    """Four blocks alike: each key is counted twice, the second as a check, and the rest take
    it; the figures are those of a replay that counts every call. Block 0 and its first Linear
    read the root's input, a leaf (blocks 1-3 read a non-leaf): keys of their own."""
    from cbtrace.cost import opcount
    from cbtrace.replay import engine
    from cbtrace.replay.measure.reuse import CountCache

    # a loaded CPU times some calls again, counting them again too: not what is counted here
    monkeypatch.setattr(engine, "recheck", lambda done, by_id, every=False: [])
    model = nn.Sequential(*[Mlp() for _ in range(4)])
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.randn(4, 16))
    entered = []
    enter = opcount.OpCounter.__enter__
    monkeypatch.setattr(opcount.OpCounter, "__enter__", lambda self: entered.append(1) or
                        enter(self))
    cached = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY).set_index("fqn")
    n_cached = len(entered)
    monkeypatch.setattr(CountCache, "get", lambda self, key: None)
    every = cbtrace.replay(tmp_path / "r", model=model, **FAST_REPLAY).set_index("fqn")
    assert len(every) == 17 and len(entered) - n_cached == 17  # one count per call without it
    # the root; block 0 and block 0's up: once each; blocks 1-3 and their ups: twice each
    # (1 taken each); the 4 GELUs and 4 downs: twice each (2 taken each)
    assert n_cached == 1 + 2 + 2 * 2 + 2 * 2
    cols = ["flops", "flops_executed", "bytes", "unknown_ops", "compute_dtype"]
    assert cached[cols].equals(every.loc[cached.index, cols])


def test_a_count_is_reused_only_after_a_second_one_agrees():
    from cbtrace.replay.measure.reuse import CountCache

    a, b = {"flops": 1}, {"flops": 2}
    cache = CountCache()
    cache.put("k", a, value_free=True)
    assert cache.get("k") is None                  # one count: nothing to take yet
    cache.put("k", a, value_free=True)
    assert cache.get("k") == a                     # two alike: the rest take it
    cache.put("j", a, value_free=True)
    cache.put("j", b, value_free=True)             # the second differs: never reused
    cache.put("j", a, value_free=True)
    assert cache.get("j") is None
    cache.put("v", a, value_free=False)            # value-dependent: never kept
    cache.put("v", a, value_free=True)
    assert cache.get("v") is None and cache.get(None) is None


class Eps(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.lin, self.eps = nn.Linear(16, 16), eps

    def forward(self, x, dim=-1, extra=None):
        return torch.softmax(self.lin(x) + self.eps, dim=dim)


def test_the_count_key_sees_settings_arguments_and_objects(tmp_path):
    import dataclasses

    from cbtrace.replay.measure.reuse import call_key
    from cbtrace.rundir.read import load_run
    from cbtrace.schema.modules import frame_to_records

    @dataclasses.dataclass
    class Box:
        v: int

    model = nn.ModuleList([Eps(), Eps(), Eps(eps=1e-3), Eps()])

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return (self.m[0](x) + self.m[1](x) + self.m[2](x) + self.m[1](x, dim=0)
                    + self.m[3](x, extra=Box(1)))

    root = Root()
    with cbtrace.capture(root, tmp_path / "r", trace=False):
        root(torch.randn(4, 16))
    recs = [r for r in frame_to_records(load_run(tmp_path / "r")[1]) if r.fqn.count(".") == 1]
    keys = {(r.fqn, r.call_index): call_key(module_tree.get_submodule(root, r.fqn), r)
            for r in recs}
    assert keys[("m.0", 0)] == keys[("m.1", 0)]           # the same work
    assert keys[("m.2", 0)] != keys[("m.0", 0)]           # another eps
    assert keys[("m.1", 1)] != keys[("m.1", 0)]           # another dim
    assert keys[("m.3", 0)] is None                       # an object argument: never reused


def test_the_count_key_sees_tuple_and_private_settings_and_refuses_callables_and_hooks(
        tmp_path):
    from cbtrace.replay.measure.reuse import call_key
    from cbtrace.rundir.read import load_run
    from cbtrace.schema.modules import frame_to_records

    class Rep(nn.Module):
        def __init__(self, rep=1, act=None):
            super().__init__()
            self.lin, self._rep = nn.Linear(8, 8), rep
            if act is not None:
                self.act = act

        def forward(self, x):
            for _ in range(self._rep):
                x = self.lin(x)
            return x

    convs = [nn.Conv2d(4, 4, 3, stride=1), nn.Conv2d(4, 4, 3, stride=2),
             nn.Conv2d(4, 4, 3, stride=1)]
    reps = [Rep(), Rep(rep=3), Rep(act=torch.relu), Rep(), Rep()]
    reps[4].register_forward_hook(lambda *a: None)
    model = nn.ModuleList(convs + reps)

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, img, x):
            return [c(img).sum() for c in convs] + [r(x).sum() for r in reps]

    root = Root()
    with cbtrace.capture(root, tmp_path / "r", trace=False):
        root(torch.randn(1, 4, 16, 16), torch.randn(2, 8))
    keys = {r.fqn: call_key(module_tree.get_submodule(root, r.fqn), r)
            for r in frame_to_records(load_run(tmp_path / "r")[1]) if r.fqn.count(".") == 1}
    assert keys["m.0"] == keys["m.2"] and keys["m.1"] != keys["m.0"]  # stride is a tuple
    assert keys["m.4"] != keys["m.3"]                     # _rep, a private setting
    assert keys["m.5"] is None                            # a callable attribute
    assert keys["m.6"] == keys["m.3"] and keys["m.7"] is None  # a hook: never reused


def test_the_large_recsys_preset_is_a_thousand_calls():
    from cbtrace.model.spec import resolve
    from cbtrace.plugins.providers.dlrm import SimpleDeepFMNN

    provider = resolve("dlrm:large")
    with torch.device("meta"):  # no weights: 676 M parameters
        model = SimpleDeepFMNN(provider.config())
    assert sum(1 for _ in model.modules()) >= 1000 and len(provider.tables()) == 600


class SlowAtFirst(nn.Module):
    """Spins 2 ms on each of its first ``n`` calls, as a shared machine's slow stretch would
    slow a call's first timing window (a spin: its thread stays on the CPU, nothing says noisy)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls = n, 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= self.n:
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
        return x * 2


@pytest.mark.parametrize("windows", [1, 2])
def test_a_cpu_call_is_timed_in_two_windows_and_the_faster_kept(tmp_path, monkeypatch, windows):
    from cbtrace.replay import engine

    model = nn.Sequential(SlowAtFirst(0), SlowAtFirst(0)).eval()  # the root: twice either
    with cbtrace.capture(model, tmp_path / "r", trace=False), torch.no_grad():
        model(torch.randn(4, 8))
    for m in model:
        m.n = 10**9  # slow until every call had its first window
    first_pass = engine.ReplayLoop._replay_and_log

    def replay_and_log(loop, cid):
        first_pass(loop, cid)
        if loop.by_id[cid].fqn == "1":  # the last call (breadth-first): the stretch ends
            for m in model:
                m.n = 0
    monkeypatch.setattr(engine.ReplayLoop, "_replay_and_log", replay_and_log)
    if windows == 1:  # and no call that a loaded machine made noisy timed again
        monkeypatch.setattr(engine, "recheck", lambda done, by_id, every=False: (
            list(done) if every else []))
    df = cbtrace.replay(tmp_path / "r", model=model,
                        **{**FAST_REPLAY, "min_runs": 5, "cpu_windows": windows}).set_index("fqn")
    for fqn in ("0", "1"):
        row = df.loc[fqn]
        if windows == 1:  # one window: the slow stretch is the figure
            assert row["isolated_ms"] > 1.5 and "timed twice" not in str(row["timer_notes"])
        else:  # the later window, fast, is kept, whole
            assert row["isolated_ms"] < 1.0 and "timed twice" in row["timer_notes"]
            assert row["runs"] >= 5 and row["isolated_ms_p90"] < 1.0
