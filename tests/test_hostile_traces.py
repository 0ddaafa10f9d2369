"""Hostile traces: a gzip bomb and a deeply nested JSON are refused in one line, in bounded
memory, by the streaming readers of attribute and annotate."""
import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cbtrace import trace_io
from cbtrace.attribution.loader import load
from cbtrace.trace_io import TraceLimitError

DATA = Path(__file__).parent / "data"
RSS_LIMIT_KB = 1536 * 1024  # 1.5 GiB


def bomb(path: Path, gib: int = 4) -> Path:
    """A ~4 MB gzip that inflates to ``gib`` GiB of blanks inside traceEvents (gzip members of
    64 MiB each, as a concatenated .gz is read whole)."""
    member = gzip.compress(b" " * (64 << 20), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(gib * 16):
            f.write(member)
        f.write(gzip.compress(b"]}"))
    return path


def deep(path: Path, inside_event: bool) -> Path:
    """10^6 nested arrays: bare, or in the args of an nn.Module event (which annotate parses)."""
    nest = b"[" * 10**6 + b"]" * 10**6
    if inside_event:
        nest = (b'{"traceEvents": [{"ph": "X", "name": "nn.Module: Deep", "pid": 1, "tid": 1, '
                b'"ts": 1, "dur": 1, "args": {"a": ' + nest + b"}}]}")
    path.write_bytes(nest)
    return path


def run_cli(*args, env=None):
    """(exit status, stderr lines, peak RSS in KB) of ``cbtrace ARGS`` in a child process."""
    proc = subprocess.Popen([sys.executable, "-m", "cbtrace", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    err = proc.stderr.read().decode()  # small: one line expected
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, [x for x in err.splitlines() if x.strip()], usage.ru_maxrss


def commands(trace: Path, tmp_path: Path):
    return [("attribute", trace), ("annotate", "--trace", trace, "--out",
                                   tmp_path / f"annotated_{trace.name}")]


@pytest.fixture(scope="module")
def gzip_bomb(tmp_path_factory):
    return bomb(tmp_path_factory.mktemp("bomb") / "bomb.pt.trace.json.gz")


def test_gzip_bomb_is_refused_at_the_default_limit(gzip_bomb, tmp_path):
    assert gzip_bomb.stat().st_size < 8 << 20  # 4 GiB inflated
    for args in commands(gzip_bomb, tmp_path):
        rc, err, rss_kb = run_cli(*args)
        assert rc == 1 and len(err) == 1, (args[0], err)
        assert err[0].startswith(f"Error: {gzip_bomb}: gzip data inflates over 200x"), err
        assert "CBTRACE_MAX_GZIP_RATIO" in err[0]
        assert rss_kb < RSS_LIMIT_KB, (args[0], rss_kb)
        assert not (tmp_path / f"annotated_{gzip_bomb.name}").exists()


def test_gzip_bomb_without_a_ratio_limit_still_ends_in_bounded_memory(gzip_bomb, tmp_path):
    for args in commands(gzip_bomb, tmp_path):
        rc, err, rss_kb = run_cli(*args, env={trace_io.RATIO_ENV: "0"})
        assert rc == 1 and len(err) == 1, (args[0], err)
        assert "no event boundary in 256 MiB of traceEvents" in err[0]
        assert rss_kb < RSS_LIMIT_KB, (args[0], rss_kb)


@pytest.mark.parametrize("inside_event", [False, True])
def test_deeply_nested_json_is_refused_in_one_line(tmp_path, inside_event):
    trace = deep(tmp_path / "deep.pt.trace.json", inside_event)
    for args in commands(trace, tmp_path):
        rc, err, rss_kb = run_cli(*args)
        assert rc == 1 and len(err) == 1, (args[0], err)
        assert err[0].startswith(f"Error: {trace}: JSON nested too deeply"), err
        assert rss_kb < RSS_LIMIT_KB


def test_the_ratio_limit_is_set_by_the_environment(tmp_path, monkeypatch):
    small = tmp_path / "small.json.gz"
    small.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (4 << 20) + b"]}"))
    monkeypatch.setattr(trace_io, "RATIO_FLOOR_BYTES", 1 << 20)
    monkeypatch.setenv(trace_io.RATIO_ENV, "50")
    with pytest.raises(TraceLimitError, match="inflates over 50x"):
        load(small)
    from cbtrace.annotate.rewrite_json import read_chunks

    with pytest.raises(TraceLimitError, match="inflates over 50x"):
        for _ in read_chunks(small):
            pass
    monkeypatch.setenv(trace_io.RATIO_ENV, "0")  # no limit
    assert load(small).n_events == 0
    monkeypatch.setenv(trace_io.RATIO_ENV, "lots")
    with pytest.raises(trace_io.TraceError, match="CBTRACE_MAX_GZIP_RATIO='lots'"):
        load(small)


def test_real_traces_are_well_under_the_default_ratio(monkeypatch):
    monkeypatch.setattr(trace_io, "RATIO_FLOOR_BYTES", 0)  # check from the first byte
    monkeypatch.setenv(trace_io.RATIO_ENV, str(trace_io.DEFAULT_MAX_RATIO / 5))
    traces = sorted(DATA.rglob("*.pt.trace.json.gz"))
    assert traces
    for path in traces:
        assert sum(map(len, trace_io.iter_bytes(path))) > 0
