"""Capture overhead: a captured step vs a plain profiled step, against disk write bandwidth.

Goal (issues 2 and 15): capture <= 1.5 x (plain profiled step + captured bytes / disk bandwidth).
All sides export a gzipped Kineto trace; the capture side also copies, serializes and writes
the inputs, modules.parquet and the manifest. A third side, the *floor*, is the plain step with
the two hooks per module a capture needs, doing nothing but open and close its ranges: what any
hook-based capture costs before it copies, records or writes anything (``floor/b``). ``writes``
re-writes the capture's files atomically with no fsync, hashing or input encoding, a lower bound
of writing any run; ``(f+w)/b`` = (floor + writes) / bound.

Run: python benchmarks/bench_capture.py [CASE ...]   (default: nanogpt-tiny-cpu, and on a GPU
nanogpt dlrm dlrm-large and the zoo's GPU models; CASES lists the names)
"""
import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

ZOO = str(Path(__file__).resolve().parent / "zoo.py")
REAL = {"size": "real"}
CASES = {  # name: (spec, device, dtype, provider options)
    "nanogpt-tiny-cpu": ("nanogpt:tiny", "cpu", None, {}),
    "nanogpt": ("nanogpt", "cuda", "bf16", {}),
    "dlrm": ("dlrm", "cuda", "bf16", {}),
    "dlrm-large": ("dlrm:large", "cuda", "bf16", {}),
    "llama-0.5b": (f"{ZOO}:hf_llama", "cuda", "bf16", REAL),
    "bert-base": (f"{ZOO}:hf_bert", "cuda", "bf16", REAL),
    "vit-b16": (f"{ZOO}:timm_vit_b16", "cuda", "bf16", REAL),
    "resnet50": (f"{ZOO}:tv_resnet50", "cuda", "bf16", REAL),
}
GPU_DEFAULT = ["nanogpt", "dlrm", "dlrm-large", "llama-0.5b", "bert-base", "vit-b16", "resnet50"]
REPEATS = int(os.environ.get("CBTRACE_BENCH_REPEATS", 5))  # the median of this many of each
DISK_PROBE_MB = 512  # bytes written (with fsync) to measure disk bandwidth


def disk_bandwidth(dirname) -> float:
    """bytes/s of a large sequential write with fsync, in the directory the runs go to."""
    data = os.urandom(1 << 20)
    path = Path(dirname) / "probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(DISK_PROBE_MB):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return DISK_PROBE_MB * (1 << 20) / dt


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_profiled_step(provider, model, batch, device, out_dir, hooks=False) -> float:
    """A profiled step and its gzipped trace export; ``hooks``: every module also gets the
    pre/post hooks a capture needs, doing nothing but open and close its two ranges
    (the floor of what any capture adds to the step, before copying or writing anything)."""
    from cbtrace.capture.recorder import RANGE_ENTER, RANGE_EXIT, TRACE_GZIP_LEVEL, profiler_activities

    stack, handles = [], []

    def pre(mod, args, kwargs):  # capture's two ranges: the (empty) copy range, then the call
        RANGE_EXIT(RANGE_ENTER("cbtrace.copy::", None))
        stack.append(RANGE_ENTER("cbtrace::", None))

    def post(mod, args, kwargs, out):
        RANGE_EXIT(stack.pop())

    sync(device)
    t0 = time.perf_counter()
    for mod in model.modules() if hooks else ():
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
    with torch.profiler.profile(activities=profiler_activities(), record_shapes=True, with_stack=True) as p:
        provider.run(model, batch)
        sync(device)
    for h in handles:
        h.remove()
    raw = Path(out_dir) / "plain.json"
    p.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, \
            gzip.open(str(raw) + ".gz", "wb", compresslevel=TRACE_GZIP_LEVEL) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return time.perf_counter() - t0


