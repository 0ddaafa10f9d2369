"""Measurement backends (timers), their shared statistics, and the profiled call.

CPU tests use a tiny nn.Sequential and real torch.profiler runs; GPU tests carry @pytest.mark.gpu.
"""
import ast
import dataclasses
import inspect
import json
import subprocess
import sys
import time
from collections import Counter

import pluggy
import pytest
import torch
from helpers.paths import REPO
from torch import nn

from cbtrace import hookspecs
from cbtrace.errors import ReplayError
from cbtrace.plugins.backends import hooks
from cbtrace.replay.timer import stats
from cbtrace.replay.timer import choice as timers
from cbtrace.replay.timer import contract as timing
from cbtrace.replay.timer.contract import Timing, TimerUnavailable, TimingConfig, join_notes
from cbtrace.plugins.backends.cpu import CpuTimer
from cbtrace.plugins.backends.events import EventsTimer
from cbtrace.plugins.backends.graph import GraphTimer
from cbtrace.plugins.backends.l2 import L2Flusher
from cbtrace.replay.measure.profiler_pass import (MARKER_KERNEL, Row, aten_op_count,
                                                  device_totals, lost_device_events,
                                                  own_device_work,
                                                  profile_as_timed,
                                                  peak_live_bytes, profile_call)
from cbtrace.plugins.backends.sampling import collect, timing_from_samples, warm_until_settled

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
FAST = TimingConfig(budget_s=0.02, min_runs=5, warmup_runs=2)


