"""cbtrace.annotate.write on a capture-like trace (recorded here) and on the shared nn.Module traces."""
from __future__ import annotations

import gzip
import io
import json
import shutil

import pytest

from helpers.annotate_data import (RUN_ID, load_trace, module_calls, record_capture_trace,
                                   shared_module_traces, write_fake_run)

from cbtrace.annotate.write import annotate, pftrace_path
from cbtrace.annotate.figures import BUCKETS, NO_FIGURE_CNAME
from cbtrace.errors import TraceError
from cbtrace.rundir.files import sha256_file

CNAMES = {c for _, c in BUCKETS} | {NO_FIGURE_CNAME}
FIGURE_ARGS = ("fqn", "isolated_ms", "insitu_ms", "error_pct", "flops", "mbu", "bound",
               "peak_mem_bytes", "status")


@pytest.fixture(scope="module")
def capture_trace(tmp_path_factory):
    return record_capture_trace(tmp_path_factory.mktemp("cap"))


@pytest.fixture
def run(tmp_path, capture_trace):
    return write_fake_run(tmp_path / "run", capture_trace)


def _events(path, pred):
    return [e for e in load_trace(path)["traceEvents"] if pred(e)]


def test_run_annotation_adds_figures_and_keeps_original(run):
    trace = run / "worker0.1.pt.trace.json.gz"
    before = sha256_file(trace)
    out = annotate(run)
    assert out == run / "annotated_worker0.1.pt.trace.json.gz"
    assert sha256_file(trace) == before  # the original is byte-identical
    orig, ann = load_trace(trace), load_trace(out)
    mods = [e for e in ann["traceEvents"] if e.get("name", "").startswith("cbtrace::")]
    assert [(e["args"]["fqn"], e["args"]["call_index"]) for e in mods] == \
        [(f, c) for f, c, *_ in module_calls()]
    for e in mods:
        assert all(k in e["args"] for k in FIGURE_ARGS), e["args"]
        assert e["args"]["insitu_ms"] > 0
    norm1 = next(e for e in mods if e["name"] == "cbtrace::norm" and e["args"]["call_index"] == 1)
    assert norm1["args"]["isolated_ms"] == 0.03 and norm1["args"]["module_type"] == "LayerNorm"
    # everything else passes through: same events, plus the appended ones at the end
    n = len(orig["traceEvents"])
    strip = [{k: v for k, v in e.items() if k != "args"} for e in ann["traceEvents"][:n]]
    assert strip == [{k: v for k, v in e.items() if k != "args"} for e in orig["traceEvents"]]
    assert ann["cbtrace"]["run_id"] == RUN_ID and ann["cbtrace"]["cbtrace_version"]
    assert "peaks" not in ann["cbtrace"]  # no datasheet peaks for the test data's device


def test_cbtrace_process_lays_out_isolated_replay(run):
    ann = load_trace(annotate(run, pftrace=False))["traceEvents"]
    iso = [e for e in ann if e.get("cat") == "cbtrace_isolated"]
    assert len(iso) == len(module_calls())
    assert {e["tid"] for e in iso} == {1, 2, 3}  # one track per depth (depth + 1)
    for e in iso:
        assert e["pid"] == "cbtrace" and e["cname"] in CNAMES
        assert e["dur"] == pytest.approx(e["args"]["isolated_ms"] * 1000)
    by = {(e["args"]["fqn"], e["args"]["call_index"]): e for e in iso}
    root, b0, b1 = by[("", 0)], by[("blocks.0", 0)], by[("blocks.1", 0)]
    assert by[("norm", 0)]["ts"] == root["ts"]  # first child starts with its parent
    assert b0["ts"] == pytest.approx(root["ts"] + 30.0)  # after norm (30 us isolated)
    assert b1["ts"] == pytest.approx(b0["ts"] + 150.0)
    assert by[("blocks.0.act", 0)]["ts"] == pytest.approx(b0["ts"] + 50.0)
    for track in {e["tid"] for e in iso}:  # no overlap on one track
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in iso if e["tid"] == track)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))
    # Linear has FLOPs -> coloured by MFU; GELU has none -> by MBU
    assert by[("head", 0)]["args"]["colour_metric"] == "mfu"
    assert by[("blocks.0.act", 0)]["args"]["colour_metric"] == "mbu"
    names = {(e["name"], e["args"].get("name")) for e in ann if e.get("ph") == "M"
             and e.get("pid") == "cbtrace"}
    assert ("thread_name", "isolated depth 2") in names
    meta = [e for e in ann if e.get("cat") == "cbtrace_meta"]
    assert len(meta) == 1 and meta[0]["args"]["run_id"] == RUN_ID
    assert json.loads(meta[0]["args"]["colour_buckets"])[0]["cname"] == "good"


