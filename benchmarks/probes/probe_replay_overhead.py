"""Where a whole-tree replay's wall goes, beside its timed work: laps, then cProfile.

Captures SPEC once, then replays it twice with the capture's model (no rebuild):
1. with laps: chosen functions of the replay (its steps, the graph timer's capture, warm-up
   and sampling, every CUDA synchronize) wrapped in wall-clock timers, reported as a tree of
   inclusive seconds (a lap inside another is shown under it), beside the timed device time
   (sum of ``timed_ms``: K calls per graph replay) and the phases of
   ``manifest.replay.timings_s``; per module class, the wall outside the timed work;
2. under cProfile (``--cprofile``): the functions with the most own and cumulative time.

``--variant NAME:KEY=VALUE[,KEY=VALUE]`` (repeatable) replays the same capture again with those
``ReplayConfig`` fields, with laps, and prints its wall and phases beside the first replay's, and
how far its isolated times moved from the first's (per call, the calls both timed ok).

Usage: python benchmarks/probes/probe_replay_overhead.py OUT_DIR [SPEC] [--cprofile] [--top N]
       [--variant NAME:KEY=VALUE[,...]] [--option KEY=INT]
"""
import argparse
import cProfile
import functools
import importlib
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fidelity_zoo import parse_variant  # noqa: E402 - one grammar for --variant

OPTIONS = {"nanogpt": {"batch_size": 8}, "dlrm": {"batch_size": 8192}}

