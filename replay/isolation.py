"""Replay never changes the model: parameters, buffers, grads, RNG state, train/eval flags.

A one-time host copy of every parameter is taken when replay starts; after each call the
parameters' version counters tell whether anything was written in place, and only those are
restored (a per-call clone of a 3 GB embedding table would dominate replay time). Buffers are
restored after every call unconditionally: BatchNorm updates its running stats without bumping
their version counter.
"""
from __future__ import annotations

import contextlib

import torch


class StateGuard:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.tensors = list(model.parameters())
        self.saved = [t.detach().to("cpu", copy=True) for t in self.tensors]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.versions = [t._version for t in self.tensors]
        self.restored: list[str] = []

    @contextlib.contextmanager
    def call(self):
        """Wrap one replayed call: RNG, grads and train flags restored; in-place writes undone."""
        grads = [(p, p.grad) for p in self.model.parameters()]
        flags = [(m, m.training) for m in self.model.modules()]
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            yield
        finally:
            self._undo_writes()
            for p, g in grads:
                p.grad = g
            for m, flag in flags:
                m.training = flag
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def _undo_writes(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
            for i, t in enumerate(self.tensors):
                if t._version != self.versions[i]:
                    t.copy_(self.saved[i])
                    self.versions[i] = t._version
                    self.restored.append(str(tuple(t.shape)))


def state_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of parameters, buffers, RNG and train flags (tests compare before/after replay)."""
    import hashlib

    from cbtrace.capture import state_digest

    h = hashlib.sha256(state_digest(model).encode())
    h.update(torch.random.get_rng_state().numpy().tobytes())
    if torch.cuda.is_initialized():
        for s in torch.cuda.get_rng_state_all():
            h.update(s.numpy().tobytes())
    h.update(bytes(m.training for m in model.modules()))
    return h.hexdigest()