@pytest.fixture(autouse=True)
def one_thread():
    """A 2-core CI box shared with other jobs: intra-op threads only add noise."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64)).eval()


def copies(n, device="cpu"):
    return [torch.randn(8, 32, device=device) for _ in range(n)]


# ---- stats (pure, hand-worked) -------------------------------------------------------------

def test_percentile_hand_worked():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4; position (n-1)q/100
    assert stats.percentile(xs, 50) == pytest.approx(2.5)
    assert stats.percentile(xs, 10) == pytest.approx(1.3)   # 1 + 0.3 * (2 - 1)
    assert stats.percentile(xs, 90) == pytest.approx(3.7)
    assert stats.percentile([7.0], 90) == 7.0
    assert stats.summarize([5.0, 1.0, 3.0]) == pytest.approx((3.0, 1.4, 4.6))


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        stats.percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        stats.percentile([1.0], 101)


@pytest.mark.parametrize("kw, want", [
    (dict(per_run_s=0.01, left_s=1.0, done=10), 50),    # 100 fit; take half, then re-estimate
    (dict(per_run_s=0.01, left_s=0.03, done=10), 2),    # 3 fit -> ceil(3/2)
    (dict(per_run_s=0.01, left_s=0.005, done=10), 0),   # nothing fits: stop
    (dict(per_run_s=1.0, left_s=-5.0, done=3), 7),      # over budget, but min_runs=10 first
    (dict(per_run_s=0.0, left_s=1.0, done=10), 50),     # free runs: half of max_runs
    (dict(per_run_s=1e-6, left_s=1.0, done=90), 10),    # never past max_runs=100
])
def test_plan_runs(kw, want):
    assert stats.plan_runs(min_runs=10, max_runs=100, **kw) == want


def test_graph_calls_and_spin():
    assert stats.graph_calls(per_call_ms=0.005, k_max=20, max_replay_ms=2.0) == 20
    assert stats.graph_calls(per_call_ms=0.3, k_max=20, max_replay_ms=2.0) == 6   # 2 / 0.3 = 6.7
    assert stats.graph_calls(per_call_ms=5.0, k_max=20, max_replay_ms=2.0) == 1
    assert stats.graph_calls(per_call_ms=0.0, k_max=20, max_replay_ms=2.0) == 20
    assert stats.spin_for(host_ms=0.1, lo_ms=0.05, hi_ms=20) == pytest.approx(0.22)
    assert stats.spin_for(host_ms=0.001, lo_ms=0.05, hi_ms=20) == 0.05
    assert stats.spin_for(host_ms=50, lo_ms=0.05, hi_ms=20) == 20


def test_graph_timer_spins_only_without_a_flush_before_the_replay():
    from cbtrace.plugins.backends import graph

    cfg = TimingConfig(gap_s=0.001, spin_min_ms=0.05)
    assert graph.gap_ms(cfg, flushing=True) == pytest.approx(1.0)    # the flush covers the launch
    assert graph.gap_ms(cfg, flushing=False) == pytest.approx(1.05)
    assert graph.gap_ms(TimingConfig(), flushing=True) == 0.0        # no spin kernel queued at all


# ---- config and result ---------------------------------------------------------------------

def test_config_is_keyword_only_and_validated():
    with pytest.raises(TypeError):
        TimingConfig(0.5)
    for bad in (dict(min_runs=0), dict(min_runs=20, max_runs=10), dict(graph_k=0),
                dict(budget_s=-1), dict(warmup_runs=-1)):
        with pytest.raises(ValueError):
            TimingConfig(**bad)
    cfg = TimingConfig(budget_s=0.5, min_runs=10, max_runs=10_000, warmup_runs=3, graph_k=20,
                       flush_l2=True, gap_s=0.0)
    assert cfg.graph_k == 20 and cfg.flush_bytes >= 4 * 50 * 2**20  # > 4x an H200 L2


def test_every_config_field_has_one_doc_line():
    tree = ast.parse(inspect.getsource(timing.TimingConfig))
    body = tree.body[0].body
    fields = [(i, n.target.id) for i, n in enumerate(body) if isinstance(n, ast.AnnAssign)]
    assert {name for _, name in fields} == set(TimingConfig.__dataclass_fields__)
    for i, name in fields:
        doc = body[i + 1]
        assert isinstance(doc, ast.Expr) and isinstance(doc.value.value, str), name
        assert "\n" not in doc.value.value.strip(), f"{name}: doc is more than one line"


def test_timing_from_samples():
    t = timing_from_samples([2.0, 1.0, 3.0, 4.0, 5.0], "cpu", "note")
    assert (t.median_ms, t.p10_ms, t.p90_ms, t.runs, t.timer) == (3.0, 1.4, 4.6, 5, "cpu")
    assert t.samples_ms == [2.0, 1.0, 3.0, 4.0, 5.0] and t.notes == "note"
    assert isinstance(t, Timing)


def test_join_notes_and_cpu_flusher_is_a_no_op():
    assert join_notes("K=20", None, "", "no L2 flush") == "K=20; no L2 flush"
    assert join_notes(None, "") is None
    flusher = L2Flusher(torch.device("cpu"), 1 << 20)
    flusher.flush()
    assert flusher.buf is None and flusher.note is None


# ---- the adaptive loop ---------------------------------------------------------------------

class FakeClock:
    """The sampling loop's clock, moved only by ``sleep``: its budgets and windows are then the
    same on a loaded machine as on an idle one."""

    def __init__(self):
        self.ns = 0  # whole nanoseconds: 5 x 10 ms adds up to exactly 50 ms

    def perf_counter(self) -> float:
        return self.ns / 1e9

    def sleep(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)


@pytest.fixture
def clock(monkeypatch):
    from cbtrace.plugins.backends import sampling

    fake = FakeClock()
    monkeypatch.setattr(sampling, "time", fake)
    return fake


def sleeper(per_s, log, clock):
    def sample(first, n):
        log.append((first, n))
        clock.sleep(per_s * n)
        return [per_s * 1e3] * n
    return sample


def test_collect_fills_the_budget_then_stops(clock):
    log = []
    cfg = TimingConfig(budget_s=0.1, min_runs=5, converge_spread=0.0, converge_ci=0.0)
    t0 = clock.perf_counter()
    got = collect(sleeper(0.002, log, clock), cfg)
    assert log[0] == (0, 5)                                # min_runs first
    assert [f for f, _ in log] == [sum(n for _, n in log[:i]) for i in range(len(log))]
    assert [n for _, n in log][:3] == [5, 23, 11]          # half of what fits, re-estimated
    assert 45 <= len(got) <= 50                            # 0.1 s / 2 ms, never past it
    assert clock.perf_counter() - t0 <= 0.1 + 1e-9


def test_warm_for_runs_the_sampler_for_its_time_and_not_at_zero(clock):
    from cbtrace.plugins.backends.sampling import warm_for

    log = []
    t0 = clock.perf_counter()
    warm_for(sleeper(0.002, log, clock), 0.05)
    assert clock.perf_counter() - t0 >= 0.05 and len(log) == 5  # 5 x 2 ms per round
    log.clear()
    warm_for(sleeper(0.002, log, clock), 0.0)
    assert log == []
    with pytest.raises(ValueError):
        TimingConfig(warmup_s=-1)


def test_settled_hand_worked():
    assert not stats.settled(None, 1.0, 0.01)
    assert stats.settled(1.0, 1.009, 0.01) and stats.settled(1.0, 0.991, 0.01)
    assert not stats.settled(1.0, 1.02, 0.01) and not stats.settled(0.0, 1.0, 0.01)


def drifting(ms_at, log, clock, run_s=0.0002):
    """A sampler whose per-call time is ``ms_at(seconds since its first round)``; each run
    takes ``run_s`` of the clock; ``log`` gets the number of runs of each round."""
    t0 = []

    def sample(first, n):
        t0.append(t0[0] if t0 else clock.perf_counter())
        log.append(n)
        clock.sleep(run_s * n)
        return [ms_at(clock.perf_counter() - t0[0])] * n
    return sample


@pytest.fixture
def settle(clock):
    def run(ms_at, run_s=0.0002, **kw):
        log = []
        note = warm_until_settled(drifting(ms_at, log, clock, run_s),
                                  TimingConfig(settle_tol=0.01, **kw))
        return note, log
    return run


def test_warm_until_settled_waits_for_the_drift_to_stop(settle):
    # 0.86 -> 1.0 ms over 60 ms (2.3 % per 10 ms window), then steady
    ramp = lambda t: 0.86 + 0.14 * min(t / 0.06, 1.0)  # noqa: E731
    note, log = settle(ramp, settle_window_s=0.01, settle_lag=1)
    assert note.startswith("settled in") and float(note.split()[2]) >= 60
    note, log = settle(lambda t: 1.0, settle_window_s=0.01, settle_lag=1)
    assert note is None  # already steady: two windows, nothing to say
    # a slow slide, 0.8 % per 10 ms: windows next door agree, three apart they do not
    slide = lambda t: 1.0 + 0.08 * min(t / 0.1, 1.0)  # noqa: E731
    assert settle(slide, settle_window_s=0.01, settle_lag=1)[0] is None  # fooled: quick
    note, _ = settle(slide, settle_window_s=0.01, settle_lag=3)
    assert note.startswith("settled in") and float(note.split()[2]) >= 100
    note, _ = settle(lambda t: 1.0 + 10 * t, settle_window_s=0.01, settle_max_s=0.05)
    assert note.startswith("still drifting")


def test_warm_until_settled_sizes_rounds_for_slow_calls_and_says_when_it_could_not_check(
        settle):
    # a 20 ms call in 25 ms windows: one run per round, and 4 windows do not fit in 50 ms
    note, log = settle(lambda t: 20.0, run_s=0.02, settle_window_s=0.025, settle_max_s=0.05)
    assert log[0] == 1 and set(log) == {1} and note.startswith("settling not checked")
    with pytest.raises(ValueError):
        warm_until_settled(lambda first, n: [], TimingConfig(settle_tol=0.01))


def test_settle_settings_are_validated():
    for bad in (dict(settle_tol=-0.1), dict(settle_lag=0), dict(settle_window_s=0),
                dict(warmup_s=0.5, settle_max_s=0.1), dict(warmup_s=-1)):
        with pytest.raises(ValueError):
            TimingConfig(**bad)


def test_collect_honours_min_and_max_runs(clock):
    cfg = TimingConfig(budget_s=10, min_runs=3, max_runs=17, converge_spread=0.0)
    assert len(collect(sleeper(0.0, [], clock), cfg)) == 17
    assert len(collect(sleeper(0.005, [], clock), TimingConfig(budget_s=0, min_runs=4))) == 4


def test_converged_within_a_share_of_the_median_or_under_the_jitter_floor():
    steady = [1.0, 1.002, 0.998, 1.001, 0.999] * 2
    assert stats.converged(steady, 0.01) and not stats.converged(steady, 0.001)
    empty = [6.2e-5, 1.1e-4, 8e-5, 9e-5, 7e-5] * 2   # an empty graph's replays: +-40 % of ~0
    assert not stats.converged(empty, 0.01)
    assert stats.converged(empty, 0.01, floor_ms=stats.EVENT_JITTER_MS / 20)
    assert not stats.converged([0.0] * 10, 0.01)       # zero median and no floor: never
    assert stats.converged([0.0] * 10, 0.01, floor_ms=1e-6)


def jittery(values: list[float], log: list):
    """A sample() returning values in turn, logging how many runs each round asked for."""
    def sample(first, n):
        log.append(n)
        return [values[(first + i) % len(values)] for i in range(n)]
    return sample


def test_collect_stops_at_min_runs_once_converged_else_spends_the_budget(clock):
    empty = [6.2e-5, 1.1e-4, 8e-5, 9e-5, 7e-5]
    cfg = TimingConfig(budget_s=0.05, min_runs=10, converge_spread=0.01, max_runs=10_000)
    log = []
    assert len(collect(jittery(empty, log), cfg, floor_ms=stats.EVENT_JITTER_MS / 20)) == 10
    assert log == [10]
    log = []
    assert len(collect(jittery(empty, log), cfg)) > 10 and len(log) > 1   # no floor: budget
    log = []
    off = TimingConfig(budget_s=0.05, min_runs=10, converge_spread=0.0, converge_ci=0.0,
                       max_runs=10_000)
    assert len(collect(jittery(empty, log), off, floor_ms=1.0)) > 10      # converge off: budget


def test_median_ci_hand_worked():
    xs = [float(v) for v in range(20, 0, -1)]  # 1..20, any order
    # n = 20: ranks floor(10 - 1.96 * sqrt(20) / 2) = 5 and ceil(1 + 10 + 4.38) = 16
    assert stats.median_ci(xs) == (5.0, 16.0)
    assert stats.median_ci([3.0]) == (3.0, 3.0)
    assert stats.median_ci([1.0, 2.0, 3.0]) == (1.0, 3.0)  # few samples: the extremes
    with pytest.raises(ValueError):
        stats.median_ci([])


def test_converged_once_the_median_is_known_though_the_runs_disagree():
    wide = [96 + 8 * ((37 * i) % 100) / 99 for i in range(100)]  # +-4 %, evenly spread
    assert not stats.converged(wide, 0.01)                         # p10..p90: 6.4 %
    assert stats.converged(wide, 0.01, ci=0.01)                    # median within ~0.9 %
    assert not stats.converged(wide[:20], 0.01, ci=0.01)           # 20 runs: not yet
    assert not stats.converged(wide, 0.01, ci=0.002)
    # spread 0 is off: neither the spread nor the jitter floor stops it, the interval may
    assert not stats.converged([5.0] * 10, 0.0, floor_ms=1.0)
    assert not stats.converged(wide, 0.0, floor_ms=100.0, ci=0.002)
    assert stats.converged([5.0] * 10, 0.0, ci=0.01)
    # the interval within the timer's jitter per sample, when asked: a 5 us call, 0.1 us a sample
    small = [0.005 + 1e-4 * ((37 * i) % 20) / 19 for i in range(20)]  # 5.0..5.1 us
    assert not stats.converged(small, 0.0, floor_ms=1e-4, ci=0.001)  # ci_floor off
    assert stats.converged(small, 0.0, floor_ms=1e-4, ci=0.001, ci_floor=True)
    assert not stats.converged(small, 0.0, floor_ms=1e-5, ci=0.001, ci_floor=True)


def test_collect_with_converge_ci_stops_before_the_budget(clock):
    wide = [96 + 8 * ((37 * i) % 100) / 99 for i in range(100)]

    def sample(first, n):  # 0.1 ms a run on the fake clock
        clock.sleep(1e-4 * n)
        return [wide[(first + i) % len(wide)] for i in range(n)]

    def runs(**kw):
        cfg = TimingConfig(budget_s=0.5, min_runs=10, converge_spread=0.01, max_runs=10_000,
                           **kw)
        return len(collect(sample, cfg))

    spent = runs(converge_ci=0.0)      # never within 1 %: the whole budget, ~5,000 runs
    known = runs(converge_ci=0.01)     # stops once the median is known to 1 %
    assert spent > 4000 and 20 < known < 400
    assert stats.converged([wide[i % 100] for i in range(known)], 0.01, ci=0.01)
    with pytest.raises(ValueError, match="converge_ci"):
        TimingConfig(converge_ci=-0.1)


# ---- cpu timer -----------------------------------------------------------------------------

def test_cpu_timer_rotates_copies_and_summarises():
    model, xs, seen = tiny_model(), copies(3), Counter()

    def call(i):
        seen[i] += 1
        return model(xs[i])

    with torch.no_grad():
        t = CpuTimer().measure(call, 3, torch.device("cpu"), FAST)
    assert t.timer == "cpu" and t.runs == len(t.samples_ms) >= FAST.min_runs
    assert 0 < t.p10_ms <= t.median_ms <= t.p90_ms
    assert sum(seen.values()) >= t.runs + FAST.warmup_runs  # warm-up also lasts warmup_min_s
    assert set(seen) == {0, 1, 2} and max(seen.values()) - min(seen.values()) <= 1


def test_cpu_timer_spends_its_budget_whatever_converge_ci_says(monkeypatch):
    from cbtrace.plugins.backends import cpu

    seen = []

    def collect(sample, cfg, *a, **kw):
        seen.append(cfg)
        return [1.0] * cfg.min_runs

    monkeypatch.setattr(cpu, "collect", collect)
    cfg = dataclasses.replace(FAST, converge_ci=0.01)
    CpuTimer().measure(lambda i: None, 1, torch.device("cpu"), cfg)
    assert seen and all(c.converge_ci == 0.0 for c in seen)
    assert seen[0].converge_spread == cfg.converge_spread  # the rest as asked


def test_cpu_timer_measures_real_time():
    t = CpuTimer().measure(lambda i: time.sleep(0.003), 1, "cpu",
                           TimingConfig(budget_s=0.0, min_runs=5, warmup_runs=0))
    assert t.runs == 5
    # a 3 ms sleep never reads less; the upper bound only catches a unit slip (s or us), as a
    # loaded machine may wake the sleeper late
    assert 3.0 <= t.median_ms < 1000.0


def test_cpu_timer_passes_module_errors_through():
    def call(i):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes"):
        CpuTimer().measure(call, 1, "cpu", FAST)


def test_cuda_timers_say_why_not_on_cpu():
    assert CpuTimer().unavailable_reason(torch.device("cpu")) is None
    assert "meta" in CpuTimer().unavailable_reason(torch.device("meta"))
    with pytest.raises(TimerUnavailable, match="meta"):
        CpuTimer().measure(lambda i: None, 1, "meta", FAST)
    for timer in (GraphTimer(), EventsTimer()):
        reason = timer.unavailable_reason(torch.device("cpu"))
        assert reason and "CUDA" in reason and timer.name in reason
        with pytest.raises(TimerUnavailable, match="CUDA"):
            timer.measure(lambda i: None, 1, "cpu", FAST)


def test_capture_error_names_the_op_that_broke_it():
    from cbtrace.errors import one_line
    from cbtrace.replay.timer.graph_capture import root_cause
    try:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nhint")
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as e:
        assert one_line(root_cause(e)) == (
            "RuntimeError: CUDA error: operation not permitted when stream is capturing")


# ---- registration and fallback -------------------------------------------------------------

class FailingTimer:
    """Stands in for a graph capture that fails on this call (e.g. an embedding backward)."""

    name = "flaky"

    def unavailable_reason(self, device):
        return None

    def measure(self, call, n_copies, device, cfg):
        raise TimerUnavailable("graph capture failed: operation not permitted when capturing")


class FakePlugin:
    @hookspecs.hookimpl
    def register_backends(self, register):
        register("flaky", FailingTimer())


@pytest.fixture
def registered():
    """A plugin manager with the built-in backends and a fake one, registered through the hook."""
    pm = pluggy.PluginManager("cbtrace")
    pm.add_hookspecs(hookspecs)
    pm.register(hooks, name="cbtrace.plugins.backends.hooks")
    pm.register(FakePlugin(), name="fake")
    table = {}
    pm.hook.register_backends(register=lambda name, obj: table.setdefault(name, obj))
    yield table
    pm.unregister(name="fake")


def test_builtins_register_through_the_hook(registered):
    assert {"graph", "events", "cpu", "flaky"} <= set(registered)
    for name, backend in registered.items():
        assert backend.name == name
        assert callable(backend.measure) and callable(backend.unavailable_reason)


def test_chain_follows_the_fallback_ranks(registered):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert timers.chain("auto", cpu, registered) == ["cpu"]  # graph, events: not on a CPU
    assert timers.chain("graph", cpu, registered) == ["graph", "cpu"]
    assert timers.chain("cpu", cpu, registered) == ["cpu"]
    assert timers.chain("flaky", cpu, registered) == ["flaky", "cpu"]  # unranked: all fallbacks
    assert "flaky" not in timers.chain("auto", cpu, registered)  # asked for by name only
    with pytest.raises(ReplayError, match="--timer nope: no such timer.*auto, cpu, events"):
        timers.chain("nope", cpu, registered)
    if CUDA:
        assert timers.chain("auto", cuda, registered) == ["graph", "stream", "events", "cpu"]
        assert timers.chain("events", cuda, registered) == ["events", "cpu"]


def test_a_failing_timer_falls_back_and_records_why(registered):
    model, xs = tiny_model(), copies(2)
    chain = timers.chain("flaky", torch.device("cpu"), registered)
    with torch.no_grad():
        t, why = timers.measure(lambda i: model(xs[i]), 2, torch.device("cpu"), chain,
                                registered, FAST)
    assert t.timer == "cpu"
    assert why == "flaky: graph capture failed: operation not permitted when capturing"


def test_no_usable_timer_says_why(registered):
    want = "flaky: graph capture failed.*events: events timer needs"
    with pytest.raises(TimerUnavailable, match=want):
        timers.measure(lambda i: None, 1, torch.device("cpu"), ["flaky", "events"], registered,
                       FAST)


# ---- profiled call -------------------------------------------------------------------------

def rows(*spec):
    return [Row(a, n, t, d, b, c) for a, n, t, d, b, c in spec]


def test_a_session_that_launched_kernels_and_recorded_none_lost_them():
    launch = ("cuda_runtime", "cudaLaunchKernel", 0, 5, 0, True)
    kernel = ("kernel", "sm90_gemm", 10, 500, 0, False)
    assert lost_device_events(rows(("cpu_op", "aten::mm", 0, 9, 0, True), launch))
    assert lost_device_events(rows(("cuda_runtime", "cudaGraphLaunch", 0, 5, 0, True)))
    assert not lost_device_events(rows(launch, kernel))
    # ops ran and CUPTI recorded not even a runtime call: lost as well (a view-only call is
    # then profiled once more, to the same result)
    assert lost_device_events(rows(("cpu_op", "aten::addmm", 0, 9, 0, True)))
    memcpy = ("cuda_runtime", "cudaMemcpyAsync", 0, 5, 0, True)
    assert not lost_device_events(rows(("cpu_op", "aten::copy_", 0, 9, 0, True), memcpy))
    assert not lost_device_events([])


def test_row_summaries_hand_worked():
    rs = rows(("cpu_op", "aten::linear", 0, 900, 0, True),
              ("cpu_op", "aten::addmm", 10, 800, 0, True),
              ("cpu_op", "Optimizer.step", 10, 800, 0, True),
              ("kernel", "sm90_gemm", 20, 1500, 0, False),
              ("gpu_memset", "Memset", 30, 500, 0, False),
              ("gpu_user_annotation", "fwd", 0, 9000, 0, False),
              ("[memory]", "[memory]", 3, 0, 100, True),
              ("[memory]", "[memory]", 1, 0, 50, True),     # out of order on purpose
              ("[memory]", "[memory]", 5, 0, -100, True),
              ("[memory]", "[memory]", 6, 0, 30, True),
              ("[memory]", "[memory]", 4, 0, 999, False))   # device memory: not the CPU estimate
    # busy time: the memset [30, 530) ns runs inside the kernel [20, 1520): 1500 ns, not 2000
    assert device_totals(rs) == (2, pytest.approx(0.0015))
    apart = [r._replace(start_ns=2000) if r.activity == "gpu_memset" else r for r in rs]
    assert device_totals(apart) == (2, pytest.approx(0.002))
    # Kineto's clock is epoch nanoseconds (~1.8e18): exact to the nanosecond, not to 256
    epoch = 1_796_554_109_823_007_766
    late = [r._replace(start_ns=r.start_ns + epoch + 128) for r in apart]
    assert device_totals(late) == (2, pytest.approx(0.002, abs=1e-9))
    one = [r for r in late if r.activity == "kernel"]
    one[0] = one[0]._replace(dur_ns=1100)
    assert device_totals(one) == (1, pytest.approx(0.0011, abs=1e-9))
    assert aten_op_count(rs) == 2
    assert peak_live_bytes(rs) == 150                     # 50, 150, 50, 80
    assert peak_live_bytes(rs, on_cpu=False) == 999


def test_own_device_work_counts_between_markers_only():
    mark = f"void at::cuda::(anonymous namespace)::{MARKER_KERNEL}(long)"
    # per run: a context kernel, a sync, marker, the call's two kernels (one on a second
    # stream, overlapping), a sync, marker; the rows come out of order
    rs = rows(("kernel", "ctx_gemm", 0, 500, 0, False),
              ("kernel", mark, 600, 10, 0, False),
              ("kernel", "relu", 620, 100, 0, False),
              ("gpu_memcpy", "Memcpy DtoD", 650, 100, 0, False),   # overlaps: busy 130
              ("kernel", mark, 800, 10, 0, False),
              ("kernel", "ctx_gemm", 1000, 500, 0, False),
              ("kernel", "relu", 1620, 120, 0, False),
              ("gpu_memcpy", "Memcpy DtoD", 1745, 50, 0, False),   # after it: busy 170
              ("kernel", mark, 1600, 10, 0, False),
              ("kernel", mark, 1800, 10, 0, False),
              ("cpu_op", "aten::relu", 1610, 5, 0, True))
    count, each = own_device_work(rs, runs=2)
    assert count == 4 and each == [pytest.approx(130 / 1e6), pytest.approx(170 / 1e6)]
    # a run whose kernels the profiler lost (one fewer than the others): no figure, not 0 ms
    lost = [r for r in rs if not (r.name == "Memcpy DtoD" and r.start_ns == 1745)]
    assert own_device_work(lost, runs=2) is None
    # markers missing or extra (another kernel of that name, a profiler that dropped one):
    # no figure rather than a wrong one
    assert own_device_work(rs[:-2], runs=2) is None
    assert own_device_work(rs, runs=1) is None
    assert profile_as_timed(None, "cpu") is None  # a CPU call keeps its profiled pass


def test_profiled_pass_rotates_copies_but_the_first_and_last():
    from cbtrace.replay.measure.steps import ProfilerPass, profiled_copies

    assert profiled_copies(1) == [0] and profiled_copies(2) == [0]
    assert profiled_copies(3) == [1] and profiled_copies(6) == [1, 2, 3, 4]

    class Call:  # a prepared call's surface the pass uses
        n_copies, device, rec, module, row = 6, torch.device("cpu"), None, None, {}
        ran: list = []

        def run(self, i):
            self.ran.append(i)
            return torch.ones(4) * i

    for as_timed, expected in ((True, {1, 2, 3, 4}), (False, {0})):
        c = Call()
        c.ran = []
        ProfilerPass(runs=2, as_timed=as_timed).run(c)
        assert set(c.ran) == expected and len(c.ran) >= 5


def test_profile_call_on_cpu_linear():
    model, (x,) = tiny_model(), copies(1)
    with torch.no_grad():
        s = profile_call(lambda: model(x), "cpu", runs=2)
    assert s.runs == 2 and s.kernel_count == 0 and s.device_ms == 0
    assert s.wall_ms > 0 and s.launch_overhead_ms == s.wall_ms
    assert s.op_count >= 3  # at least aten::linear, aten::gelu, aten::layer_norm
    assert s.peak_mem_source == "estimate"
    assert s.peak_mem_bytes >= 8 * 64 * 4  # the (8, 64) fp32 activations


def test_profile_call_cpu_peak_is_live_bytes():
    x = torch.randn(1 << 20)
    s = profile_call(lambda: (x * 2).sum(), torch.device("cpu"), runs=1)
    # x*2 allocates 4 MiB, freed after sum; the scalar 2 and the sum's result add a few bytes
    assert 4 * 2**20 <= s.peak_mem_bytes < 4 * 2**20 + 1024
    with pytest.raises(ValueError, match="runs"):
        profile_call(lambda: None, "cpu", runs=0)


# ---- GPU (run by the lead on an H200) --------------------------------------------------------

@pytest.mark.parametrize("timer", [GraphTimer(), EventsTimer(), CpuTimer()], ids=lambda t: t.name)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_timers_time_a_gemm(timer):
    a = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    assert timer.unavailable_reason(torch.device("cuda")) is None
    t = timer.measure(lambda i: a[i] @ b, 2, torch.device("cuda"), FAST)
    assert t.timer == timer.name and t.runs >= FAST.min_runs
    # 17.2 GFLOP; an H100/H200 does it in ~20-40 us, anything sane in < 20 ms
    assert 0.005 < t.median_ms < 20
    if timer.name == "graph":
        assert t.notes.startswith("K=")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_graph_capture_failure_falls_back_to_the_stream_timer(registered):
    x = torch.randn(1024, device="cuda")

    def call(i):  # .item() syncs with the host: not capturable
        return x * float((x > 0).sum().item())

    with pytest.raises(TimerUnavailable, match="capture"):
        GraphTimer().measure(call, 1, "cuda", FAST)
    dev = torch.device("cuda")
    t, why = timers.measure(call, 1, dev, timers.chain("auto", dev, registered), registered, FAST)
    assert t.timer == "stream" and why.startswith("graph: graph capture failed")
    torch.cuda.empty_cache()  # torch < 2.12 asserted here after a failed capture (pytorch#180395)
    t = GraphTimer().measure(lambda i: x * 2, 1, "cuda", FAST)  # capture still works afterwards
    assert t.timer == "graph"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_graph_shrinks_k_for_long_calls_and_captures_backward():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)  # 1.1 TFLOP: > 1 ms
    t = GraphTimer().measure(lambda i: a @ a, 1, "cuda", TimingConfig(budget_s=0, min_runs=3))
    assert t.notes.startswith("K=") and int(t.notes[2:].split(";")[0]) < 20
    lin = nn.Linear(256, 256).cuda()
    xs = [torch.randn(64, 256, device="cuda", requires_grad=True) for _ in range(2)]
    t = GraphTimer().measure(lambda i: lin(xs[i]).sum().backward(), 2, "cuda", FAST)
    assert t.timer == "graph" and t.median_ms > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_profile_call():
    model = tiny_model().cuda()
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        s = profile_call(lambda: model(x), "cuda")
    assert s.kernel_count >= 3 and s.device_ms > 0
    assert s.peak_mem_source == "cuda_allocator" and s.peak_mem_bytes >= 8 * 64 * 4
    assert s.launch_overhead_ms == pytest.approx(max(s.wall_ms - s.device_ms, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_profile_as_timed_counts_the_call_not_its_context():
    a = torch.randn(2048, 2048, device="cuda")
    x = torch.randn(1 << 20, device="cuda")
    runner = timing.CallRunner(run=lambda j: torch.relu(x), n_copies=1,
                               before=lambda j: a @ a)  # the context: a GEMM, untimed
    count, ms, each, _ = profile_as_timed(runner, "cuda", runs=3)
    assert count == 1  # the ReLU's one kernel: neither the GEMM nor the markers
    assert len(each) == 3 and ms == pytest.approx(sum(each) / 3)
    alone = profile_call(lambda: torch.relu(x), "cuda")
    assert 0 < ms < 3 * alone.device_ms  # not the GEMM's milliseconds


# what benchmarks/gpu_timers.py defines, read in a process of its own (argv[1]: the script)
GPU_TIMERS_CASES = """import json, runpy, sys, torch
script = runpy.run_path(sys.argv[1])
print(json.dumps({"labels": [label for label, _, _ in script["TIMERS"]],
                  "cases": len(script["CASES"]),
                  "ln_gelu": list(script["case_ln_gelu"](torch.device("cpu"))(1).shape)}))
