"""Work the isolated backward did that the step never did: the backward as replay ran it before
(``torch.autograd.backward`` into the leaves, each ``.grad`` emptied first) beside replay's now
(``torch.autograd.grad`` down to the inputs' gradient edges: ``modes.backward.backward_targets``).

In the step an input's gradient flows on into its producer. Ended in a leaf instead, the
autograd engine copies a gradient it cannot take over (the caller's gradient tensor that a
pass-through backward hands on: an input added as it came) and runs the nodes the input was
rebuilt with (as_strided's zero-fill and copy). Per call of a captured train step, on the CPU:
the bytes each way (``cost.opcount``) and the aten ops each way ran inside a leaf's
AccumulateGrad or an as_strided backward. Counts, not times: the same on any device.

Usage: python benchmarks/probes/probe_backward_targets.py [SPEC ...]
       (default: the zoo's tiny transformers GPT-2, Llama, T5 and BERT, and nanogpt:tiny)
"""
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

ZOO = str(Path(__file__).resolve().parents[1] / "zoo.py")
SPECS = [f"{ZOO}:hf_gpt2", f"{ZOO}:hf_llama", f"{ZOO}:hf_t5", f"{ZOO}:hf_bert", "nanogpt:tiny"]


def leaves_of(inputs) -> list:
    """The leaves an input's gradient ended in before (the walk replay used then)."""
    from cbtrace.nested import flat_tensors

    leaves, stack, seen = [], [], set()
    for t in flat_tensors(inputs):
        if t.requires_grad:
            if t.is_leaf:
                leaves.append(t)
            elif t.grad_fn is not None:
                stack.append((t.grad_fn, 0))
    while stack:
        fn, depth = stack.pop()
        if fn is None or fn in seen or depth > 4:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            leaves.append(var)
            continue
        stack.extend((nxt, depth + 1) for nxt, _ in fn.next_functions)
    return leaves


# autograd nodes whose work in a replayed backward is no call's in the step: a leaf's
# AccumulateGrad (a copy into an empty .grad, an add into a full one) and as_strided's
# backward, which only an input rebuilt over a slice of its storage puts there
NOT_THE_CALLS = ("torch::autograd::AccumulateGrad", "AsStridedBackward0")


def counted(fn, params) -> tuple[int, Counter]:
    """(bytes of ``fn()``, counts of the aten ops that do work, no view or other free op,
    inside the nodes ``NOT_THE_CALLS``)."""
    from cbtrace.cost.flops import is_free
    from cbtrace.cost.opcount import OpCounter

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with OpCounter(params=params) as oc:
            fn()
    ops: Counter = Counter()
    for e in prof.events():
        if e.name.startswith("autograd::engine::evaluate_function: ") and e.name.endswith(
                NOT_THE_CALLS):
            stack = list(e.cpu_children)
            while stack:
                op = stack.pop()
                if op.name.startswith("aten::") and not is_free(op.name):
                    ops[op.name] += 1
                stack.extend(op.cpu_children)
    return int(oc.cost().bytes or 0), ops


def probe(spec: str, root: Path) -> list[dict]:
    from cbtrace import module_tree
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.config import ReplayConfig
    from cbtrace.replay.measure.prepare import prepare
    from cbtrace.replay.modes.backward import _Backward, _gradients, _grad_outputs
    from cbtrace.rundir.read import load_run
    from cbtrace.schema.modules import frame_to_records
    from cbtrace.store.load import load_call_inputs

    run = root / spec.rsplit(":", 1)[-1]
    model = capture_model(spec, run, device="cpu", step="train").model
    _, df = load_run(run)
    kept = {id(p): p.grad for p in model.parameters()}
    rows = []
    for rec in frame_to_records(df):
        module = module_tree.get_submodule(model, rec.fqn)
        args, kwargs = load_call_inputs(run, rec.inputs_ref)
        grads = load_call_inputs(run, rec.grads_ref)[0] if rec.grads_ref else None
        module.train(bool(rec.training))
        c = prepare(module, rec, args, kwargs, torch.device("cpu"),
                    ReplayConfig(backward=True, max_copies=1), grads)
        outs = _grad_outputs(c.run(0))
        if not outs:
            continue
        g, _ = _gradients(c, outs)
        del outs
        backward = _Backward(c, g)
        c.writes_inputs = False
        params = {id(p): n for n, p in module.named_parameters()}
        outs, targets = backward.forward(0)
        now = counted(lambda: backward(outs, targets), params)
        outs, _ = backward.forward(0)
        leaves = [p for p in module.parameters()] + leaves_of(c.run.copies[0])

        def before():
            for t in leaves:
                t.grad = None
            torch.autograd.backward(outs, g)

        then = counted(before, params)
        for t in leaves:
            t.grad = None
        rows.append(dict(fqn=rec.fqn or "(root)", kind=rec.module_type, bytes_then=then[0],
                         bytes_now=now[0], ops_then=_joined(then[1]), ops_now=_joined(now[1])))
    for p in model.parameters():
        p.grad = kept[id(p)]
    return rows


def _joined(ops: Counter) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(ops.items()))


def main(specs: list[str]) -> None:
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        for spec in specs:
            t = pd.DataFrame(probe(spec, Path(tmp)))
            then, now = (t[t[c] != ""] for c in ("ops_then", "ops_now"))
            print(f"\n== {spec.rsplit('/', 1)[-1]}: {len(t)} backwards; ran work of "
                  f"{', '.join(NOT_THE_CALLS)}: {len(then)} then, {len(now)} now; bytes "
                  f"{t['bytes_then'].sum():,} then, {t['bytes_now'].sum():,} now")
            more = t[(t["ops_then"] != "") | (t["ops_now"] != "")]
            if len(more):
                print(more.to_string(index=False, max_colwidth=60))

if __name__ == "__main__":
    main(sys.argv[1:] or SPECS)
