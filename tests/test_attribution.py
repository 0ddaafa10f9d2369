"""Attribution on a small CPU capture-like trace recorded by tests/data/record_attribution_traces.py."""
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from cbtrace.attribution.attribute import attribute, summarize
from cbtrace.attribution.join import insitu_for_run
from cbtrace.attribution.identity import class_index_map, hierarchy_path
from cbtrace.errors import CbtraceError

TRACE = Path(__file__).parent / "data" / "cbtrace_capture_cpu.pt.trace.json.gz"


@pytest.fixture(scope="module")
def df():
    return attribute(TRACE)


@pytest.fixture(scope="module")
def raw():
    return json.loads(gzip.decompress(TRACE.read_bytes()))["traceEvents"]


def _row(df, step, fqn, phase="fwd", call_index=0):
    r = df[(df.step == step) & (df.fqn == fqn) & (df.phase == phase) & (df.call_index == call_index)]
    assert len(r) == 1, (step, fqn, phase, call_index)
    return r.iloc[0]


def test_hand_checked_numbers(df):
    # step 2 in the trace: cbtrace::blocks.0.fc1 dur 131.295 us, its cbtrace.copy range 32.240 us
    assert _row(df, 2, "blocks.0.fc1").cpu_ms == pytest.approx((131.295 - 32.240) / 1e3)
    # head is called twice: 169.396 - 55.063 and 114.554 - 33.503
    assert _row(df, 2, "head", call_index=0).cpu_ms == pytest.approx((169.396 - 55.063) / 1e3)
    assert _row(df, 2, "head", call_index=1).cpu_ms == pytest.approx((114.554 - 33.503) / 1e3)
    # fc1: addmm of (32 tokens x 32) @ (32 x 64): 2*32*32*64 FLOPs; backward: two matmuls
    assert _row(df, 2, "blocks.0.fc1").flops == 2 * 32 * 32 * 64
    assert _row(df, 2, "blocks.0.fc1", "bwd").flops >= 2 * (2 * 32 * 32 * 64)
    assert _row(df, 2, "blocks.0.fc1").compute_dtype == "float32"


def test_identity_columns(df):
    assert set(df.step) == {1, 2, 3}
    r = _row(df, 1, "blocks.1.norm")
    assert (r.source, r.depth, r.parent_fqn) == ("cbtrace", 3, "blocks.1")
    root = _row(df, 1, "")
    assert root.depth == 0 and pd.isna(root.parent_fqn)
    assert r.ts_us > root.ts_us and r.dur_us > 0 and r.ev_index >= 0 and r.pid > 0


def test_slice_identity_finds_the_event(df, raw):
    for r in df[(df.phase == "fwd") & (df.depth >= 0)].itertuples():
        ev = raw[r.ev_index]
        assert ev["name"] == f"cbtrace::{r.fqn}" and ev["ts"] == r.ts_us and ev["dur"] == r.dur_us


def test_cpu_conservation_and_overhead(df, raw):
    for step in (1, 2, 3):
        s = df[df.step == step]
        mods = s[s.depth >= 0]
        for phase in ("fwd", "bwd"):
            m = mods[mods.phase == phase]
            root = m[m.depth == 0].cpu_ms.sum()
            assert m.cpu_self_ms.sum() == pytest.approx(root, rel=1e-9)
        # the root's raw range = modules' self time + cbtrace overhead (all copies sit inside it)
        root_raw = _row(df, step, "").dur_us / 1e3
        ovh = _row(df, step, "<cbtrace-overhead>").cpu_ms
        assert mods[mods.phase == "fwd"].cpu_self_ms.sum() + ovh == pytest.approx(root_raw)
    copies = [e["dur"] for e in raw if e.get("name", "").startswith("cbtrace.copy::")]
    assert df[df.fqn == "<cbtrace-overhead>"].cpu_ms.sum() == pytest.approx(sum(copies) / 1e3)


def test_backward_mapped_to_forward_modules(df):
    for fqn in ("emb", "blocks.0.fc1", "blocks.1.norm", "head"):
        assert _row(df, 2, fqn, "bwd").cpu_self_ms > 0
    assert _row(df, 2, "head", "bwd", call_index=1).cpu_ms > 0
    # AccumulateGrad and the loss have no forward op inside a module: their own row
    assert _row(df, 2, "<unattributed>", "bwd").cpu_ms > 0


def test_aggregates_over_steps(df):
    g = df[(df.fqn == "blocks.0") & (df.phase == "fwd")]
    assert len(g) == 3
    assert (g.cpu_ms_median == g.cpu_ms.median()).all()
    assert (g.cpu_ms_min == g.cpu_ms.min()).all() and (g.cpu_ms_max == g.cpu_ms.max()).all()
    s = summarize(df)
    assert len(s) == len(df) // 3 and not s.duplicated(["rank", "fqn", "call_index", "phase"]).any()


