"""Holistic Trace Analysis as cbtrace's ``hta`` extra: traceinsight (its name since 0.6) or
holistictraceanalysis (up to 0.5.0), whichever is installed, joins with cbtrace's table."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from cbtrace.attribution.attribute import attribute, hta_distribution
from cbtrace.errors import TraceError

TRACE = Path(__file__).resolve().parent / "data" / "cbtrace_capture_cpu.pt.trace.json.gz"


def test_the_hta_package_comes_from_a_known_distribution():
    pytest.importorskip("hta")
    name, version = hta_distribution()
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    assert (name, major_minor >= (0, 6)) in {("traceinsight", True),
                                             ("HolisticTraceAnalysis", False)}


def test_hta_table_joins_cbtrace_rows_by_event_index(tmp_path):
    pytest.importorskip("hta")
    shutil.copy(TRACE, tmp_path / "rank-0.pt.trace.json.gz")
    df, ta = attribute(tmp_path, hta=True, workers=1)
    hta_df = ta.t.get_trace(0)
    names = ta.t.symbol_table.sym_table
    mods = df[(df.source == "cbtrace") & (df.ev_index >= 0)]
    assert len(mods) > 5
    joined = mods.merge(hta_df, left_on="ev_index", right_on="index", suffixes=("", "_hta"))
    # HTA drops the last profiler step; every row it kept is the same slice as ours
    assert len(joined) >= 1
    assert [names[i] for i in joined["name"]] == [f"cbtrace::{f}" for f in joined["fqn"]]
    assert ((joined["dur"] - joined["dur_us"]).abs() < 2).all()  # HTA keeps whole µs ends


def test_without_hta_the_message_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", None)  # import fails as if absent
    shutil.copy(TRACE, tmp_path / "rank-0.pt.trace.json.gz")
    with pytest.raises(TraceError, match=r"pip install 'cbtrace\[hta\]' \(traceinsight"):
        attribute(tmp_path, hta=True, workers=1)
