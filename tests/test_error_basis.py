"""What error_pct compares a call with: the plain step for a root timed back to back or run
compiled, eager against eager for other calls the step ran compiled (capture runs them eagerly),
the captured span or busy time otherwise; and the plain step capture times for it."""
import types

import pandas as pd
import pytest

from cbtrace.cost import metrics


def test_the_basis_follows_the_timer_the_compile_and_the_figures_there_are():
    assert metrics.error_basis("stream", 2.0, step_ms=3.0) == "step"
    assert metrics.error_basis("graph", 2.0, step_ms=3.0, compiled=True) == "step"
    assert metrics.error_basis("graph", 2.0, step_ms=3.0) == "busy"  # device-busy vs busy
    assert metrics.error_basis("graph", 2.0, compiled=True) == "eager"
    assert metrics.error_basis("stream", 2.0, step_ms=None) == "span"
    assert metrics.error_basis("stream", None, step_ms=0.0) == "busy"
    assert metrics.error_basis("stream", 2.0, host_ms=1.5) == "host"  # unhooked, over the span
    assert metrics.error_basis("graph", 2.0, host_ms=1.5) == "busy"


def test_the_join_compares_each_call_with_the_figure_its_basis_names(monkeypatch):
    from cbtrace.attribution import join

    n = 6
    table = pd.DataFrame(dict(fqn=[f"m{i}" for i in range(n)], call_index=[0] * n,
                              cpu_ms=[9.0] * n, gpu_ms=[4.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                              gpu_span_ms=[9.0, 2.0, 1.5, 1.0, 3.0, 3.0],
                              kernel_count=[5, 1, 1, 1, 1, 1],
                              insitu_ms=[4.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    monkeypatch.setattr(join, "insitu_for_run", lambda run, manifest, phase="fwd": table)
    df = pd.DataFrame(dict(
        call_id=range(n), fqn=table["fqn"], call_index=[0] * n,
        timer=["graph", "graph", "graph", "stream", "stream", "stream"],
        timer_fallback=[None] * n,
        isolated_ms=[2.0, 0.5, 1.2, 1.6, 2.2, 1.03], eager_ms=[4.4, 1.1, None, None, None, None],
        host_ms=[3.3, None, None, None, None, None],
        step_compiled=[True, True, False, False, False, False],
        insitu_step_ms=[3.0, None, None, None, None, None],
        device_ms=[4.0, 1.0, 1.0, 1.0, 1.0, 1.0], kernel_count=[5, 1, 1, 1, 1, 1],
        noisy=[False] * n, bwd_ms=[None] * n,
        insitu_host_ms=[0.5, None, 0.5, None, 2.0, 0.5]))
    out = join.insitu_columns("run", types.SimpleNamespace(device="cuda:0", files={}), df)
    # the compiled root: what it costs a loop of steps (its host issue, 3.3 ms, over its device
    # time, 2.0 ms) against the step run compiled, plainly, in a loop
    assert out[0]["error_basis"] == "step" and out[0]["error_pct"] == pytest.approx(10.0)
    # a call inside the compiled region: eager against the (eager) captured step
    assert out[1]["error_basis"] == "eager" and out[1]["error_pct"] == pytest.approx(10.0)
    assert out[2]["error_basis"] == "busy" and out[2]["error_pct"] == pytest.approx(20.0)
    assert out[3]["error_basis"] == "span" and out[3]["error_pct"] == pytest.approx(60.0)
    assert out[3]["miss_cause"].startswith("host-paced")
    # timed back to back, with a host time from the unhooked repeat: the larger of that and
    # its busy time (2.0 ms of host over 1.0 ms of kernels; 1.0 ms of kernels over 0.5 ms)
    assert out[4]["error_basis"] == "host" and out[4]["error_pct"] == pytest.approx(10.0)
    assert out[5]["error_basis"] == "host" and out[5]["error_pct"] == pytest.approx(3.0)
    assert out[4]["miss_cause"].startswith("host-paced") and out[5]["miss_cause"] is None
    assert out[2]["error_basis"] == "busy"  # a host time changes nothing for a graph-timed call
    assert out[0]["insitu_ms"] == 4.0  # every in-situ figure kept beside the one compared


def test_capture_times_the_plain_forward_of_a_root_only(tmp_path):
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.rundir.read import read_modules

    capture_model("nanogpt:tiny", tmp_path / "fwd", device="cpu", trace=False, max_depth=1)
    df = read_modules(tmp_path / "fwd")
    root = df["parent_call_id"] == -1
    assert (df.loc[root, "insitu_step_ms"] > 0).all()
    assert df.loc[~root, "insitu_step_ms"].isna().all()
    capture_model("nanogpt:tiny", tmp_path / "train", device="cpu", trace=False, max_depth=1,
                  step="train")
    df = read_modules(tmp_path / "train")  # a train step's root: its forward, with grad
    root = df["parent_call_id"] == -1
    assert (df.loc[root, "insitu_step_ms"] > 0).all() and df.loc[~root, "insitu_step_ms"].isna().all()
