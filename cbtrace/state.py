"""A model's state: its digest, and the guard that undoes whatever a call changes in it.

Neither replay nor a warm-up step may change the model: parameters, buffers, grads, RNG state
and train/eval flags come back as they were (``StateGuard``). A one-time host copy of every parameter is taken when replay starts; after each call the
parameters' version counters tell whether anything was written in place, and only those are
restored (a per-call clone of a 3 GB embedding table would dominate replay time). Buffers are
restored after every call unconditionally: BatchNorm updates its running stats without bumping
their version counter.
"""
from __future__ import annotations

import contextlib

import torch

from cbtrace import module_tree


class StateGuard:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        # (owner module, name, original object, host copy, data_ptr, version) per parameter
        self.params = [(m, n, p, p.detach().to("cpu", copy=True), p.data_ptr(), p._version)
                       for m in model.modules() for n, p in m._parameters.items() if p is not None]
        self.buffers = [(m, n, b, b.detach().clone())
                        for m in model.modules() for n, b in m._buffers.items() if b is not None]
        self.restored: list[str] = []
        # walked once: walking them for every call cost 2 ms a GPT-2 call and 10-28 ms a
        # dlrm:large call (1,021 modules) on the H200 host and this CPU
        self._params, self._modules = list(model.parameters()), list(model.modules())

    @contextlib.contextmanager
    def call(self):
        """Wrap one replayed call: RNG, grads and train flags restored; writes undone."""
        grads = [p.grad for p in self._params]
        flags = [m.training for m in self._modules]
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            yield
        finally:
            self._undo_writes()
            for p, g in zip(self._params, grads):
                if p.grad is not g:
                    p.grad = g
            for m, flag in zip(self._modules, flags):
                if m.training != flag:  # nn.Module.__setattr__ only where it changed
                    m.training = flag
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def _undo_writes(self) -> None:
        with torch.no_grad():
            for m, name, orig, saved in self.buffers:
                if m._buffers.get(name) is not orig:  # reassigned (self.n = self.n + 1)
                    m._buffers[name] = orig
                    self.restored.append(name)
                orig.copy_(saved)
            for i, (m, name, orig, saved, ptr, version) in enumerate(self.params):
                if m._parameters.get(name) is not orig:  # a new Parameter was assigned
                    m._parameters[name] = orig
                    self.restored.append(name)
                if orig.data_ptr() != ptr:  # .data swapped for another tensor
                    orig.data = saved.to(orig.device)
                    self.restored.append(name)
                elif orig._version != version:  # written in place
                    orig.copy_(saved)
                    self.restored.append(name)
                self.params[i] = (m, name, orig, saved, orig.data_ptr(), orig._version)


def state_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of parameters, buffers, RNG and train flags (tests compare before/after replay)."""
    import hashlib

    h = hashlib.sha256(state_digest(model, sampled=False).encode())
    h.update(torch.random.get_rng_state().numpy().tobytes())
    if torch.cuda.is_initialized():
        for s in torch.cuda.get_rng_state_all():
            h.update(s.numpy().tobytes())
    h.update(bytes(m.training for m in model.modules()))
    return h.hexdigest()


SAMPLED = "v2:"           # prefix of a digest that samples the tensors above SAMPLE_ABOVE
SAMPLE_ABOVE = 4 << 20    # bytes
SAMPLE_BLOCKS, SAMPLE_BLOCK = 256, 4096  # evenly spaced blocks of bytes, first and last included


def state_digest(model, sampled: bool = True) -> str:
    """sha256 over the parameters and buffers (names, dtypes, shapes, values): which weights a
    run was captured with, so that replay knows a rebuilt model is the same one.

    ``sampled`` (the default, and what capture stores; prefixed ``v2:``): a tensor larger than
    4 MiB is read as 256 evenly spaced 4 KiB blocks (1 MiB), not whole. Another seed, init or
    checkpoint changes every block; copying DLRM's 1.7 GB of embedding tables to the host and
    hashing them cost a capture and a replay a second or more each. ``sampled=False``: every
    byte (digests without the prefix, as runs before it stored)."""
    import hashlib

    h = hashlib.sha256()
    model = module_tree.unwrap(model)  # the same digest compiled, wrapped in DDP or not
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        name = module_tree.user_name(name)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(_digest_bytes(t.detach(), sampled).cpu().numpy())
    return (SAMPLED if sampled else "") + h.hexdigest()


def same_state(model, digest: str) -> bool:
    """Whether ``model``'s weights are those ``digest`` (a stored ``state_digest``) names."""
    return state_digest(model, sampled=digest.startswith(SAMPLED)) == digest


def _digest_bytes(t: torch.Tensor, sampled: bool) -> torch.Tensor:
    """The bytes of ``t`` that its digest reads (on t's device): all, or sampled blocks."""
    flat = t.contiguous().view(-1).view(torch.uint8)
    n = flat.numel()
    if not sampled or n <= SAMPLE_ABOVE:
        return flat
    step = (n - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
    blocks = flat.as_strided((SAMPLE_BLOCKS - 1, SAMPLE_BLOCK), (step, 1))
    return torch.cat([blocks.reshape(-1), flat[n - SAMPLE_BLOCK:]])
