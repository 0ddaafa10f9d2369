"""Built-in serializers: tensors, Python scalars and containers, torch enums, records.

Scalars are stored bit-exactly (floats as their IEEE-754 bits, big ints as decimal strings).
Exact types are matched so that a subclass (an IntEnum, a numpy float) is never silently
turned into its base type.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import keyword
import struct

import torch

from cbtrace.errors import SerializationError
from cbtrace.store.serializer import Serializer, lookup_class, qualname_of

_JSON_INT = 2**53  # ints beyond this are stored as strings (JSON readers use doubles)


def _fbits(x: float) -> str:
    return struct.pack(">d", x).hex()


def _unfbits(s: str) -> float:
    return struct.unpack(">d", bytes.fromhex(s))[0]


class _Exact(Serializer):
    """Handles objects whose type is exactly one of ``types``."""
    by_type = True  # handles() looks at type(obj) only

    types: tuple = ()

    def handles(self, obj) -> bool:
        return type(obj) in self.types


class TensorSerializer(Serializer):
    by_type = True  # handles() looks at type(obj) only
    name = "tensor"

    def handles(self, obj):
        return type(obj) in (torch.Tensor, torch.nn.Parameter)

    def encode(self, obj, ctx):
        return ctx.tensor(obj)

    def decode(self, node, ctx):
        return ctx.tensor(node)


class _Singleton(_Exact):
    """The one value of its type: stored as its name only."""

    value = None

    def encode(self, obj, ctx):
        return {}

    def decode(self, node, ctx):
        return self.value


class NoneSerializer(_Singleton):
    name, types, value = "none", (type(None),), None


class EllipsisSerializer(_Singleton):
    name, types, value = "ellipsis", (type(Ellipsis),), Ellipsis


class BoolSerializer(_Exact):
    name, types = "bool", (bool,)

    def encode(self, obj, ctx):
        return {"v": obj}

    def decode(self, node, ctx):
        return bool(node["v"])


class IntSerializer(_Exact):
    name, types = "int", (int,)

    def encode(self, obj, ctx):
        return {"v": obj if -_JSON_INT < obj < _JSON_INT else str(obj)}

    def decode(self, node, ctx):
        return int(node["v"])


class FloatSerializer(_Exact):
    name, types = "float", (float,)

    def encode(self, obj, ctx):
        return {"v": _fbits(obj)}

    def decode(self, node, ctx):
        return _unfbits(node["v"])


class ComplexSerializer(_Exact):
    name, types = "complex", (complex,)

    def encode(self, obj, ctx):
        return {"v": [_fbits(obj.real), _fbits(obj.imag)]}

    def decode(self, node, ctx):
        return complex(_unfbits(node["v"][0]), _unfbits(node["v"][1]))


class StrSerializer(_Exact):
    name, types = "str", (str,)

    def encode(self, obj, ctx):
        return {"v": obj}  # json escapes lone surrogates and reads them back

    def decode(self, node, ctx):
        return node["v"]


class BytesSerializer(_Exact):
    name, types = "bytes", (bytes, bytearray)

    def encode(self, obj, ctx):
        node = {"v": base64.b64encode(obj).decode("ascii")}
        if type(obj) is bytearray:
            node["mutable"] = True
        return node

    def decode(self, node, ctx):
        data = base64.b64decode(node["v"])
        return bytearray(data) if node.get("mutable") else data


class TorchEnumSerializer(Serializer):
    """torch.dtype, torch.layout, torch.memory_format: stored by their torch attribute name."""
    by_type = True  # handles() looks at type(obj) only

    name = "torch_enum"
    _types = (torch.dtype, torch.layout, torch.memory_format)

    def handles(self, obj):
        return isinstance(obj, self._types)

    def encode(self, obj, ctx):
        return {"v": str(obj).removeprefix("torch.")}

    def decode(self, node, ctx):
        obj = getattr(torch, node["v"], None)
        if not isinstance(obj, self._types):
            raise SerializationError(f"this torch has no {node['v']!r} (dtype, layout or format)")
        return obj


class DeviceSerializer(_Exact):
    name, types = "device", (torch.device,)

    def encode(self, obj, ctx):
        return {"v": str(obj)}

    def decode(self, node, ctx):
        return torch.device(node["v"])


class SizeSerializer(_Exact):
    name, types = "size", (torch.Size,)

    def encode(self, obj, ctx):
        return {"v": list(obj)}

    def decode(self, node, ctx):
        return torch.Size(node["v"])


class SliceSerializer(_Exact):
    name, types = "slice", (slice,)

    def encode(self, obj, ctx):
        return {"v": [ctx.encode(obj.start), ctx.encode(obj.stop), ctx.encode(obj.step)]}

    def decode(self, node, ctx):
        return slice(*(ctx.decode(n) for n in node["v"]))


class EnumSerializer(Serializer):
    """An Enum member, by class and member name; the class must pass ``lookup_class``."""
    by_type = True  # handles() looks at type(obj) only

    name = "enum"

    def handles(self, obj):
        return isinstance(obj, enum.Enum)

    def encode(self, obj, ctx):
        return {"cls": qualname_of(type(obj)), "member": obj.name}

    def decode(self, node, ctx):
        where = f"enum {node['cls']}.{node['member']}"
        try:
            cls = lookup_class(node["cls"])
        except SerializationError as e:
            raise SerializationError(f"{where} cannot be rebuilt: {e}") from None
        if not issubclass(cls, enum.Enum):
            raise SerializationError(f"{where} cannot be rebuilt: {node['cls']} is not an Enum")
        try:
            return cls[node["member"]]
        except KeyError:
            raise SerializationError(f"{where} cannot be rebuilt: no such member") from None


def _is_namedtuple_type(cls) -> bool:
    return (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")
            and hasattr(cls, "_make"))


class NamedTupleSerializer(Serializer):
    """A namedtuple; rebuilt by class if ``lookup_class`` allows it, else as a look-alike
    ``collections.namedtuple`` with the same name and fields."""
    by_type = True  # handles() looks at type(obj) only

    name = "namedtuple"

    def handles(self, obj):
        return _is_namedtuple_type(type(obj))

    def encode(self, obj, ctx):
        return {"cls": qualname_of(type(obj)), "fields": list(obj._fields),
                "v": [ctx.encode(x) for x in obj]}

    def decode(self, node, ctx):
        values = [ctx.decode(n) for n in node["v"]]
        fields = tuple(node["fields"])
        try:
            cls = lookup_class(node["cls"])
        except SerializationError:
            cls = None
        if not (_is_namedtuple_type(cls) and tuple(cls._fields) == fields):
            name = node["cls"].rpartition(".")[2].rpartition(":")[2]
            try:  # namedtuple checks each name is an identifier before it builds anything
                ok = name.isidentifier() and not keyword.iskeyword(name)
                cls = collections.namedtuple(name if ok else "Record", fields)
            except (TypeError, ValueError) as e:
                raise SerializationError(f"namedtuple {node['cls']}: {e}") from None
        return cls._make(values)


class DataclassSerializer(Serializer):
    """A dataclass instance: init fields through the constructor, the others set afterwards.
    The class must pass ``lookup_class`` (a look-alike would hide its methods from the module)."""
    by_type = True  # handles() looks at type(obj) only

    name = "dataclass"

    def handles(self, obj):
        return dataclasses.is_dataclass(obj) and not isinstance(obj, type)

    def encode(self, obj, ctx):
        init, other = {}, {}
        own = getattr(obj, "__dict__", None)
        for f in dataclasses.fields(obj):
            if f.init:
                init[f.name] = ctx.encode(getattr(obj, f.name))
            elif (f.name in own) if own is not None else hasattr(obj, f.name):
                other[f.name] = ctx.encode(getattr(obj, f.name))  # not a class-level default
        return {"cls": qualname_of(type(obj)), "init": init, "other": other}

    def decode(self, node, ctx):
        try:
            cls = lookup_class(node["cls"])
        except SerializationError as e:
            raise SerializationError(f"dataclass {e}") from None
        if not dataclasses.is_dataclass(cls):
            raise SerializationError(f"{node['cls']} is no longer a dataclass; not building it")
        # built as data: no __init__ or __post_init__ of a class the run names runs
        obj = object.__new__(cls)
        for k, v in [*node["init"].items(), *node["other"].items()]:
            object.__setattr__(obj, k, ctx.decode(v))
        return obj


class TupleSerializer(_Exact):
    name, types = "tuple", (tuple,)

    def encode(self, obj, ctx):
        return {"v": [ctx.encode(x) for x in obj]}

    def decode(self, node, ctx):
        return tuple(ctx.decode(n) for n in node["v"])


class ListSerializer(_Exact):
    name, types = "list", (list,)

    def encode(self, obj, ctx):
        return {"v": [ctx.encode(x) for x in obj]}

    def decode(self, node, ctx):
        return [ctx.decode(n) for n in node["v"]]


class DictSerializer(_Exact):
    """dict and OrderedDict, as [key, value] pairs (keys need not be strings)."""

    name, types = "dict", (dict, collections.OrderedDict)

    def encode(self, obj, ctx):
        node = {"v": [[ctx.encode(k), ctx.encode(v)] for k, v in obj.items()]}
        if type(obj) is collections.OrderedDict:
            node["ordered"] = True
        return node

    def decode(self, node, ctx):
        cls = collections.OrderedDict if node.get("ordered") else dict
        return cls((ctx.decode(k), ctx.decode(v)) for k, v in node["v"])


SERIALIZERS = (
    TensorSerializer(), NoneSerializer(), BoolSerializer(), IntSerializer(), FloatSerializer(),
    ComplexSerializer(), StrSerializer(), BytesSerializer(), TorchEnumSerializer(),
    DeviceSerializer(), SizeSerializer(), SliceSerializer(), EllipsisSerializer(),
    EnumSerializer(), NamedTupleSerializer(), DataclassSerializer(), TupleSerializer(),
    ListSerializer(), DictSerializer(),
)
