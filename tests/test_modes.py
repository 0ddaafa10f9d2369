"""Replay in other modes (issue 14, part 1): torch.compile (inductor on CPU), one-call CUDA graphs,
each call's saving in its fastest mode, the --opportunities ranking and the icicle's speedup
colours. Compile on CPU takes a fraction of a second to seconds per module: the models are the
tiny demos cut at a shallow depth, with a small timing budget."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import cbtrace
from cbtrace.model.spec import resolve
from cbtrace.plugins.reporters import icicle_model, palette
from cbtrace.plugins.reporters.icicle_tree import record_rows
from cbtrace.plugins.reporters.opportunities import (module_opportunities, opportunity_table,
                                                     overlap)
from cbtrace.replay.modes import compile_cudagraph as modes
from cbtrace.replay.modes import opportunity as opp
from cbtrace.rundir.read import load_run
from cbtrace.schema.modules import records_to_frame
from cbtrace.state import state_fingerprint
from helpers.runs import record, write_run
from helpers.settings import FAST_REPLAY



def _replay_spec(tmp_path, spec: str, max_depth: int, **options):
    provider = resolve(spec)
    model, batch = provider.model_and_batch("cpu")
    model.eval()
    with cbtrace.capture(model, tmp_path / "r", trace=False, max_depth=max_depth):
        provider.run(model, batch)
    before = state_fingerprint(model)
    df = cbtrace.replay(tmp_path / "r", model=model, **{**FAST_REPLAY, **options})
    assert state_fingerprint(model) == before
    return df


@pytest.fixture(scope="module")
def gpt_modes(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt")
    return path / "r", _replay_spec(path, "nanogpt:tiny", 2, modes=("compile", "cudagraph"))


# ---------------------------------------------------------------- the opportunity, by hand


def test_step_cost_is_the_larger_of_device_and_host_time():
    assert opp.step_ms(0.05, 0.08) == 0.08       # host-bound: the step pays the issue time
    assert opp.step_ms(0.05, 0.01) == 0.05
    assert opp.step_ms(2.0, None) == 2.0         # CPU: no host_ms, wall time is the cost
    assert opp.step_ms(None, 0.3) is None and opp.step_ms(float("nan")) is None


def test_opportunity_of_hand_worked_calls():
    # GPU, launch-bound: eager max(0.05, 0.08) = 0.08; compile max(0.03, 0.06) = 0.06;
    # cudagraph 0.055 (launch included) wins: 0.08 / 0.055 = 1.4545x, saving 0.025 ms
    gpu = record("a", 0, isolated_ms=0.05, host_ms=0.08, status="ok", compile_status="ok",
                 compile_ms=0.03, cudagraph_status="ok", cudagraph_ms=0.055)
    gpu.compile_host_ms = 0.06  # recorded where the schema has the column
    # CPU: eager 2.0, compiled 1.5: 1.333x, 0.5 ms
    cpu = record("b", 1, isolated_ms=2.0, status="ok", compile_status="ok", compile_ms=1.5,
                 cudagraph_status="unavailable: needs CUDA")
    # compile failed and no CUDA: eager is best, nothing to save
    failed = record("c", 2, isolated_ms=1.0, status="ok", compile_status="error: boom",
                    cudagraph_status="unavailable: needs CUDA")
    plain = record("d", 3, isolated_ms=1.0, status="ok")         # replayed without --modes
    broken = record("e", 4, status="error", compile_status="error: x")
    opp.add_opportunities([gpu])  # a step of its own: a GPU's calls and a CPU's never mix
    opp.add_opportunities([cpu, failed, plain, broken])
    assert (gpu.eager_step_ms, gpu.best_mode) == (0.08, "cudagraph")
    assert gpu.speedup == pytest.approx(0.08 / 0.055) and gpu.opportunity_ms == pytest.approx(0.025)
    assert (cpu.eager_step_ms, cpu.best_mode) == (2.0, "compile")
    assert cpu.speedup == pytest.approx(4 / 3) and cpu.opportunity_ms == pytest.approx(0.5)
    assert (failed.best_mode, failed.speedup, failed.opportunity_ms) == ("eager", 1.0, 0.0)
    assert plain.eager_step_ms == 1.0 and plain.best_mode is None and plain.speedup is None
    assert broken.eager_step_ms is None and broken.best_mode is None
    # without compile_host_ms the compiled call costs its device time
    assert opp.mode_costs({"compile_status": "ok", "compile_ms": 0.03}) == {"compile": 0.03}
    assert opp.best_of(1.0, {"compile": 1.0}) == ("eager", 1.0)  # ties stay eager


def test_in_step_saving_counts_host_time_only_where_the_host_bounds_the_step():
    assert opp.in_step_saving_ms(10, 6, 1, 2) == 1       # device-bound: the device saving
    assert opp.in_step_saving_ms(4, 10, 1, 3) == 3       # host-bound: the host saving
    assert opp.in_step_saving_ms(9, 10, 3, 0.5) == 0.5   # host-bound, little host saved
    assert opp.in_step_saving_ms(9, 10, 1, 5) == 2       # crosses over: device bounds it after
    assert opp.in_step_saving_ms(5, None, 2, None) == 2  # CPU: wall time
    assert opp.in_step_saving_ms(None, 3, 1, 1) is None


def test_compile_estimates_place_each_module_in_the_step():
    def r(fqn, cid, parent, **kw):
        return dict(fqn=fqn, call_id=cid, parent_call_id=parent, status="ok",
                    compile_status="ok", **kw)

    rows = [r("", 0, -1, isolated_ms=4.0, host_ms=10.0, compile_ms=2.5, compile_host_ms=6.0),
            r("a", 1, 0, isolated_ms=1.0, host_ms=3.0, compile_ms=0.5, compile_host_ms=1.0),
            r("b", 2, 0, isolated_ms=1.0, host_ms=0.5, compile_ms=0.2, compile_host_ms=0.6),
            r("b", 3, 0, isolated_ms=1.0, host_ms=0.5, compile_ms=0.2, compile_host_ms=0.6),
            {**r("c", 4, 0, isolated_ms=1.0, host_ms=1.0), "compile_status": "error: x"}]
    est = opp.compile_estimates(rows)
    # the step is host-bound (device 4, host 10): root max(4, 10) - max(2.5, 6) = 4; a saves
    # 2 ms of host; b saves 1.6 ms of device but costs 0.2 ms more host: -0.2; c never compiled
    assert est == pytest.approx({"": 4.0, "a": 2.0, "b": -0.2})
    assert opp.pick_modules(est, 1) == ["", "a"]
    assert opp.pick_modules(est, 5) == ["", "a", "b"]


def _hand_run():
    """root (5 ms saved) > a (2 ms) > a.x (two calls, 0.5 ms each); root > b (1 ms, a leaf)."""
    def r(fqn, cid, parent, k=0, **kw):
        return record(fqn, cid, parent, call_index=k, status="ok", module_type=fqn or "Root",
                      **{"compile_status": "ok", "cudagraph_status": "ok", **kw})

    return [
        r("", 0, -1, isolated_ms=10.0, compile_ms=5.0, cudagraph_ms=9.0, compile_s=4.0,
          compile_graphs=1),
        r("a", 1, 0, isolated_ms=4.0, compile_ms=2.0, cudagraph_ms=3.0, compile_s=1.0,
          compile_graphs=2),
        r("a.x", 2, 1, isolated_ms=1.0, compile_ms=1.2, cudagraph_ms=0.5, compile_s=0.5,
          compile_graphs=1),
        r("a.x", 3, 1, k=1, isolated_ms=1.0, compile_ms=1.2, cudagraph_ms=0.5, compile_s=0.0,
          compile_graphs=0),
        r("b", 4, 0, isolated_ms=2.0, compile_ms=1.0, cudagraph_status="error: graph capture "
          "failed: x", compile_s=0.2, compile_graphs=1),
    ]


def test_ranking_sums_calls_and_says_levels_overlap(tmp_path):
    recs = _hand_run()
    opp.add_opportunities(recs)
    rows = record_rows(records_to_frame(recs))
    ranked = module_opportunities(rows)
    assert [m["fqn"] for m in ranked] == ["", "a", "a.x", "b"]
    ax = ranked[2]
    assert ax["calls"] == 2 and ax["eager_ms"] == 2.0 and ax["opportunity_ms"] == 1.0
    assert ax["cudagraph"] == 1.0 and ax["compile"] == pytest.approx(2.4)
    assert ax["speedup"] == 2.0 and ax["best"] == "cudagraph"
    assert (ax["compile_s"], ax["compile_graphs"]) == (0.5, 1)
    assert ranked[3]["cudagraph"] == "error" and ranked[3]["best"] == "compile"
    # children of the root: a 2 + b 1; leaves: a.x 1 + b 1; the root's own: 5
    assert overlap(rows) == dict(children=3.0, leaves=2.0, root=5.0)
    text = opportunity_table(records_to_frame(recs))
    assert "Top 4 of 4 modules by saving per step" in text
    assert "over the root's children 3 ms, over the leaves 2 ms; the root's own 5 ms" in text
    assert "levels overlap" in text
    assert "cudagraph failed: b: error: graph capture failed: x" in text
    line = next(x for x in text.splitlines() if x.split()[:2] == ["3", "a.x"])
    assert line.split()[2:] == ["a.x", "2", "2", "ms", "2.4", "ms", "1", "ms", "1", "ms",
                                "2.00x", "cudagraph", "0.5", "1"]
    plain = [record("a", 0, isolated_ms=1.0, status="ok")]
    assert "replay it with `cbtrace replay RUN --modes compile,cudagraph`" in opportunity_table(
        records_to_frame(plain))


def test_report_prints_the_ranking(tmp_path, capsys):
    from cbtrace.cli.main import main

    recs = _hand_run()
    opp.add_opportunities(recs)
    run = write_run(tmp_path / "run", recs)
    try:
        main(["report", str(run), "--opportunities", "--top", "2"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "Top 2 of 4 modules by saving per step" in out
    assert "the root's own 5 ms" in out and (run / "icicle.html").is_file()


# ---------------------------------------------------------------- compile on CPU (inductor)


def test_compile_mode_on_nanogpt(gpt_modes):
    run, df = gpt_modes
    assert (df["status"] == "ok").all()
    ok = df[df["compile_status"] == "ok"]
    assert len(ok) == len(df), df[df["compile_status"] != "ok"][["fqn", "compile_status"]]
    assert (ok["compile_ms"] > 0).all() and (ok["compile_s"] > 0).all()
    assert (ok["compile_graphs"] >= 1).all()  # one module object per call here: each compiled
    assert (df["cudagraph_status"] == "unavailable: needs CUDA").all()
    assert df["cudagraph_ms"].isna().all()
    assert (df["eager_step_ms"] == df["isolated_ms"]).all()  # CPU: no host_ms
    assert df["best_mode"].isin(["eager", "compile"]).all()
    best = df[["isolated_ms", "compile_ms"]].min(axis=1)
    assert df["opportunity_ms"].to_numpy() == pytest.approx((df["isolated_ms"] - best).to_numpy())
    assert df["speedup"].to_numpy() == pytest.approx((df["isolated_ms"] / best).to_numpy())
    stored = load_run(run)[1]
    assert stored["speedup"].notna().all() and stored["compile_status"].notna().all()


def test_report_opportunities_of_a_real_run(gpt_modes, capsys):
    from cbtrace.cli.main import main

    run, df = gpt_modes
    try:
        main(["report", str(run), "--opportunities"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "modules by saving per step" in out and "(root)" in out
    assert "over the root's children" in out


@pytest.mark.slow
def test_compile_mode_on_dlrm(tmp_path):
    df = _replay_spec(tmp_path, "dlrm:tiny", 1, modes=("compile",))
    assert (df["status"] == "ok").all()
    ok = df[df["compile_status"] == "ok"]
    assert len(ok) >= len(df) - 1, df[["fqn", "compile_status"]]
    assert (ok["compile_ms"] > 0).all() and (ok["compile_graphs"] >= 1).all()
    assert df["cudagraph_status"].isna().all()  # not asked for
    assert df["best_mode"].notna().all() and df["opportunity_ms"].ge(0).all()


class NoCompile(nn.Module):
    """Runs eagerly, raises while dynamo traces it: dynamo gives up and runs it eagerly."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            raise RuntimeError("not under torch.compile")
        return x * 2