def captured_step(provider, model, batch, device, out_dir) -> tuple[float, int, dict]:
    import json

    import cbtrace

    run = Path(out_dir) / "run"
    sync(device)
    t0 = time.perf_counter()
    with cbtrace.capture(model, run):
        provider.run(model, batch)
        sync(device)
    dt = time.perf_counter() - t0
    stored = sum(p.stat().st_size for p in (run / "inputs").glob("*.parquet"))
    timings = json.loads((run / "manifest.json").read_text())["capture_timings_s"]
    return dt, stored, timings


def minimal_writes(run: Path, out_dir) -> float:
    """Seconds to write a capture's three kinds of files again, atomically (temp file, rename)
    but with no fsync, hashing or encoding of the inputs: the modules table from its Arrow
    table, the input shards' bytes as they are, the manifest's text. A lower bound of what
    writing any such run costs on this disk."""
    import pyarrow.parquet as pq

    table = pq.read_table(run / "modules.parquet")
    blobs = [p.read_bytes() for p in sorted((run / "inputs").glob("*.parquet"))]
    blobs.append((run / "manifest.json").read_bytes())
    out = Path(tempfile.mkdtemp(dir=out_dir))
    t0 = time.perf_counter()
    pq.write_table(table, out / "m.tmp")
    os.replace(out / "m.tmp", out / "modules.parquet")
    for i, blob in enumerate(blobs):
        (out / f"{i}.tmp").write_bytes(blob)
        os.replace(out / f"{i}.tmp", out / f"{i}.bin")
    return time.perf_counter() - t0


def bench(spec, device, dtype, options, work):
    from cbtrace.capture.from_spec import warm_up
    from cbtrace.cost.dtypes import torch_dtype
    from cbtrace.model.spec import resolve

    provider = resolve(spec, options=options)
    model, batch = provider.model_and_batch(device, torch_dtype(dtype) if dtype else None)
    model.eval()
    with torch.no_grad():
        warm_up(provider, model, batch, "forward", 2)
        plain, floor, writes, cap, stored = [], [], [], [], 0
        for i in range(REPEATS):
            d = Path(tempfile.mkdtemp(dir=work))
            plain.append(plain_profiled_step(provider, model, batch, device, d))
            floor.append(plain_profiled_step(provider, model, batch, device, d, hooks=True))
            t, stored, timings = captured_step(provider, model, batch, device, d)
            cap.append((t, timings))
            writes.append(minimal_writes(d / "run", d))
            shutil.rmtree(d)
    cap.sort(key=lambda x: x[0])
    mid = REPEATS // 2
    return sorted(plain)[mid], sorted(floor)[mid], sorted(writes)[mid], cap[mid], stored


def main(names):
    work = Path(os.environ.get("CBTRACE_BENCH_DIR", tempfile.gettempdir()))
    bw = disk_bandwidth(work)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {name}; disk write bandwidth {bw / 1e6:.0f} MB/s (fsync, {DISK_PROBE_MB} MB)")
    print(f"{'model':<17}{'dev':<6}{'plain s':>9}{'floor s':>9}{'writes s':>9}{'capture s':>11}"
          f"{'stored MB':>11}{'MB/s':>8}{'bound s':>9}{'floor/b':>8}{'(f+w)/b':>8}{'ratio':>7}"
          "  goal<=1.5")
    breakdown = []
    names = names or ["nanogpt-tiny-cpu"] + (GPU_DEFAULT if torch.cuda.is_available() else [])
    for name in names:
        spec, device, dtype, options = CASES[name]
        try:
            plain, floor, writes, (cap, timings), stored = bench(spec, device, dtype, options, work)
        except Exception as e:  # noqa: BLE001 - one model failing must not hide the others
            print(f"{name:<17}FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        spec = name
        bound = plain + stored / bw
        print(f"{spec:<17}{device:<6}{plain:>9.3f}{floor:>9.3f}{writes:>9.3f}{cap:>11.3f}"
              f"{stored / 1e6:>11.1f}{stored / 1e6 / cap:>8.0f}{bound:>9.3f}{floor / bound:>8.2f}"
              f"{(floor + writes) / bound:>8.2f}{cap / bound:>7.2f}")
        breakdown.append((spec, timings))
    for spec, timings in breakdown:  # where the median capture's time went (s)
        print(f"  {spec}: " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items()))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
