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

# name -> (module, attribute). ``capture``, ``replay`` and ``annotate`` are packages that are
# also callable (``cbtrace._callable``), so they are imported as modules.
_LAZY = {
    "capture": ("cbtrace.capture", None),
    "replay": ("cbtrace.replay", None),
    "annotate": ("cbtrace.annotate", None),
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

__all__ = ["CbtraceError", "__version__", *_LAZY]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        mod, attr = _LAZY[name]
        module = importlib.import_module(mod)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'cbtrace' has no attribute '{name}'")
