"""Where the autograd engine's gradient sums belong: the in-situ attribution beside the graph.

When a tensor feeds several ops, the autograd engine sums their gradients with an ``aten::add``
that runs inside whichever consumer's backward node finishes second (third, ...). The in-situ
attribution (``backward_ops.engine_work``) gives such an add to the parent of the module whose
node it ran in: right where the consumers sit in different modules (a residual stream, the q/k/v
projections of one input), wrong where they all sit in one leaf (a tanh GELU uses its input three
times, an RMSNorm twice): the leaf's replayed backward runs adds its in-situ figure then lacks
(transformers GPT-2's GELU backward read +28 % for it on the H200, RESULTS.md session 16).

Per leaf module of one train step (its first call), this prints the engine adds the capture
trace shows in its backward nodes beside its own sums, counted on the autograd graph in a
forward hook (``replay.modes.backward.grad_sums``, which the replay of ``--backward`` records as
``bwd_grad_sums``): for every tensor its nodes feed gradients into, the edges into it beyond the
first. The in-situ attribution keeps ``min(own sums, adds in its nodes)`` in the call
(``backward_ops.keep_own_adds``) and gives the rest to the parent.

Usage: python benchmarks/probes/probe_engine_sums.py OUT_DIR [SPEC]   (default: the zoo's
       tiny transformers GPT-2; CPU is enough: the adds are host ops in the trace)
"""
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from cbtrace.nested import flat_tensors
from cbtrace.replay.modes.backward import grad_sums, grad_targets

ZOO = str(Path(__file__).resolve().parents[1] / "zoo.py")


def graph_sums(spec: str) -> dict:
    """fqn -> the gradient sums inside each leaf's first call, from one forward of the
    provider's model in train mode (built afresh, as the capture built it); None where a walk
    gave up."""
    from cbtrace.model.spec import resolve

    provider = resolve(spec, seed=0, options={})
    model, batch = provider.model_and_batch("cpu", None)
    model.train()
    total, handles = {}, []
    for fqn, m in model.named_modules():
        if next(m.children(), None) is not None:
            continue  # leaves only: a parent's count by this walk did not match its trace

        def hook(m, args, kwargs, o, fqn=fqn):
            outs = [t for t in flat_tensors(o) if t.grad_fn is not None]
            total.setdefault(fqn, grad_sums(outs, grad_targets(flat_tensors((args, kwargs))), m))
        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.enable_grad():
            provider.run(model, batch)
    finally:
        for h in handles:
            h.remove()
    return total


def trace_adds(run) -> Counter:
    """fqn -> the engine adds the capture trace shows in its calls' backward nodes."""
    from cbtrace.attribution import backward_ops as bw
    from cbtrace.attribution import forest as fm
    from cbtrace.attribution import identity, loader
    from cbtrace.rundir.read import find_trace, load_run

    manifest, _ = load_run(run)
    f = fm.build(loader.load(find_trace(run, manifest)))
    lab, is_copy, labels = identity.labels(f, identity.choose_source(f))
    module_of, copy_of = f.nearest(lab >= 0), f.outermost(is_copy)
    roots = bw.backward_roots(f)
    owner = bw.backward_owner(f, roots, bw.forward_owner_by_seq(f, module_of, roots, copy_of))
    adds = Counter()
    for j in np.flatnonzero(bw.engine_work(f, roots)):
        o = owner[roots[j]]
        if o >= 0:
            adds[labels[lab[o]]] += 1
    return adds


def main(out_dir, spec=f"{ZOO}:hf_gpt2") -> None:
    from cbtrace.capture.from_spec import capture_model

    run = Path(out_dir) / "engine_sums"
    capture_model(spec, run, device="cpu", step="train", options={})
    adds, sums = trace_adds(run), graph_sums(spec)
    print(f"{spec}: leaves whose backward nodes ran engine adds, or that sum gradients")
    print(f"{'module':<48} {'adds in its nodes':>17} {'own sums':>9} {'kept':>5}")
    for fqn in sorted(set(adds) | {f for f, n in sums.items() if n}):
        n_adds, own = adds.get(fqn, 0), sums.get(fqn)
        keep = "?" if own is None else min(own, n_adds)
        print(f"{fqn:<48} {n_adds:>17} {own if own is not None else '?':>9} {keep:>5}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:3])
