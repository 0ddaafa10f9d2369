"""Plugin manager: loads built-ins and entry points once, lazily.

Third-party entry points (group ``cbtrace``) are loaded unless ``CBTRACE_DISABLE_PLUGIN_AUTOLOAD``
is set (as pytest's ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``): the test suite sets it, so tests see
only what they register themselves, while a user's process that merely imports pytest keeps its
plugins. ``load(entrypoints=True)`` loads them regardless.
"""
from __future__ import annotations

import os
import threading

import pluggy

from cbtrace import hookspecs
from cbtrace.errors import PluginError

DEFAULT_PLUGINS = (
    "cbtrace.plugins.providers.hooks",
    "cbtrace.plugins.inputs.hooks",
    "cbtrace.plugins.backends.hooks",
    "cbtrace.plugins.reporters.hooks",
)

DISABLE_AUTOLOAD = "CBTRACE_DISABLE_PLUGIN_AUTOLOAD"

pm = pluggy.PluginManager("cbtrace")
pm.add_hookspecs(hookspecs)
_lock = threading.Lock()
_loaded = {"builtins": False, "entrypoints": False}


def load(*, entrypoints: bool | None = None) -> pluggy.PluginManager:
    """Register built-ins and (outside pytest) third-party entry points, once."""
    import importlib

    with _lock:
        if not _loaded["builtins"]:
            for name in DEFAULT_PLUGINS:
                try:
                    mod = importlib.import_module(name)
                except ModuleNotFoundError as e:
                    if e.name != name:
                        raise
                    continue  # a layer with no built-ins in this install
                if not pm.is_registered(mod):
                    pm.register(mod, name=name)
            _loaded["builtins"] = True
        if entrypoints is None:
            entrypoints = not os.environ.get(DISABLE_AUTOLOAD)
        if entrypoints and not _loaded["entrypoints"]:
            pm.load_setuptools_entrypoints("cbtrace")
            _loaded["entrypoints"] = True
    return pm


def _collect(hook_name: str, keyed: bool):
    load()
    table: dict = {}
    items: list = []

    def register(*args):
        if keyed:
            name, obj = args
            if name in table:
                raise PluginError(f"{hook_name}: '{name}' is registered twice")
            table[name] = obj
        else:
            (obj,) = args
            items.append(obj)

    getattr(pm.hook, hook_name)(register=register)
    return table if keyed else items


def models() -> dict:
    """name -> provider factory."""
    return _collect("register_models", keyed=True)


def serializers() -> list:
    """Input serializers, in registration order (plugins first, built-ins last)."""
    return _collect("register_serializers", keyed=False)


def backends() -> dict:
    """name -> measurement backend."""
    return _collect("register_backends", keyed=True)


def reporters() -> dict:
    """name -> reporter."""
    return _collect("register_reporters", keyed=True)