def test_insitu_for_run(tmp_path):
    from helpers.runs import manifest

    shutil.copy(TRACE, tmp_path / TRACE.name)
    out = insitu_for_run(tmp_path, manifest(trace=TRACE.name))
    assert list(out.columns) == ["fqn", "call_index", "cpu_ms", "gpu_ms", "gpu_busy_ms",
                                 "gpu_span_ms", "kernel_count", "insitu_ms"]
    assert len(out) == 15  # 14 modules, head called twice; the first step only
    assert (out.insitu_ms == out.cpu_ms).all()  # CPU trace: no device events


def test_a_trace_is_attributed_once_until_it_changes(tmp_path, monkeypatch):
    from helpers.runs import manifest

    from cbtrace.attribution import join

    calls = []
    real = join.attribute_file
    monkeypatch.setattr(join, "attribute_file", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(join, "_ATTRIBUTED", {})
    shutil.copy(TRACE, tmp_path / TRACE.name)
    m = manifest(trace=TRACE.name)
    fwd = insitu_for_run(tmp_path, m)
    insitu_for_run(tmp_path, m, "bwd")  # the same file and sums: not attributed again
    assert len(calls) == 1 and len(fwd) == 15
    insitu_for_run(tmp_path, m, "fwd", {("head", 0): 1})  # other sums: attributed again
    assert len(calls) == 2
    # the file rewritten (another step's trace, fewer events): never the old figures
    events = json.loads(gzip.decompress(TRACE.read_bytes()))
    events["traceEvents"] = [e for e in events["traceEvents"]
                             if "cbtrace::head" not in str(e.get("name"))]
    (tmp_path / TRACE.name).write_bytes(gzip.compress(json.dumps(events).encode()))
    again = insitu_for_run(tmp_path, m)
    assert len(calls) == 3 and "head" not in set(again.fqn) and "head" in set(fwd.fqn)


def test_capture_run_names_nn_module_events(tmp_path, shared_traces):
    from helpers.runs import record, write_run

    from cbtrace.errors import RunDirError

    layer = [("", "TransformerEncoderLayer"), (".self_attn", "MultiheadAttention"),
             (".dropout1", "Dropout"), (".norm1", "LayerNorm"), (".linear1", "Linear"),
             (".dropout", "Dropout"), (".linear2", "Linear"), (".dropout2", "Dropout"),
             (".norm2", "LayerNorm")]
    calls = ([("", "Net"), ("emb", "Embedding"), ("encoder", "TransformerEncoder")]
             + [(f"encoder.layers.{i}{f}", m) for i in (0, 1) for f, m in layer]
             + [("head", "Linear")])  # the whole model, in call order
    mods = pd.DataFrame({"fqn": [f for f, _ in calls], "call_id": range(len(calls)),
                         "module_type": [m for _, m in calls]})
    assert class_index_map(mods)["TransformerEncoderLayer_1"] == "encoder.layers.1"
    assert class_index_map(mods)["Linear_4"] == "head"
    write_run(tmp_path / "whole", [record(f, c, module_type=m)
                                   for f, c, m in zip(mods.fqn, mods.call_id, mods.module_type)])
    trace = next((shared_traces / "generated/torch2.13cpu_transformer2").glob("*.json.gz"))
    df = attribute(trace, capture_run=tmp_path / "whole", aggregate=False)
    assert {"emb", "encoder.layers.1", "", "encoder.layers.1.linear2", "head"} <= \
        set(df[df.source == "nn.Module"].fqn)
    # a run holding only some Linear modules would call the trace's Linear_0 "head": refused
    part = mods[mods.fqn.str.count(r"\.") < 3]  # the layers, nothing inside them
    write_run(tmp_path / "part", [record(f, c, module_type=m)
                                  for f, c, m in zip(part.fqn, part.call_id, part.module_type)])
    with pytest.raises(RunDirError, match="do not match the nn.Module events"):
        attribute(trace, capture_run=tmp_path / "part", aggregate=False)


def test_hierarchy_path():
    assert hierarchy_path("TOP(Net)::forward.layer1(Sequential)::forward.0(Block)::forward") == "layer1.0"
    assert hierarchy_path("") is None


def test_cli_writes_parquet_and_prints(tmp_path):
    from cbtrace.cli.main import cli

    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(cli, ["attribute", str(TRACE), "--out", str(out), "--top", "5"])
    assert res.exit_code == 0, res.output
    assert "blocks" in res.output and f"to {out}" in res.output
    assert len(pd.read_parquet(out)) == len(attribute(TRACE))


def test_errors(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"traceEvents": []}')
    with pytest.raises(CbtraceError, match="x.json: the trace has no events"):
        attribute(p)
    with pytest.raises(CbtraceError, match="no .json or .json.gz"):
        attribute(_empty_dir(tmp_path))


def _empty_dir(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


# --- the vectorized core, against plain-Python references ---------------------------------

def _stack_nest(ts, dur, thread):
    """Reference: a stack of open events per thread (events sorted by thread, ts, -dur)."""
    parent, depth, stack, cur = [], [], [], None
    for i, (t, d, th) in enumerate(zip(ts, dur, thread)):
        if th != cur:
            cur, stack = th, []
        while stack and stack[-1][0] <= t:
            stack.pop()
        parent.append(stack[-1][1] if stack else -1)
        depth.append(len(stack))
        stack.append((t + d, i))
    return parent, depth


def _random_events(seed, n=400):
    import numpy as np

    rng = np.random.default_rng(seed)
    ts = rng.integers(0, 60, n).astype(float) + rng.choice([0.0, 0.5], n)  # ties on purpose
    dur = rng.choice([0.0, 1.0, 3.0, 7.5, 20.0, 45.0], n)  # zero-length and partial overlaps
    thread = rng.integers(0, 3, n)
    order = np.lexsort((-dur, ts, thread))
    return ts[order], dur[order], thread[order]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("segment", [5, 1 << 16])
def test_nest_matches_a_stack_of_open_events(seed, segment, monkeypatch):
    import numpy as np

    from cbtrace.attribution import forest

    monkeypatch.setattr(forest, "_SEGMENT", segment)  # small segments: open events carried over
    ts, dur, thread = _random_events(seed)
    parent, depth = forest.nest(ts, dur, thread, np.zeros_like(thread))
    ref_parent, ref_depth = _stack_nest(ts.tolist(), dur.tolist(), thread.tolist())
    assert parent.tolist() == ref_parent and depth.tolist() == ref_depth


def test_tree_walks_match_naive_loops():
    import numpy as np

    from cbtrace.attribution import forest

    ts, dur, thread = _random_events(7, n=300)
    f = forest.Forest.__new__(forest.Forest)  # only the walk methods: parent, depth, len
    f.parent, f.depth = forest.nest(ts, dur, thread, np.zeros_like(thread))
    f.host = np.arange(len(ts))
    mark = np.random.default_rng(1).random(len(ts)) < 0.2
    par = f.parent.tolist()

    def chain(i):  # i, its parent, ... up to the top
        while i >= 0:
            yield i
            i = par[i]

    near = [next((j for j in chain(i) if mark[j]), -1) for i in range(len(ts))]
    outer = [([j for j in chain(i) if mark[j]] or [-1])[-1] for i in range(len(ts))]
    strict = [any(mark[j] for j in list(chain(i))[1:]) for i in range(len(ts))]
    sub = [mark[i] or any(mark[j] for j in range(len(ts)) if i in list(chain(j))[1:])
           for i in range(len(ts))]
    assert f.nearest(mark).tolist() == near and f.outermost(mark).tolist() == outer
    assert f.strict_any(mark).tolist() == strict and f.subtree_any(mark).tolist() == sub


def test_loader_columns_and_odd_events(tmp_path):
    from cbtrace.attribution import loader

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": "7", "ts": 10,
         "dur": 5.5, "args": {"correlation": 3, "Sequence number": 9,
                              "Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": "stream 7", "ts": 12,
         "dur": 1, "args": {"correlation": "3"}},  # a string id: decoded leniently
        {"name": "no phase"}, {"ph": "Z", "name": "unknown phase"},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": "7", "ts": 11,
         "dur": 1, "args": None},
        {"ph": "f", "cat": "ac2g", "id": 3, "pid": 0, "tid": "stream 7", "ts": 12, "bp": "e"},
    ]
    p = tmp_path / "odd.json"
    p.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"name": "H"}]}))
    coster_calls = []

    class Coster:
        def by_name(self, name):
            return loader.SHAPED if name == "aten::mm" else -1

        def __call__(self, name, dims, types, concrete):
            coster_calls.append((name, bytes(dims), bytes(types)))
            return 5

    c = loader.load(p, on_op=Coster(), chunk_bytes=64)
    assert c.n_events == 7 and c.meta == {"deviceProperties": [{"name": "H"}]}
    assert c.idx.tolist() == [1, 2, 5]  # positions in traceEvents: HTA's index
    assert [c.strings[k] for k in c.name] == ["aten::mm", "k", "aten::add"]
    assert c.corr.tolist() == [3, 3, -1] and c.seq.tolist() == [9, -1, -1]
    assert c.cost.tolist() == [5, -1, -1]
    assert coster_calls == [("aten::mm", b"[[2,3],[3,4]]", b'["float","float"]')]
    assert [c.ids[k] for k in c.tid] == ["7", "stream 7", "7"] and c.dur.tolist() == [5.5, 1, 1]
    assert [(f, c.ids[p], c.ids[t], ts) for f, p, t, ts in c.flows] == [(3, 0, "stream 7", 12)]


