"""Summed device time against device-busy time, per module row, on real traces.

A call whose kernels overlap on several streams (a collective beside compute, cuDNN's grouped
convolutions, a copy beside a kernel) has summed durations (``gpu_ms``) above the time the
device was busy with them (``gpu_busy_ms``, the union of their intervals). The in-situ figure
replay is compared with is the busy time; this prints, per trace, how many rows differ and by
how much, and the attribution's wall time (best of ``--repeat``).

    .venv/bin/python benchmarks/bench_busy_time.py [TRACE ...]

Traces: the arguments, else every Kineto trace in ../shared/traces.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "traces"


def traces(args: list[str]) -> list[Path]:
    if args:
        return [Path(a) for a in args]
    return sorted(p for p in SHARED.rglob("*") if p.name.endswith((".json", ".json.gz")))


def label(p: Path) -> str:
    """The trace's path below ../shared/traces (else its name), its last 56 characters."""
    try:
        name = str(p.resolve().relative_to(SHARED.resolve()))
    except ValueError:
        name = p.name
    return name if len(name) <= 56 else "..." + name[-53:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--repeat", type=int, default=1, help="attributions per trace (best kept)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from cbtrace.attribution.attribute import attribute
    from cbtrace.errors import CbtraceError

    print("| trace | rows | rows busy < sum | largest sum / busy - 1 | in row | attribute s |")
    print("|---|---:|---:|---:|---|---:|")
    done = 0
    for p in traces(a.traces):
        best, df = float("inf"), None
        try:
            for _ in range(a.repeat):
                t = time.perf_counter()
                df = attribute(p, aggregate=False)
                best = min(best, time.perf_counter() - t)
        except CbtraceError as e:
            why = str(e).splitlines()[0].split(": ", 1)[-1]
            print(f"| {label(p)} | refused: {why[:60]} | | | | |")
            continue
        done += 1
        dev = df[df.gpu_busy_ms > 0]
        gap = dev.gpu_ms / dev.gpu_busy_ms - 1
        over = dev[gap > 1e-6]
        where = "" if over.empty else (
            f"{dev.loc[gap.idxmax(), 'fqn'][:40]} ({dev.loc[gap.idxmax(), 'phase']})")
        worst = f"{100 * gap.max():.1f} %" if len(over) else "-"
        print(f"| {label(p)} | {len(df)} | {len(over)} | {worst} | {where} | {best:.2f} |")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
