"""A plain ``cbtrace replay`` in a fresh process beside the same replay inside ``cbtrace profile``.

Per repeat: ``cbtrace capture`` then ``cbtrace replay`` of that run (each its own process), and
``cbtrace profile`` (capture and replay in one process, which has paid every first-use cost in
its capture). Prints the median over repeats of each replay phase (``manifest.replay``:
``timings_s``, the per-call loop's steps, and ``outside_s``, the rest of its wall), the replay
wall, its duty cycle (timed work, sum of ``timed_ms``, over the wall) and the replay process's
CPU seconds and whole run time (torch import included).

Usage: python benchmarks/bench_replay_fresh.py --model nanogpt:tiny --device cpu [--repeats 3]
       [--dtype bf16] [-o KEY=VALUE ...] [--out DIR]
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPEATS = 3
CBTRACE = [sys.executable, "-m", "cbtrace"]


def run(args: list[str]) -> tuple[float, float]:
    """Run a cbtrace command; (wall s, CPU s of the process and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(CBTRACE + args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
    for line in p.stderr.splitlines():  # anything but progress is worth seeing
        if not line.startswith("cbtrace:"):
            print(f"  stderr of {args[0]}: {line[:200]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def replay_figures(run_dir: Path) -> dict:
    """The replay's phases, wall and duty cycle from the run directory."""
    import pandas as pd

    r = json.loads((run_dir / "manifest.json").read_text())["replay"]
    timed_s = pd.read_parquet(run_dir / "modules.parquet")["timed_ms"].fillna(0).sum() / 1e3
    out = {f"loop.{k}": v for k, v in r["timings_s"].items()}
    out.update({f"outside.{k}": v for k, v in r["outside_s"].items()})
    out.update({"replay wall_s": r["wall_s"], "timed_s": timed_s, "duty": timed_s / r["wall_s"]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="nanogpt:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", help="the capture's dtype (default: the CLI's)")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("-o", "--option", action="append", default=[], help="provider option")
    ap.add_argument("--out", help="where the runs go (default: a temporary directory)")
    a = ap.parse_args()
    opts = [x for o in a.option for x in ("-o", o)]
    common = ["--model", a.model, "--device", a.device, *opts,
              *(["--dtype", a.dtype] if a.dtype else [])]
    root = Path(a.out or tempfile.mkdtemp(prefix="bench_replay_fresh_"))
    fresh, inside = [], []
    for i in range(a.repeats):
        cap, prof = root / f"capture_{i}", root / f"profile_{i}"
        run(["capture", *common, "--out", str(cap)])
        wall, cpu = run(["replay", str(cap), "--device", a.device])
        fresh.append({**replay_figures(cap), "process wall_s": wall, "process cpu_s": cpu})
        wall, cpu = run(["profile", *common, "--out", str(prof)])
        inside.append({**replay_figures(prof), "process wall_s": wall, "process cpu_s": cpu})
        print(f"repeat {i + 1}/{a.repeats}: fresh replay {fresh[-1]['replay wall_s']:.2f} s, "
              f"inside profile {inside[-1]['replay wall_s']:.2f} s", flush=True)
        # after every repeat, so a call cut short by its time limit still leaves the phases
        table(fresh, inside, f"{a.model} on {a.device}, median of {i + 1} (runs in {root})")


def table(fresh: list[dict], inside: list[dict], title: str) -> None:
    keys = sorted({k for r in fresh + inside for k in r},
                  key=lambda k: (not k.startswith("loop."), not k.startswith("outside."), k))
    print(f"\n{title}; process rows: the whole command (profile: capture too)")
    print(f"{'':28} {'cbtrace replay':>15} {'inside profile':>15}")
    for k in keys:
        f = statistics.median(r.get(k, 0.0) for r in fresh)
        p = statistics.median(r.get(k, 0.0) for r in inside)
        print(f"{k:28} {f:15.3f} {p:15.3f}", flush=True)


if __name__ == "__main__":
    main()