def test_loader_memory_is_columns_not_objects(tmp_path):
    import tracemalloc

    from cbtrace.attribution import loader

    n = 60_000
    ev = [{"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 50}", "pid": 1, "tid": i % 4,
           "ts": i * 0.5, "dur": 0.25, "args": {"External id": i, "Sequence number": i,
                                                   "Record function id": 0, "Ev Idx": i}}
          for i in range(n)]
    p = tmp_path / "big.json.gz"
    p.write_bytes(gzip.compress(json.dumps({"traceEvents": ev}).encode(), 1))
    del ev
    tracemalloc.start()
    try:
        c = loader.load(p, chunk_bytes=256 << 10)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(c) == n
    assert kept < 72 * n + (1 << 20)  # ~64 bytes of arrays per event, no Python objects
    assert peak < 2 * kept + 24 * (256 << 10)  # + a few chunks' worth of transient objects


def _same_rows(a, b):
    key = ["rank", "step", "phase", "depth", "fqn", "call_index", "ts_us"]
    a = a.sort_values(key, na_position="first").reset_index(drop=True)
    b = b.sort_values(key, na_position="first").reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9)


@pytest.mark.parametrize("steps_per_window", [1, 2])
def test_step_windows_give_the_one_pass_table(df, steps_per_window):
    # a trace bigger than memory is read once per window of steps; same rows
    _same_rows(df, attribute(TRACE, steps_per_window=steps_per_window))


