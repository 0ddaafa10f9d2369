"""cbtrace: a Component Benchmark for PyTorch.

Public API (imported lazily so that ``import cbtrace`` and ``cbtrace --help`` stay light):

    cbtrace.capture(model, out_dir, ...)        context manager, capture one step
    cbtrace.load_inputs(run, fqn, call_index)   (args, kwargs) exactly as captured
    cbtrace.replay(run, model=None, device=None)  isolated replay -> DataFrame
    cbtrace.attribute(paths)                     in-situ time per module from Kineto traces
    cbtrace.annotate(...)                        annotated_<trace> for Perfetto / TensorBoard
    cbtrace.trace_handler(dir_name)              drop-in for tensorboard_trace_handler
"""
from cbtrace.errors import CbtraceError

__version__ = "0.1.0"

_LAZY = {
    "CaptureConfig": ("cbtrace.capture", "CaptureConfig"),
    "load_inputs": ("cbtrace.rundir", "load_inputs"),
    "load_run": ("cbtrace.rundir", "load_run"),
    "ModuleRecord": ("cbtrace.records", "ModuleRecord"),
    "ReplayConfig": ("cbtrace.replay.config", "ReplayConfig"),
    "attribute": ("cbtrace.attribution.attribute", "attribute"),
    "Provider": ("cbtrace.plugins.providers.base", "Provider"),
    "RecSysProvider": ("cbtrace.plugins.providers.base", "RecSysProvider"),
}

# cbtrace.<name> is both a module and callable as the function of the same name
_CALLABLE_MODULES = ("capture", "replay", "annotate", "trace_handler")

__all__ = ["CbtraceError", "__version__", *_CALLABLE_MODULES, *_LAZY]


def __getattr__(name):
    import importlib

    if name in _CALLABLE_MODULES:  # modules that are also the function of their name
        return importlib.import_module(f"cbtrace.{name}")
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'cbtrace' has no attribute '{name}'")