# (module, attribute path) wrapped in a lap; a class attribute wraps the method
LAPS = [
    ("cbtrace.replay.measure.plan", "prepare"),
    ("cbtrace.replay.run_io.prefetch", "ReadAhead.take"),
    ("cbtrace.store.load", "load_call_inputs"),
    ("cbtrace.replay.measure.steps", "OpCount.run"),
    ("cbtrace.replay.measure.steps", "ProfilerPass.run"),
    ("cbtrace.replay.measure.steps", "Timed.run"),
    ("cbtrace.replay.measure.steps", "HostIssue.run"),
    ("cbtrace.replay.measure.steps", "OutputCheck.run"),
    ("cbtrace.replay.measure.steps", "in_step_cache_state"),
    ("cbtrace.replay.measure.context", "ContextSource.calls"),
    ("cbtrace.replay.measure.context", "ContextSource._inputs"),
    ("cbtrace.plugins.backends.graph", "side_stream_warmup"),
    ("cbtrace.plugins.backends.graph", "staged"),
    ("cbtrace.plugins.backends.graph", "capture"),
    ("cbtrace.plugins.backends.graph", "replay_ms"),
    ("cbtrace.plugins.backends.graph", "L2Flusher"),
    ("cbtrace.plugins.backends.graph", "warm_until_settled"),
    ("cbtrace.plugins.backends.graph", "collect"),
    ("cbtrace.plugins.backends.graph", "event_pairs"),
    ("cbtrace.plugins.backends.graph", "timing_from_samples"),
    ("torch.cuda", "CUDAGraph.capture_begin"),
    ("torch.cuda", "CUDAGraph.capture_end"),
    ("torch.cuda", "CUDAGraph.reset"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("torch.cuda", "synchronize"),
]


class Laps:
    """Inclusive wall time and count of each wrapped function, keyed by the stack of wrapped
    functions it ran inside."""

    def __init__(self):
        self.total, self.count = defaultdict(float), defaultdict(int)
        self.stack: list[str] = []
        self._undo: list = []

    def wrap(self, module: str, path: str) -> None:
        owner = importlib.import_module(module)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        original = getattr(owner, attr)
        label = path

        @functools.wraps(original)
        def lapped(*a, **kw):
            self.stack.append(label)
            key = " > ".join(self.stack)
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.total[key] += time.perf_counter() - t0
                self.count[key] += 1
                self.stack.pop()

        setattr(owner, attr, lapped)
        self._undo.append((owner, attr, original))

    def undo(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()

    def lines(self, min_s: float = 0.005) -> list[str]:
        out = []
        for key in sorted(self.total):
            if self.total[key] < min_s:
                continue
            depth = key.count(" > ")
            name = key.rsplit(" > ", 1)[-1]
            out.append(f"{'  ' * depth}{name:<{40 - 2 * depth}} {self.count[key]:>7} "
                       f"{self.total[key]:8.3f} s")
        return out


def by_class(df, wall_s: float) -> str:
    d = df.assign(over_ms=df["replay_wall_s"] * 1e3 - df["timed_ms"].fillna(0))
    g = d.groupby("module_type").agg(calls=("over_ms", "size"), runs=("runs", "mean"),
                                     timed_s=("timed_ms", lambda s: s.sum() / 1e3),
                                     other_s=("over_ms", lambda s: s.sum() / 1e3))
    g["other_ms_per_call"] = 1e3 * g["other_s"] / g["calls"]
    return g.sort_values("other_s", ascending=False).round(3).to_string()


def moved(a, b) -> str:
    """How far the isolated times of replay ``b`` sit from replay ``a``'s, per call timed ok in
    both (|change| median, p90, max), and the runs each took per call (mean)."""
    both = a[["call_id", "status", "isolated_ms", "runs"]].merge(
        b[["call_id", "status", "isolated_ms", "runs"]], on="call_id", suffixes=("_a", "_b"))
    ok = both[(both.status_a == "ok") & (both.status_b == "ok")]
    change = (100 * (ok.isolated_ms_b / ok.isolated_ms_a - 1)).abs()
    return (f"isolated time against the first replay, {len(ok)} calls: |change| median "
            f"{change.median():.2f} %, p90 {change.quantile(0.9):.2f} %, max {change.max():.1f} %; "
            f"runs per call {ok.runs_a.mean():.1f} -> {ok.runs_b.mean():.1f}")


def device_costs() -> str:
    """Device time of what the graph timer queues around each replay: the L2 flush (memset of
    256 and 128 MB) and the shortest spin, each the median of 50 between events."""
    from cbtrace.plugins.backends.l2 import L2Flusher, spin
    from cbtrace.replay.timer.stats import percentile

    dev = torch.device("cuda")
    rows = []
    for label, fn in [("flush 256 MB", L2Flusher(dev, 256 * 2**20).flush),
                      ("flush 128 MB", L2Flusher(dev, 128 * 2**20).flush),
                      ("spin 0.05 ms", lambda: spin(dev, 0.05)),
                      ("empty", lambda: None)]:
        ms = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        rows.append(f"{label:<14} {1e3 * percentile(ms, 50):8.1f} us")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("spec", nargs="?", default="nanogpt")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,...]")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=INT",
                    help="a provider option, e.g. batch_size=32 (dlrm:large on a CPU)")
    a = ap.parse_args()
    options = dict(OPTIONS.get(a.spec, {}))
    for kv in a.option:
        key, _, value = kv.partition("=")
        if not key or not value.isdigit():
            ap.error(f"--option {kv!r}: want KEY=INT")
        options[key] = int(value)
    try:
        variants = [parse_variant(v) for v in a.variant]
    except ValueError as e:
        ap.error(f"--variant: {e}")
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.engine import replay
    from cbtrace.rundir.read import read_manifest

    gpu = torch.cuda.is_available()
    run = Path(a.out_dir) / f"overhead-{a.spec.replace(':', '-')}"
    cap = capture_model(a.spec, run, device="cuda" if gpu else "cpu",
                        dtype="bf16" if gpu else None, options=options)
    laps = Laps()
    for module, path in LAPS:
        laps.wrap(module, path)
    t0 = time.perf_counter()
    df = replay(run, model=cap.model, progress=False)
    wall = time.perf_counter() - t0
    laps.undo()
    timed = df["timed_ms"].fillna(0).sum() / 1e3
    print(f"== {a.spec}: {len(df)} calls, replay wall {wall:.2f} s, timed work {timed:.3f} s "
          f"(duty {100 * timed / wall:.1f} %), with laps")
    m = read_manifest(run).replay
    print(f"phases (s): {m.timings_s}\noutside (s): {m.outside_s}")
    print(f"\n-- laps (inclusive; nested under the lap they ran in)\n{'':40} {'count':>7} "
          f"{'wall':>10}")
    print("\n".join(laps.lines()))
    print(f"\n-- per module class: replay_wall_s less timed work\n{by_class(df, wall)}")
    if gpu:
        print(f"\n-- device time of the timer's own work per replay\n{device_costs()}")
    for name, overrides in variants:
        again = Laps()
        for module, path in LAPS:
            again.wrap(module, path)
        t0 = time.perf_counter()
        dv = replay(run, model=cap.model, progress=False, **overrides)
        wall_v = time.perf_counter() - t0
        again.undo()
        timed_v = dv["timed_ms"].fillna(0).sum() / 1e3
        print(f"\n== variant {name} ({overrides}): replay wall {wall_v:.2f} s (first replay "
              f"{wall:.2f} s), timed work {timed_v:.3f} s (duty {100 * timed_v / wall_v:.1f} %)")
        print(f"phases (s): {read_manifest(run).replay.timings_s}")
        print(f"{moved(df, dv)}\n-- laps\n" + "\n".join(again.lines()))
    if not a.cprofile:
        return
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    df = replay(run, model=cap.model, progress=False)
    prof.disable()
    print(f"\n== under cProfile: replay wall {time.perf_counter() - t0:.2f} s")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print(f"\n-- by {key}")
        print("\n".join(ln[:150] for ln in lines[start:]))


if __name__ == "__main__":
    main()
