"""The built-in providers' weights, built fast and the same everywhere.

A model is constructed without PyTorch's default init (which a provider overwrites anyway), then
every parameter is filled in chunks of ``CHUNK`` elements, each from its own CPU generator
seeded from (seed, parameter name, chunk index), on a thread pool: torch releases the GIL in
``normal_``/``uniform_``, which run on one core each, so DLRM's
839 M parameters take a core each instead of one for all. The values depend on the seed and the
names only: not on the device the model goes to, nor on how the threads are scheduled.
"""
from __future__ import annotations

import contextlib
import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

CHUNK = 1 << 22  # elements per generator (16 MiB of float32): one big table spans threads
# the nn.init functions that dispatch through torch-function modes (the ones nn.Linear,
# nn.Embedding(Bag) and nanoGPT's init call); zeros_/ones_ run (cheap fills, overwritten)
DEFAULT_INIT = frozenset({nn.init.uniform_, nn.init.normal_, nn.init.constant_,
                          nn.init.kaiming_uniform_})


class _SkipInit(TorchFunctionMode):
    """Returns the tensor an init function was asked to fill, untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DEFAULT_INIT:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def skip_init():
    """Modules constructed inside get uninitialised parameters (no meta device: a random op on
    meta imports torch._dynamo, seconds of import)."""
    with _SkipInit():
        yield


def build(make, device, seed: int, fill):
    """``make()`` constructed without its default init, every parameter filled by
    ``fill(name, module, param) -> (op, a, b)`` (``init_parameters``), moved to ``device``.
    On the meta device (module naming builds there) nothing is filled."""
    with skip_init():
        model = make()
    if not any(p.is_meta for p in model.parameters()):
        init_parameters(model, seed, fill)
    return model.to(device)


def init_parameters(model: nn.Module, seed: int, fill) -> None:
    """Fill each parameter (a tied one once, under its first name) as ``fill`` says:
    ("normal", mean, std), ("uniform", low, high) or ("constant", value, None)."""
    owner = {}
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            owner.setdefault(id(p), m)
    jobs = []
    for name, p in model.named_parameters():
        op, a, b = fill(name, owner[id(p)], p)
        if op not in ("normal", "uniform", "constant"):
            raise ValueError(f"fill: {name}: unknown op {op!r}")
        flat = p.data.view(-1)
        jobs += [(flat[i:i + CHUNK], op, a, b, chunk_seed(seed, name, i // CHUNK))
                 for i in range(0, flat.numel(), CHUNK)]
    # p.data: views that do not require grad, so no no_grad() (thread-local) is needed
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for _ in pool.map(_fill_chunk, jobs):
            pass


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """A 64-bit generator seed for one chunk of one parameter."""
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _fill_chunk(job) -> None:
    part, op, a, b, s = job
    if op == "constant":
        part.fill_(a)
        return
    g = torch.Generator().manual_seed(s)
    if op == "normal":
        part.normal_(a, b, generator=g)
    else:
        part.uniform_(a, b, generator=g)