"""


def test_gpu_benchmark_script_builds_its_cases_on_cpu():
    """benchmarks/gpu_timers.py runs only on a GPU; check here that it loads and its calls work."""
    out = subprocess.run([sys.executable, "-c", GPU_TIMERS_CASES,
                          str(REPO / "benchmarks" / "gpu_timers.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    labels = got["labels"]
    assert len(labels) == len(set(labels)) and {"graph", "events", "cpu_sync"} <= set(labels)
    assert got["cases"] >= 4
    assert got["ln_gelu"] == [4, 256, 768]


def test_a_call_that_asks_whether_it_is_captured_is_noted(monkeypatch):
    from cbtrace.replay.timer.graph_capture import watch_capture_checks

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    asked = []
    with watch_capture_checks(asked):
        assert torch.cuda.is_current_stream_capturing() is True  # the call's own check
    assert asked == [True]
    assert torch.cuda.is_current_stream_capturing() is True and not [a for a in asked[1:]]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_a_call_that_branches_on_capture_is_timed_without_a_graph(registered):
    x = torch.randn(4096, device="cuda")

    def call(i):  # transformers' mask creation does this: another path under capture
        return x * 2 if torch.cuda.is_current_stream_capturing() else x + 1

    with pytest.raises(TimerUnavailable, match="is_current_stream_capturing"):
        GraphTimer().measure(call, 1, "cuda", FAST)
    dev = torch.device("cuda")
    t, why = timers.measure(call, 1, dev, timers.chain("auto", dev, registered), registered, FAST)
    assert t.timer == "stream" and "is_current_stream_capturing" in why


def test_warm_inputs_touch_each_copy_before_its_call_untimed():
    """The input toucher runs before every timed call on the copy the call gets, and the CPU
    timer says so; a call without one is timed as before."""
    from cbtrace.replay.timer.contract import CallRunner

    log = []

    def call(i):
        log.append(("call", i))

    warm = TimingConfig(budget_s=0.0, min_runs=4, warmup_runs=1, warmup_min_s=0)
    touched = CallRunner(run=call, n_copies=3, before=lambda i: log.append(("touch", i)),
                         warms_inputs=True)
    t = CpuTimer().measure(touched, 3, "cpu", warm)
    timed = log[log.index(("call", 0)) + 1:]  # after the warm-up call
    assert timed[::2] == [("touch", c) for _, c in timed[1::2]] and "warm inputs" in t.notes
    log.clear()
    t = CpuTimer().measure(call, 3, "cpu", warm)
    assert all(kind == "call" for kind, _ in log) and "warm" not in (t.notes or "")


def test_the_toucher_rewrites_big_inputs_with_their_own_values():
    from cbtrace.replay.measure.prepare import input_toucher

    big = torch.randn(256, 256)
    small, flags = torch.randn(4), torch.ones(256, 256, dtype=torch.bool)
    grad = torch.randn(256, 256, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(256, 256))
    expanded = torch.randn(1, 256).expand(512, 256)
    copies = [((big, small, flags, grad, param, expanded), {})]
    before = [t.clone() for t in (big, grad)]
    versions = [t._version for t in (big, small, flags, grad, param, expanded)]
    touch = input_toucher(copies)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        touch(0)
    muls = [e.input_shapes[0] for e in prof.events() if e.name == "aten::mul_"]
    assert muls == [[256, 256], [256, 256]]  # big and grad, rewritten in place
    # through aliases: no version bump, so autograd keeps a view input's grad_fn as it was
    assert [t._version for t in (big, small, flags, grad, param, expanded)] == versions
    assert torch.equal(big, before[0]) and torch.equal(grad.detach(), before[1])
    assert input_toucher([((small,), {})]) is None


def test_the_toucher_as_a_sum_reads_the_next_copy_and_keeps_each_copys_values():
    from cbtrace.replay.measure.prepare import input_toucher

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    before = (a.clone(), b.clone())
    touch = input_toucher([((a,), {}), ((b,), {})], as_a_sum=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        touch(0)
        touch(1)
    adds = [e.input_shapes[:2] for e in prof.events() if e.name == "aten::add_"]
    assert adds == [[[256, 256], [256, 256]]] * 2  # each copy rewritten from two operands
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


def test_a_graph_capture_out_of_memory_hands_the_cache_back_and_tries_once_more(monkeypatch):
    from types import SimpleNamespace

    from cbtrace.plugins.backends import graph

    def staged_with(results):
        released = []

        def capture(run, n_copies, k, touch, stream, slots=False):
            r = results.pop(0)
            if isinstance(r, Exception):
                raise r
            return r

        monkeypatch.setattr(graph, "capture", capture)
        monkeypatch.setattr(graph, "hand_back", released.append)
        call = SimpleNamespace(stage=None, unstage=None, run=lambda i: None)
        stream = SimpleNamespace(device=torch.device("cuda", 0))
        return lambda: graph.staged(call, 1, 4, stream=stream), released

    oom = TimerUnavailable("graph capture failed: OutOfMemoryError: CUDA out of memory.")
    run, released = staged_with([oom, "graph"])
    assert run() == "graph" and released == [torch.device("cuda", 0)]
    run, released = staged_with([oom, oom])  # once only: then the next timer, saying why
    with pytest.raises(TimerUnavailable, match="out of memory"):
        run()
    assert released == [torch.device("cuda", 0)]
    run, released = staged_with([TimerUnavailable("graph capture failed: x")])
    with pytest.raises(TimerUnavailable, match="failed: x"):
        run()
    assert released == []  # another failure: nothing handed back, no retry


def test_the_cache_goes_back_before_a_capture_only_when_the_driver_is_short(monkeypatch):
    from cbtrace.replay.timer import graph_capture as gc_

    gib = 2**30
    assert gc_.needs_room(free=10 * gib, total=80 * gib, idle=59 * gib)
    assert not gc_.needs_room(free=30 * gib, total=80 * gib, idle=39 * gib)
    # short, but too little idle to be worth a synchronisation and fresh allocations
    assert not gc_.needs_room(free=1 * gib, total=80 * gib, idle=gib // 2)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    stats = {"reserved_bytes.all.current": 60 * gib, "allocated_bytes.all.current": gib,
             "inactive_split_bytes.all.current": gib}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    assert gc_.make_room() and emptied == [1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 * gib, 80 * gib))
    assert not gc_.make_room() and emptied == [1]
    # 1.5 GiB reserved beyond what is allocated, but 1 GiB of it the free parts of split blocks,
    # which empty_cache cannot return
    stats.update({"reserved_bytes.all.current": 5 * gib + gib // 2,
                  "allocated_bytes.all.current": 4 * gib})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    assert not gc_.make_room() and emptied == [1]


@pytest.mark.gpu
def test_gpu_a_capture_after_reset_graphs_filled_the_cache_does_not_run_out_of_memory():
    """A reset graph's pool stays in torch's cache; a capture cannot free it itself."""
    from cbtrace.replay.timer.graph_capture import ROOM_SHARE, capturing

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    big = int(free * 0.9) // 2  # bytes each of the two graphs' pools hold
    stream = torch.cuda.Stream()
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with capturing(g, stream):
            torch.empty(big, dtype=torch.uint8, device="cuda").fill_(1)
        g.reset()
        del g
    assert torch.cuda.mem_get_info()[0] < ROOM_SHARE * total  # the pools, cached and idle
    g = torch.cuda.CUDAGraph()
    try:
        with capturing(g, stream):  # needs what only the cache has: handed back first
            torch.empty(int(free * 0.5), dtype=torch.uint8, device="cuda").fill_(2)
        g.replay()
        torch.cuda.synchronize()
    finally:
        g.reset()
        torch.cuda.empty_cache()


def test_a_lookup_gets_enough_table_copies_to_overflow_the_l2_twice():
    """A graph of K = 20 lookups after the L2 flush on 8 copies of a 2.5 MB table read each
    copy again while it was in the cache; 48 copies (120 MB) are all read once."""
    from cbtrace.replay.measure.copies import tables_for

    mb = 1 << 20
    assert tables_for(5 * mb // 2, 60 * mb, 64) == 48   # 2.5 MB tables: 120 MB of copies
    assert tables_for(5 * mb // 2, 60 * mb, 8) == 8     # the old cap: 20 MB, inside the L2
    assert tables_for(40 * mb, 60 * mb, 64) == 3
    assert tables_for(100 * mb, 60 * mb, 64) == 2