def test_isolated_layout_by_hand_several_roots_and_noisy_children():
    from cbtrace.annotate.appended import isolated_layout

    # "" (no figure) holds p (1 us, but its child q took 3 us) and r (2 us); s is a 2nd root
    rows = [{"call_id": 0, "parent_call_id": -1, "fqn": "", "depth": 0, "isolated_ms": None},
            {"call_id": 1, "parent_call_id": 0, "fqn": "p", "depth": 1, "isolated_ms": 0.001},
            {"call_id": 2, "parent_call_id": 1, "fqn": "p.q", "depth": 2, "isolated_ms": 0.003},
            {"call_id": 3, "parent_call_id": 0, "fqn": "r", "depth": 1, "isolated_ms": 0.002},
            {"call_id": 4, "parent_call_id": -1, "fqn": "s", "depth": 0, "isolated_ms": 0.004}]
    got = [(e["name"], e["tid"], e["ts"], e["dur"]) for e in isolated_layout(rows, 10.0)]
    # widths: q 3, p max(1, 3) = 3, r 2, "" 3 + 2 = 5 (drawn that wide: no figure), s 4
    assert got == [("<root>", 1, 10, 5), ("p", 2, 10, 1), ("p.q", 3, 10, 3), ("r", 2, 13, 2),
                   ("s", 1, 15, 4)]  # us; each figure * 1000 is exact here


def test_isolated_layout_of_a_deep_chain():
    from cbtrace.annotate.appended import isolated_layout

    rows = [{"call_id": i, "parent_call_id": i - 1, "fqn": f"m{i}", "depth": i,
             "isolated_ms": 0.001} for i in range(5000)]
    out = isolated_layout(rows, 0.0)
    assert [e["name"] for e in out] == [f"m{i}" for i in range(5000)]
    assert {e["ts"] for e in out} == {0.0}


def test_counter_tracks_and_insitu_copy(run):
    ann = load_trace(annotate(run, pftrace=False))["traceEvents"]
    c = [e for e in ann if e.get("ph") == "C"]
    assert {e["name"] for e in c} == {"achieved"} and all(e["pid"] == "cbtrace" for e in c)
    tflops, gbs = [e["args"]["TFLOP/s"] for e in c], [e["args"]["GB/s"] for e in c]
    assert max(tflops) > 0 and max(gbs) > 0 and min(tflops) == 0.0
    leaves = [f for f, _, _, _, t in module_calls() if t in ("Linear", "GELU", "LayerNorm")]
    assert len(c) == 2 * len(leaves)  # one rise and one fall per leaf call
    lin = next(e for e in ann if e.get("name") == "cbtrace::head")
    rise = next(e for e in c if e["ts"] == lin["ts"])
    want = lin["args"]["flops"] / (lin["args"]["insitu_ms"] * 1e-3) / 1e12
    assert rise["args"]["TFLOP/s"] == pytest.approx(want)
    # the in-situ module slices again, on a cbtrace track, named by fqn and coloured
    copy = [e for e in ann if e.get("cat") == "cbtrace_insitu"]
    assert [e["name"] for e in copy] == [f or "<root>" for f, *_ in module_calls()]
    assert all(e["cname"] in CNAMES and e["pid"] == "cbtrace" for e in copy)
    assert copy[-1]["ts"] == lin["ts"] and copy[-1]["args"]["isolated_ms"] == 0.05


