"""Let ``cbtrace.capture(...)`` work although ``cbtrace.capture`` is also a package.

Importing a submodule binds its name on the parent package, shadowing a function of the same
name; a module whose class has ``__call__`` keeps both working. The function is imported on the
first call, so importing the package stays light.
"""
import importlib
import sys
import types


def make_module_callable(module_name: str, target: str) -> None:
    """Calling module ``module_name`` calls ``target`` ("pkg.module:function")."""
    module = sys.modules[module_name]
    mod, _, attr = target.partition(":")

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(importlib.import_module(mod), attr)(*args, **kwargs)

    module.__class__ = _CallableModule
