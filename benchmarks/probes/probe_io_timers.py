"""Device probe (session 2): where capture's disk time goes, and do_bench vs in-graph timing.

Part 1 prints the write path's rates on this machine (page-cache writes, fsync, sha256, pinned
device-to-host, Parquet encoding). Part 2 times a few GPT-2 modules with do_bench (twice),
do_bench over a one-call CUDA graph, do_bench_cudagraph, and per-call CUDA events recorded
inside one graph with an L2-flushing memset before each call (cold) or not (warm).
Run: python benchmarks/probes/probe_io_timers.py [DIR]
"""
import hashlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


def rate(nbytes, dt):
    return f"{nbytes / dt / 1e9:6.2f} GB/s ({dt:.3f} s)"


def io_part(d: Path):
    for f in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        print(f, Path(f"/proc/sys/vm/{f}").read_text().strip())
    os.system(f"df -hT {d} | tail -1; cat /sys/fs/cgroup/memory.max 2>/dev/null")
    total, shard = 2304 << 20, 256 << 20
    buf = np.random.default_rng(0).integers(0, 255, shard, dtype=np.uint8)
    mv = memoryview(buf)

    def write(path, fsync):
        with open(path, "wb", buffering=0) as f:
            for lo in range(0, shard, 8 << 20):
                f.write(mv[lo:lo + (8 << 20)])
            if fsync:
                os.fsync(f.fileno())

    for threads in (1, 4, 8):
        for fsync in (False, True):
            paths = [d / f"p{i}.bin" for i in range(total // shard)]
            os.sync()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda p: write(p, fsync), paths))
            dt = time.perf_counter() - t0
            t1 = time.perf_counter()
            os.sync()
            print(f"write {threads} thr fsync={fsync}: {rate(total, dt)}; then sync "
                  f"{time.perf_counter() - t1:.3f} s")
            for p in paths:
                p.unlink()
    for threads in (1, 4, 8):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: hashlib.sha256(mv).hexdigest(), range(total // shard)))
        print(f"sha256 {threads} thr: {rate(total, time.perf_counter() - t0)}")
    import pyarrow as pa
    sys.path.insert(0, ".")
    from cbtrace.store import shards

    rows = [(i, 0, "d", buf[lo:lo + (64 << 20)]) for i, lo in enumerate(range(0, shard, 64 << 20))]
    t0 = time.perf_counter()
    sink = pa.BufferOutputStream()
    with ThreadPoolExecutor(2) as pool:
        shards._write_rows(sink, rows, pool)
    sink.getvalue()
    print(f"parquet encode to memory 1 thr: {rate(shard, time.perf_counter() - t0)}")
    t0 = time.perf_counter()
    shards.write_shard(d / "s.parquet", rows, {})
    print(f"write_shard (current, 1 shard): {rate(shard, time.perf_counter() - t0)}")
    (d / "s.parquet").unlink()
    if torch.cuda.is_available():
        x = torch.empty(total, dtype=torch.uint8, device="cuda")
        t0 = time.perf_counter()
        pinned = torch.empty(shard, dtype=torch.uint8, pin_memory=True)
        print(f"pin alloc 256 MB: {time.perf_counter() - t0:.3f} s")
        t0 = time.perf_counter()
        for lo in range(0, total, shard):
            pinned.copy_(x[lo:lo + shard], non_blocking=True)
            torch.cuda.synchronize()
        print(f"D2H pinned 256 MB blocks: {rate(total, time.perf_counter() - t0)}")
        t0 = time.perf_counter()
        host = np.empty(total, np.uint8)
        for lo in range(0, total, shard):
            pinned.copy_(x[lo:lo + shard], non_blocking=True)
            torch.cuda.synchronize()
            host[lo:lo + shard] = pinned.numpy()
        print(f"D2H pinned + memcpy out: {rate(total, time.perf_counter() - t0)}")


def graph_events(fn, k=20, flush=True, reps=10):
    """Per-call times from events recorded inside one graph of k calls (memset before each)."""
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True, external=True),
           torch.cuda.Event(enable_timing=True, external=True)) for _ in range(k)]
    from cbtrace.plugins.backends.graph import side_stream_warmup

    side_stream_warmup(lambda i: fn(), 1, 3)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for a, b in ev:
            if flush:
                buf.zero_()
            a.record()
            fn()
            b.record()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        g.replay()
        torch.cuda.synchronize()
        out += [a.elapsed_time(b) for a, b in ev]
    return float(np.median(out))


def timer_part():
    import triton.testing as tt
    sys.path.insert(0, ".")
    from cbtrace.plugins.providers.nanogpt import Block, GPTConfig
    from cbtrace.plugins.backends.graph import GraphTimer
    from cbtrace.replay.timer.contract import TimingConfig

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    c = GPTConfig()
    x = torch.randn(8, 1024, 768, device=dev, dtype=dt)
    h = torch.randn(8, 1024, 3072, device=dev, dtype=dt)
    cases = {
        "ln": (torch.nn.LayerNorm(768), (x,)),
        "c_attn": (torch.nn.Linear(768, 2304), (x,)),
        "c_fc": (torch.nn.Linear(768, 3072), (x,)),
        "gelu": (torch.nn.GELU(approximate="tanh"), (h,)),
        "c_proj": (torch.nn.Linear(3072, 768), (h,)),
        "block": (Block(c), (x,)),
        "lm_head": (torch.nn.Linear(768, 50304, bias=False), (x,)),
    }
    print(f"{'case':<8}{'db1':>8}{'db2':>8}{'db_g1':>8}{'db_cg':>8}{'cb_K':>8}{'ev_cold':>8}"
          f"{'ev_warm':>8}  (ms; db_g1 = do_bench over a one-call graph)")
    with torch.no_grad():
        for name, (m, args) in cases.items():
            m = m.to(dev, dt).eval()
            fn = lambda: m(*args)
            db1 = tt.do_bench(fn, return_mode="median")
            db2 = tt.do_bench(fn, return_mode="median")
            g = torch.cuda.CUDAGraph()
            fn(); torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fn()
            dbg = tt.do_bench(g.replay, return_mode="median")
            dbc = tt.do_bench_cudagraph(fn, return_mode="median")
            cb = GraphTimer().measure(lambda i: fn(), 1, torch.device(dev), TimingConfig()).median_ms
            try:
                cold = graph_events(fn, flush=True)
                warm = graph_events(fn, flush=False)
            except Exception as e:
                print("in-graph events failed:", repr(e)[:200])
                cold = warm = float("nan")
            print(f"{name:<8}{db1:8.4f}{db2:8.4f}{dbg:8.4f}{dbc:8.4f}{cb:8.4f}{cold:8.4f}{warm:8.4f}")


if __name__ == "__main__":
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe")
    d.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        timer_part()
    io_part(d)
