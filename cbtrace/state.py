"""A model's state: its digest, and the guard that undoes whatever a call changes in it.

Neither replay nor a warm-up step may change the model: parameters, buffers, grads, RNG state
and train/eval flags come back as they were (``StateGuard``). A one-time copy of every
parameter is taken when replay starts, on its own GPU while the copies take at most
``DEVICE_COPY_SHARE`` of its free memory, else on the host (slower: large embedding tables
cross PCIe); after each call the parameters' version counters
tell whether anything was written in place, and only those are restored (a per-call clone of a
3 GB embedding table would dominate replay time). Buffers are restored after every call
unconditionally: BatchNorm updates its running stats without bumping their version counter.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch

from cbtrace import module_tree
from cbtrace.device import free_memory


DEVICE_COPY_SHARE = 0.2


def saved_copies(tensors: list) -> list:
    """A copy of each tensor: on its GPU while they fit in DEVICE_COPY_SHARE of its free
    memory (counted from the first), else on the host; one copy of a tensor listed twice (a
    tied weight)."""
    left: dict = {}
    out, seen = [], {}
    for t in tensors:
        if id(t) in seen:
            out.append(seen[id(t)])
            continue
        key, t = id(t), t.detach()
        nbytes = t.numel() * t.element_size()
        if t.is_cuda:
            if t.device not in left:
                left[t.device] = DEVICE_COPY_SHARE * free_memory(t.device)
            if nbytes <= left[t.device]:
                left[t.device] -= nbytes
                out.append(seen.setdefault(key, t.clone()))
                continue
        out.append(seen.setdefault(key, t.to("cpu", copy=True)))
    return out


def _same_data(t: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether ``t`` still shows ``data``: the same address, shape and strides (a .data swap
    to a transposed view of the same bytes keeps the address)."""
    return (t.data_ptr() == data.data_ptr() and t.shape == data.shape
            and t.stride() == data.stride())


def _slot(table, name):
    """``table.get(name)`` that a TorchScript module's parameter/buffer table (no ``get``) takes."""
    return table[name] if name in table else None


class StateGuard:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        owned = [(m, n, p) for m in model.modules() for n, p in m._parameters.items()
                 if p is not None]
        # (owner module, name, original object, its copy, its data, version) per parameter;
        # the device it lives on, by id (a .data swap may move it). Its data is held (an alias,
        # no copy) so that a .data swap cannot land on the freed original's address and pass
        # for no swap: .data = ... moves no version counter
        self._devices = {id(p): p.device for _, _, p in owned}
        self.params = [(m, n, p, saved, p.detach(), p._version)
                       for (m, n, p), saved in zip(owned, saved_copies([p for _, _, p in owned]))]
        self.buffers = [(m, n, b, b.detach().clone())
                        for m in model.modules() for n, b in m._buffers.items() if b is not None]
        self.restored: list[str] = []
        self._scopes: dict[int, tuple[set, list]] = {}  # id(module) -> its subtree's entries
        # walked once, not per call: a model of a thousand modules makes the walk a call's cost
        self._params, self._modules = list(model.parameters()), list(model.modules())

    @contextlib.contextmanager
    def call(self, module: torch.nn.Module | None = None):
        """Wrap one replayed call: RNG, grads and train flags restored; writes undone.
        ``module``: the call's module: its subtree's parameters and buffers are checked whole
        (reassigned, .data swapped, written in place; buffers put back), the others by their
        version counters alone (walking all 1,400 parameters of a 600-table DLRM whole took
        2.3 ms a call, 2.7 s of a 1,020-call replay); ``undo()`` checks everything, as a call
        without ``module`` does (the replay runs it at its end)."""
        grads = [p.grad for p in self._params]
        flags = [m.training for m in self._modules]
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            yield
        finally:
            self._undo_writes(None if module is None else self._scope(module))
            for p, g in [(p, g) for p, g in zip(self._params, grads) if p.grad is not g]:
                p.grad = g
            for m, flag in [(m, f) for m, f in zip(self._modules, flags) if m.training != f]:
                m.training = flag  # nn.Module.__setattr__ only where it changed
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def undo(self) -> None:
        """Every parameter and buffer checked whole and put back (``call`` with a module checks
        its subtree's so)."""
        self._undo_writes(None)

    def _scope(self, module) -> tuple[set, list]:
        """(parameter entries, buffer entries) owned by ``module``'s subtree, by index."""
        key = id(module)
        if key not in self._scopes:
            owners = {id(m) for m in module.modules()}
            self._scopes[key] = ({i for i, e in enumerate(self.params) if id(e[0]) in owners},
                                 [i for i, e in enumerate(self.buffers) if id(e[0]) in owners])
        return self._scopes[key]

    def _undo_writes(self, scope: tuple[set, list] | None) -> None:
        params = self.params
        if scope is None:
            whole, check = None, range(len(params))
        else:  # the subtree's entries, and any other whose version counter moved
            whole = scope[0]
            check = sorted(whole.union(i for i, e in enumerate(params) if e[2]._version != e[5]))
        with torch.no_grad():
            for i in range(len(self.buffers)) if scope is None else scope[1]:
                m, name, orig, saved = self.buffers[i]
                if _slot(m._buffers, name) is not orig:  # reassigned (self.n = self.n + 1)
                    m._buffers[name] = orig
                    self.restored.append(name)
                orig.copy_(saved)
            done = set()  # a tied weight (two entries, one tensor) is restored once
            for i in check:
                m, name, orig, saved, data, version = params[i]
                all_of_it = whole is None or i in whole
                if all_of_it and _slot(m._parameters, name) is not orig:  # a new Parameter
                    m._parameters[name] = orig
                    self.restored.append(name)
                if id(orig) in done:
                    continue
                if all_of_it and not _same_data(orig, data):  # .data swapped for another tensor
                    orig.data = saved.to(self._devices[id(orig)], copy=True)
                    self.restored.append(name)
                    done.add(id(orig))
                elif orig._version != version:  # written in place
                    orig.copy_(saved)
                    self.restored.append(name)
                    done.add(id(orig))
            if done:  # every entry of a restored tensor takes its new data and version
                self.params = [(m, n, o, sv, o.detach(), o._version)
                               for m, n, o, sv, _, _ in self.params]


