"""Inputs of plain-attribute classes no other serializer takes (torchvision's ``ImageList``, a
torch_geometric batch, a user's own record class), stored as data: the class's qualified name
and its attributes (``__dict__`` and ``__slots__``), each encoded like any other input.

Only classes of allowlisted packages are stored or rebuilt: ``DEFAULT_PACKAGES``, plus those
the user names in ``CBTRACE_INPUT_CLASSES`` (comma-separated module names; a package covers its
submodules) or with ``allow_input_classes``; never a name the run gives. Rebuilding imports the
class's module only when it is allowlisted (installed, never from the working or a run
directory), creates the instance with ``object.__new__`` and sets its attributes directly: no
``__init__``, ``__setattr__`` or other code of the run's choosing runs.
"""
from __future__ import annotations

import os

import torch

from cbtrace.errors import SerializationError
from cbtrace.store.serializer import Serializer, lookup_class, qualname_of

DEFAULT_PACKAGES = ("torchvision", "torchaudio", "torch_geometric")
ENV = "CBTRACE_INPUT_CLASSES"
_added: list[str] = []
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not a C type


class _Slotted:
    __slots__ = ("x",)


_MEMBER = type(_Slotted.__dict__["x"])  # the descriptor type __slots__ makes

# classes whose instances hold state object.__new__ cannot make, or that are no plain record
_NOT_PLAIN = (type, BaseException, torch.Tensor, torch.nn.Module, tuple, list, dict, set,
              frozenset, str, bytes, bytearray, int, float, complex)


def allow_input_classes(*modules: str) -> None:
    """Allow the classes of ``modules`` (and their submodules) as stored inputs, for this
    process; the same as listing them in ``CBTRACE_INPUT_CLASSES``."""
    for m in modules:
        if not all(p.isidentifier() for p in m.split(".")):
            raise ValueError(f"allow_input_classes: {m!r} is not a module name")
        _added.append(m)


def allowed_packages() -> tuple[str, ...]:
    """The allowlist: built-in packages, the environment's and ``allow_input_classes``'."""
    env = [m.strip() for m in os.environ.get(ENV, "").split(",") if m.strip()]
    return (*DEFAULT_PACKAGES, *env, *_added)


def is_allowed(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in allowed_packages())


def slot_names(cls: type) -> list[tuple[str, type]]:
    """(attribute name, defining class) of every ``__slots__`` entry along the MRO, private
    names mangled as Python stores them."""
    out = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            out.append((name, klass))
    return out


class PlainObjectSerializer(Serializer):
    """An instance of an allowlisted class that holds its state in plain attributes."""

    by_type = True  # handles() looks at type(obj) only
    name = "object"

    def handles(self, obj):
        cls = type(obj)
        return is_allowed(cls.__module__) and is_plain(cls)

    def encode(self, obj, ctx):
        state = {k: ctx.encode(v) for k, v in getattr(obj, "__dict__", {}).items()}
        slots = {}
        for name, klass in slot_names(type(obj)):
            try:
                value = _slot_descriptor(klass, name).__get__(obj, klass)
            except AttributeError:
                continue  # an unset slot stays unset
            slots[name] = ctx.encode(value)
        return {"cls": qualname_of(type(obj)), "dict": state, "slots": slots}

    def decode(self, node, ctx):
        spec = str(node.get("cls"))
        module = spec.partition(":")[0]
        if not is_allowed(module):
            raise SerializationError(
                f"input class {spec} is not rebuilt: {module} is not on the input-class "
                f"allowlist ({', '.join(allowed_packages())}); add it with {ENV}={module}")
        try:
            cls = lookup_class(spec, modules=(module,))
        except SerializationError as e:
            raise SerializationError(f"input class {e}") from None
        if not is_plain(cls):
            raise SerializationError(f"input class {spec} is not a plain-attribute class")
        try:
            obj = object.__new__(cls)
        except TypeError as e:
            raise SerializationError(f"input class {spec} cannot be made without its "
                                     f"constructor ({e})") from None
        state = {k: ctx.decode(v) for k, v in node.get("dict", {}).items()}
        if state:
            if not hasattr(obj, "__dict__"):
                raise SerializationError(f"input class {spec} has no __dict__ now")
            vars(obj).update(state)  # no __setattr__ of the class runs
        slots = dict(slot_names(cls))
        for name, v in node.get("slots", {}).items():
            if name not in slots:
                raise SerializationError(f"input class {spec} has no slot {name!r} now")
            _slot_descriptor(slots[name], name).__set__(obj, ctx.decode(v))
        return obj


def is_plain(cls: type) -> bool:
    """Instances keep their state in ``__dict__`` or ``__slots__`` of Python classes only, so
    ``object.__new__`` and setting those attributes make one."""
    return (not issubclass(cls, _NOT_PLAIN)
            and all(k is object or k.__flags__ & _HEAPTYPE for k in cls.__mro__)
            and bool(cls.__dictoffset__ or slot_names(cls)))


def _slot_descriptor(klass: type, name: str):
    """The member descriptor ``__slots__`` made for ``name`` (its mangled name) in ``klass``;
    nothing else (a property of that name would run the class's code)."""
    d = klass.__dict__.get(name)
    if type(d) is not _MEMBER:
        raise SerializationError(f"{qualname_of(klass)}: {name!r} is not a plain slot")
    return d
