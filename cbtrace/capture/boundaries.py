"""Modules that capture records at their boundary only, and calls it does not record.

Hooks on or inside some modules would change what the step runs, or cannot be placed:

- TorchScript modules (scripted or traced): ``register_forward_pre_hook is not supported on
  ScriptModules``, and their submodules' Python forward never runs (the graph does);
- ``nn.TransformerEncoderLayer`` in eval: a forward hook on it or on any submodule switches
  off its fast path (``aten::_transformer_encoder_layer_fwd``; ``why_not_sparsity_fast_path``
  in torch/nn/modules/transformer.py).

Such a module's calls are seen by wrapping its ``forward`` on the instance (its hook dicts stay
empty) and its submodules are not recorded. Module calls made while autograd runs a backward
(activation checkpointing's recomputation) are not calls of the step's forward.
"""
from __future__ import annotations

import torch

from cbtrace.capture.helper_thread import untraced

# torch._C._current_graph_task_id(): -1 outside a backward, the graph task's id inside one
_GRAPH_TASK = untraced(torch._C._current_graph_task_id)
RECOMPUTE = "cbtrace.recompute::"  # range around a module call recomputed in the backward


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recomputation)."""
    return _GRAPH_TASK() != -1


def mark_recomputed(records, counts: dict) -> None:
    """Set ``recomputed`` on the forward calls that ``counts`` (fqn -> recomputations) says were
    recomputed: the last ones of each fqn, as the backward runs in reverse."""
    by_fqn: dict = {}
    for rec in records:
        by_fqn.setdefault(rec.fqn, []).append(rec)
    for fqn, k in counts.items():
        for rec in by_fqn.get(fqn, [])[-k:]:
            rec.recomputed = True


def why_boundary(module) -> str | None:
    """Why ``module`` is recorded at its boundary only, or None for an ordinary module."""
    if isinstance(module, torch.jit.ScriptModule):
        return "TorchScript: no hooks inside a scripted or traced module"
    if isinstance(module, torch.nn.TransformerEncoderLayer) and not module.training:
        return "fast path: hooks on its submodules would switch off _transformer_encoder_layer_fwd"
    return None


def find(named) -> dict[str, str]:
    """fqn -> reason of the outermost boundary modules among ``named`` (fqn, module) pairs,
    parents before children."""
    out: dict[str, str] = {}
    for fqn, module in named:
        if inside(fqn, out):
            continue
        reason = why_boundary(module)
        if reason is not None:
            out[fqn] = reason
    return out


def inside(fqn: str, bounds) -> bool:
    """Whether ``fqn`` is a submodule of one of the boundary paths ``bounds``."""
    parts = fqn.split(".")
    return any(".".join(parts[:k]) in bounds for k in range(1, len(parts))) or (
        fqn != "" and "" in bounds)


_NONE = object()


class _Wrapped:
    """Handle of a forward wrapped on the instance (``remove()`` restores it)."""

    def __init__(self, module, pre, post):
        forward = module.forward
        # a traced TorchScript module forwards attribute writes to its script module: the
        # wrapper is set, and so must be removed, there
        self.module = getattr(module, "_actual_script_module", module)
        self._own = vars(self.module).get("forward", _NONE)  # a forward set on the instance

        def call(*args, **kwargs):
            pre(module, args, kwargs)
            try:
                out = forward(*args, **kwargs)
            except BaseException:
                post(module, args, kwargs, None)  # inside the except: the hook sees the error
                raise
            post(module, args, kwargs, out)
            return out

        module.forward = call
        if vars(self.module).get("forward") is not call:  # landed elsewhere: find it there
            self.module = module

    def remove(self) -> None:
        if self._own is not _NONE:
            self.module.forward = self._own
        elif "forward" in vars(self.module):
            del self.module.forward


def hook_calls(module, pre, post, *, boundary: bool) -> list:
    """Handles calling ``pre(module, args, kwargs)`` and ``post(module, args, kwargs, output)``
    around each call of ``module``: forward hooks (post always called), or, for a boundary
    module, its forward wrapped on the instance."""
    if boundary:
        return [_Wrapped(module, pre, post)]
    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True)]
