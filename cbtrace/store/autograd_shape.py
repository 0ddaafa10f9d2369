"""The autograd shape of an input tensor: a leaf, or the output of an op that requires grad.

A module in a training step often gets a non-leaf input (a BatchNorm's output feeding
``ReLU(inplace=True)``); rebuilt as a leaf that requires grad, the in-place op raises ("a leaf
Variable that requires grad is being used in an in-place operation"). ``as_non_leaf`` gives the
tensor back as a view of a non-leaf base: same values, shape, strides and storage offset, and
in-place ops run as they did in the step. Capture records the shape per tensor node (``"nl"``).
"""
from __future__ import annotations

import torch


def is_non_leaf(t: torch.Tensor) -> bool:
    """True for a tensor that requires grad and was made by an op (has a grad_fn)."""
    return t.requires_grad and not t.is_leaf


def as_non_leaf(t: torch.Tensor, bases: dict | None = None, view: bool = True) -> torch.Tensor:
    """``t`` (no grad) as a non-leaf that requires grad: a view, with ``t``'s shape, strides and
    offset, of a copy of its whole storage (bytes unchanged). Tensors over one storage share one
    copy through ``bases`` (storage -> base), so aliasing between arguments survives.
    ``view=False``: a tensor that covers its whole storage is made anew instead, not as a view
    (for a call that writes it in place)."""
    storage = t.untyped_storage()
    key = (storage.data_ptr(), t.device, t.dtype)
    base = None if bases is None else bases.get(key)
    whole = t.storage_offset() == 0 and t.is_contiguous() and (
        t.numel() * t.element_size() == storage.nbytes())
    if base is None and whole and not view:
        # the tensor itself made anew (CloneBackward), no view: an in-place op on a view rebases
        # the base's history, and its backward then zero-fills and copies a storage-sized gradient
        with torch.enable_grad():
            base = t.detach().requires_grad_(True).clone()
        if bases is not None:
            bases[key] = base
        return base
    if base is None:
        n = storage.nbytes() // t.element_size()
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (n,), (1,))
        with torch.enable_grad():
            base = flat.detach().requires_grad_(True).clone()  # CloneBackward: a non-leaf
        if bases is not None:
            bases[key] = base
    with torch.enable_grad():
        if base.shape == t.shape and base.stride() == t.stride():
            return base  # the same tensor again (another argument aliasing it whole)
        if t.storage_offset() == 0 and t.is_contiguous() and t.numel() == base.numel():
            # the whole storage: a plain view, whose backward is free. as_strided's backward
            # zero-fills a buffer the size of the storage and copies the gradient into it
            return base.view(t.shape)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())