def state_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of parameters, buffers, RNG and train flags (tests compare before/after replay)."""
    h = hashlib.sha256(state_digest(model, sampled=False).encode())
    h.update(torch.random.get_rng_state().numpy().tobytes())
    if torch.cuda.is_initialized():
        for s in torch.cuda.get_rng_state_all():
            h.update(s.numpy().tobytes())
    h.update(bytes(m.training for m in model.modules()))
    return h.hexdigest()


# How a digest reads a tensor larger than ``above`` bytes: ``blocks`` evenly spaced blocks of
# ``block`` bytes, first and last included. A stored digest names its scheme by its prefix; one
# without a prefix read every byte (runs before "v2:").
SCHEMES = {
    "v2:": (4 << 20, 256, 4096),  # tensors above 4 MiB: 1 MiB each
    # above 64 KiB: 64 KiB each, so that many mid-sized tables are sampled, not read whole
    "v3:": (64 << 10, 16, 4096),
}
SAMPLED = "v3:"  # the scheme capture stores


def state_digest(model, sampled: bool = True, *, scheme: str = SAMPLED) -> str:
    """sha256 over the parameters and buffers (names, dtypes, shapes, values): which weights a
    run was captured with, so that replay knows a rebuilt model is the same one.

    ``sampled`` (the default, and what capture stores; prefixed with ``scheme``, ``SAMPLED``
    unless told): a tensor above the scheme's size is read as evenly spaced blocks, not whole
    (``SCHEMES``). Another seed, init or checkpoint changes every block; reading DLRM's 1.7 GB
    of embedding tables (or dlrm:large's 1.2 GB of tables and Linears) whole cost a capture and
    a replay a second or more each. ``sampled=False``: every byte (digests without a prefix,
    as runs stored before "v2:")."""
    how = SCHEMES[scheme] if sampled else None
    h = hashlib.sha256()
    model = module_tree.unwrap(model)  # the same digest compiled, wrapped in DDP or not
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        name = module_tree.user_name(name)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            for block in _digest_blocks(t.detach(), how):
                h.update(block)
    return (scheme if sampled else "") + h.hexdigest()


def same_state(model, digest: str) -> bool:
    """Whether ``model``'s weights are those ``digest`` (a stored ``state_digest``) names."""
    scheme = next((p for p in SCHEMES if digest.startswith(p)), None)
    return state_digest(model, sampled=scheme is not None, scheme=scheme or SAMPLED) == digest


def _digest_blocks(t: torch.Tensor, how: tuple | None) -> list:
    """The host byte arrays of ``t`` that its digest reads, in order: all (``how`` None), or
    the evenly spaced blocks ``how`` = (above, blocks, block) says.

    On the host the blocks are views (no torch op: small reshapes and cats wait on intra-op
    threads under load); a device tensor's blocks are gathered there and copied to the host once."""
    flat = t.contiguous().view(-1).view(torch.uint8)
    n = flat.numel()
    if how is None or n <= how[0]:
        return [flat.cpu().numpy()]
    _, blocks, block = how
    step = (n - block) // (blocks - 1)
    starts = [i * step for i in range(blocks - 1)] + [n - block]
    if flat.device.type == "cpu":
        arr = flat.numpy()
        return [arr[s:s + block] for s in starts]
    sampled = flat.as_strided((blocks - 1, block), (step, 1))
    return [torch.cat([sampled.reshape(-1), flat[n - block:]]).cpu().numpy()]
