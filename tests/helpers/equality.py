"""Bitwise comparison of two input structures (tests, and replay's sanity checks)."""
from __future__ import annotations

import dataclasses
import struct

import torch


def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view (*shape, itemsize) of the bytes of each element, read through t's strides."""
    isz = t.element_size()
    u = torch.empty(0, dtype=torch.uint8, device=t.device)
    return u.set_(t.untyped_storage(), t.storage_offset() * isz, (*t.shape, isz),
                  (*(s * isz for s in t.stride()), 1))


def _tensor_diff(a: torch.Tensor, b: torch.Tensor, where: str) -> str | None:
    for attr in ("dtype", "shape", "device", "requires_grad"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{where}: {attr} {getattr(a, attr)} != {getattr(b, attr)}"
    for name in ("stride", "storage_offset", "is_conj", "is_neg"):
        if getattr(a, name)() != getattr(b, name)():
            return f"{where}: {name} {getattr(a, name)()} != {getattr(b, name)()}"
    if a.numel() and a.device.type != "meta" and not torch.equal(element_bytes(a),
                                                                 element_bytes(b).to(a.device)):
        return f"{where}: values differ"
    return None


def first_difference(a, b, where: str = "inputs") -> str | None:
    """None if ``a`` and ``b`` are bitwise the same structure, else where they differ."""
    if type(a) is not type(b):
        return f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        return _tensor_diff(a, b, where)
    if isinstance(a, float):
        same = struct.pack(">d", a) == struct.pack(">d", b)
        return None if same else f"{where}: {a!r} != {b!r}"
    if isinstance(a, complex):
        return (first_difference(a.real, b.real, where + ".real")
                or first_difference(a.imag, b.imag, where + ".imag"))
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            d = first_difference(a[k], b[k], f"{where}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    if dataclasses.is_dataclass(a):
        return first_difference(vars(a), vars(b), where)
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return first_difference(vars(a), vars(b), where)
    return None if a == b else f"{where}: {a!r} != {b!r}"
