"""Every trace in ../shared/traces gives a table or a one-line error; conservation on real traces."""
import functools
import gzip
import json
from pathlib import Path

import pytest

from cbtrace.attribution.attribute import COLUMNS, attribute
from cbtrace.attribution.forest import DEVICE_CATS
from cbtrace.errors import CbtraceError

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
FILES = sorted(p for p in TRACES.rglob("*") if p.name.endswith((".json", ".json.gz"))) if TRACES.is_dir() else []
NOT_TRACES = {"benchmark_simple_add_et.json.gz": "not a Kineto trace"}  # an execution trace
GPU_CHECKED = ["hta/tests/data/amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz",
               "hta/tests/data/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
               "kineto/tb_plugin/samples/resnet50_num_workers_0/worker0.1623143089861.pt.trace.json.gz",
               "param/et_replay/tests/inputs/dlrm_kineto/worker0_step_12.1694128201545.pt.trace.json",
               "hta/tests/data/mtia_inference_trace/mtia_inference_rank_0.json.gz",
               "hta/tests/data/trace_filter/sampled_rank-0.json.gz",
               "kineto/docs/traces/after_fix_trace.json"]
pytestmark = pytest.mark.skipif(not FILES, reason=f"shared traces not found at {TRACES}")


@functools.lru_cache(maxsize=None)
def table(path: Path):
    """Session cache: each trace is attributed once for all tests."""
    try:
        return attribute(path, aggregate=False)
    except CbtraceError as e:
        return e


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(TRACES)) for p in FILES])
def test_every_shared_trace_gives_a_table_or_a_reason(path):
    res = table(path)
    if path.name in NOT_TRACES:
        assert isinstance(res, CbtraceError) and NOT_TRACES[path.name] in str(res)
    if isinstance(res, CbtraceError):
        msg = str(res)
        assert "\n" not in msg and path.name in msg
        return
    assert list(res.columns) == COLUMNS and len(res) > 0
    assert (res.fqn == "<unattributed>").any()  # always present, never dropped
    assert (res.gpu_ms >= res.gpu_self_ms - 1e-9).all() and (res.cpu_ms >= 0).all()


def _device_us(path: Path) -> tuple[float, int]:
    data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    ev = [e for e in json.loads(data)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    return sum(e["dur"] for e in ev), len(ev)


@pytest.mark.parametrize("rel", GPU_CHECKED)
def test_gpu_conservation(rel):
    path = TRACES / rel
    df = table(path)
    total_us, n = _device_us(path)
    assert n > 0
    assert df.gpu_self_ms.sum() * 1e3 == pytest.approx(total_us, rel=1e-3)
    roots = df[(df.depth <= 0)]  # module roots + unattributed rows hold every device event once
    assert roots.kernel_count.sum() == n
    assert roots.gpu_ms.sum() * 1e3 == pytest.approx(total_us, rel=1e-3)


def test_cpu_conservation_nn_module_trace():
    path = next((TRACES / "generated/torch2.13cpu_transformer2").glob("*.json.gz"))
    df = table(path)
    assert set(df.source) == {"nn.Module", "unattributed"}
    for (step, phase), s in df[df.depth >= 0].groupby(["step", "phase"]):
        assert s.cpu_self_ms.sum() == pytest.approx(s[s.depth == 0].cpu_ms.sum(), rel=1e-9)
    layer = df[(df.step == 2) & df.fqn.str.endswith("TransformerEncoderLayer_1") & (df.phase == "bwd")]
    assert len(layer) == 1 and layer.cpu_ms.iloc[0] > 0  # backward found through sequence numbers


def test_multi_rank_directory():
    df = attribute(TRACES / "param/et_replay/tests/inputs/dlrm_kineto")
    assert sorted(set(df["rank"])) == list(range(8))
    assert set(df.step) == {10}
    g = df[df.fqn == "DistributedDataParallel.forward"]
    assert len(g[(g.phase == "fwd") & (g.call_index == 0)]) == 8 and (g.gpu_ms > 0).all()


def test_torch19_format_drift():
    path = TRACES / GPU_CHECKED[2]  # Operator/Runtime/Kernel categories, "stream 7" tids
    df = table(path)
    assert df.kernel_count.sum() > 8000
    launched = df[df.fqn == "<unattributed>"]
    assert launched.gpu_ms.sum() > 0 and len(set(df.step)) >= 2


def test_hta_join(tmp_path):
    pytest.importorskip("hta")
    import shutil

    src = TRACES / "hta/tests/data/trace_compare/base/base.json.gz"
    shutil.copy(src, tmp_path / "rank-1.json.gz")
    df, ta = attribute(tmp_path, hta=True)
    hta_df = ta.t.get_trace(1)
    names = ta.t.symbol_table.sym_table
    mods = df[df.ev_index >= 0]
    assert len(mods) > 0
    joined = mods.merge(hta_df, left_on="ev_index", right_on="index", suffixes=("", "_hta"))
    # HTA keeps a subset of events (it drops the last profiler step) and shifts ts to the
    # trace start, but its ``index`` is the position in traceEvents, like our ev_index
    assert len(joined) >= 1
    assert [names[i] for i in joined["name"]] == list(joined["fqn"])
    assert (joined["dur"] == joined["dur_us"]).all()


@pytest.mark.parametrize("rel", [GPU_CHECKED[0], GPU_CHECKED[1]])
def test_step_windows_on_gpu_traces(rel):
    # device events counted once across windows: by launcher, else by the step they run in
    path = TRACES / rel
    a = table(path)
    b = attribute(path, aggregate=False, steps_per_window=1)
    key = ["rank", "step", "phase", "depth", "fqn", "call_index", "ts_us"]
    a = a.sort_values(key, na_position="first").reset_index(drop=True)
    b = b.sort_values(key, na_position="first").reset_index(drop=True)
    import pandas as pd

    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9)
    assert a.step.nunique() >= 2
