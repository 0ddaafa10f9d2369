"""Let ``cbtrace.capture(...)`` work although ``cbtrace.capture`` is also a module.

Importing a submodule binds its name on the parent package, shadowing a function of the same
name; a module whose class has ``__call__`` keeps both working.
"""
import sys
import types


def make_module_callable(module_name: str, attr: str) -> None:
    """Calling module ``module_name`` calls its attribute ``attr``."""
    module = sys.modules[module_name]

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(self, attr)(*args, **kwargs)

    module.__class__ = _CallableModule