def test_refuses_to_overwrite_without_force(run):
    out = annotate(run, pftrace=False)
    with pytest.raises(TraceError, match="already exists"):
        annotate(run)
    out.write_bytes(b"stale")
    assert annotate(run, force=True) == out and load_trace(out)["traceEvents"]
    with pytest.raises(TraceError, match="overwrite the original"):
        annotate(trace=run / "worker0.1.pt.trace.json.gz", out=run / "worker0.1.pt.trace.json.gz")


def test_trace_alone_plain_json_and_run_joined(tmp_path, capture_trace, run):
    plain = tmp_path / "user.pt.trace.json"
    plain.write_bytes(gzip.decompress(capture_trace.read_bytes()))
    out = annotate(trace=plain, pftrace=False)
    assert out.name == "annotated_user.pt.trace.json"
    mods = _events(out, lambda e: e.get("name", "").startswith("cbtrace::"))
    assert all("insitu_ms" in e["args"] and "isolated_ms" not in e["args"] for e in mods)
    assert not _events(out, lambda e: e.get("cat") == "cbtrace_isolated")
    joined = annotate(trace=plain, run=run, out=tmp_path / "j.pt.trace.json", pftrace=False)
    mods = _events(joined, lambda e: e.get("name", "").startswith("cbtrace::"))
    assert all("isolated_ms" in e["args"] for e in mods)


def test_multi_step_trace_restarts_call_index(tmp_path):
    trace = record_capture_trace(tmp_path, steps=2)
    out = annotate(trace=trace, insitu=False, pftrace=False)
    mods = _events(out, lambda e: e.get("name") == "cbtrace::norm")
    assert sorted(e["args"]["call_index"] for e in mods) == [0, 0, 1, 1]


def test_output_does_not_depend_on_chunk_size(tmp_path, run, monkeypatch):
    from cbtrace.annotate import rewrite_json

    ref = annotate(run, out=tmp_path / "ref.pt.trace.json", pftrace=False).read_bytes()
    for size in (4096, 777):
        monkeypatch.setattr(rewrite_json, "CHUNK_BYTES", size)
        got = annotate(run, out=tmp_path / f"c{size}.pt.trace.json", pftrace=False)
        assert got.read_bytes() == ref


def test_scanner_handles_strings_with_braces_and_escapes(tmp_path):
    from cbtrace.annotate.rewrite_json import rewrite

    events = [{"ph": "X", "name": 'k<{lambda()#1}> "q" \\ [', "pid": 1, "tid": 1, "ts": 1,
               "dur": 1},
              {"ph": "X", "name": "cbtrace::a", "pid": 1, "tid": 1, "ts": 2, "dur": 5,
               "args": {"s": "}\\\\", "t": "\\\"{"}},
              {"ph": "X", "name": "nn.Module: A_0", "pid": 1, "tid": 1, "ts": 2, "dur": 5}]
    doc = {"deviceProperties": [{"name": "x{"}], "traceEvents": events, "z": ["]"]}
    for text in (json.dumps(doc), json.dumps(doc, indent=1)):
        src = tmp_path / "t.json"
        src.write_text(text)
        same = io.BytesIO()
        rewrite(src, same, on_event=lambda e: None, chunk_bytes=7)
        assert same.getvalue() == text.encode()
        seen, out = [], io.BytesIO()
        rewrite(src, out, on_event=lambda e: seen.append(e["name"]) or {**e, "hit": 1},
                head=b'"h": 1,', tail=lambda: [{"ph": "C"}], chunk_bytes=5)
        got = json.loads(out.getvalue())
        assert seen == ["cbtrace::a", "nn.Module: A_0"]
        assert [e.get("hit") for e in got["traceEvents"]] == [None, 1, 1, None]
        assert got["h"] == 1 and got["z"] == ["]"] and got["traceEvents"][1]["args"] == \
            events[1]["args"]


def test_not_a_trace(tmp_path):
    bad = tmp_path / "x.pt.trace.json"
    bad.write_text('{"nodes": []}')
    with pytest.raises(TraceError, match="no complete traceEvents"):
        annotate(trace=bad)
    assert not (tmp_path / "annotated_x.pt.trace.json").exists()


