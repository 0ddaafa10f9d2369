"""Capture's input writes by shard size and writer count, against raw fsynced writes.

A capture writes its inputs after the step as Parquet shards of ``snapshot.SHARD_BYTES``,
``snapshot.WRITERS`` at a time, each fsynced. This runs the same captured step (a case of
bench_capture.py) under several (shard MB x writers) settings, interleaved repeat by repeat so
that a drifting disk hits every setting alike, and beside each repeat two raw writes of the
same bytes with fsync: one file (bench_capture.disk_bandwidth), and the same bytes cut into files
of the shipped shard size written by as many threads. Prints the median capture wall, its inputs_write phase (the shards alone) and the writer threads'
summed fsync seconds per setting, and the raw writes' bandwidth.

Run: python benchmarks/probes/bench_shard_writes.py [--case dlrm] [--configs 32x8,64x8,128x4]
     [--repeats 5]
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_capture, one level up
import bench_capture as bc  # noqa: E402
from cbtrace.store import snapshot  # noqa: E402

BLOCK = os.urandom(8 << 20)  # incompressible, as the raw writes' source


def raw_files_write(directory: Path, nbytes: int, files: int) -> float:
    """Seconds to write ``nbytes`` as ``files`` equal files, one thread each, each fsynced."""
    per = nbytes // files

    def one(i):
        with open(directory / f"raw{i}.bin", "wb") as f:
            left = per
            while left > 0:
                left -= f.write(BLOCK[:min(left, len(BLOCK))])
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(one, range(files)))
    dt = time.perf_counter() - t0
    for p in directory.glob("raw*.bin"):
        p.unlink()
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="dlrm", choices=sorted(bc.CASES))
    ap.add_argument("--configs", default="16x8,32x8,64x8,128x4,32x16")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")]
    shipped = snapshot.SHARD_BYTES  # the raw files' size (the settings below overwrite it)
    spec, device, dtype, options, with_stack = bc.case(a.case)
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.model.spec import resolve

    provider = resolve(spec, options=options)
    model, batch = provider.model_and_batch(device, torch_dtype(dtype) if dtype else None)
    model.eval()
    work = Path(os.environ.get("CBTRACE_BENCH_DIR", tempfile.gettempdir()))
    rows = {c: [] for c in configs}
    one_file, many_files, stored = [], [], 0
    with torch.no_grad():
        for _ in range(2):
            provider.run(model, batch)
        bc.sync(device)
        d = Path(tempfile.mkdtemp(dir=work))
        bc.captured_step(provider, model, batch, device, d, with_stack)  # one-time costs
        shutil.rmtree(d)
        for _ in range(a.repeats):
            for mb, writers in configs:
                snapshot.SHARD_BYTES, snapshot.WRITERS = mb << 20, writers
                d = Path(tempfile.mkdtemp(dir=work))
                wall, stored, t = bc.captured_step(provider, model, batch, device, d, with_stack)
                rows[(mb, writers)].append((wall, t["inputs_write"],
                                            t.get("inputs_fsync_thread_s", 0.0)))
                shutil.rmtree(d)
            d = Path(tempfile.mkdtemp(dir=work))
            one_file.append(stored / bc.disk_bandwidth(d, stored))
            many_files.append(raw_files_write(d, stored, max(1, round(stored / shipped))))
            shutil.rmtree(d)
    med = statistics.median
    print(f"case {a.case} ({device}): {stored / 1e6:.1f} MB of inputs; {a.repeats} repeats, "
          f"medians; raw fsynced writes of the same bytes: one file "
          f"{stored / med(one_file) / 1e6:.0f} MB/s, {max(1, round(stored / shipped))} files of "
          f"{shipped >> 20} MB at once {stored / med(many_files) / 1e6:.0f} MB/s")
    print(f"{'shard MB':>9}{'writers':>8}{'capture s':>11}{'inputs_write s':>16}"
          f"{'fsync thread-s':>16}{'MB/s':>8}")
    for (mb, writers), r in rows.items():
        wall, io, fs = (med(x) for x in zip(*r))
        print(f"{mb:>9}{writers:>8}{wall:>11.3f}{io:>16.3f}{fs:>16.3f}{stored / 1e6 / io:>8.0f}")


if __name__ == "__main__":
    main()
