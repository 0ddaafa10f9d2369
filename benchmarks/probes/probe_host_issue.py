"""Why the replay's host issue time of a whole model differs from the host's pace in a loop.

Builds a CNN (timm or torchvision, bf16, batch 64 of 224 x 224) and, under no_grad, measures
the host time to issue one forward: (a) ``HostIssue``'s way (5 calls back to back after a
sync, median per-call perf_counter), (b) a steady loop (K calls back to back after warm-up,
wall / K, the device then paces the host once the queue fills), and the device time of one
call between events; first in a fresh state, then after a torch.profiler session with CUDA
activities, then after a cbtrace replay of a capture of it (with ``host_ms`` of its root).

Usage: python benchmarks/probes/probe_host_issue.py [--model efficientnet_b0]
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_opportunity import cnn  # noqa: E402 - one definition of the benchmark's CNNs


def figures(model, x, k: int = 20) -> dict:
    with torch.no_grad():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        per = []
        for _ in range(5):
            t0 = time.perf_counter()
            model(x)
            per.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            model(x)
        loop_issue = (time.perf_counter() - t0) * 1e3 / k
        torch.cuda.synchronize()
        loop_wall = (time.perf_counter() - t0) * 1e3 / k
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        time.sleep(0.05)
        s.record()
        model(x)
        e.record()
        e.synchronize()
    return {"host 5 after sync (median)": statistics.median(per), "loop issue / call":
            loop_issue, "loop wall / call": loop_wall, "one call between events": s.elapsed_time(e)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="efficientnet_b0")
    a = ap.parse_args()
    import cbtrace

    model = cnn(a.model).cuda().to(torch.bfloat16).eval()
    x = torch.randn(64, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    rows = {"fresh": figures(model, x)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        with torch.no_grad():
            model(x)
    torch.cuda.synchronize()
    rows["after torch.profiler"] = figures(model, x)
    run = Path(tempfile.mkdtemp()) / "run"
    with torch.no_grad():
        with cbtrace.capture(model, run, trace=False, max_depth=1):
            model(x)
    df = cbtrace.replay(run, model=model, device="cuda", budget_s=0.03)
    root = df[df["parent_call_id"] < 0].iloc[0]
    rows["after cbtrace replay"] = figures(model, x)
    print(f"{a.model} bf16 b64, ms; replay root: host_ms {root['host_ms']:.3f}, isolated_ms "
          f"{root['isolated_ms']:.3f}, timer {root['timer']}")
    print(f"{'':30}" + "".join(f"{c:>22}" for c in rows))
    for key in rows["fresh"]:
        print(f"{key:30}" + "".join(f"{rows[c][key]:22.3f}" for c in rows))


if __name__ == "__main__":
    main()