def test_pftrace_holds_annotations_and_counters(run):
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    out = annotate(run)
    pf = Trace.FromString(pftrace_path(out).read_bytes())
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in pf.packet
              if p.HasField("track_descriptor")}
    counters = {t.name for t in tracks.values() if t.HasField("counter")}
    assert {"achieved TFLOP/s", "achieved GB/s"} <= counters
    assert any(t.process.process_name == "cbtrace" for t in tracks.values())
    assert any(t.name == "isolated depth 2" for t in tracks.values())
    begins = [p.track_event for p in pf.packet if p.HasField("track_event")
              and p.track_event.type == TrackEvent.Type.TYPE_SLICE_BEGIN]
    ends = [p for p in pf.packet if p.HasField("track_event")
            and p.track_event.type == TrackEvent.Type.TYPE_SLICE_END]
    assert len(begins) == len(ends)
    head = next(te for te in begins if te.name == "cbtrace::head")
    ann = {d.name: d for d in head.debug_annotations}
    assert ann["fqn"].string_value == "head" and ann["isolated_ms"].double_value == 0.05
    ts = [p.timestamp for p in pf.packet if p.HasField("track_event")]
    assert ts == sorted(ts)


def test_cli(run, capsys):
    from cbtrace.cli.main import main

    main(["annotate", str(run), "--no-pftrace"])
    assert "annotated_worker0.1.pt.trace.json.gz" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["annotate", str(run)])
    assert "already exists" in capsys.readouterr().err


@pytest.mark.skipif(not shared_module_traces(), reason="../shared/traces/generated is absent")
@pytest.mark.parametrize("trace", shared_module_traces(), ids=lambda p: p.parent.name)
def test_shared_nn_module_traces(tmp_path, trace):
    before = sha256_file(trace)
    small = "transformer2" in trace.parent.name
    out = annotate(trace=trace, out=tmp_path / ("annotated_" + trace.name),
                   insitu=None if small else False, pftrace=small)
    assert sha256_file(trace) == before
    mods = _events(out, lambda e: e.get("name", "").startswith("nn.Module: "))
    assert mods and all(e["args"]["insitu_ms"] > 0 for e in mods)
    if small:  # attribution names the nn.Module events and gives in-situ FLOPs
        assert all("fqn" in e["args"] for e in mods)
        assert any(e["args"].get("flops", 0) > 0 for e in mods)
        assert _events(out, lambda e: e.get("ph") == "C")
    shutil.rmtree(tmp_path)


@pytest.mark.gpu
def test_gpu_capture_trace(tmp_path):
    """On CUDA, the device-side copies of the cbtrace ranges (gpu_user_annotation) get figures
    too, and in-situ time on host slices is the device span from attribution."""
    run = write_fake_run(tmp_path / "run", record_capture_trace(tmp_path / "cap", device="cuda"))
    ann = load_trace(annotate(run))["traceEvents"]
    host = [e for e in ann if e.get("name", "").startswith("cbtrace::")
            and e.get("cat") == "user_annotation"]
    dev = [e for e in ann if e.get("name", "").startswith("cbtrace::")
           and e.get("cat") == "gpu_user_annotation"]
    assert [e["args"]["fqn"] for e in host] == [f for f, *_ in module_calls()]
    assert dev and all("isolated_ms" in e["args"] and e["args"]["insitu_ms"] > 0 for e in dev)
    assert all(e["args"]["insitu_ms"] > 0 for e in host)
    assert pftrace_path(run / "annotated_worker0.1.pt.trace.json.gz").stat().st_size > 0