class Broken(nn.Module):
    """A graph break in the middle: two graphs."""

    def forward(self, x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2


def _replay_small(tmp_path, model, max_depth=None, **options):
    x = torch.randn(4, 8)
    with cbtrace.capture(model, tmp_path / "r", trace=False, max_depth=max_depth), \
            torch.no_grad():
        model(x)  # no grad: a call's input and the next's output differ in nothing dynamo guards
    settings = {**FAST_REPLAY, **options}
    return cbtrace.replay(tmp_path / "r", model=model, **settings).set_index("fqn")


def test_a_module_that_cannot_compile_is_recorded_and_replay_goes_on(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), NoCompile(), Broken(), nn.ReLU()).eval()
    df = _replay_small(tmp_path, model, modes=("compile", "cudagraph"))
    assert (df["status"] == "ok").all()  # eager works for every call
    bad = df.loc["1"]
    assert bad["compile_status"].startswith("error: not compiled, dynamo ran it eagerly")
    assert "Observed exception" in bad["compile_status"] and math.isnan(bad["compile_ms"])
    assert bad["best_mode"] == "eager" and bad["opportunity_ms"] == 0
    for fqn in ("0", "3"):  # before and after the failure: compiled
        assert df.loc[fqn, "compile_status"] == "ok" and df.loc[fqn, "compile_ms"] > 0
    assert df.loc["2", "compile_status"] == "ok" and df.loc["2", "compile_graphs"] == 2
    assert "compile: 2 graphs (Call to `torch._dynamo.graph_break()`)" in df.loc["2", "timer_notes"]


