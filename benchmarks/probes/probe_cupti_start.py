"""What the first CUDA profiler start in a process costs, and whether it can be paid early or aside.

A fresh ``cbtrace replay`` pays the first ``torch.profiler`` start with CUDA activities (CUPTI's
set-up, seconds) in its first profiled call. Each variant runs in a fresh process:

- ``late``: CUDA up, a model built and run (its kernels loaded), then the first profiler start;
- ``early``: the first profiler start right after CUDA is up, then the model, then a second start;
- ``thread``: the first start on a thread while the main thread builds and runs the model; the
  main thread's work is timed against ``late``'s same work (the GIL or the driver shared).

Usage: python benchmarks/probes/probe_cupti_start.py [--repeats 2]
"""
import argparse
import json
import statistics
import subprocess
import sys
import threading
import time


def profiler_start_s() -> float:
    """Seconds for one profiler session with CUDA activities around one small op."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(64, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        (x * 2).sum()
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def model_work_s() -> float:
    """Build a small transformer and CNN and run them (loads cuBLAS, cuDNN and many kernels)."""
    import torch
    from torch import nn

    t0 = time.perf_counter()
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 6)
    cnn = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU(),
                        nn.Conv2d(64, 128, 3, 2, 1), nn.BatchNorm2d(128), nn.SiLU(),
                        nn.AdaptiveAvgPool2d(1))
    enc, cnn = enc.cuda().eval(), cnn.cuda().eval()
    with torch.no_grad():
        for _ in range(3):
            enc(torch.randn(8, 256, 512, device="cuda"))
            cnn(torch.randn(16, 3, 224, 224, device="cuda"))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def variant(name: str) -> dict:
    import torch

    torch.cuda.init()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    if name == "late":
        work = model_work_s()
        return {"main work s": work, "first start s": profiler_start_s(),
                "second start s": profiler_start_s()}
    if name == "early":
        first = profiler_start_s()
        return {"first start s": first, "main work s": model_work_s(),
                "second start s": profiler_start_s()}
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("s", profiler_start_s()))
    t0 = time.perf_counter()
    t.start()
    work = model_work_s()
    t.join()
    return {"first start s": done["s"], "main work s": work,
            "both done s": time.perf_counter() - t0, "second start s": profiler_start_s()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(variant(a.variant)))
        return
    rows = {}
    for _ in range(a.repeats):
        for name in ("late", "early", "thread"):
            p = subprocess.run([sys.executable, __file__, "--variant", name],
                               capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"{name} failed:\n{p.stderr[-1500:]}")
            for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items():
                rows.setdefault(name, {}).setdefault(k, []).append(v)
    keys = ["first start s", "main work s", "both done s", "second start s"]
    print(f"median of {a.repeats} fresh processes per variant")
    print(f"{'variant':8}" + "".join(f"{k:>16}" for k in keys))
    for name, r in rows.items():
        print(f"{name:8}" + "".join(f"{statistics.median(r[k]):16.3f}" if k in r else f"{'':>16}"
                                    for k in keys))


if __name__ == "__main__":
    main()