def test_metadata_names_replay_device_and_its_peaks(tmp_path, capture_trace):
    from helpers.runs import write_run

    from cbtrace.rundir.read import read_manifest, read_records
    from cbtrace.schema.manifest import ReplayInfo

    run = write_fake_run(tmp_path / "run", capture_trace)
    m, recs = read_manifest(run), read_records(run)
    m.replay = ReplayInfo(device="cuda:0", device_name="NVIDIA H200", timer_requested="auto",
                          wall_s=1.0, torch_version="test")
    for r in recs:
        r.compute_dtype = "bfloat16"
    write_run(run, recs, **{f: getattr(m, f) for f in m.__struct_fields__})
    meta = load_trace(annotate(run, pftrace=False))["cbtrace"]
    assert meta["device"] == "NVIDIA H200" and meta["run_id"] == "run@2026-01-01T00:00:00"
    assert meta["peaks"]["bfloat16"]["flops_per_s"] == pytest.approx(989.5e12)
    assert meta["peaks"]["bfloat16"]["source"].startswith("https://")


def _partial_overlaps(events) -> list:
    """Complete events that overlap another on their (pid, tid) track without nesting, with
    ts/dur in integer ns as Perfetto's JSON importer converts them (slices it would drop)."""
    from collections import defaultdict

    from cbtrace.annotate.appended import perfetto_ns

    tracks = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "ts" in e:
            start = perfetto_ns(e["ts"])
            tracks[(e.get("pid"), e.get("tid"))].append(
                (start, start + perfetto_ns(e.get("dur", 0)), e.get("name")))
    bad = []
    for spans in tracks.values():
        stack = []
        for span in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= span[0]:
                stack.pop()
            if stack and span[1] > stack[-1][1]:
                bad.append((stack[-1], span))
            stack.append(span)
    return bad


def test_perfetto_ns_rounds_like_the_json_importer():
    from cbtrace.annotate.appended import perfetto_ns

    # trace_processor's json_utils tests: 42 -> 42000, 42.1 -> 42100; llround halves away
    assert perfetto_ns(42) == 42000 and perfetto_ns(42.1) == 42100
    assert perfetto_ns(0.0005) == 1 and perfetto_ns(-0.0005) == -1 and perfetto_ns(0.0004) == 0
    assert perfetto_ns(0.0025) == 3 and round(0.0025 * 1000) == 2  # not Python's half-even


def test_nest_in_ns_trims_a_child_running_over_and_a_sibling_starting_early():
    from cbtrace.annotate.appended import nest_in_ns

    ev = [{"ph": "X", "pid": 1, "tid": 1, "name": "parent", "ts": 10.0, "dur": 5.0},
          {"ph": "X", "pid": 1, "tid": 1, "name": "child", "ts": 12.0, "dur": 3.001},
          {"ph": "X", "pid": 1, "tid": 1, "name": "next", "ts": 14.999, "dur": 1.0},
          {"ph": "X", "pid": 1, "tid": 2, "name": "other track", "ts": 10.0, "dur": 9.0}]
    assert len(_partial_overlaps(ev)) == 2
    nest_in_ns(ev)
    assert _partial_overlaps(ev) == []
    assert [e["dur"] for e in ev] == [4.999, 2.999, 1.0, 9.0]  # 1 ns less where it overlapped


def test_annotated_nanogpt_trace_nests_in_integer_nanoseconds(tmp_path):
    """A real nanogpt:tiny capture with isolated times of many decimals: after Perfetto's
    µs -> ns conversion no complete event overlaps another on its track (none dropped)."""
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.rundir.read import read_modules
    from cbtrace.rundir.writer import write_stage

    run = capture_model("nanogpt:tiny", tmp_path / "run", device="cpu").out
    ids = read_modules(run)["call_id"].tolist()
    # sums of such figures land between integer nanoseconds, as a real replay's do
    write_stage(run, "replay", {c: {"status": "ok", "isolated_ms": 0.0123456789 * (1 + c % 7)
                                    + c / 3e5} for c in ids})
    trace = load_trace(annotate(run, pftrace=False))["traceEvents"]
    iso = [e for e in trace if e.get("cat") == "cbtrace_isolated"]
    assert len(iso) == len(ids) and len({e["tid"] for e in iso}) > 2
    assert _partial_overlaps(trace) == []
    for e in iso:  # trimmed by a nanosecond at most
        assert abs(e["dur"] - e["args"]["isolated_ms"] * 1000) <= 0.0011