def test_a_compile_error_is_one_line_on_every_row(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    df = _replay_small(tmp_path, model, modes=("compile",), compile_mode="no-such-mode")
    assert (df["status"] == "ok").all()
    assert df["compile_status"].str.startswith("error: RuntimeError: Unrecognized mode").all()
    assert (df["best_mode"] == "eager").all() and df["compile_ms"].isna().all()


def test_calls_failing_alike_stop_compile_mode_with_the_reason(tmp_path):
    from cbtrace.replay.modes.compile_cudagraph import FAILED_ALIKE

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).eval()
    df = _replay_small(tmp_path, model, modes=("compile",), compile_mode="no-such-mode")
    assert (df["status"] == "ok").all()  # eager goes on
    status = df["compile_status"]
    failed = status.str.startswith("error: RuntimeError: Unrecognized mode")
    stopped = status.str.startswith(f"skipped: compile mode stopped: {FAILED_ALIKE} calls in a "
                                    "row failed alike (RuntimeError: Unrecognized mode")
    assert failed.sum() == FAILED_ALIKE and stopped.sum() == len(df) - FAILED_ALIKE
    assert (failed | stopped).all() and df["compile_ms"].isna().all()


def test_a_compiled_call_between_failures_keeps_compile_mode_on():
    from cbtrace.replay.modes.compile_cudagraph import FAILED_ALIKE, Compiled

    c = Compiled.__new__(Compiled)  # its bookkeeping alone
    c.failures, c.stopped = [], None
    for status in ["error: a"] * (FAILED_ALIKE - 1) + ["ok", "error: a", "skipped: x", "error: b"]:
        c._watch(status)
    assert c.stopped is None and c.failures == ["error: b"]
    for _ in range(FAILED_ALIKE - 1):
        c._watch("error: b")
    assert c.stopped == f"compile mode stopped: {FAILED_ALIKE} calls in a row failed alike (b)"


