"""trace_io: .json / .json.gz by suffix, chunked streaming equal to a whole-file decode."""
import gzip
import json

import msgspec
import pytest

from cbtrace import trace_io
from cbtrace.errors import TraceError

EVENTS = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.5,
           "dur": 2.25, "args": {"Input Dims": [[2, 3], [3, 4]], "nested": [{"a": 1}, {"b": 2}]}},
          {"ph": "i", "name": "marker", "pid": 1, "tid": 1, "ts": 3}] * 50


def _decode(b):
    return msgspec.json.decode(b)


def _stream(path, chunk):
    events, meta = [], None
    for kind, payload in trace_io.stream_trace(path, _decode, chunk_bytes=chunk):
        if kind == "events":
            events.extend(payload)
        else:
            meta = payload
    return events, meta


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_write_read_roundtrip(tmp_path, suffix):
    trace = {"schemaVersion": 1, "traceEvents": EVENTS, "traceName": "x"}
    p = tmp_path / f"t{suffix}"
    trace_io.write_trace(p, trace)
    assert (p.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".json.gz")
    assert trace_io.read_trace(p) == trace


@pytest.mark.parametrize("chunk", [1, 100, 1 << 20])
@pytest.mark.parametrize("indent", [None, 2])
def test_stream_equals_whole_decode_meta_before_and_after(tmp_path, chunk, indent):
    # metadata both before and after traceEvents, nested "}, {" inside args, float timestamps
    text = json.dumps({"deviceProperties": [{"id": 0}, {"id": 1}], "traceEvents": EVENTS,
                       "INFO": ["a]", "b"], "baseTimeNanoseconds": 17}, indent=indent)
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(text.encode()))
    events, meta = _stream(p, chunk)
    assert events == EVENTS
    assert meta == {"deviceProperties": [{"id": 0}, {"id": 1}], "INFO": ["a]", "b"],
                    "baseTimeNanoseconds": 17}


def test_bare_array_and_empty_events(tmp_path):
    p = tmp_path / "bare.json"
    p.write_text(json.dumps(EVENTS[:3]))
    assert _stream(p, 10) == (EVENTS[:3], {})
    q = tmp_path / "empty.json"
    q.write_text('{"traceEvents": [], "x": 1}')
    assert _stream(q, 10) == ([], {"x": 1})


def test_errors_are_one_line_and_name_the_file(tmp_path):
    p = tmp_path / "et.json"
    p.write_text('{"schema": 1, "nodes": []}')
    with pytest.raises(TraceError, match=r"et.json: not a Kineto trace \(no traceEvents"):
        _stream(p, 10)
    bad = tmp_path / "cut.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X"}, {"ph": ')[:-6])
    with pytest.raises(TraceError, match="cut.json.gz"):
        _stream(bad, 10)
    with pytest.raises(TraceError, match="no such|cannot open"):
        _stream(tmp_path / "missing.json", 10)


def test_shared_trace_streams_like_json_load(shared_traces):
    p = shared_traces / "hta/tests/data/trace_filter/sampled_rank-0.json.gz"
    whole = json.loads(gzip.decompress(p.read_bytes()))
    events, meta = _stream(p, 4096)
    assert events == whole["traceEvents"]
    assert meta == {k: v for k, v in whole.items() if k != "traceEvents"}
