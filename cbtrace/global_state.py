"""Process-wide settings that replay, calibration and capture may change, and the one guard
that gives them back (``GlobalSettings``): whatever cbtrace does, the caller's RNG streams,
default dtype, grad mode, autocast, cuDNN/TF32 flags, matmul precision, deterministic
algorithms, SDPA backends and thread counts are as it left them.
"""
from __future__ import annotations

import torch


class GlobalSettings:
    """What replay, calibration and capture may change process-wide and must give back: every
    RNG (torch CPU and CUDA, Python ``random``, numpy's global one), the default dtype, grad
    mode, autocast, cuDNN and TF32 flags, matmul precision, deterministic algorithms, SDPA
    backends and torch's thread counts. ``with GlobalSettings():`` (or as a decorator) puts
    back on exit, even on error, each one that differs from what it found on entry."""

    def __enter__(self):
        self._saved = read_globals()
        self._cuda = _cuda_ready()
        self._seed = torch.initial_seed()  # torch.manual_seed's, which CUDA takes at its start
        return self

    def __exit__(self, *exc):
        reseeded = torch.initial_seed() != self._seed  # torch.manual_seed inside (a provider)
        restore_globals(self._saved)
        if not self._cuda and _cuda_ready():  # CUDA started inside: its RNG as it would begin
            for g in torch.cuda.default_generators:
                g.manual_seed(self._seed if reseeded else g.initial_seed())
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            with GlobalSettings():
                return fn(*args, **kwargs)
        return guarded


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


# name -> (read, write) of each process-wide setting; a name a torch build lacks is skipped.
# The legacy TF32 flags and matmul precision are views of the fp32_precision fields (torch
# 2.9+; reading them raises once the two APIs were mixed): set first, the fields after them
# have the last word.
def _attr(path: str):
    obj, _, name = path.rpartition(".")

    def read():
        return getattr(_resolve(obj), name)

    def write(v):
        setattr(_resolve(obj), name, v)
    return read, write


def _resolve(path: str):
    obj = torch
    for part in path.split(".")[1:]:  # "torch.backends.cuda.matmul": attributes, not modules
        obj = getattr(obj, part)
    return obj


def _autocast(device: str):
    def read():
        return (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))

    def write(v):
        torch.set_autocast_enabled(device, v[0])
        torch.set_autocast_dtype(device, v[1])
    return read, write


def _deterministic():
    def read():
        return (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())

    def write(v):
        torch.use_deterministic_algorithms(v[0], warn_only=v[1])
    return read, write


def _sdp(name: str):
    b = torch.backends.cuda
    return getattr(b, f"{name}_sdp_enabled"), getattr(b, f"enable_{name}_sdp")


def _numpy_rng():
    import numpy as np

    return np.random.get_state, np.random.set_state


def _python_rng():
    import random

    return random.getstate, random.setstate


def _cuda_rng():
    def read():
        return torch.cuda.get_rng_state_all() if _cuda_ready() else None

    def write(v):
        if v is not None:
            torch.cuda.set_rng_state_all(v)
    return read, write


def _threads():
    def write(n):
        torch.set_num_threads(n)
    return torch.get_num_threads, write


def _interop_threads():
    def write(n):  # settable once, before any inter-op work: only read back after that
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:
            pass
    return torch.get_num_interop_threads, write


GLOBALS = {
    "torch_rng": (torch.random.get_rng_state, torch.random.set_rng_state),
    "cuda_rng": _cuda_rng(),
    "python_rng": _python_rng(),
    "numpy_rng": _numpy_rng(),
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "grad_enabled": (torch.is_grad_enabled, torch.set_grad_enabled),
    "autocast_cpu": _autocast("cpu"),
    "autocast_cuda": _autocast("cuda"),
    "autocast_cache": (torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
    "deterministic_algorithms": _deterministic(),
    "cudnn_enabled": _attr("torch.backends.cudnn.enabled"),
    "cudnn_benchmark": _attr("torch.backends.cudnn.benchmark"),
    "cudnn_deterministic": _attr("torch.backends.cudnn.deterministic"),
    "cudnn_allow_tf32": _attr("torch.backends.cudnn.allow_tf32"),
    "matmul_allow_tf32": _attr("torch.backends.cuda.matmul.allow_tf32"),
    "float32_matmul_precision": (torch.get_float32_matmul_precision,
                                 torch.set_float32_matmul_precision),
    "fp32_precision": _attr("torch.backends.fp32_precision"),
    "cuda_matmul_fp32_precision": _attr("torch.backends.cuda.matmul.fp32_precision"),
    "cudnn_fp32_precision": _attr("torch.backends.cudnn.fp32_precision"),
    "cudnn_conv_fp32_precision": _attr("torch.backends.cudnn.conv.fp32_precision"),
    "cudnn_rnn_fp32_precision": _attr("torch.backends.cudnn.rnn.fp32_precision"),
    "mkldnn_fp32_precision": _attr("torch.backends.mkldnn.fp32_precision"),
    "mkldnn_matmul_fp32_precision": _attr("torch.backends.mkldnn.matmul.fp32_precision"),
    "mkldnn_conv_fp32_precision": _attr("torch.backends.mkldnn.conv.fp32_precision"),
    "mkldnn_rnn_fp32_precision": _attr("torch.backends.mkldnn.rnn.fp32_precision"),
    "matmul_fp16_reduced_precision": _attr(
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction"),
    "matmul_bf16_reduced_precision": _attr(
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"),
    "sdp_flash": _sdp("flash"),
    "sdp_mem_efficient": _sdp("mem_efficient"),
    "sdp_math": _sdp("math"),
    "sdp_cudnn": _sdp("cudnn"),
    "num_threads": _threads(),
    "num_interop_threads": _interop_threads(),
}

_UNREADABLE = object()  # a legacy flag that raises once the old and new TF32 APIs were mixed


def read_globals() -> dict:
    """name -> value of every setting in ``GLOBALS`` this torch has."""
    out = {}
    for name, (read, _) in GLOBALS.items():
        try:
            out[name] = read()
        except (AttributeError, RuntimeError):
            out[name] = _UNREADABLE
    return out


def restore_globals(saved: dict) -> list[str]:
    """Set back each setting of ``saved`` (``read_globals``) that now differs; the names set."""
    changed = []
    for name, value in saved.items():
        if value is _UNREADABLE:
            continue
        read, write = GLOBALS[name]
        try:
            if same_value(read(), value):
                continue
        except (AttributeError, RuntimeError):
            pass
        write(value)
        changed.append(name)
    return changed


def same_value(a, b) -> bool:
    """Equality of settings, tensors (RNG states) and numpy's RNG tuple included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy as np

        return bool(np.array_equal(a, b))
    return a == b
