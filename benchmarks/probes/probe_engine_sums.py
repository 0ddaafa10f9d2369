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

On a GPU the plain step's trace (the one the in-situ figures come from) is read too, and each
leaf's in-situ backward is printed as attributed with and without its own sums (what
``join.insitu_for_run`` gives): on the H100 GPT-2's GELU backward still read slow though the
rule had been built (benchmarks/RESULTS.md), and this says whether the rule reached it there.

Usage: python benchmarks/probes/probe_engine_sums.py OUT_DIR [SPEC] [--device cuda]
       [--dtype bf16] [--size real]   (default: the zoo's tiny transformers GPT-2 on the CPU)
"""
import argparse
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from cbtrace.nested import flat_tensors
from cbtrace.replay.modes.backward import grad_sums, grad_targets

ZOO = str(Path(__file__).resolve().parents[1] / "zoo.py")


def graph_sums(spec: str, options: dict, device: str = "cpu", dtype=None) -> dict:
    """fqn -> the gradient sums inside each leaf's first call, from one forward of the
    provider's model in train mode (built afresh, as the capture built it); None where a walk
    gave up."""
    from cbtrace.model.spec import resolve

    provider = resolve(spec, seed=0, options=options)
    model, batch = provider.model_and_batch(device, dtype)
    model.train()
    total, handles, shown = {}, [], {}
    for fqn, m in model.named_modules():
        if next(m.children(), None) is not None:
            continue  # leaves only: a parent's count by this walk did not match its trace

        def hook(m, args, kwargs, o, fqn=fqn):
            outs = [t for t in flat_tensors(o) if t.grad_fn is not None]
            ins = flat_tensors((args, kwargs))
            total.setdefault(fqn, grad_sums(outs, grad_targets(ins), m))
            if fqn not in shown and type(m).__name__ not in {c for c, _ in shown.values()}:
                # one line per leaf class: what the walk started from (a GPU run counted 0
                # for GPT-2's GELU, where the CPU counts 2)
                fn = outs[0].grad_fn if outs else None
                shown[fqn] = (type(m).__name__, (
                    f"outputs with a graph {len(outs)}, inputs requiring grad "
                    f"{sum(t.requires_grad for t in ins)}/{len(ins)}, output node "
                    f"{type(fn).__name__ if fn else None} <- "
                    f"{[type(f).__name__ for f, _ in fn.next_functions] if fn else []}, "
                    f"sums {total[fqn]}"))
        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.enable_grad():
            provider.run(model, batch)
    finally:
        for h in handles:
            h.remove()
    for fqn, (kind, line) in shown.items():
        print(f"  walk of {fqn} ({kind}): {line}")
    return total


def trace_adds(run, trace=None) -> Counter:
    """fqn -> the engine adds the capture trace (or ``trace``) shows in its calls' backward
    nodes."""
    from cbtrace.attribution import backward_ops as bw
    from cbtrace.attribution import forest as fm
    from cbtrace.attribution import identity, loader
    from cbtrace.rundir.read import find_trace, load_run

    manifest, _ = load_run(run)
    f = fm.build(loader.load(trace or find_trace(run, manifest)))
    lab, is_copy, labels = identity.labels(f, identity.choose_source(f))
    module_of, copy_of = f.nearest(lab >= 0), f.outermost(is_copy)
    roots = bw.backward_roots(f)
    owner = bw.backward_owner(f, roots, bw.forward_owner_by_seq(f, module_of, roots, copy_of))
    adds = Counter()
    engine = bw.engine_work(f, roots)
    # the outermost events alone, as keep_own_adds counts them: on a GPU an add's kernel launch
    # is an event inside it, and every add counted twice
    for j in np.flatnonzero(engine & (f.outermost(engine) == np.arange(len(f)))):
        o = owner[roots[j]]
        if o >= 0:
            adds[labels[lab[o]]] += 1
    return adds


def insitu_bwd(run, trace, sums: dict) -> dict:
    """fqn -> (in-situ backward ms without its own sums, with them, kernel counts) of each
    leaf's first call, from ``trace``."""
    from cbtrace.attribution.join import insitu_for_run
    from cbtrace.rundir.read import load_run

    manifest, _ = load_run(run)
    own = {(f, 0): n for f, n in sums.items() if n}
    a, b = (insitu_for_run(run, manifest, phase="bwd", grad_sums=g, trace=trace)
            for g in (None, own))
    a, b = (t[t["call_index"] == 0].set_index("fqn") for t in (a, b))
    return {f: (a.at[f, "insitu_ms"], b.at[f, "insitu_ms"], a.at[f, "kernel_count"],
                b.at[f, "kernel_count"]) for f in a.index if f in b.index}


def main() -> None:
    from cbtrace.attribution.join import plain_trace
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.rundir.read import find_trace, load_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("spec", nargs="?", default=f"{ZOO}:hf_gpt2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--size", default=None, help="the zoo's size option (tiny, real)")
    args = ap.parse_args()
    options = {"size": args.size} if args.size else {}
    run = Path(args.out_dir) / "engine_sums"
    capture_model(args.spec, run, device=args.device, dtype=args.dtype, step="train",
                  options=options)
    manifest, _ = load_run(run)
    traces = {"captured": find_trace(run, manifest), "plain": plain_trace(run, manifest)}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    sums = graph_sums(args.spec, options, args.device, dtype)
    for label, trace in traces.items():
        if trace is None:
            continue
        adds, ins = trace_adds(run, trace), insitu_bwd(run, trace, sums)
        print(f"{args.spec} ({args.device}), {label} step: leaves whose backward nodes ran "
              f"engine adds, or that sum gradients")
        print(f"{'module':<40} {'adds in nodes':>13} {'own sums':>8} {'kept':>4} "
              f"{'bwd ms w/o':>10} {'with':>8} {'kernels w/o':>11} {'with':>5}")
        for fqn in sorted(set(adds) | {f for f, n in sums.items() if n}):
            n_adds, own = adds.get(fqn, 0), sums.get(fqn)
            keep = "?" if own is None else min(own, n_adds)
            w, k, kw, kk = ins.get(fqn, (float("nan"),) * 4)
            print(f"{fqn:<40} {n_adds:>13} {own if own is not None else '?':>8} {keep:>4} "
                  f"{w:>10.4f} {k:>8.4f} {kw:>11} {kk:>5}")


if __name__ == "__main__":
    main()
