"""cbtrace: a Component Benchmark for PyTorch.

Public API (each implementation is imported on first use, so that ``import cbtrace`` and
``cbtrace --help`` stay light):

    cbtrace.capture(model, out_dir, ...)        context manager, capture one step
    cbtrace.load_inputs(run, fqn, call_index)   (args, kwargs) exactly as captured
    cbtrace.replay(run, model=None, device=None)  isolated replay -> DataFrame
    cbtrace.attribute(paths)                     in-situ time per module from Kineto traces
    cbtrace.annotate(...)                        annotated_<trace> for Perfetto / TensorBoard
    cbtrace.trace_handler(dir_name)              drop-in for tensorboard_trace_handler
"""
# The packages of the same names are loaded first: importing a package binds its name here,
# which would otherwise replace the function on first use of the package.
import cbtrace.annotate
import cbtrace.capture
import cbtrace.replay  # noqa: F401 - bound before the function of the same name
from cbtrace.api import annotate, capture, replay
from cbtrace._version import __version__
from cbtrace.errors import CbtraceError

# name -> (module, attribute), imported on first access
_LAZY = {
    "trace_handler": ("cbtrace.annotate.trace_handler", "trace_handler"),
    "CaptureConfig": ("cbtrace.capture.recorder", "CaptureConfig"),
    "load_inputs": ("cbtrace.store.load", "load_inputs"),
    "load_run": ("cbtrace.rundir.read", "load_run"),
    "ModuleRecord": ("cbtrace.schema.modules", "ModuleRecord"),
    "ReplayConfig": ("cbtrace.replay.config", "ReplayConfig"),
    "attribute": ("cbtrace.attribution.attribute", "attribute"),
    "Provider": ("cbtrace.model.provider", "Provider"),
    "RecSysProvider": ("cbtrace.model.provider", "RecSysProvider"),
}

__all__ = ["CbtraceError", "__version__", "annotate", "capture", "replay", *_LAZY]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'cbtrace' has no attribute '{name}'")