def test_rows_timed_twice_keep_their_compile_error(tmp_path, monkeypatch):
    """Under load the noisy rows are timed again, the time steps alone: compile mode does not
    run a call twice and count it as two failures (a CI run on a busy machine stopped compile
    mode after two calls of three when it did)."""
    from cbtrace.replay import engine

    monkeypatch.setattr(engine, "recheck", lambda done, by_id, every: list(done))  # all again
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    df = _replay_small(tmp_path, model, modes=("compile",), compile_mode="no-such-mode")
    assert df["compile_status"].str.startswith("error: RuntimeError: Unrecognized mode").all()


def test_a_module_called_twice_compiles_once(tmp_path):
    lin = nn.Linear(8, 8)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    df = _replay_small(tmp_path, Twice().eval(), modes=("compile",)).reset_index()
    calls = df[df["fqn"] == "lin"].sort_values("call_index")
    assert list(calls["compile_status"]) == ["ok", "ok"]
    assert list(calls["compile_graphs"]) == [1, 0]  # the second call reuses the first's graph


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x))) + x


def test_identical_blocks_compile_once_and_run_with_their_own_weights(tmp_path):
    from torch._dynamo.utils import counters

    model = nn.Sequential(*[Block() for _ in range(12)], nn.Linear(8, 4)).eval()
    before = counters["stats"]["unique_graphs"]
    df = _replay_small(tmp_path, model, modes=("compile",), max_depth=1).reset_index()
    assert (df["compile_status"] == "ok").all(), df[["fqn", "compile_status"]]
    blocks = df[df["fqn"].isin([str(i) for i in range(12)])].sort_values("call_id")
    assert list(blocks["compile_graphs"]) == [1] + [0] * 11  # one compile for the 12 blocks
    # dynamo's own count: the root, one block, the last Linear (3), and at most once more each
    # where a busy CPU's timer retried on one thread (dynamo guards on the thread count); a
    # compile per block would need 14
    assert 3 <= counters["stats"]["unique_graphs"] - before <= 6


def test_steady_issue_time_runs_warm_calls_back_to_back():
    from cbtrace.replay.modes.compile_cudagraph import ISSUE_MAX_CALLS, steady_issue_ms

    copies = []

    def run(i):
        copies.append(i)
        return torch.ones(4) * i

    ms = steady_issue_ms(run, 3, "cpu", warmup=3, repeats=2)
    assert ms > 0
    # 3 warm-up calls, one to size K, then 2 x K back to back (a call this short: K at its cap)
    assert len(copies) == 3 + 1 + 2 * ISSUE_MAX_CALLS
    assert copies[:4] == [0, 1, 2, 0] and copies[4:7] == [0, 1, 2]  # input copies rotate


def test_cold_issue_time_evicts_the_host_caches_before_each_timed_call():
    from cbtrace.replay.modes.compile_cudagraph import HostEvictor, cold_issue_ms

    log = []
    evictor = HostEvictor(1 << 20)

    def evict():
        evictor()
        log.append("evict")

    def run(i):
        log.append(i)
        return torch.ones(4) * i

    ms = cold_issue_ms(run, 2, "cpu", evict, warmup=2, runs=3)
    assert ms > 0 and int(evictor.buf[-1]) == 1  # the buffer was written through
    # two warm-up calls, then each timed call right after an eviction, copies rotating
    assert log == [0, 1, "evict", 0, "evict", 1, "evict", 0]


def test_cold_host_issue_is_a_setting_that_tells_its_rows_apart():
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.engine import timing_settings

    assert ReplayConfig().cold_host_issue is True
    assert "cold_host_issue" not in timing_settings(ReplayConfig())  # no compile mode: moot
    compiled = ReplayConfig(modes=("compile",))
    assert timing_settings(compiled)["cold_host_issue"] is True
    off = ReplayConfig(modes=("compile",), cold_host_issue=False)
    assert timing_settings(off)["cold_host_issue"] is False


class CountsEager(nn.Module):
    """Counts its eager runs (a compiled run skips the branch: dynamo folds it away)."""

    def __init__(self):
        super().__init__()
        self.eager = 0

    def forward(self, x):
        if not torch.compiler.is_compiling():
            self.eager += 1
        return x * 2


