"""Where a captured step's time goes above the floor (bench_capture.py's range-only hooks).

Each variant captures the same step (median of REPEATS steps, ``timings_s['step']``):
``capture`` as shipped; ``inline``: the hook bookkeeping on the step's own thread (no helper
thread: planning traced, no hand-off); ``no-copy``: the input copies not run (the run is wrong;
the cost of launching them); ``no-trace``: trace=False (the hooks without the profiler). Beside
them the plain profiled step and the floor, and the helper thread's round trip measured alone
(a call that does nothing, handed over and waited for, without a profiler), how much slower
Python runs on a thread while another has a profile function, a capture's trace events by
category, and one capture with clocks around the hand-off and its trace's events by thread.
Profiling is without ``with_stack`` (capture's default) unless the case is named ``+stack``
(bench_capture.case); ``inline`` then differs from ``capture`` only under ``+stack``, where the
helper thread runs; the hand-off's clocks always come from a ``with_stack`` capture.

Run: python benchmarks/probes/probe_capture_step.py [CASE]   (a bench_capture.py case; default
dlrm-large on a GPU, dlrm-large-cpu without; PROBE_CPROFILE=1 adds a cProfile of the hooks
without the profiler)
"""
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_capture, one level up
import bench_capture as bc  # noqa: E402

REPEATS = int(os.environ.get("CBTRACE_BENCH_REPEATS", 5))


def step_s(provider, model, batch, device, work, **cfg) -> tuple[float, int]:
    """(the captured step's seconds, the calls recorded) of one capture."""
    import cbtrace

    run = Path(tempfile.mkdtemp(dir=work)) / "run"
    with cbtrace.capture(model, run, **cfg) as cap:
        provider.run(model, batch)
        bc.sync(device)
    global LAST_TRACE
    LAST_TRACE = cap.trace_path
    return cap.timings_s["step"], len(cap.records)


LAST_TRACE = None  # the trace of step_s's last capture


def trace_events(path) -> str:
    """A capture trace's complete events by category."""
    import collections
    import gzip
    import json

    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    by = collections.Counter(e.get("cat") for e in events if e.get("ph") == "X")
    return ", ".join(f"{k}: {v}" for k, v in by.most_common(6))


def laps(provider, model, batch, device, work) -> str:
    """One more capture (with_stack: the helper's case) with clocks around the hand-off: the
    step thread's wait in ``HelperThread.call``, the job's own time on the helper, the copies;
    and the trace's events by thread (whether the helper's work reaches the trace)."""
    import collections
    import gzip
    import json

    import cbtrace
    from cbtrace.capture import helper_thread, recorder

    clock = functools.partial(time.perf_counter)
    acc = collections.Counter()
    real_call, real_copies = helper_thread.HelperThread.call, recorder.run_copies

    def call(self, fn, *args):
        def timed(*a):
            t = clock()
            try:
                return fn(*a)
            finally:
                acc["job_s"] += clock() - t
        t = clock()
        try:
            return real_call(self, timed, *args)
        finally:
            acc["call_s"] += clock() - t
            acc["calls"] += 1

    def copies(c):
        t = clock()
        real_copies(c)
        acc["copies_s"] += clock() - t
        acc["copies"] += len(c)

    helper_thread.HelperThread.call, recorder.run_copies = call, copies
    try:
        run = Path(tempfile.mkdtemp(dir=work)) / "run"
        with cbtrace.capture(model, run, with_stack=True) as cap:  # the hand-off's case
            provider.run(model, batch)
            bc.sync(device)
    finally:
        helper_thread.HelperThread.call, recorder.run_copies = real_call, real_copies
    with gzip.open(cap.trace_path) as f:
        events = json.load(f)["traceEvents"]
    by = collections.Counter((e.get("tid"), e.get("cat")) for e in events if e.get("ph") == "X")
    n = acc["calls"]
    lines = [f"laps: step {cap.timings_s['step']:.3f} s; {n} helper calls: wait "
             f"{acc['call_s'] / n * 1e6:.0f} us each, job on the helper {acc['job_s'] / n * 1e6:.0f}"
             f" us; {acc['copies']} copies, {acc['copies_s'] / max(n, 1) * 1e6:.0f} us a call",
             "trace events by (tid, cat): " + ", ".join(
                 f"{k[0]}/{k[1]}: {v}" for k, v in by.most_common(8))]
    return "\n".join(lines)


