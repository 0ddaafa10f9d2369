"""Where a whole-tree replay's wall goes, function by function (cProfile), beside its timed work.

Captures SPEC once, then replays it with the capture's model (no rebuild) under cProfile and
prints the wall, the timed device time (sum of ``timed_ms``: K calls per graph replay), the
phases of ``manifest.replay.timings_s`` and the functions with the most own and cumulative time.

Usage: python benchmarks/probe_replay_overhead.py OUT_DIR [SPEC] [TOP]   (SPEC: nanogpt)
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

OPTIONS = {"nanogpt": {"batch_size": 8}, "dlrm": {"batch_size": 8192}}


def main(out_dir, spec="nanogpt", top=30):
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.engine import replay
    from cbtrace.rundir.read import read_manifest

    gpu = torch.cuda.is_available()
    run = Path(out_dir) / f"overhead-{spec.replace(':', '-')}"
    cap = capture_model(spec, run, device="cuda" if gpu else "cpu", dtype="bf16" if gpu else None,
                        options=OPTIONS.get(spec, {}))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    df = replay(run, model=cap.model, progress=False)
    prof.disable()
    wall = time.perf_counter() - t0
    timed = df["timed_ms"].fillna(0).sum() / 1e3
    print(f"== {spec}: {len(df)} calls, replay wall {wall:.2f} s, timed work {timed:.3f} s "
          f"(duty {100 * timed / wall:.1f} %)")
    print(f"phases (s): {read_manifest(run).replay.timings_s}")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(int(top))
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print(f"\n-- by {key}")
        print("\n".join(ln[:150] for ln in lines[start:]))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], *sys.argv[2:4])
