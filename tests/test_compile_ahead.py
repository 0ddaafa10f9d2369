"""Compiling ahead (issue 31, item 2): the calls the compile mode will compile are compiled first
in worker processes, each with its own rebuild of the run's model, so that the loop's compiles
hit inductor's on-disk cache; the loop then measures as before. Inductor on CPU: the model is
a few small blocks, two of them identical (one kind, compiled once)."""
from __future__ import annotations

import textwrap

import pytest
import torch

import cbtrace
from cbtrace.capture.from_spec import capture_model
from cbtrace.replay.config import ReplayConfig
from cbtrace.replay.modes import precompile
from cbtrace.rundir.read import read_manifest, read_records
from helpers.settings import FAST_REPLAY

MODEL = textwrap.dedent("""
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, c_in, c_out):
            super().__init__()
            self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
            self.act = nn.SiLU()

        def forward(self, x):
            return self.act(self.conv(x)) * 2


    def build():
        torch.manual_seed(0)
        model = nn.Sequential(Block(4, 6), Block(6, 6), Block(6, 6)).eval()
        return model, (torch.randn(2, 4, 8, 8),)
""")


@pytest.fixture
def spec_run(tmp_path, monkeypatch):
    """A run captured from a file spec (signed: the workers may rebuild it), depth 1, and an
    empty inductor cache of the test's own (the workers inherit it)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    (tmp_path / "blocks.py").write_text(MODEL)
    run = tmp_path / "run"
    capture_model(f"{tmp_path / 'blocks.py'}:build", run, device="cpu", max_depth=1,
                  trace=False)
    return run


def _fx_counts():
    from torch._dynamo.utils import counters

    return (counters["inductor"].get("fxgraph_cache_hit", 0),
            counters["inductor"].get("fxgraph_cache_miss", 0))


def test_the_loop_compiles_from_what_the_workers_compiled(spec_run):
    torch._dynamo.reset()  # nothing of earlier tests in this process's memory
    hits, misses = _fx_counts()
    # one worker: on a loaded 2-core machine a second costs more than it saves (the split
    # between workers is tested below)
    df = cbtrace.replay(spec_run, modes=("compile",), compile_workers=1,
                        **{**FAST_REPLAY, "timeout_s": None})
    info = read_manifest(spec_run).replay
    # the root, three blocks of two kinds: four calls of three kinds
    assert info.compile_ahead.startswith("compiled ahead: 4 of 4 calls (3 kinds) in 1 process")
    assert info.outside_s["compile_ahead"] > 0
    assert (df["compile_status"] == "ok").all(), df["compile_status"].tolist()
    new_hits, new_misses = _fx_counts()
    # every graph the loop compiled first, a worker had compiled; a loaded machine's CPU timer
    # may time a call again on one thread, and dynamo, guarding on the thread count, compiles
    # it again there (the row says so): those the workers never saw
    again = df["timer_notes"].fillna("").str.extract(
        r"compile: (\d+) more graph\(s\) compiled while timed")[0].dropna().astype(int).sum()
    assert new_misses - misses == again, df[["fqn", "timer_notes"]]
    assert new_hits - hits >= 3
    assert df["compile_ms"].notna().all()


def test_a_run_of_a_live_model_is_compiled_by_the_loop_alone(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with cbtrace.capture(model, tmp_path / "run", trace=False):
        model(torch.randn(4, 8))
    df = cbtrace.replay(tmp_path / "run", model=model, modes=("compile",), compile_workers=2,
                        **FAST_REPLAY)
    note = read_manifest(tmp_path / "run").replay.compile_ahead
    assert note.startswith("no compile ahead: the workers could not rebuild the model")
    assert (df["compile_status"] == "ok").all()


def test_no_workers_by_default_on_a_cpu_and_none_below_zero():
    assert ReplayConfig().compile_workers == 0
    with pytest.raises(ValueError, match="compile_workers"):
        ReplayConfig(compile_workers=-1)


def test_every_module_by_kind_and_shares_weighed_by_subtree(spec_run):
    records = read_records(spec_run)
    model = torch.nn.Sequential(*[torch.nn.Conv2d(c, 6, 3, padding=1) for c in (4, 6, 6)])
    fqn = {r.call_id: r.fqn for r in records}
    with_parent = {r.call_id for r in records if r.parent_call_id in fqn}
    assert len(records) == 4 and len(with_parent) == 3
    # the same layout of kinds as the captured blocks: "1" and "2" are one kind
    recs = precompile.candidates(records, model, ReplayConfig(modes=("compile",)),
                                 torch.device("cpu"))
    assert [[fqn[r.call_id] for r in g] for g in recs] == [[""], ["0"], ["1", "2"]]
    shares = precompile.shares(recs, records, 2)
    # the root (a subtree of four) alone; the three blocks, "1" and "2" on one worker as one
    # kind, on the other
    assert sorted([fqn[c] for c in s] for s in shares) == [[""], ["0", "1", "2"]]
    assert precompile.candidates(records, model, ReplayConfig(), torch.device("cpu")) == []


def test_an_interrupted_compile_ahead_leaves_no_worker_running(spec_run, monkeypatch):
    from cbtrace.replay.run_io.rebuild import rebuild_model
    from cbtrace.rundir.read import load_run

    manifest, _ = load_run(spec_run)
    records = read_records(spec_run)
    model = rebuild_model(manifest, torch.device("cpu"), verify=False, run=spec_run)
    started = []
    start = precompile._start

    def spy(job, n):
        started.append(start(job, n))
        return started[-1]

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(precompile, "_start", spy)
    monkeypatch.setattr(precompile, "_wait", interrupted)
    cfg = ReplayConfig(modes=("compile",), compile_workers=2, progress=False)
    with pytest.raises(KeyboardInterrupt):
        precompile.compile_ahead(spec_run, manifest, records, model, cfg, torch.device("cpu"))
    assert len(started) == 2 and all(p.poll() is not None for p, _, _ in started)


def test_on_a_gpu_a_leaf_that_ran_one_kernel_in_the_step_is_left_to_the_loop(spec_run):
    records = read_records(spec_run)
    model = torch.nn.Sequential(*[torch.nn.Conv2d(c, 6, 3, padding=1) for c in (4, 6, 6)])
    fqn = {r.call_id: r.fqn for r in records}
    cid = {f: c for c, f in fqn.items()}
    cfg = ReplayConfig(modes=("compile",))
    # "0" ran one kernel (the loop skips it: nothing to fuse), "1" two, "2" is not in the trace
    groups = precompile.candidates(records, model, cfg, torch.device("cuda"),
                                   {cid["0"]: 1, cid["1"]: 2})
    assert [[fqn[r.call_id] for r in g] for g in groups] == [[""], ["1", "2"]]
    # "1" ran no kernel: left out too ("0" and "2", not in the trace, count as more); with
    # nothing read from a trace, every leaf is
    groups = precompile.candidates(records, model, cfg, torch.device("cuda"), {cid["1"]: 0})
    assert [[fqn[r.call_id] for r in g] for g in groups] == [[""], ["0"], ["2"]]
    for unknown in ({}, None):
        groups = precompile.candidates(records, model, cfg, torch.device("cuda"), unknown)
        assert [[fqn[r.call_id] for r in g] for g in groups] == [[""]]


def test_kernels_in_step_need_a_trace_with_device_kernels(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with cbtrace.capture(model, tmp_path / "traced"):
        model(torch.randn(4, 8))
    with cbtrace.capture(model, tmp_path / "untraced", trace=False):
        model(torch.randn(4, 8))
    # a CPU step's trace has no device kernel: nothing to tell the leaves apart by
    for name in ("traced", "untraced"):
        run = tmp_path / name
        assert precompile.kernels_in_step(run, read_manifest(run), read_records(run)) == {}


def test_kernels_in_step_prefer_the_plain_step_and_fall_back_to_the_captured_one(
        spec_run, monkeypatch):
    import pandas as pd

    records = read_records(spec_run)
    manifest = read_manifest(spec_run)
    plain = spec_run / "plain.pt.trace.json"
    table = {plain: [1, 2, 1, 3], None: [5, 6, 7, 8]}  # the trace -> each call's kernels
    read = []

    def insitu(run, manifest, trace=None):
        read.append(trace)
        if isinstance(table[trace], Exception):
            raise table[trace]
        return pd.DataFrame({"fqn": [r.fqn for r in records],
                             "call_index": [r.call_index for r in records],
                             "kernel_count": table[trace]})

    monkeypatch.setattr(precompile, "insitu_for_run", insitu)
    monkeypatch.setattr(precompile, "plain_trace", lambda run, manifest: plain)
    ids = [r.call_id for r in records]
    assert precompile.kernels_in_step(spec_run, manifest, records) == dict(zip(ids, [1, 2, 1, 3]))
    assert read == [plain]
    table[plain] = ValueError("a trace cut short")  # unreadable: the captured step's counts
    assert precompile.kernels_in_step(spec_run, manifest, records) == dict(zip(ids, [5, 6, 7, 8]))
    table[plain], table[None] = [0, 0, 0, 0], [0, 0, 0, 0]  # no device kernel in either
    assert precompile.kernels_in_step(spec_run, manifest, records) == {}
