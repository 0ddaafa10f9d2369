"""Capture's per-call planning alone: ``capture._plan_call`` (walk the inputs, plan their
copies, make the record) on one small tensor per call, as capture's helper thread runs it.

Two sides in one run: no profiler anywhere, and another thread holding a profile function, as
the step's thread does under torch.profiler's ``with_stack``: under Python 3.12 that slows
Python on every thread (``probe_capture_step.py``), so the second side is what capture pays
on the helper. Prints µs per call (median of 5 rounds of 3,000 calls) and their ratio.

Run: python benchmarks/probes/bench_plan_call.py
"""
import statistics
import sys
import tempfile
import threading
import time

import torch

ROUNDS, CALLS = 5, 3000


def rounds(cap, mods) -> list[float]:
    out = []
    for _ in range(ROUNDS):
        inputs = [torch.randn(16, 64) for _ in range(CALLS)]  # fresh storages: no dedup hits
        t0 = time.perf_counter()
        for i, t in enumerate(inputs):
            cap._plan_call(mods[i % len(mods)], str(i % len(mods)), (t,), {}, True, None, None)
        out.append((time.perf_counter() - t0) / CALLS * 1e6)
    return out


def main() -> None:
    from cbtrace.capture import recorder

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    cap = recorder.capture(model, tempfile.mkdtemp() + "/run", trace=False)
    cap.__enter__()
    try:
        mods = list(model)
        plain = statistics.median(rounds(cap, mods))
        release = threading.Event()

        def profiled_thread():
            sys.setprofile(lambda *a: None)
            release.wait()

        other = threading.Thread(target=profiled_thread)
        other.start()
        time.sleep(0.1)
        try:
            profiled = statistics.median(rounds(cap, mods))
        finally:
            release.set()
            other.join()
    finally:
        cap.__exit__(None, None, None)
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")
    print(f"{'side':<34}{'us/call':>9}")
    print(f"{'no profiler':<34}{plain:>9.1f}")
    print(f"{'another thread profiled':<34}{profiled:>9.1f}")
    print(f"{'ratio':<34}{profiled / plain:>9.2f}")


if __name__ == "__main__":
    main()
