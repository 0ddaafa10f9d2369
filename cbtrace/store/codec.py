"""Walk a nested (args, kwargs) structure with the registered serializers, both ways.

Encoding never raises for user data: an object no serializer handles (or whose serializer
fails) becomes ``{"t": "unsupported", "type": ...}``, and decoding that node raises
``SerializationError`` naming the type, so replay can mark just that call as an error.
"""
from __future__ import annotations

import torch

from cbtrace.errors import PluginError, SerializationError, one_line

UNSUPPORTED = "unsupported"
NESTED = "nested"  # a nested tensor: its components, each a tensor node, and its layout
MAX_DEPTH = 100  # deeper nesting is almost surely a cycle
HOW_TO_REGISTER = ("no serializer handles it; register one with the register_serializers hook "
                   "(docs/ARCHITECTURE.md, 'a serializer')")


def type_name(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def unsupported(obj, why: str | None = None) -> dict:
    node = {"t": UNSUPPORTED, "type": type_name(obj)}
    if why:
        node["why"] = one_line(why) or why
    return node


def by_name(serializers) -> dict:
    """name -> serializer; two serializers with one name is a plugin error."""
    table = {}
    for s in serializers:
        if not s.name or s.name == UNSUPPORTED:
            raise PluginError(f"serializer {type_name(s)}: invalid name {s.name!r}")
        if s.name in table:
            raise PluginError(f"serializer name '{s.name}' is registered twice "
                              f"({type_name(table[s.name])}, {type_name(s)})")
        table[s.name] = s
    return table


def _is_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor)


class EncodeContext:
    """Given to ``Serializer.encode``: ``encode(child)`` recurses, ``tensor(t)`` stores a tensor."""

    def __init__(self, serializers, put_tensor, type_cache: dict | None = None):
        self._serializers = serializers  # checked with by_name() by the caller, once
        self._put_tensor = put_tensor
        self._depth = 0
        # type -> serializer, filled only where every serializer asked decides by type alone:
        # capture runs inside a with_stack-traced step, where each handles() call is an event
        self._cache = {} if type_cache is None else type_cache

    def _find(self, obj):
        s = self._cache.get(type(obj))
        if s is not None:
            return s
        cacheable = True
        for s in self._serializers:
            try:
                ok = s.handles(obj)
            except Exception:  # a plugin's handles() must not break capture
                ok = False
            cacheable = cacheable and getattr(s, "by_type", False)
            if ok:
                if cacheable:
                    self._cache[type(obj)] = s
                return s
        return None

    def encode(self, obj) -> dict:
        if self._depth >= MAX_DEPTH:
            return unsupported(obj, f"nested more than {MAX_DEPTH} levels deep")
        if getattr(obj, "is_nested", False) is True and _is_tensor(obj):  # strided or jagged
            return self._nested(obj)
        s = self._find(obj)
        if s is not None:
            self._depth += 1
            try:
                node = s.encode(obj, self)
            except Exception as e:
                return unsupported(obj, f"serializer '{s.name}' failed: {e}")
            finally:
                self._depth -= 1
            node["t"] = s.name  # in place: a tensor node is filled in after the walk
            return node
        return unsupported(obj)

    def tensor(self, t) -> dict:
        """A node for tensor ``t``; its data is copied now and stored by reference."""
        return self._put_tensor(t)

    def _nested(self, t) -> dict:
        """A nested tensor (TransformerEncoder's padding-mask path makes one) as its
        components: each a strided view, stored like any tensor."""
        try:
            parts = [self.encode(c.detach()) for c in t.unbind()]
        except Exception as e:  # noqa: BLE001 - an odd nested tensor must not fail the capture
            return unsupported(t, f"nested tensor: {e}")
        return {"t": NESTED, "layout": str(t.layout).removeprefix("torch."), "parts": parts,
                "rg": int(t.requires_grad)}


class DecodeContext:
    """Given to ``Serializer.decode``: ``decode(child)`` recurses, ``tensor(node)`` loads."""

    def __init__(self, serializers, get_tensor):
        self._by_name = by_name(serializers)
        self._get_tensor = get_tensor

    def decode(self, node):
        if not isinstance(node, dict) or "t" not in node:
            raise SerializationError(f"inputs_ref: malformed node {str(node)[:80]}")
        kind = node["t"]
        if kind == UNSUPPORTED:
            raise SerializationError(f"input of type {node.get('type')} was not captured: "
                                     + (node.get("why") or HOW_TO_REGISTER))
        if kind == NESTED:
            return self._nested(node)
        s = self._by_name.get(kind)
        if s is None:
            raise SerializationError(f"inputs_ref: no serializer named '{kind}' is registered "
                                     "(is the plugin that captured it installed?)")
        return s.decode(node, self)

    def tensor(self, node: dict):
        return self._get_tensor(node)

    def _nested(self, node: dict):
        layout = {"strided": torch.strided, "jagged": torch.jagged}.get(node.get("layout"))
        if layout is None or not isinstance(node.get("parts"), list):
            raise SerializationError(f"inputs_ref: malformed nested tensor node "
                                     f"(layout {str(node.get('layout'))[:40]})")
        parts = [self.decode(p) for p in node["parts"]]
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise SerializationError("inputs_ref: a nested tensor component is not a tensor")
        return torch.nested.nested_tensor(parts, layout=layout,
                                          requires_grad=bool(node.get("rg")))
