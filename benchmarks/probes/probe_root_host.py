"""Device probe: why replay's host time for a root exceeds the user's step (benchmarks/RESULTS.md,
session 23: BERT-base, T5-base, EfficientNet-B0 on an H100; not on a CPU).

First, in fresh processes, the forward as the user calls it: in one that never starts the
profiler, after one profiler session, and after one with Kineto told to tear CUPTI down
(TEARDOWN_CUPTI=1; PyTorch's record says a profiler left subscribed slows a later loop by 10-20 %:
pytorch/pytorch#146604); in the two profiled ones, then SESSIONS more sessions of one forward
each (what a session costs with and without the teardown: replay starts one a call) and the
forward after them.
Then captures SPEC once (bf16), and times the forward's host issue (perf_counter around each call,
5 back to back, no sync between, the first left out: what replay's HostIssue does) and its wall
a call (CUDA events around 5 back to back), in turn:
  plain              the model called as the user calls it
  collection off     the same with Python's collection off, as replay's timers run a call
  no grad            the same without grad (a forward that records no autograd graph)
  reader thread      the same while a thread reads the run's next calls' inputs, as replay's
                     read-ahead does (load.read_call_chunks into pageable memory, in a loop)
  after profiler     the same after one torch.profiler session (CUPTI may stay subscribed)
  after 200 more     and after 200 short sessions more, as replay's profiled pass starts one
                     per call (whatever a session leaves behind, 200 times)
and then cbtrace's replay of the root and its children (--max-depth 1 capture: the children's
reads overlap the root's timing) with the read-ahead on and off: the root's host_ms and
isolated_ms. Prints one line each.

Run: python benchmarks/probes/probe_root_host.py OUT_DIR [--spec SPEC] [--device cuda] [--size real]
     [--step train]
"""
import argparse
import statistics
import threading
import time
from pathlib import Path

import torch

from cbtrace.device import window_ms

SESSIONS = 10  # later profiler sessions timed in a fresh process


def sync():
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def host_ms(call, reps: int = 5) -> float:
    """Median host time of a call, ``reps`` back to back without a sync (the first left out)."""
    sync()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        call()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return statistics.median(times)


def ms(x) -> str:
    return "    n/a" if x is None or x != x else f"{x:7.3f}"  # a CPU row has no host_ms


def line(name, call, device):
    hosts = [host_ms(call) for _ in range(5)]
    wall = min(window_ms(call, device, 5) for _ in range(3))
    print(f"{name:<28} host {statistics.median(hosts):7.3f} ms (min {min(hosts):.3f})   "
          f"wall a call {wall:7.3f} ms", flush=True)


def fresh(spec, device, size, step, profile_first: bool) -> None:
    """The plain line in a fresh process: one that never started the profiler (CUPTI not
    loaded), or (``profile_first``) after one torch.profiler session of the forward, with
    Kineto's CUPTI teardown as the environment sets it (TEARDOWN_CUPTI: unset, "1")."""
    import os

    from cbtrace.model.spec import resolve

    provider = resolve(spec, seed=0, options={"size": size})
    model, batch = provider.model_and_batch(device, torch.bfloat16)
    model.train(step == "train")
    call = lambda: provider.run(model, batch)  # noqa: E731
    for _ in range(3):
        call()
    name = "fresh process, no profiler"
    if profile_first:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            call()
            sync()
        name = f"fresh, after profiler (TEARDOWN_CUPTI={os.environ.get('TEARDOWN_CUPTI', 'unset')})"
    line(name, call, device)
    if profile_first:  # what each later session costs: replay starts one a call
        t0 = time.perf_counter()
        for _ in range(SESSIONS):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                call()
                sync()
        took = (time.perf_counter() - t0) / SESSIONS * 1e3
        print(f"  {SESSIONS} more sessions of one forward: {took:.1f} ms a session", flush=True)
        line("  after them", call, device)


def main(out, spec, device, size, step="forward"):
    import subprocess
    import sys

    from cbtrace.capture.from_spec import capture_model

    import os

    args = [sys.executable, __file__, out, "--spec", spec, "--device", device, "--size", size,
            "--step", step, "--fresh"]
    for extra, env in (([], {}), (["--profile-first"], {}),
                       (["--profile-first"], {"TEARDOWN_CUPTI": "1"})):
        rc = subprocess.run(args + extra, env={**os.environ, **env}).returncode
        if rc:
            print(f"(the fresh process {extra} {env} exited {rc}: no line from it)", flush=True)
    from cbtrace.replay import engine
    from cbtrace.rundir.read import load_run
    from cbtrace.store import load

    cap = capture_model(spec, Path(out) / "full", device=device, dtype="bf16",
                        options={"size": size}, step=step)
    model, run = cap.model, cap.out
    _, df = load_run(run)
    root_row = df[df["parent_call_id"] == -1].iloc[0]
    step_ms = root_row.get("insitu_step_ms")
    print(f"{'capture: insitu_step_ms':<28} {ms(step_ms)} ms a forward (the root's in-situ "
          f"figure; model.training={model.training})", flush=True)
    from cbtrace.model.spec import resolve
    provider = resolve(spec, seed=0, options={"size": size})
    _, batch = provider.model_and_batch(device, torch.bfloat16)
    call = lambda: provider.run(model, batch)  # noqa: E731
    for _ in range(3):
        call()
    line("plain", call, device)
    # what replay's timers run under: the interpreter's collection off (engine's
    # MainThreadCollection); and, to tell a forward that records no autograd graph, no grad
    import gc
    gc.disable()
    try:
        line("plain, collection off", call, device)
    finally:
        gc.enable()
    with torch.no_grad():
        line("plain, no grad", call, device)

    refs = [r for r in df["inputs_ref"].dropna()][:16]
    stop = threading.Event()
    read = [0]

    def reader():
        while not stop.is_set():
            for ref in refs:
                load.read_call_chunks(run, ref)
                read[0] += 1

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    line("reader thread", call, device)
    stop.set()
    t.join()
    print(f"  (the reader read {read[0]} calls' inputs meanwhile)")
    line("plain again", call, device)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        call()
        sync()
    line("after profiler", call, device)
    x = torch.ones(8, device=device)
    for _ in range(200):  # replay's profiled pass: one short session per call
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            x.add_(1)
            sync()
    line("after 200 more sessions", call, device)

    root = capture_model(spec, Path(out) / "root", device=device, dtype="bf16",
                         options={"size": size}, max_depth=1, step=step)
    real = engine.ReadAhead
    for name, enabled in (("replay, read-ahead on", True), ("replay, read-ahead off", False)):
        def ahead(*a, **k):
            return real(*a, **{**k, "enabled": enabled, "pin": enabled and k.get("pin", False)})
        engine.ReadAhead = ahead
        try:
            rows = engine.replay(root.out, model=root.model, progress=False)
        finally:
            engine.ReadAhead = real
        r = rows[rows["parent_call_id"] == -1].iloc[0]
        print(f"{name:<28} host {ms(r.host_ms)} ms   isolated {ms(r.isolated_ms)} ms "
              f"({r.timer}; {r.timer_notes})", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--spec", default=str(Path(__file__).resolve().parent.parent / "zoo.py")
                    + ":hf_bert")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="real", help="the zoo's size (tiny: a CPU check)")
    ap.add_argument("--step", default="forward", choices=("forward", "train"),
                    help="the capture's step")
    ap.add_argument("--fresh", action="store_true",
                    help="only the plain line, in this process, before any profiler (main runs "
                         "it in subprocesses)")
    ap.add_argument("--profile-first", action="store_true",
                    help="with --fresh: after one profiler session (Kineto's CUPTI teardown as "
                         "TEARDOWN_CUPTI says)")
    a = ap.parse_args()
    if a.fresh:
        fresh(a.spec, a.device, a.size, a.step, a.profile_first)
    else:
        main(a.out, a.spec, a.device, a.size, a.step)
