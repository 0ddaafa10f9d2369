"""The cause a row names when its isolated figure misses in situ (attribution/miss.py)."""
from cbtrace.attribution.miss import kernel_error_pct, miss_cause


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
