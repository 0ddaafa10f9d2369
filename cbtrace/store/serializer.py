"""The serializer contract: how one kind of Python object becomes a JSON node and back.

A serializer has a unique ``name`` (written into each node as ``"t"``), ``handles(obj)``,
``encode(obj, ctx) -> dict`` and ``decode(node, ctx) -> obj``. Nodes are plain JSON: children
are encoded with ``ctx.encode(child)`` and tensors with ``ctx.tensor(t)``, which stores the data
by reference. Plugins register instances through the ``register_serializers`` hook; the first
serializer whose ``handles`` says yes wins (third-party ones are asked first).
"""
from __future__ import annotations

import importlib


class Serializer:
    """Do-nothing defaults; subclasses set ``name`` and override the three methods."""

    name: str = ""
    by_type: bool = False
    """True if ``handles`` depends only on ``type(obj)``: the codec may then cache its answer."""

    def handles(self, obj) -> bool:
        """True if this serializer encodes ``obj``."""
        return False

    def encode(self, obj, ctx) -> dict:
        """``obj`` -> JSON-able dict (``"t"`` is added by the codec)."""
        raise NotImplementedError

    def decode(self, node: dict, ctx):
        """A node written by ``encode`` -> the object."""
        raise NotImplementedError


def qualname_of(cls: type) -> str:
    """``"package.module:Outer.Inner"`` for a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def import_qualname(spec: str):
    """Import a class named by ``qualname_of``; raises ImportError or AttributeError."""
    module, _, qual = spec.partition(":")
    if "<locals>" in qual:
        raise ImportError(f"{spec} is defined inside a function")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj
