"""GPU memory across a whole-tree replay, call by call, under variants that each undo one replay
mechanism: where free device memory goes when calls start being skipped for it.

Captures SPEC (train step: forward and backward) once, then replays it with the capture's model once
per variant (a patch, or replay settings: no-context, rewrite-off), recording after every call the
driver's free memory and torch's allocated and reserved bytes; prints per variant the calls skipped
and the memory at the 10th, middle and last call (and the parameters' .grad bytes). Usage: python
benchmarks/probes/probe_memory.py OUT_DIR [VARIANT ...] [--spec SPEC] [--top N]
"""
import contextlib
import gc
from pathlib import Path

import torch

GIB = 2**30


@contextlib.contextmanager
def patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def variants():
    from cbtrace import state
    from cbtrace.plugins.backends import graph
    from cbtrace.replay import engine
    from cbtrace.replay.measure import steps

    fresh = graph.side_stream_warmup

    def warm_fresh(call, n, runs, stream=None):
        return fresh(call, n, runs)

    issue = steps.HostIssue.run

    def issue_drop(self, c):
        out = issue(self, c)
        c.outputs = None
        return out

    ahead = engine.ReadAhead

    def no_ahead(*a, **k):
        return ahead(*a, **{**k, "enabled": False, "pin": False})

    return {
        "default": contextlib.nullcontext,
        # replay settings, not patches: (name) -> ReplayConfig fields
        "no-context": {"context": False},
        "rewrite-off": {"context_rewrite": "off"},
        "warm-fresh-stream": lambda: patched(graph, "side_stream_warmup", warm_fresh),
        "no-kept-outputs": lambda: patched(steps.HostIssue, "run", issue_drop),
        "no-read-ahead": lambda: patched(engine, "ReadAhead", no_ahead),
        "host-state-copy": lambda: patched(state, "DEVICE_COPY_SHARE", 0.0),
        # reference cycles holding graphs and their pools: collected after every call
        "gc-each-call": "gc",
    }


def main(out_dir, names, spec="nanogpt", options=None, top=0):
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay import engine

    cap = capture_model(spec, Path(out_dir) / "mem", device="cuda", dtype="bf16",
                        options=options if options is not None else {"batch_size": 8},
                        step="train")
    table = variants()
    one = engine.ReplayLoop.replay_one
    params = list(cap.model.parameters())
    for name in names or list(table):
        log = []

        def logged(loop, rec, *a, **k):
            row = one(loop, rec, *a, **k)
            if how == "gc":
                gc.collect()
            free = torch.cuda.mem_get_info()[0]
            grads = sum(p.grad.numel() * p.grad.element_size() for p in params
                        if p.grad is not None)
            status = row.get("status")
            if row.get("bwd_status") not in (None, "ok"):
                status = "bwd " + str(row.get("bwd_status"))
            log.append((status, free, torch.cuda.memory_allocated(),
                        torch.cuda.memory_reserved(), rec.fqn, grads))
            return row

        torch.cuda.empty_cache()
        how = table[name]
        options = how if isinstance(how, dict) else {}
        patch = how if callable(how) else contextlib.nullcontext
        with patch(), patched(engine.ReplayLoop, "replay_one", logged):
            engine.replay(cap.out, model=cap.model, backward=True, progress=False, **options)
        skipped = sum(s != "ok" for s, *_ in log)
        marks = [min(9, len(log) - 1), len(log) // 2, len(log) - 1]
        total = torch.cuda.mem_get_info()[1]
        # outside: the driver's used memory that torch's allocator does not hold (CUDA graphs'
        # own, cuDNN/cuBLAS workspaces, the context)
        cells = "  ".join(f"#{i}: free {log[i][1] / GIB:6.1f} alloc {log[i][2] / GIB:5.1f} "
                          f"reserved {log[i][3] / GIB:6.1f} outside "
                          f"{(total - log[i][1] - log[i][3]) / GIB:5.1f} "
                          f"grads {log[i][5] / GIB:5.2f}"
                          for i in marks)
        peak = max(r[3] for r in log) / GIB
        print(f"{name:<18} skipped {skipped:3d}  {cells}  peak reserved {peak:.1f}  (GiB)",
              flush=True)
        if top:  # the calls after which allocated memory grew most
            grew = sorted(((log[i][2] - (log[i - 1][2] if i else 0), log[i][4] or "(root)")
                           for i in range(len(log))), reverse=True)[:top]
            print("  allocated grew most after: " + ", ".join(
                f"{fqn} +{d / 2**20:.0f} MiB" for d, fqn in grew), flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("variants", nargs="*")
    ap.add_argument("--spec", default="nanogpt")
    ap.add_argument("--top", type=int, default=0, help="print the N calls memory grew most after")
    a = ap.parse_args()
    main(a.out_dir, a.variants, a.spec, None if a.spec == "nanogpt" else {"size": "real"}, a.top)
