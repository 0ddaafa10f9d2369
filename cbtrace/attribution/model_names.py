"""Real attribute paths for a trace's ``nn.Module: Class_N`` events from a model spec alone.

The profiler numbers the instances of each class in the order it first sees them called
(``Linear_0`` is the first Linear called). ``model_calls(spec)`` finds that order without
weights or a capture run: the provider's model is built on the meta device (no memory, no
initialisation cost) and its forward run once on the provider's batch moved to meta, with a
forward pre-hook on every module noting the first call of each. The N-th first-called instance
of a class is then Class_N, exactly as a capture run numbers them (identity.run_labels), and
the trace is checked against that sequence (identity.check_labels): another model, other
options that change the module tree, or a forward that calls its modules in another order is
refused in one line.

A model whose forward cannot run on meta (data-dependent shapes: ``.item()``, ``nonzero``)
falls back to declaration order: the N-th instance of a class in ``named_modules()`` is
Class_N. That is right only where the forward calls each class's instances in the order they
were declared and calls all of them (nanoGPT's ``attn_dropout`` is never called under SDPA),
so only the number of instances per class can be checked there; ``how`` says which rule named
the modules.
"""
from __future__ import annotations

import contextlib

from cbtrace.errors import ProviderError
from cbtrace.model.provider import Provider, move_batch
from cbtrace.model.spec import resolve

FIRST_CALLS = "first calls of a forward on the meta device"
DECLARED = "declaration order (named_modules())"


def model_calls(spec: str, *, options: dict | None = None) -> tuple[list, bool, str]:
    """(("Class_N", fqn) per module in the order the model first calls them, strict, how).

    ``strict``: the order is the real call order (the whole sequence can be checked), not the
    declaration-order fallback (only the count per class can).
    """
    import torch  # only to name events by a model: attributing a trace needs no torch

    provider = resolve(spec, options=options)
    model, batch = _on_meta(provider, spec)
    names = {id(m): fqn for fqn, m in model.named_modules()}
    try:
        with first_calls(model) as order, torch.no_grad():
            provider.run(model, batch)
        strict, how = True, FIRST_CALLS
    except Exception as e:  # a forward that needs real values: declaration order instead
        order = [m for m in model.modules() if type(m).forward is not torch.nn.Module.forward]
        strict, how = False, f"{DECLARED}; the forward did not run on meta ({type(e).__name__})"
    return labelled(order, names), strict, how


def _on_meta(provider, spec):
    """(model, batch) with the model's parameters on the meta device."""
    import torch  # as in model_calls

    try:
        if type(provider).build_model is Provider.build_model:  # a callable's (model, batch)
            with torch.device("meta"):
                return provider.model_and_batch("meta")
        with torch.device("meta"):
            model = provider.build_model("meta")
        return model, move_batch(provider.build_batch("cpu"), "meta")
    except ProviderError:
        raise
    except Exception as e:
        raise ProviderError(f"{spec}: cannot build the model on the meta device "
                            f"({type(e).__name__}: {e}); name its modules with --capture-run") from e


@contextlib.contextmanager
def first_calls(model):
    """Yields a list that fills with the model's modules in the order first called."""
    order, seen = [], set()

    def note(module, args):
        if id(module) not in seen:
            seen.add(id(module))
            order.append(module)

    handles = [m.register_forward_pre_hook(note) for m in model.modules()]
    try:
        yield order
    finally:
        for h in handles:
            h.remove()


def labelled(modules: list, names: dict) -> list[tuple[str, str]]:
    """("Class_N", fqn) per module: N counts the earlier modules of its class in the list."""
    count: dict = {}
    out = []
    for m in modules:
        cls = type(m).__name__
        out.append((f"{cls}_{count.get(cls, 0)}", names[id(m)]))
        count[cls] = count.get(cls, 0) + 1
    return out
