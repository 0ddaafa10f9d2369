"""The call under test: one captured module call, ready to run on rotating input copies."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from cbtrace.cost.dtypes import torch_dtype
from cbtrace.replay.copies import clone_like, embedding_copies, n_copies, tensor_bytes


def call_context(rec, device_type: str | None = None):
    """Grad mode and autocast as at capture time, on the replay device."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.set_grad_enabled(bool(rec.grad_enabled)))
    if rec.autocast_dtype:
        dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        stack.enter_context(torch.autocast(dev, dtype=torch_dtype(rec.autocast_dtype)))
    return stack


@dataclass
class CallUnderTest:
    """What every step of a replay plan works on."""

    module: torch.nn.Module
    rec: object                    # the call's ModuleRecord
    run: Callable[[int], object]   # run(i): the module on input copy i (0 = the captured inputs)
    n_copies: int                  # copies to rotate among (against a warm L2)
    device: torch.device
    cfg: object                    # ReplayConfig


def prepare(module, rec, args, kwargs, device, cfg) -> CallUnderTest:
    """The call on ``args``/``kwargs`` and enough copies of them (ids shifted for embeddings)."""
    copies = embedding_copies(module, args, kwargs, device)
    if copies is None:
        n = n_copies(tensor_bytes((args, kwargs)), device, cfg.max_copies)
        copies = [(args, kwargs)] + [clone_like((args, kwargs)) for _ in range(n - 1)]
    n = len(copies)

    def run(i: int = 0):
        a, k = copies[i % n]
        with call_context(rec, device.type):
            return module(*a, **k)

    return CallUnderTest(module, rec, run, n, device, cfg)