def test_the_compiled_call_is_timed_not_the_eager_calls_timed_function():
    from types import SimpleNamespace

    from cbtrace import registry
    from cbtrace.replay.timer import choice as timers
    from cbtrace.replay.measure.prepare import prepare
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.modes.compile_cudagraph import Compiled

    cfg, dev, backends = ReplayConfig(modes=("compile",), **FAST_REPLAY), torch.device("cpu"), \
        registry.backends()
    module = CountsEager()
    rec = SimpleNamespace(grad_enabled=False, autocast_dtype=None, fqn="m", call_id=0,
                          input_meta="[]", inputs_ref="", training=False)
    c = prepare(module, rec, (torch.randn(4, 8),), {}, dev, cfg)
    c.timed = c.run  # the eager call's timed function, as the eager Timed step leaves it
    c.context = [lambda j: torch.randn(4, 8)]  # a predecessor whose output it does not read
    row = Compiled(cfg, timers.chain(cfg.timer, dev, backends), backends).run(c)
    assert row["compile_status"] == "ok" and row["compile_ms"] > 0
    assert module.eager == 0  # every run of the step was the compiled call
    assert "compile timed without the eager call's in-step cache state" in row["timer_notes"]


def test_a_shared_entry_runs_each_module_with_its_own_parameters():
    from cbtrace.replay.modes.compile_cudagraph import EntryCache

    cache, x = EntryCache("default"), torch.randn(4, 8)
    blocks = [Block().eval() for _ in range(3)]
    with torch.no_grad():
        for b in blocks:
            fn = cache.runner_fn("same kind", b)
            torch.testing.assert_close(fn(x), b(x))
    assert len(cache.entries) == 1 and len(cache.modules["same kind"]) == 3


def test_a_kind_that_recompiles_per_module_gets_entries_of_its_own():
    from cbtrace.replay.modes.compile_cudagraph import SHARE_MISSES, EntryCache

    cache, rec = EntryCache("default"), record("b", 0, input_meta="[]", inputs_ref="")
    blocks = [Block() for _ in range(SHARE_MISSES + 2)]
    cache.key = lambda module, rec: "k" if cache.misses.get("k", 0) < SHARE_MISSES else (
        "module", id(module))  # call_key stands in: the same kind for every block
    for b in blocks:
        key = cache.key(b, rec)
        cache.runner_fn(key, b)
        cache.compiled_again(key, b)
    assert cache.misses["k"] == SHARE_MISSES  # the first block's compile is no miss
    assert cache.key(blocks[-1], rec) == ("module", id(blocks[-1]))


def test_verify_in_place_measures_each_chosen_module_in_the_whole_step(tmp_path):
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 4)).eval()
    df = _replay_small(tmp_path, model, modes=("compile",), max_depth=1).reset_index()
    est = opp.compile_estimates(record_rows(df))
    assert set(est) == {"", "0", "1", "2"}  # every module compiled ok in the replay
    fqns = opp.pick_modules(est, 2)
    x = torch.randn(4, 8)
    want = model(x).detach()

    def step(m):
        with torch.no_grad():
            return m(x)

    rows = opp.verify_in_place(model, step, fqns, est, "cpu", k=3, repeats=2)
    assert [r.fqn for r in rows] == fqns and fqns[0] == "" and len(rows) == 3
    for r in rows:
        assert r.status == "ok" and r.estimated_ms == est[r.fqn]
        assert r.eager_ms > 0 and r.compiled_ms > 0 and r.compile_s > 0
        assert r.measured_ms == r.eager_ms - r.compiled_ms
        assert r.error_ms == r.estimated_ms - r.measured_ms
    # the model is put back as it was: its own modules, the same outputs
    assert [type(m) for m in model] == [Block, Block, nn.Linear]
    torch.testing.assert_close(step(model), want)


@pytest.mark.slow
def test_profile_verify_opportunity_prints_a_row_per_chosen_module(tmp_path):
    from click.testing import CliRunner

    from cbtrace.cli.main import cli

    # the root only (depth 0): one compile in replay, one in place
    res = CliRunner().invoke(cli, ["profile", "--model", "benchmarks/zoo.py:cnn", "--device",
                                   "cpu", "--max-depth", "0", "--out", str(tmp_path / "r"),
                                   "--verify-opportunity", "1"])
    assert res.exit_code == 0, res.output
    lines = res.output.split("Compiled in place:", 1)[1].splitlines()
    row = lines[3].split()  # title, header, rule, then one row per module
    assert row[:2] == ["(root)", "SmallCNN"]
    # estimated, measured, its noise and the error: each a figure with its unit
    assert all(row[i] in ("ms", "µs") for i in (3, 5, 7, 9)), row
    assert "of the measured saving:" in lines[4] and "of 1 modules (0 not measured)" in lines[4]
    df = load_run(tmp_path / "r")[1]
    assert len(df) == 1 and (df["compile_status"] == "ok").all()


