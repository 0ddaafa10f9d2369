"""Input snapshot throughput: take() + flush() of ~200 MB of fp32 tensors vs raw disk writes.

Run: .venv/bin/python benchmarks/probes/bench_snapshot.py [--device cuda] [--mb 200]
Prints one JSON line. The disk figure writes the same bytes to a temp file with fsync
(dd-style), in the same directory, so both numbers share the file system.
"""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from cbtrace.store.load import load_call_inputs
from cbtrace.store.snapshot import Snapshotter

TENSOR_MB = 8  # size of each captured tensor (a typical activation)
REPEATS = 5    # best of


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def disk_write_mb_s(directory: Path, nbytes: int) -> float:
    block = os.urandom(1 << 20) * 8  # 8 MiB blocks of incompressible data
    path = directory / "dd.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return nbytes / dt / 1e6


def snapshot_mb_s(directory: Path, tensors, device) -> dict:
    out = Path(tempfile.mkdtemp(dir=directory))
    _sync(device)
    t0 = time.perf_counter()
    snap = Snapshotter(out / "inputs")
    refs = [snap.take((t,), {}) for t in tensors]
    _sync(device)
    t1 = time.perf_counter()
    snap.flush()
    t2 = time.perf_counter()
    (got,), _ = load_call_inputs(out, refs[-1])
    t3 = time.perf_counter()
    assert torch.equal(got.cpu(), tensors[-1].cpu())
    nbytes = sum(t.nbytes for t in tensors)
    for p in (out / "inputs").iterdir():
        p.unlink()
    return {"take_s": t1 - t0, "flush_s": t2 - t1, "mb_s": nbytes / (t2 - t0) / 1e6,
            "load_one_s": t3 - t2}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = ap.parse_args()
    n = a.mb // TENSOR_MB
    tensors = [torch.randn(TENSOR_MB << 18, device=a.device) for _ in range(n)]
    nbytes = sum(t.nbytes for t in tensors)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        d = Path(d)
        disk = max(disk_write_mb_s(d, nbytes) for _ in range(REPEATS))
        runs = [snapshot_mb_s(d, tensors, a.device) for _ in range(REPEATS)]
    best = max(runs, key=lambda r: r["mb_s"])
    print(json.dumps({"device": a.device, "mb": nbytes / 1e6, "disk_write_mb_s": round(disk, 1),
                      "snapshot_mb_s": round(best["mb_s"], 1),
                      "ratio": round(best["mb_s"] / disk, 3),
                      **{k: round(v, 4) for k, v in best.items() if k != "mb_s"}}))


if __name__ == "__main__":
    main()
