"""The cause a row names when its isolated figure misses in situ (attribution/miss.py)."""
import pytest

from cbtrace.attribution.miss import bwd_miss_cause, clock_error_pct, kernel_error_pct, miss_cause
from cbtrace.device import sm_clock_mhz


def row(**kw):
    return {"error_pct": 12.0, "kernel_count": 3, "timer": "graph", **kw}


def test_a_call_within_five_percent_or_without_an_error_has_no_cause():
    assert miss_cause(row(error_pct=4.9), 3, 30.0) is None
    assert miss_cause(row(error_pct=float("nan")), 3, 30.0) is None
    assert miss_cause(row(error_pct=None), 3, 30.0) is None


def test_other_kernels_come_first():
    assert miss_cause(row(), 4, 0.0) == "other kernels: 3 alone, 4 in the step"


def test_kernels_slower_or_faster_alone_name_the_cache_or_clock_state():
    assert miss_cause(row(), 3, 9.6) == ("its kernels ran 10 % slower alone than in the step "
                                         "(cache or clock state)")
    assert "faster alone" in miss_cause(row(error_pct=-20.0), 3, -18.0)


def clocked(err, step_mhz, timed_mhz, **kw):
    return row(error_pct=err, step_clock_mhz=step_mhz, timed_clock_mhz=timed_mhz,
               clock_error_pct=clock_error_pct(step_mhz, timed_mhz), **kw)


def test_a_miss_the_clocks_account_for_names_the_sm_clock():
    # timed at 1946 MHz, the step at 1800: a call following the clock reads 7.5 % fast alone
    assert abs(clock_error_pct(1800, 1946) - (-7.50)) < 0.01
    assert miss_cause(clocked(-9.0, 1800, 1946), 3, -9.0) == (
        "SM clock: timed at 1946 MHz, the step's 1800 MHz (-7.5 % from the clocks; "
        "-1.5 % besides)")


def test_a_compiled_calls_eager_figure_against_the_eager_step_names_the_clock_too():
    # compiled NanoGPT's train step: its eager figure timed at 1988 MHz, the captured (eager)
    # step's busy time at 1844: both are the device busy with the same kernels
    assert miss_cause(clocked(-9.7, 1844, 1988, error_basis="eager"), 3, -11.0).startswith(
        "SM clock: timed at 1988 MHz, the step's 1844 MHz (-7.2 % from the clocks")
    # the step repeated as the user runs it is not a busy time: no clock named there
    assert not miss_cause(clocked(-9.7, 1844, 1988, error_basis="step"), 3, -11.0).startswith(
        "SM clock")


def test_the_clock_is_not_named_where_it_cannot_account_for_the_miss():
    # the other way round, too small to matter, too small beside the miss, against host time
    assert miss_cause(clocked(9.0, 1800, 1946), 3, 9.0).startswith("its kernels ran 9 % slower")
    assert miss_cause(clocked(-9.0, 1940, 1946), 3, -9.0).startswith("its kernels ran 9 %")
    assert miss_cause(clocked(-20.0, 1800, 1946), 3, -20.0).startswith("its kernels ran 20 %")
    assert miss_cause(clocked(-9.0, 1800, 1946, error_basis="span"), 3, 0.0).startswith(
        "host-paced")
    assert clock_error_pct(None, 1946) is None and clock_error_pct(1800, 0) is None


def bwd(**kw):
    return {"bwd_error_pct": 24.8, "bwd_kernel_count": 33, "bwd_device_ms": 0.36,
            "bwd_insitu_ms": 0.358, "bwd_timer": "graph", "bwd_timer_notes": "K=20", **kw}


def test_a_backward_names_other_kernels_its_kernels_and_its_fallback_timer():
    # the attention backward that ran 37 kernels alone against 33 in the step
    assert bwd_miss_cause(bwd(bwd_kernel_count=37), 33) == "other kernels: 37 alone, 33 in the step"
    assert bwd_miss_cause(bwd(bwd_device_ms=0.44), 33).startswith("its kernels ran 23 % slower")
    fell_back = bwd(bwd_timer="events", bwd_timer_fallback="graph: capture failed: operation "
                    "would make the legacy stream depend on a capturing stream")
    assert bwd_miss_cause(fell_back, 33) == (
        "timed by the events timer (graph: capture failed: operation would make the legacy "
        "stream depend on a capturing stream)")
    # its kernels match the step: what is left is between them
    assert bwd_miss_cause(bwd(), 33).startswith("between its kernels")


def test_a_backward_within_five_percent_or_unprofiled_names_what_it_can():
    assert bwd_miss_cause(bwd(bwd_error_pct=-3.0), 33) is None
    assert bwd_miss_cause(bwd(bwd_error_pct=None), 33) is None
    # a CPU replay profiles no kernels: nothing is named rather than a guess
    assert bwd_miss_cause(bwd(bwd_kernel_count=None, bwd_device_ms=None, bwd_timer="cpu"),
                          None) is None


def test_no_clock_is_read_off_a_gpu():
    assert sm_clock_mhz("cpu") is None


@pytest.mark.gpu
def test_gpu_clock_readings_agree_with_each_other_and_with_a_plausible_clock():
    import torch

    got = [sm_clock_mhz(torch.device("cuda")) for _ in range(5)]
    assert all(200 < g < 4000 for g in got), got
    assert max(got) / min(got) < 1.05, got  # an idle device, read back to back


def test_with_matching_kernels_the_gaps_the_host_or_the_timer_are_named():
    assert miss_cause(row(error_basis="span"), 3, 1.0).startswith("host-paced")
    assert miss_cause(row(timer="events", timer_fallback="graph: capture failed"), 3, 1.0) == \
        "timed by the events timer (graph: capture failed)"
    assert miss_cause(row(noisy=True), 3, 1.0) == "noisy samples (a busy machine)"
    assert miss_cause(row(), 3, -2.0) == ("between its kernels: they match the step within 2 %, "
                                          "the gaps and launches around them do not")


def test_without_kernel_figures_nothing_is_made_up():
    assert miss_cause(row(kernel_count=None, timer="cpu"), None, None) is None


def test_kernel_error_is_device_busy_against_device_busy():
    assert abs(kernel_error_pct(0.011, 0.010) - 10.0) < 1e-9
    assert kernel_error_pct(None, 0.01) is None and kernel_error_pct(0.01, 0.0) is None


def test_every_miss_of_a_real_h200_run_names_its_cause(tmp_path):
    import shutil
    from pathlib import Path

    from cbtrace.attribution.join import join_insitu

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "data" / "h200_nanogpt_run", run)
    df = join_insitu(run)
    ran = df["insitu_kernel_count"] > 0  # a Dropout at p = 0 runs no kernel
    assert ran.sum() > 100 and df.loc[ran, "kernel_error_pct"].notna().all()
    out = df["error_pct"].abs() > 5
    assert out.any() and df.loc[out, "miss_cause"].notna().all()
    assert df.loc[~out, "miss_cause"].isna().all()
    # the replay ran the step's kernels: no row says otherwise
    assert not df["miss_cause"].fillna("").str.startswith("other kernels").any()