def test_verify_in_place_keeps_a_row_for_a_module_that_fails(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), NoCompile()).eval()
    x = torch.randn(4, 8)
    rows = opp.verify_in_place(model, lambda m: m(x), ["1"], {}, "cpu", k=2, repeats=1,
                               mode="no-such-mode")
    assert len(rows) == 1 and rows[0].status.startswith("error: RuntimeError: Unrecognized mode")
    assert rows[0].eager_ms > 0 and rows[0].measured_ms is None and rows[0].estimated_ms is None
    assert type(model[1]) is NoCompile


def test_modes_past_their_budget_are_skipped_with_a_note(tmp_path):
    from click.testing import CliRunner

    from cbtrace.cli.main import cli

    from cbtrace.capture.from_spec import capture_model

    capture_model("nanogpt:tiny", tmp_path / "r", device="cpu", trace=False, max_depth=1)
    # a budget of 0 s is spent before the first call: every call skips both modes
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "r"), "--modes",
                                    "compile,cudagraph", "--modes-budget-s", "0",
                                    "--budget-s", "0.005"])
    assert res.exit_code == 0, res.output
    n = len(load_run(tmp_path / "r")[1])
    assert f"compile skipped on {n} of {n} calls: modes budget of 0 s spent " \
           "(--modes-budget-s)" in res.output
    assert f"cudagraph skipped on {n} of {n} calls" in res.output
    df = load_run(tmp_path / "r")[1]
    assert (df["status"] == "ok").all() and df["isolated_ms"].notna().all()
    assert df["compile_status"].str.startswith("skipped: modes budget").all()
    assert df["best_mode"].isna().all() and df["opportunity_ms"].isna().all()


def test_the_budget_lets_calls_through_until_it_is_spent():
    from cbtrace.replay.modes.compile_cudagraph import Budgeted, ModesBudget

    class Step:
        name, runs = "compile", 0

        def run(self, c):
            self.runs += 1
            budget.spent_s += 1.0  # as if each call took a second
            return dict(compile_status="ok")

    budget, step = ModesBudget(2.5), Step()
    out = [Budgeted(step, budget).run(None)["compile_status"] for _ in range(5)]
    assert out[:3] == ["ok"] * 3 and step.runs == 3
    assert out[3:] == ["skipped: modes budget of 2.5 s spent (--modes-budget-s)"] * 2


# ---------------------------------------------------------------- the icicle's speedup colours


def test_speedup_colours_by_hand():
    lo, hi = palette.SPEEDUP_SCALE
    assert palette.speedup_color(1.0, "eager") == (lo, "eager best")
    assert palette.speedup_color(4.0, "compile") == (hi, "4.00x compile")
    assert palette.speedup_color(16.0, "cudagraph")[0] == hi  # clamped
    assert palette.speedup_color(2.0, "compile")[0] == palette.lerp_color(lo, hi, 0.5)  # log2
    assert palette.speedup_color(None) == (palette.NO_FIGURES, "")
    assert palette.speedup_color(float("nan")) == (palette.NO_FIGURES, "")


def test_icicle_offers_speedup_only_with_figures():
    recs = _hand_run()
    opp.add_opportunities(recs)
    data = icicle_model.build(records_to_frame(recs), name="modes")
    assert [s[0] for s in data["schemes"]] == ["metric", "bound", "speedup"]
    assert data["columns"][-3:] == ["speedup", "saving", "best"]
    by_q = {n["q"]: n for n in data["nodes"] if n["k"] == "module"}
    assert by_q["a.x"]["bg"]["speedup"] == palette.speedup_color(2.0, "cudagraph")[0]
    assert by_q["a.x"]["s"] == "2.00x cudagraph" and by_q[""]["s"] == "2.00x compile"
    tip = dict(map(tuple, by_q["b"]["tip"]))
    assert tip["CUDA graph"] == "error: graph capture failed: x" and tip["best mode"] == "compile"
    assert tip["saving per step"] == "1 ms" and tip["compile time"] == "0.20 s, 1 graph(s)"
    plain = icicle_model.build(records_to_frame([record("a", 0, isolated_ms=1.0, status="ok")]))
    assert [s[0] for s in plain["schemes"]] == ["metric", "bound"]
    assert "speedup" not in plain["legend"] and "s" not in plain["nodes"][0]
    assert "speedup" not in plain["columns"]
    assert not any(t[0] in ("eager step", "compiled") for t in plain["nodes"][0]["tip"])