def hook_profile(provider, model, batch, device, work, top: int = 25) -> str:
    """cProfile of a capture's step without the profiler (trace=False: the hooks' bookkeeping
    runs inline): where the hooks' own Python time goes, device ops included."""
    import cProfile
    import io
    import pstats

    import cbtrace

    run = Path(tempfile.mkdtemp(dir=work)) / "run"
    prof = cProfile.Profile()
    with cbtrace.capture(model, run, trace=False):
        prof.enable()
        provider.run(model, batch)
        bc.sync(device)
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def other_thread_slowdown() -> float:
    """How much slower Python runs on an unprofiled thread while this one has a profile
    function (what torch's Python tracer sets under with_stack): 1.0 under Python 3.11; about
    2 under 3.12, whose legacy profiling instruments the interpreter's code for every thread."""
    import sys
    import threading

    def work():
        def f(x):
            return x + 1
        t, s = time.perf_counter(), 0
        for _ in range(500_000):
            s = f(s)
        return time.perf_counter() - t

    def on_thread():
        out = []
        th = threading.Thread(target=lambda: out.append(work()))
        th.start()
        th.join()
        return out[0]

    plain = min(on_thread() for _ in range(3))
    sys.setprofile(lambda *a: None)
    try:
        profiled = min(on_thread() for _ in range(3))
    finally:
        sys.setprofile(None)
    return profiled / plain


def round_trip_us(n: int = 2000) -> float:
    from cbtrace.capture.helper_thread import HelperThread

    h = HelperThread()
    noop = functools.partial(int)
    for _ in range(100):
        h.call(noop)
    t0 = time.perf_counter()
    for _ in range(n):
        h.call(noop)
    dt = time.perf_counter() - t0
    h.close()
    return dt / n * 1e6


def main(name: str) -> None:
    from cbtrace.capture import helper_thread, recorder
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.model.spec import resolve

    spec, device, dtype, options, stack = bc.case(name)
    work = Path(tempfile.mkdtemp(dir=os.environ.get("CBTRACE_BENCH_DIR")))
    provider = resolve(spec, options=options)
    model, batch = provider.model_and_batch(device, torch_dtype(dtype) if dtype else None)
    model.eval()
    real_helper, real_copies = recorder.HelperThread, recorder.run_copies
    variants = {
        "capture": ({}, None),
        "inline": ({}, "inline"),
        "no-copy": ({}, "no-copy"),
        "no-trace": ({"trace": False}, None),
    }
    rows = {}
    with torch.no_grad():
        for _ in range(2):
            provider.run(model, batch)
        bc.sync(device)
        step_s(provider, model, batch, device, work, with_stack=stack)  # one-time costs
        for _ in range(REPEATS):
            for label, hooks in (("plain", False), ("floor", True)):
                d = Path(tempfile.mkdtemp(dir=work))
                _, phases = bc.plain_profiled_step(provider, model, batch, device, d, hooks=hooks,
                                                   with_stack=stack)
                rows.setdefault(label, []).append(phases["step"])
            for label, (cfg, patch) in variants.items():
                recorder.HelperThread = (helper_thread.InlineHelper if patch == "inline"
                                         else real_helper)
                recorder.run_copies = (functools.partial(len) if patch == "no-copy"
                                       else real_copies)
                try:
                    t, calls = step_s(provider, model, batch, device, work, with_stack=stack,
                                      **cfg)
                finally:
                    recorder.HelperThread, recorder.run_copies = real_helper, real_copies
                rows.setdefault(label, []).append(t)
                if label == "capture":
                    events = trace_events(LAST_TRACE)
        lap_lines = laps(provider, model, batch, device, work)
        if os.environ.get("PROBE_CPROFILE"):
            print(hook_profile(provider, model, batch, device, work))
    rt = round_trip_us()
    floor = statistics.median(rows["floor"])
    print(f"{name}: {calls} calls; helper round trip {rt:.1f} us (no profiler); Python on an "
          f"unprofiled thread {other_thread_slowdown():.2f}x slower while another is profiled")
    print(f"{'variant':<10}{'step s':>9}{'- floor s':>11}{'us/call':>9}")
    for label, ts in rows.items():
        s = statistics.median(ts)
        print(f"{label:<10}{s:>9.3f}{s - floor:>11.3f}{(s - floor) / calls * 1e6:>9.0f}")
    print(f"a capture's trace (variant capture): {events}")
    print(lap_lines)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         ("dlrm-large" if torch.cuda.is_available() else "dlrm-large-cpu"))
