"""Device probe: where a host-paced root's back-to-back window goes (benchmarks/RESULTS.md,
session 32: transformers Llama's train root read 52.5 ms isolated, host 50.5 ms, against 24.5 ms
a forward as the user runs it; BERT-base's capture-time repeat of the step read 14.1 ms a
forward where the same loop reads about 7 ms later in the process).

Captures SPEC (bf16, the root and its children: ``--max-depth 1``), then:
  capture's step   the root's ``insitu_step_ms`` (the in-situ figure it is compared with), and
                   the same loop (``device.steps_ms``) again at once, with Python's collections
                   counted (gc callbacks) and the host time of each step
  plain windows    the forward as the user calls it, 5 back to back between CUDA events: the
                   window a call, each call's host time, the allocator's retries and
                   cudaMalloc/cudaFree counts over the window
  replay windows   the same, of the stream timer's windows in a replay of the run (its
                   ``window_sampler``, instrumented), for the root and each host-paced child
One line each. Run: python benchmarks/probes/probe_root_window.py OUT_DIR --spec SPEC
[--step train] [--size real]
"""
import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from cbtrace.capture.from_spec import capture_model
from cbtrace.device import steps_ms
from cbtrace.model.spec import resolve
from cbtrace.plugins.backends import stream
from cbtrace.replay import engine
from cbtrace.rundir.read import load_run

ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


class Collections:
    """Python's garbage collections while on: (generation, ms) each."""

    def __init__(self):
        self.done, self._t0 = [], 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.done.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)

    def summary(self) -> str:
        by = {}
        for g, ms in self.done:
            by.setdefault(g, []).append(ms)
        done = [f"gen{g} x{len(v)} {sum(v):.1f} ms" for g, v in sorted(by.items())]
        return ", ".join(done) or "none"


def alloc_counts() -> dict:
    s = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: s.get(k, 0) for k in ALLOC_KEYS}


def window(calls, k: int = 5) -> str:
    """k calls back to back between events after a sync: the window a call, each call's host
    ms, the allocator's counts over it, collections during it."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    before = alloc_counts()
    hosts = []
    with Collections() as gcs:
        t_start = time.perf_counter()
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        for j in range(k):
            t0 = time.perf_counter()
            calls(j)
            hosts.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
        wall = (start.elapsed_time(end) if cuda else (time.perf_counter() - t_start) * 1e3)
    after = alloc_counts()
    delta = {k2.replace("num_", ""): after[k2] - before[k2] for k2 in before}
    return (f"window {wall / k:7.3f} ms a call; host a call "
            f"{' '.join(f'{h:.1f}' for h in hosts)}; {delta}; gc {gcs.summary()}")


def main(out, spec, size, step, device):
    cap = capture_model(spec, Path(out) / "root", device=device, dtype="bf16",
                        options={"size": size}, step=step, max_depth=1)
    _, df = load_run(cap.out)
    root = df[df["parent_call_id"] == -1].iloc[0]
    print(f"capture's step (insitu_step_ms)   {root.get('insitu_step_ms'):7.3f} ms a forward",
          flush=True)
    provider = resolve(spec, seed=0, options={"size": size})
    _, batch = provider.model_and_batch(torch.device(device), torch.bfloat16)
    model = cap.model
    model.train(step == "train")
    user = lambda j=0: provider.run(model, batch)  # noqa: E731
    for label in ("steps_ms again", "and again"):
        with Collections() as gcs:
            ms = steps_ms(user, device, k=5, repeats=3, warmup=1)
        print(f"{label:<33} {ms:7.3f} ms a forward; gc {gcs.summary()}", flush=True)
    for i in range(3):
        print(f"plain {i}: {window(user)}", flush=True)

    real = stream.window_sampler

    def instrumented(run, k, n_copies, **kw):
        def timed_run(j):
            t0 = time.perf_counter()
            run(j)
            timed_run.hosts.append((time.perf_counter() - t0) * 1e3)
        timed_run.hosts = []
        sample = real(timed_run, k, n_copies, **kw)

        def logged(first, n):
            before, timed_run.hosts[:] = alloc_counts(), []
            with Collections() as gcs:
                got = sample(first, n)
            after = alloc_counts()
            delta = {x.replace("num_", ""): after[x] - before[x] for x in before}
            hosts = timed_run.hosts
            print(f"  replay window(s) x{n}, K={k}: {' '.join(f'{g:.2f}' for g in got)} ms a "
                  f"call; host a call median {statistics.median(hosts):.2f} (max "
                  f"{max(hosts):.2f}); {delta}; gc {gcs.summary()}", flush=True)
            return got
        return logged

    stream.window_sampler = instrumented
    try:
        rows = engine.replay(cap.out, model=model, progress=False)
    finally:
        stream.window_sampler = real
    def ms(x) -> str:
        return "n/a" if x is None or x != x else f"{x:.3f}"

    for r in rows[rows["timer"].isin(["stream", "cpu"])].head(4).itertuples():
        name = r.fqn if isinstance(r.fqn, str) and r.fqn else "(root)"
        print(f"replay row {name}: isolated {ms(r.isolated_ms)} host {ms(r.host_ms)} device "
              f"{ms(r.device_ms)} ms ({r.timer_notes})", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--size", default="real")
    ap.add_argument("--step", default="forward", choices=("forward", "train"))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no stream timer there)")
    a = ap.parse_args()
    main(a.out, a.spec, a.size, a.step, a.device)
