"""The read-ahead's pinned ring: what its first allocation costs, by way of allocating, side by side.

A replay's first read-ahead allocates one pinned host buffer (``run_io.prefetch``; GPT-2-small's
240 MB took 0.23-0.30 s of a 2.7-3.8 s replay on the H200 hosts). This times, for each size, in
one process (fresh memory each time: torch's host cache emptied between):

- ``torch.empty(pin_memory=True)``: what the ring does now (cudaHostAlloc via torch's caching
  host allocator);
- ``numpy + cudaHostRegister``: pageable memory whose pages are touched first (a worker thread
  could do that part: no CUDA call), then registered; the two parts timed apart;
- the same, pages not touched first;
- torch's allocator with ``pinned_use_cuda_host_register:True,pinned_num_register_threads:8``
  (``PYTORCH_CUDA_ALLOC_CONF``, a process-wide setting: run in a subprocess).

Each way also times one 64 MB host-to-device copy out of the buffer (non_blocking, then a
synchronize), so a way that pins less well shows. Usage:

    python benchmarks/probes/bench_pinned_ring.py [MB ...]   (default: 64 128 256 512)
"""
import os
import subprocess
import sys
import time

COPY_MB = 64


def _copy_gbs(buf) -> float:
    import torch

    dst = torch.empty(COPY_MB << 20, dtype=torch.uint8, device="cuda")
    src = buf[:COPY_MB << 20]
    dst.copy_(src, non_blocking=True)  # the first copy pays its own setup
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return (COPY_MB << 20) / (time.perf_counter() - t) / 1e9


def _empty_host_cache() -> None:
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def torch_pinned(mb: int) -> dict:
    import torch

    _empty_host_cache()
    t = time.perf_counter()
    buf = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
    alloc = time.perf_counter() - t
    gbs = _copy_gbs(buf)
    del buf
    _empty_host_cache()
    return {"alloc_s": alloc, "copy_GB/s": gbs}


def registered(mb: int, touch: bool) -> dict:
    import numpy as np
    import torch

    t = time.perf_counter()
    arr = np.empty(mb << 20, dtype=np.uint8)
    if touch:
        arr[::4096] = 0  # one write a page: the pages exist before registering
    touched = time.perf_counter() - t
    t = time.perf_counter()
    err = int(torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, 0))
    reg = time.perf_counter() - t
    if err:
        return {"error": err}
    buf = torch.from_numpy(arr)
    out = {"touch_s": touched, "register_s": reg, "copy_GB/s": _copy_gbs(buf)}
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)
    out["unregister_s"] = time.perf_counter() - t
    return out


def main(argv) -> None:
    import torch

    sizes = [int(a) for a in argv if a.isdigit()] or [64, 128, 256, 512]
    if "--child" in argv:  # the allocator config's run: torch's pinned allocation only
        for mb in sizes:
            print(mb, torch_pinned(mb)["alloc_s"], flush=True)
        return
    torch.zeros(1, device="cuda")  # CUDA context first: not part of any figure
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="pinned_use_cuda_host_register:True,"
                                                  "pinned_num_register_threads:8")
    child = subprocess.run([sys.executable, __file__, "--child", *map(str, sizes)], env=env,
                           capture_output=True, text=True)
    by_conf = {int(line.split()[0]): float(line.split()[1])
               for line in child.stdout.splitlines() if line.strip()}
    print(f"{'MB':>5} {'torch pin s':>11} {'GB/s':>5} {'touch s':>8} {'register s':>10} "
          f"{'GB/s':>5} {'register, untouched s':>21} {'conf: host_register x8 s':>24}")
    for mb in sizes:
        a = torch_pinned(mb)
        b = registered(mb, touch=True)
        c = registered(mb, touch=False)
        conf = by_conf.get(mb, float("nan"))
        print(f"{mb:5d} {a['alloc_s']:11.3f} {a['copy_GB/s']:5.1f} {b.get('touch_s', 0):8.3f} "
              f"{b.get('register_s', float('nan')):10.3f} {b.get('copy_GB/s', float('nan')):5.1f} "
              f"{c.get('register_s', float('nan')):21.3f} {conf:24.3f}", flush=True)
    if child.returncode:
        print(f"allocator-config run failed: {child.stderr.strip().splitlines()[-1:]}")


if __name__ == "__main__":
    main(sys.argv[1:])
