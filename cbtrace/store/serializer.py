"""The serializer contract: how one kind of Python object becomes a JSON node and back.

A serializer has a unique ``name`` (written into each node as ``"t"``), ``handles(obj)``,
``encode(obj, ctx) -> dict`` and ``decode(node, ctx) -> obj``. Nodes are plain JSON: children
are encoded with ``ctx.encode(child)`` and tensors with ``ctx.tensor(t)``, which stores the data
by reference. Plugins register instances through the ``register_serializers`` hook; the first
serializer whose ``handles`` says yes wins (third-party ones are asked first).

A run directory is data: a class named in a node is rebuilt only through ``lookup_class``,
which never imports a module on the node's say-so unless it is one of ``ALLOWED_MODULES`` or a
registered serializer's ``modules``, installed outside the working directory and any run
directory.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from cbtrace import registry
from cbtrace.errors import SerializationError, one_line
from cbtrace.rundir.layout import MANIFEST

ALLOWED_MODULES = ("torch", "transformers", "torchrec")
"""Packages (and their submodules) whose classes stored inputs may name before they are
imported; any other class is rebuilt only once its module is imported (``sys.modules``)."""


class Serializer:
    """Do-nothing defaults; subclasses set ``name`` and override the three methods."""

    name: str = ""
    by_type: bool = False
    """True if ``handles`` depends only on ``type(obj)``: the codec may then cache its answer."""
    modules: tuple[str, ...] = ()
    """Modules whose classes this serializer's nodes name (e.g. ``("transformers.cache_utils",)``):
    ``lookup_class`` may import them, as it does ``ALLOWED_MODULES``."""

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


def lookup_class(spec: str, *, modules=()) -> type:
    """The class a stored node names (``qualname_of``'s ``"pkg.module:Outer.Inner"``), if it may
    be rebuilt; SerializationError saying why not otherwise.

    The module is taken from ``sys.modules`` when already imported; otherwise it is imported
    only if it is (under) one of ``ALLOWED_MODULES``, ``modules`` (the caller's own) or a
    registered serializer's ``modules``, and only from where it is installed: never from the
    working directory or a run directory on ``sys.path``. Names are looked up in the module's
    and classes' own ``__dict__`` (no ``__getattr__`` runs), and the object found must be a
    class whose own module and qualified name are ``spec``.
    """
    spec = str(spec)
    module_name, sep, qual = spec.partition(":")
    if "<locals>" in qual:
        raise SerializationError(f"{spec} cannot be imported (it is defined inside a function)")
    parts = qual.split(".")
    mod_parts = module_name.split(".")
    if not (sep and all(m.isidentifier() for m in mod_parts) and _plain(parts)):
        raise SerializationError(f"{spec!r} cannot be imported (not a module:Class name)")
    module = sys.modules.get(module_name)
    if module is None:
        if not (_plain(mod_parts) and _allowed(module_name, modules)):
            raise SerializationError(
                f"{spec} is not rebuilt: its module {module_name} is not imported, and stored "
                f"inputs import only {', '.join(ALLOWED_MODULES)} and registered serializers' "
                f"modules (import {module_name} before loading to allow it)")
        module = _import_installed(module_name, spec)
    obj = module
    for part in parts:
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            raise SerializationError(f"{spec} cannot be imported ({module_name} has no {qual})")
    if not isinstance(obj, type) or qualname_of(obj) != spec:
        raise SerializationError(f"{spec} does not name a class defined there")
    return obj


def _plain(names) -> bool:
    """Identifiers, none of them a dunder (``__main__``, ``__class__``, ``__init__``)."""
    return all(n.isidentifier() and not n.startswith("__") for n in names)


def _allowed(module_name: str, extra) -> bool:
    declared = [m for s in registry.serializers() for m in (getattr(s, "modules", ()) or ())]
    return any(module_name == m or module_name.startswith(m + ".")
               for m in (*ALLOWED_MODULES, *extra, *declared))


def _import_installed(module_name: str, spec: str):
    """Import an allowed module, refusing a top-level package that would be found in the
    working directory or a run directory (a ``torchrec/`` shipped inside a run)."""
    top = module_name.partition(".")[0]
    if top not in sys.modules:
        try:
            found = importlib.util.find_spec(top)  # top-level: locates without running it
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise SerializationError(f"{spec} cannot be imported (no module named {top!r})")
        for where in _locations(found):
            if _untrusted_dir(where):
                raise SerializationError(f"{spec} is not rebuilt: {top} would be imported from "
                                         f"{where}, the working directory or a run directory")
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise SerializationError(f"{spec} cannot be imported ({one_line(e)})") from None


def _locations(found) -> list[Path]:
    """Directories a found top-level module or package sits in."""
    if found.submodule_search_locations:
        return [Path(p).parent for p in found.submodule_search_locations]
    if found.origin and found.has_location:
        return [Path(found.origin).parent]
    return []  # built-in or frozen


def _untrusted_dir(d: Path) -> bool:
    d = d.resolve()
    return d == Path(os.getcwd()).resolve() or (d / MANIFEST).is_file()
