"""What ``cbtrace.attribute`` reads from the paths it is given: trace files, directories of
traces, run directories and a distributed run's rank-N shards; annotated_ copies skipped."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cbtrace.attribution.attribute import trace_files
from cbtrace.errors import TraceError

RUN = Path(__file__).resolve().parent / "data" / "h200_nanogpt_run"


def _run(dst: Path, annotated: bool = False) -> Path:
    shutil.copytree(RUN, dst)
    if annotated:
        trace = next(dst.glob("*.pt.trace.json.gz"))
        shutil.copy(trace, dst / f"annotated_{trace.name}")
    return dst


def test_a_run_directory_gives_its_capture_trace_only(tmp_path):
    run = _run(tmp_path / "gpt", annotated=True)
    assert [p.name for p in trace_files(run)] == [next(RUN.glob("*.pt.trace.json.gz")).name]


def test_rank_shards_each_give_their_trace_in_rank_order(tmp_path):
    for r in (0, 2, 10):
        _run(tmp_path / "ddp" / f"rank-{r}", annotated=True)
    files = trace_files(tmp_path / "ddp")
    assert [p.parent.name for p in files] == ["rank-0", "rank-2", "rank-10"]
    assert not any(p.name.startswith("annotated_") for p in files)


def test_annotated_copy_beside_its_original_is_skipped_with_one_warning(tmp_path):
    run = _run(tmp_path / "gpt", annotated=True)
    both = sorted(run.glob("*.pt.trace.json.gz"))
    with pytest.warns(UserWarning, match=r"skipped 1 annotated_\* trace") as caught:
        assert [p.name.startswith("annotated_") for p in trace_files(both)] == [False]
    assert len(caught) == 1
    # given alone, an annotated trace is what the user asked for
    alone = [p for p in both if p.name.startswith("annotated_")]
    assert trace_files(alone) == alone


def test_a_plain_directory_of_traces_and_a_missing_path(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    for name in ("rank-1.json.gz", "rank-0.json.gz", "notes.txt"):
        (d / name).write_bytes(b"")
    assert [p.name for p in trace_files(d)] == ["rank-0.json.gz", "rank-1.json.gz"]
    with pytest.raises(TraceError, match="no such trace file or directory"):
        trace_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no .json or .json.gz traces"):
        trace_files(tmp_path / "empty")
