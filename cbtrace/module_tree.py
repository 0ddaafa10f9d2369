"""The user's module tree, seen through ``torch.compile`` (and data-parallel) wrappers.

``torch.compile(m)`` returns an ``OptimizedModule`` whose only child is ``_orig_mod``; its
``named_modules()`` spell every path with ``_orig_mod.`` and its compiled forward erases the
submodules' boundaries (hooks inside do not fire as calls of their own). cbtrace names modules
as the user wrote them (``layers.0.attn``, not ``_orig_mod.layers.0.attn``), hooks the eager
modules inside the wrapper, and runs a compiled model's step eagerly while it captures or times
calls (``eager``).
"""
from __future__ import annotations

import contextlib

import torch

WRAPPER = "_orig_mod"
# wrapper class name -> the attribute holding the user's module: torch.compile, and the data
# parallel wrappers a training job puts around its model (DDP, DataParallel, FSDP1)
WRAPPERS = {"OptimizedModule": WRAPPER, "DistributedDataParallel": "module",
            "DataParallel": "module", "FullyShardedDataParallel": "_fsdp_wrapped_module"}


def is_compiled(module) -> bool:
    """A torch.compile wrapper (torch._dynamo's OptimizedModule)."""
    return type(module).__name__ == "OptimizedModule" and WRAPPER in module._modules


def runs_compiled(module) -> bool:
    """A torch.compile wrapper, or a module compiled in place (``module.compile()``)."""
    return is_compiled(module) or getattr(module, "_compiled_call_impl", None) is not None


def compiled_paths(model) -> set[str]:
    """The user's paths (wrappers left out) of every module that runs under torch.compile: a
    compiled module and everything below it."""
    out: set[str] = set()
    stack = [("", model, False)]
    while stack:
        name, module, inside = stack.pop()
        while True:  # the wrappers around the user's module, any of them compiled
            inside = inside or runs_compiled(module)
            inner = _inner(module)
            if inner is None:
                break
            module = inner
        if inside:
            out.add(name)
        stack.extend((f"{name}.{k}" if name else k, c, inside)
                     for k, c in module._modules.items() if c is not None)
    return out


def _inner(module):
    attr = WRAPPERS.get(type(module).__name__)
    return module._modules.get(attr) if attr is not None else None


def unwrap(module):
    """The user's module inside any torch.compile or data-parallel wrappers."""
    while (inner := _inner(module)) is not None:
        module = inner
    return module


def named_modules(model, *, remove_duplicate: bool = True):
    """(fqn, module) of every module as the user's tree names it: wrappers left out, each
    compiled module under its own name; parents before children, in registration order."""
    seen: set[int] = set()
    stack = [("", unwrap(model))]
    while stack:
        name, module = stack.pop()
        if remove_duplicate:
            if id(module) in seen:
                continue
            seen.add(id(module))
        yield name, module
        children = [(f"{name}.{k}" if name else k, unwrap(c))
                    for k, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))


def get_submodule(model, fqn: str):
    """The module at ``fqn`` (a user's path) under ``model``; AttributeError if there is none."""
    module = unwrap(model)
    for part in fqn.split(".") if fqn else ():
        child = module._modules.get(part)
        if child is None:
            raise AttributeError(f"{type(module).__name__} has no submodule {part!r}")
        module = unwrap(child)
    return module


def user_name(name: str) -> str:
    """A parameter or module path without torch.compile's ``_orig_mod`` components (a data
    parallel wrapper's prefix: ``state_digest`` digests the unwrapped model)."""
    return ".".join(p for p in name.split(".") if p != WRAPPER)


def has_compiled(model) -> bool:
    return any(runs_compiled(m) for m in model.modules())


def eager(model):
    """Context in which the model's compiled parts run eagerly (``torch.compiler`` stance
    ``force_eager``), so every module call is a call of its own; a no-op for eager models."""
    if not has_compiled(model):
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")