def test_step_windows_count_late_and_stray_kernels_once(tmp_path):
    def x(name, ts, dur, cat="user_annotation", pid=1, tid=1, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    launch = dict(cat="cuda_runtime")
    kern = dict(cat="kernel", pid=0, tid=7)
    events = [x("ProfilerStep#1", 0, 100), x("ProfilerStep#2", 100, 100),
              x("cbtrace::a", 10, 50), x("cudaLaunchKernel", 20, 5, corr=1, **launch),
              x("k_late", 150, 30, corr=1, **kern),  # launched in step 1, runs in step 2
              x("cbtrace::a", 110, 85), x("cudaLaunchKernel", 120, 5, corr=2, **launch),
              x("k2", 170, 10, corr=2, **kern), x("k_stray", 130, 5, **kern),
              x("cudaLaunchKernel", 190, 3, corr=4, **launch),
              x("k_after", 250, 5, corr=4, **kern),  # runs after the last step
              x("cudaLaunchKernel", -50, 5, corr=3, **launch),
              x("k_before", -40, 5, corr=3, **kern)]
    p = tmp_path / "steps.json"
    p.write_text(json.dumps({"traceEvents": events}))
    one = attribute(p, aggregate=False)
    _same_rows(one, attribute(p, aggregate=False, steps_per_window=1))
    assert one.gpu_self_ms.sum() * 1e3 == pytest.approx(30 + 10 + 5 + 5 + 5)
    a1, a2 = _row(one, 1, "a"), _row(one, 2, "a")
    assert (a1.gpu_ms, a1.kernel_count, a2.gpu_ms, a2.kernel_count) == (0.030, 1, 0.015, 2)
    assert _row(one, 2, "<unattributed>").gpu_ms == 0.005  # k_stray
    assert _row(one, -1, "<unattributed>").gpu_ms == 0.005  # k_before


# ---------------------------------------------------------------- device-busy time

def _naive_union(spans) -> float:
    """Length of the union of (start, duration) spans, one at a time."""
    total, reach = 0.0, -float("inf")
    base = min((a for a, _ in spans), default=0.0)  # trace clocks are ~1e12 us: work near 0
    for a, b in sorted((a - base, a - base + d) for a, d in spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _nested_trace(seed: int):
    """One step of nested module ranges on one host thread, each launching kernels onto three
    streams of one device (they overlap at random) and one kernel onto a second device, and
    a stray kernel no range launched. Returns (events, {fqn: (start, end)} of each range)."""
    rng = np.random.default_rng(seed)
    events, ranges, corr = [], {}, [0]

    def x(name, ts, dur, cat, pid=1, tid=1, c=None):
        e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
        if c is not None:
            e["args"] = {"correlation": c}
        events.append(e)

    def launch(t):
        corr[0] += 1
        x("cudaLaunchKernel", t, 0.5, "cuda_runtime", c=corr[0])
        pid, tid = (0, int(rng.integers(7, 10))) if rng.random() < 0.85 else (2, 7)
        x(f"k{corr[0]}", t + float(rng.integers(0, 2000)) + 0.25, float(rng.integers(1, 3000)),
          "kernel", pid=pid, tid=tid, c=corr[0])

    def module(name, a, b, depth):
        x(f"cbtrace::{name}", a, b - a, "user_annotation")
        ranges[name] = (a, b)
        cuts = [round(a + (b - a) * rng.uniform(lo, lo + 0.15), 3) for lo in (0.05, 0.3, 0.55, 0.8)]
        if depth < 3:
            module(f"{name}.l" if name else "l", cuts[0], cuts[1], depth + 1)
            module(f"{name}.r" if name else "r", cuts[2], cuts[3], depth + 1)
        for gap in ((a, cuts[0]), (cuts[1], cuts[2]), (cuts[3], b)):
            for _ in range(int(rng.integers(0, 3))):
                launch(round(float(rng.uniform(gap[0] + 1, gap[1] - 1)), 3))

    x("ProfilerStep#1", 0, 200_000, "user_annotation")
    module("", 5, 199_995, 0)
    x("k_stray", 100.25, 50.0, "kernel", pid=0, tid=7)
    return events, ranges


@pytest.mark.parametrize("seed", range(4))
def test_busy_time_is_the_union_of_the_calls_kernels(seed, tmp_path):
    events, ranges = _nested_trace(seed)
    launched = {e["args"]["correlation"]: e["ts"] for e in events if e["cat"] == "cuda_runtime"}
    kernels = [e for e in events if e["cat"] == "kernel"]
    p = tmp_path / "nested.json"
    p.write_text(json.dumps({"traceEvents": events}))
    df = attribute(p, aggregate=False)
    overlapped = 0
    for fqn, (a, b) in ranges.items():
        mine = [k for k in kernels if a <= launched.get(k.get("args", {}).get("correlation"),
                                                        -1) <= b]
        busy = sum(_naive_union([(k["ts"], k["dur"]) for k in mine if k["pid"] == pid])
                   for pid in (0, 2))
        r = _row(df, 1, fqn)
        assert r.gpu_ms * 1e3 == pytest.approx(sum(k["dur"] for k in mine))
        assert r.gpu_busy_ms * 1e3 == pytest.approx(busy), fqn
        overlapped += busy < r.gpu_ms * 1e3 - 1e-6
    assert overlapped >= 3  # the trace does overlap kernels, in most calls
    stray = _row(df, 1, "<unattributed>")
    assert stray.gpu_busy_ms == stray.gpu_ms == pytest.approx(0.05)
    _same_rows(df, attribute(p, aggregate=False, steps_per_window=1))


def test_busy_time_on_a_trace_with_collectives_beside_compute(shared_traces):
    # a real DDP trace: NCCL kernels on their own stream overlap the compute stream's kernels
    path = shared_traces / "hta/tests/data/nccl_parser_config/nccl_data.json.gz"
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    df = attribute(path, aggregate=False)
    assert (df.gpu_busy_ms <= df.gpu_ms + 1e-9).all()
    dev = {"kernel", "gpu_memcpy", "gpu_memset"}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in dev]
    roots = df[df.depth <= 0]  # every device event once, in one root or unattributed row
    assert roots.gpu_ms.sum() * 1e3 == pytest.approx(sum(e["dur"] for e in kernels), rel=1e-9)
    assert (roots.gpu_busy_ms < roots.gpu_ms - 1e-6).any()  # some do overlap
    # each forward call's busy time against a naive union of the kernels its range launched
    launch = {(e["args"]["correlation"]): (e["tid"], e["ts"]) for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    fwd = df[(df.phase == "fwd") & (df.depth >= 0) & (df.kernel_count > 0)]
    assert len(fwd) >= 3
    for r in fwd.itertuples():
        mine = [(k["ts"], k["dur"]) for k in kernels
                if (t := launch.get(k.get("args", {}).get("correlation"))) is not None
                and t[0] == r.tid and r.ts_us <= t[1] <= r.ts_us + r.dur_us]
        assert len(mine) == r.kernel_count and r.gpu_busy_ms * 1e3 == pytest.approx(
            _naive_union(mine), rel=1e-9), r.fqn
