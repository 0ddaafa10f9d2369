"""Walking nested inputs and outputs: tuples, NamedTuples, lists, dicts, dataclasses, torchrec,
and the state objects that libraries pass between modules (transformers' caches)."""
from __future__ import annotations

import copy
import dataclasses

import torch

TORCHREC = {"KeyedJaggedTensor", "JaggedTensor", "KeyedTensor"}
# Modules whose objects are plain state (attributes holding tensors, no behaviour we must keep
# shared): copied attribute by attribute, walked for their tensors.
STATE_MODULES = ("transformers.cache_utils",)


def is_torchrec(x) -> bool:
    return type(x).__name__ in TORCHREC and type(x).__module__.startswith("torchrec")


def is_state_object(x) -> bool:
    """A transformers cache or cache layer (by its class's module, without importing it)."""
    return type(x).__module__ in STATE_MODULES and hasattr(x, "__dict__") and not isinstance(x, type)


def map_tensors(fn, obj, torchrec=None):
    """``obj`` rebuilt with ``fn(t)`` for every tensor; torchrec objects go to ``torchrec(x)``
    (default: kept as they are); state objects are copied with their attributes mapped;
    anything else is kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v, torchrec) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v, torchrec) for v in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v, torchrec) for k, v in obj.items()}
    if torchrec is not None and is_torchrec(obj):
        return torchrec(obj)
    if is_state_object(obj):  # a copy with every attribute mapped (a cache's keys and values)
        new = copy.copy(obj)
        new.__dict__.update({k: map_tensors(fn, v, torchrec) for k, v in vars(obj).items()})
        return new
    return obj


def flat_tensors(obj, out=None) -> list:
    """Every tensor reachable in ``obj`` (dataclass fields, torchrec and nested tensors'
    components included)."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor) and obj.is_nested:  # no single shape: its components
        out.extend(obj.unbind())
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            flat_tensors(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            flat_tensors(v, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            flat_tensors(getattr(obj, f.name), out)
    elif is_state_object(obj):
        for v in vars(obj).values():
            flat_tensors(v, out)
    elif is_torchrec(obj):
        for name in ("values", "weights_or_none", "lengths", "offsets"):
            fn = getattr(obj, name, None)
            v = fn() if callable(fn) else None
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out
