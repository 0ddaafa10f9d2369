"""Modules that capture records at their boundary only, and calls it does not record.

Hooks on or inside some modules would change what the step runs, or cannot be placed:

- TorchScript modules (scripted or traced): ``register_forward_pre_hook is not supported on
  ScriptModules``, and their submodules' Python forward never runs (the graph does);
- ``nn.TransformerEncoderLayer`` in eval: a forward hook on it or on any submodule switches
  off its fast path (``aten::_transformer_encoder_layer_fwd``; ``why_not_sparsity_fast_path``
  in torch/nn/modules/transformer.py).

Such a module's calls are seen by wrapping its ``forward`` on the instance (its hook dicts stay
empty) and its submodules are not recorded. Module calls made while autograd runs a backward
(activation checkpointing's recomputation) are not calls of the step's forward: ``Recomputes``
says which forward call each one redoes.
"""
from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint as _ckpt

from cbtrace.capture.helper_thread import untraced

# torch._C._current_graph_task_id(): -1 outside a backward, the graph task's id inside one
_GRAPH_TASK = untraced(torch._C._current_graph_task_id)
_GRAD_ENABLED = untraced(torch.is_grad_enabled)
# the innermost (pack, unpack) saved-tensors hooks of this thread, or None
_TOP_HOOKS = untraced(torch._C._autograd._top_saved_tensors_default_hooks, False)
_FRAME = untraced(sys._getframe)
_FRAME_CLASS = getattr(_ckpt, "_CheckpointFrame", None)
# a reentrant checkpoint runs its region in CheckpointFunction.forward, its recomputation in
# CheckpointFunction.backward; both get the same ctx (the region's autograd node)
_REENTRANT_FWD = _ckpt.CheckpointFunction.forward.__code__
_REENTRANT_BWD = _ckpt.CheckpointFunction.backward.__code__
RECOMPUTE = "cbtrace.recompute::"  # range around a module call recomputed in the backward


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recomputation)."""
    return _GRAPH_TASK() != -1


def checkpoint_state(reentrant: bool = True) -> tuple[bool, object]:
    """Whether autograd runs a backward on this thread (a recomputation), and the
    ``torch.utils.checkpoint`` region it runs in (an id, the same in the region's forward and
    its recomputation while the region lives; None outside one). One call per module call.

    Non-reentrant: the region's saved-tensors hooks hold its ``_CheckpointFrame`` (the
    forward's as ``frame``, the recomputation's as ``target_frame_ref``). Reentrant: the
    ``ctx`` of the CheckpointFunction frame up the stack; looked for only where such a region
    can run (without grad, or in a backward) and ``reentrant`` allows it (a step that began
    without grad has no backward to recompute in), as walking the stack is not free."""
    backward = _GRAPH_TASK() != -1
    hooks = _TOP_HOOKS()
    if hooks is not None:
        frame = _checkpoint_frame(hooks[0])
        if frame is not None:
            return backward, id(frame)
    if not reentrant or (not backward and _GRAD_ENABLED()):
        return backward, None
    f = _FRAME()
    while f is not None:
        if f.f_code is _REENTRANT_FWD or f.f_code is _REENTRANT_BWD:
            return backward, id(f.f_locals.get("ctx"))
        f = f.f_back
    return backward, None


def _checkpoint_frame(pack):
    """The _CheckpointFrame a non-reentrant checkpoint's pack hook closes over, else None."""
    pack = getattr(pack, "__wrapped__", pack)  # the recomputation's hook is dynamo-disabled
    code, cells = getattr(pack, "__code__", None), getattr(pack, "__closure__", None)
    if code is None or not cells or _FRAME_CLASS is None:
        return None
    for name, cell in zip(code.co_freevars, cells):
        if name in ("frame", "target_frame_ref"):
            value = cell.cell_contents
            value = value() if name == "target_frame_ref" else value
            if isinstance(value, _FRAME_CLASS):
                return value
    return None


class Recomputes:
    """Which forward call each module call recomputed in the backward redoes.

    A checkpoint's recomputation reruns its region's calls in forward order: the k-th
    recomputation of an fqn in a region is that region's k-th call of it (a module called
    both inside and outside checkpoints, or in two regions, is told apart by the region, not
    by position in the step). A recomputation whose region the forward did not see (an
    unknown checkpoint implementation) takes the last call of its fqn not yet matched, as the
    backward runs in reverse."""

    def __init__(self):
        self._in_region: dict = {}  # (region, fqn) -> forward records, in forward order
        self._seen: dict = {}  # (region, fqn) -> recomputations matched to that list
        self._by_fqn: dict = {}  # fqn -> forward records, in forward order
        self.matched: dict = {}  # call_id -> record, the calls recomputed

    def forward(self, rec, region) -> None:
        """Note the forward call ``rec`` (a ModuleRecord), run in ``region``
        (checkpoint_state()'s, read on the thread that ran the call)."""
        self._by_fqn.setdefault(rec.fqn, []).append(rec)
        if region is not None:
            self._in_region.setdefault((region, rec.fqn), []).append(rec)

    def recompute(self, fqn: str, region):
        """The forward record that this recomputation of ``fqn`` in ``region`` redoes, or None
        where ``fqn`` had no forward call."""
        calls = self._in_region.get((region, fqn)) if region is not None else None
        if calls:
            k = self._seen[(region, fqn)] = self._seen.get((region, fqn), -1) + 1
            rec = calls[k % len(calls)]  # a second backward (retain_graph) recomputes again
        else:
            calls = self._by_fqn.get(fqn)
            if not calls:
                return None
            rec = next((r for r in reversed(calls) if r.call_id not in self.matched), calls[-1])
        self.matched[rec.call_id] = rec
        return rec

    def mark(self) -> None:
        """Set ``recomputed`` on the forward calls recomputed."""
        for rec in self.matched.values():
            rec.recomputed = True


def recompute_range(fqn: str, rec) -> str:
    """Name of the range around a recomputation of ``fqn`` that redoes the forward call ``rec``
    (attribution charges it to that call: backward_ops.recompute_of)."""
    return f"{RECOMPUTE}{fqn}" if rec is None else f"{RECOMPUTE}{fqn}#{rec.call_index}"


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