@pytest.mark.browser
def test_icicle_page_switches_to_speedup(tmp_path):
    import os
    from pathlib import Path

    if not Path("/usr/bin/chromium").exists() and "CBTRACE_CHROMIUM" not in os.environ:
        pytest.skip("no Chromium at /usr/bin/chromium (set CBTRACE_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    from cbtrace.plugins.reporters.icicle import render_html
    from helpers.servers import launch

    recs = _hand_run()
    opp.add_opportunities(recs)
    html = tmp_path / "icicle.html"
    html.write_text(render_html(icicle_model.build(records_to_frame(recs), name="modes")))
    with sync_playwright() as pw:
        b = launch(pw)
        page = b.new_page(viewport={"width": 1200, "height": 800})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(html.as_uri())
        page.wait_for_selector(".cb-node")
        assert page.locator(".cb-scheme").all_text_contents() == ["MFU / MBU", "bound",
                                                                  "speedup"]
        page.click(".cb-scheme[data-scheme='speedup']")
        assert "speedup of the fastest mode" in page.locator(".cb-legend").inner_text()
        node = page.locator(".cb-node", has_text="a ·").first
        assert "2.00x compile" in node.inner_text()
        want = palette.speedup_color(2.0, "compile")[0]
        rgb = "rgb(" + ", ".join(str(int(want[i:i + 2], 16)) for i in (1, 3, 5)) + ")"
        assert node.evaluate("e => e.style.background") == rgb
        b.close()
    assert errors == []


# ---------------------------------------------------------------- on a GPU (the lead runs these)


@pytest.mark.gpu
def test_modes_on_cuda(tmp_path):
    class Syncs(nn.Module):
        def forward(self, x):
            return x * float(x.sum().item())  # a host sync: no CUDA graph capture

    def pair():  # a parent: its one-kernel leaves are not compiled on their own
        return nn.Sequential(nn.Linear(64, 64), nn.GELU())

    model = nn.Sequential(pair(), pair(), Syncs()).cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(x)
    df = cbtrace.replay(tmp_path / "r", model=model, modes=("compile", "cudagraph"),
                        **FAST_REPLAY).set_index("fqn")
    assert (df["status"] == "ok").all()
    for fqn in ("0", "1"):
        assert df.loc[fqn, "cudagraph_status"] == "ok" and df.loc[fqn, "cudagraph_ms"] > 0
        assert df.loc[fqn, "compile_status"] == "ok" and df.loc[fqn, "compile_ms"] > 0
        assert df.loc[fqn, "eager_step_ms"] >= df.loc[fqn, "isolated_ms"]
        assert "compile host=" in df.loc[fqn, "timer_notes"]
    assert df.loc["2", "cudagraph_status"].startswith("error: graph capture failed")
    leaves = df.loc[["0.0", "0.1", "1.0", "1.1"]]  # a GELU is one kernel; a Linear may be two
    one_kernel = leaves["kernel_count"] == 1
    assert one_kernel.any()
    assert ((leaves["compile_status"] == f"skipped: {modes.NOTHING_TO_FUSE}") == one_kernel).all()
    assert df["best_mode"].notna().all() and (df["speedup"] >= 1).all()


@pytest.mark.gpu
def test_modes_on_nanogpt_cuda(tmp_path):
    from cbtrace.capture.from_spec import capture_model

    capture_model("nanogpt:tiny", tmp_path / "r", device="cuda", dtype="bf16", trace=False,
                  max_depth=2)
    df = cbtrace.replay(tmp_path / "r", modes=("compile", "cudagraph"), **FAST_REPLAY)
    assert (df["status"] == "ok").all()
    leaf = df["compile_status"] == f"skipped: {modes.NOTHING_TO_FUSE}"  # one-kernel leaves
    assert leaf.any() and (df.loc[~leaf, "compile_status"] == "ok").mean() >= 0.9, \
        df[["fqn", "compile_status"]]
    assert (df["cudagraph_status"] == "ok").mean() >= 0.9, df[["fqn", "cudagraph_status"]]
    ok = df[df["cudagraph_status"] == "ok"]
    # launch included: a one-call graph replay is never faster than the device time of K
    # calls back to back by more than noise
    assert (ok["cudagraph_ms"] > 0.8 * ok["isolated_ms"]).all()
    assert df["best_mode"].notna().all() and (df["opportunity_ms"] >= 0).all()


@pytest.mark.gpu
def test_cold_host_issue_on_cuda_puts_the_compiled_issue_beside_the_eager_one(tmp_path):
    from cbtrace.capture.from_spec import capture_model

    capture_model("nanogpt:tiny", tmp_path / "r", device="cuda", dtype="bf16", trace=False,
                  max_depth=1)
    df = cbtrace.replay(tmp_path / "r", modes=("compile",), **FAST_REPLAY)  # cold: the default
    ok = df[df["compile_status"] == "ok"]
    assert len(ok) and ok["compile_host_ms"].notna().all() and (ok["compile_host_ms"] >= 0).all()
    assert ok["host_ms"].notna().all()
    # the back-to-back figure beside it, for both estimates from one run
    assert ok["compile_host_steady_ms"].notna().all() and (ok["compile_host_steady_ms"] > 0).all()
    plain = cbtrace.replay(tmp_path / "r", modes=("compile",), cold_host_issue=False,
                           **FAST_REPLAY)
    assert plain["compile_host_steady_ms"].isna().all()


def test_a_graph_out_of_memory_hands_the_cache_back_and_tries_once_more(monkeypatch):
    import contextlib
    from types import SimpleNamespace

    from cbtrace.replay.modes import compile_cudagraph as modes
    from cbtrace.replay.config import ReplayConfig

    def step_with(results):
        step, released = modes.CudaGraphed(ReplayConfig(**FAST_REPLAY)), []

        def run(c):
            r = results.pop(0)
            if isinstance(r, Exception):
                raise r
            return r

        monkeypatch.setattr(step, "_run", run)
        monkeypatch.setattr(step, "_release", lambda: released.append(0))
        return step, released

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    call = SimpleNamespace(device=torch.device("cuda"))
    oom = modes.GraphUnavailable("graph capture failed: OutOfMemoryError: CUDA out of memory")
    ok = dict(cudagraph_ms=1.0, cudagraph_status="ok")
    step, released = step_with([oom, ok])
    assert step.run(call) == ok and released == [0]
    step, released = step_with([oom, oom])  # once only: then the row says why
    assert step.run(call)["cudagraph_status"] == f"error: {oom}" and released == [0]
    step, released = step_with([modes.GraphUnavailable("graph capture failed: x")])
    assert step.run(call)["cudagraph_status"] == "error: graph capture failed: x"
    assert released == []  # another failure: nothing handed back, no retry


@pytest.mark.gpu
def test_cudagraph_mode_memory_returns_to_its_level_between_calls():
    from types import SimpleNamespace

    from cbtrace.replay.measure.prepare import prepare
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.modes.compile_cudagraph import CudaGraphed

    cfg = ReplayConfig(modes=("cudagraph",), **FAST_REPLAY)
    step, dev = CudaGraphed(cfg), torch.device("cuda")
    rec = SimpleNamespace(grad_enabled=False, autocast_dtype=None, fqn="m", call_id=0)
    mods = [nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(dev).eval()
            for _ in range(2)]
    x = torch.randn(256, 1024, device=dev)
    torch.cuda.synchronize()
    level = torch.cuda.memory_allocated(dev)
    allocated, reserved = [], []
    for i in range(6):
        c = prepare(mods[i % 2], rec, (x,), {}, dev, cfg)
        assert step.run(c)["cudagraph_status"] == "ok"
        del c  # the call's input copies go with it, as in replay
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated(dev))
        reserved.append(torch.cuda.memory_reserved(dev))
    # graphs, their pool's blocks and the static buffers of each call are free before the next:
    # nothing stays allocated, and the calls after the first reuse what the first reserved
    assert allocated == [level] * 6
    assert reserved[1:] == [reserved[0]] * 5, reserved


