"""Why a backward's graph capture fails inside a whole replay and not alone.

``probe_backward.py`` captures a transformers attention's staged backward into a CUDA graph
without trouble, while in a whole train replay the same call's capture fails ("operation would
make the legacy stream depend on a capturing blocking stream", then timed by the events timer,
which reads Llama's attention backward slow: benchmarks/RESULTS.md). This replays a train
capture with ``--backward`` as ``cbtrace profile`` does, and at each failed capture of a
backward prints, for the first few: the call, the failing op's whole error (its C++ stack
with TORCH_SHOW_CPP_STACKTRACES=1), and the tensors Python can see that carry an autograd
graph reaching the call's parameters, with what holds them (a parameter's AccumulateGrad node
keeps the stream it was made on).

Usage: python benchmarks/probes/probe_capture_failure.py OUT_DIR [SPEC] [--size real]
       [--first N]   (default: the zoo's transformers Llama, bf16 on the GPU)
"""
import argparse
import collections
import gc
import sys
from pathlib import Path

import torch

ZOO = str(Path(__file__).resolve().parents[1] / "zoo.py")


def reaches(t: torch.Tensor, params: set, limit: int = 5000) -> bool:
    """Whether ``t``'s autograd graph reaches one of ``params`` (ids) within ``limit`` nodes."""
    seen, stack = set(), [t.grad_fn]
    while stack and len(seen) < limit:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)  # held: the id of a node let go can come back as another's
        if id(getattr(fn, "variable", None)) in params:
            return True
        stack.extend(f for f, _ in fn.next_functions)
    return False


def holders(params: set) -> collections.Counter:
    """What holds each tensor alive that carries a graph reaching ``params``: its referrers'
    types, and for a dict (an object's attributes) the types that hold the dict."""
    here = sys._getframe()
    out: collections.Counter = collections.Counter()
    everything = gc.get_objects()
    for o in everything:
        if not (isinstance(o, torch.Tensor) and o.grad_fn is not None and reaches(o, params)):
            continue
        for r in gc.get_referrers(o):
            if r is everything or r is here:
                continue
            kind = type(r).__name__
            if isinstance(r, (dict, list, tuple)):
                up = [type(x).__name__ for x in gc.get_referrers(r)
                      if x is not everything and x is not here][:3]
                kind += f" held by {up}"
            elif type(r).__name__ == "frame":
                kind += f" {r.f_code.co_name} ({Path(r.f_code.co_filename).name}:{r.f_lineno})"
            out[kind] += 1
    return out


def main() -> None:
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.plugins.backends import graph
    from cbtrace.replay.engine import replay
    from cbtrace.replay.modes import backward as bw
    from cbtrace.replay.timer.graph_capture import root_cause
    from cbtrace.workflows.profile_model import live_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("spec", nargs="?", default=f"{ZOO}:hf_llama")
    ap.add_argument("--size", default="real")
    ap.add_argument("--first", type=int, default=2, help="failures printed in full")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    run = Path(args.out_dir) / "capture_failure"
    cap = capture_model(args.spec, run, device=device, dtype="bf16" if gpu else None,
                        step="train", options={"size": args.size})
    model = live_model(cap, device)
    del cap

    current: dict = {}
    failures: list = []
    run_backward, capture = bw.BackwardStep.run, graph.capture

    def backward_step(self, c):
        current["c"] = c
        try:
            return run_backward(self, c)
        finally:
            current.clear()

    def watched_capture(call, n_copies, k, touch=None, stream=None, slots=False):
        try:
            return capture(call, n_copies, k, touch, stream, slots)
        except Exception as e:
            c = current.get("c")
            if c is None:
                raise
            failures.append(c.rec.fqn)
            if len(failures) <= args.first:
                cause = root_cause(e.__cause__ or e)
                print(f"\n== capture of {c.rec.fqn}'s backward failed (staged: {slots}, K={k})")
                print(f"{type(cause).__name__}: {cause}"[:6000])
                params = {id(p) for p in c.module.parameters()}
                gc.collect()
                print("tensors alive with a graph reaching its parameters, by holder:",
                      dict(holders(params)) or "none")
            raise

    bw.BackwardStep.run = backward_step
    graph.capture = watched_capture
    replay(run, model=model, device=device, backward=True, progress=False)
    print(f"\nbackward captures failed: {len(failures)}: "
          f"{dict(collections.Counter(f.split('.')[-1] for f in failures))}")


if __name__ == "__main__":
    main()