def test_a_one_kernel_leaf_on_a_gpu_is_not_compiled():
    from types import SimpleNamespace

    from cbtrace.replay.config import ReplayConfig

    def call(module, kernels, device="cuda"):
        return SimpleNamespace(module=module, device=torch.device(device),
                               row={"kernel_count": kernels})

    leaf, parent = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert modes.nothing_to_fuse(call(leaf, 1)) and modes.nothing_to_fuse(call(nn.Identity(), 0))
    assert not modes.nothing_to_fuse(call(leaf, 2))      # two kernels may fuse
    assert not modes.nothing_to_fuse(call(parent, 1))    # a parent's glue may fuse with its own
    assert not modes.nothing_to_fuse(call(leaf, 1, "cpu"))  # no kernel count on a CPU
    assert not modes.nothing_to_fuse(call(leaf, None))
    step = modes.Compiled(ReplayConfig(**FAST_REPLAY), ["cpu"], {})
    assert step.run(call(leaf, 1)) == {"compile_status": f"skipped: {modes.NOTHING_TO_FUSE}"}


def test_compile_host_issue_is_taken_once_per_kind_of_call(monkeypatch):
    """Cold issue times run the step's root a dozen times each: a kind's later calls (the same
    work, one shared compiled entry) take the first one's, the row saying whose."""
    import types

    from cbtrace.replay.config import ReplayConfig

    taken = []
    monkeypatch.setattr(modes, "steady_issue_ms", lambda run, n, device: taken.append("steady")
                        or 0.2)
    monkeypatch.setattr(modes, "cold_issue_ms", lambda run, n, device, evict: taken.append(
        "cold") or (0.5 if run == "compiled" else 0.3))
    comp = modes.Compiled(ReplayConfig(modes=("compile",)), ["cpu"], {})

    def call(fqn, host_ms, parent=0):
        rec = types.SimpleNamespace(fqn=fqn, parent_call_id=parent)
        return types.SimpleNamespace(row={"host_ms": host_ms}, rec=rec, run="eager", n_copies=1,
                                     device=torch.device("cuda"))

    assert comp._host_ms(call("h.0", 1.0), "compiled", True, "kind") == (
        pytest.approx(1.2), 0.2, None)
    assert taken == ["steady", "cold", "cold"]
    # another module of the kind: its own eager host time, the kind's added issue time
    assert comp._host_ms(call("h.1", 2.0), "compiled", True, "kind") == (
        pytest.approx(2.2), 0.2, "h.0")
    assert taken == ["steady", "cold", "cold"]
    # a module of no shared kind, and the back-to-back figure alone, are taken anew
    comp._host_ms(call("odd", 1.0), "compiled", True, ("module", 1))
    assert comp._host_ms(call("h.2", 1.0), "compiled", False, "kind") == (0.2, None, None)
    assert taken == ["steady", "cold", "cold"] * 2 + ["steady"]
