"""Inputs for replay: loaded once from the run, then cloned into rotating copies."""
from __future__ import annotations

import torch

from cbtrace.nested import flat_tensors, map_tensors
from cbtrace.store.autograd_shape import as_non_leaf, is_non_leaf
from cbtrace.store.tensor_store import span_bytes


def clone_like(x):
    """Deep copy of a nested structure; tensors keep dtype, shape, strides and their autograd
    shape (a leaf that requires grad, or a non-leaf). torchrec objects are shared: modules only
    read them."""
    return map_tensors(_clone, x)


def _clone(x: torch.Tensor) -> torch.Tensor:
    """A copy with x's shape and strides over a copy of the storage span it covers: an expanded
    tensor (stride 0, e.g. an attention mask) stays expanded, where copying element by element
    into new strided memory is refused ("more than one element ... refers to a single memory
    location")."""
    if x.is_nested:  # no strides to keep: a nested tensor's components are copied
        return x.detach().clone().requires_grad_(x.requires_grad)
    if x.is_conj():  # the conj/neg bits are views over the same bytes: keep them
        return _clone(x.conj()).conj()
    if x.is_neg():
        return torch._neg_view(_clone(torch._neg_view(x)))
    isz = x.element_size()
    lo, hi = span_bytes(x.shape, x.stride(), x.storage_offset(), isz)
    with torch.no_grad():
        raw = torch.empty(hi - lo, dtype=torch.uint8, device=x.device)
        if hi > lo:
            src = torch.empty(0, dtype=torch.uint8, device=x.device)
            src.set_(x.untyped_storage(), lo, (hi - lo,), (1,))
            raw.copy_(src)
        y = torch.empty(0, dtype=x.dtype, device=x.device)
        y.set_(raw.untyped_storage(), 0, x.shape, x.stride())
    if is_non_leaf(x):
        return as_non_leaf(y)
    return y.requires_grad_(x.requires_grad) if x.is_floating_point() else y


def tensor_bytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(x))


def cache_bytes(device: torch.device) -> int:
    """The last-level cache copies must overflow (GPU: L2; CPU: a typical LLC)."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return 32 << 20


def n_copies(input_bytes: int, device: torch.device, max_copies: int) -> int:
    """Enough copies that rotating among them overflows the last-level cache twice."""
    if input_bytes <= 0:
        return 1
    return max(1, min(max_copies, -(-2 * cache_bytes(device) // input_bytes)))


def table_copies(module, device, max_copies: int = 64) -> list | None:
    """``parameter_copies`` of an Embedding/EmbeddingBag's table ({"weight": ...} each); None
    for another module. Fewer copies than that leave a table of a few MB partly in the L2 when
    it is read again, and its lookup reads fast (benchmarks/RESULTS.md, "DCN lookups by how
    many table copies they rotated")."""
    if not isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return None
    return parameter_copies({"weight": module.weight}, device, max_copies)


def parameter_copies(own: dict, device, max_copies: int) -> list | None:
    """``own`` (name -> a module's tensor) and copies of it for back-to-back runs to rotate
    among, one a run, enough to overflow the GPU's L2 twice (at most ``max_copies``; copies
    keep ``requires_grad``, so a forward builds the graph it built); None on a CPU, for no
    bytes, or when fewer than two would do."""
    size = sum(t.numel() * t.element_size() for t in own.values())
    if device.type != "cuda" or not size:
        return None
    n = tables_for(size, cache_bytes(device), max_copies)
    if n < 2:
        return None
    with torch.no_grad():
        return [own] + [{k: t.detach().clone().requires_grad_(t.requires_grad)
                         for k, t in own.items()} for _ in range(n - 1)]


def tables_for(table_bytes: int, cache: int, max_copies: int) -> int:
    """Copies of a table (itself one of them) that overflow a cache of ``cache`` bytes twice,
    at most ``max_copies``."""
    return min(max_copies, -(-2 * cache // max(table_bytes, 1)))


def embedding_copies(module, args, kwargs, device, max_copies: int = 64):
    """Input copies for an Embedding/EmbeddingBag whose ids touch *different* table rows.

    Rotating copies of the same ids does not cool an embedding lookup: every copy gathers the
    same rows, which stay in L2 and read fast. Copy i
    shifts the ids by i * N / n modulo the table size N: same count, pooling and locality,
    other rows. Enough copies that their gathered rows overflow the cache twice. The copies of
    a contiguous integer tensor (ids, offsets) are slices of one buffer, made by a few kernels
    for all of them: made one by one, a lookup's 63 copies cost ~250 kernel launches.
    Returns None when the module or its first argument does not fit that pattern.
    """
    if not isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or not args:
        return None
    ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() == 0:
        return None
    n_rows = module.weight.shape[0]
    row_bytes = module.weight.shape[1] * module.weight.element_size()
    gathered = ids.numel() * row_bytes
    n = max(1, min(max_copies, -(-2 * cache_bytes(device) // max(gathered, 1)), n_rows))
    if n == 1:
        return [(args, kwargs)]
    with torch.no_grad():
        if _stackable(ids):
            # copy i: (ids + i * N // n) % N, for i = 1 .. n-1 at once
            shifts = torch.arange(1, n, device=ids.device, dtype=torch.int64) * n_rows // n
            flat = ids.reshape(1, -1).long() + shifts.view(-1, 1)
            shifted = _rows((flat % n_rows).to(ids.dtype), ids)
        else:
            shifted = [((ids + (i * n_rows) // n) % n_rows).to(ids.dtype) for i in range(1, n)]
    rest = copies_of((args[1:], kwargs), n - 1)
    return [(args, kwargs)] + [((s, *a), k) for s, (a, k) in zip(shifted, rest)]


ALIGN = 512  # bytes: each copy starts where the caching allocator starts a block


def _rows(rows: torch.Tensor, like: torch.Tensor) -> list:
    """The k rows of ``rows`` (k x like.numel(), expanded or not) as k tensors of ``like``'s
    shape and strides (also those of its size-1 dims, which contiguity leaves free), written
    by one kernel into one buffer, each ALIGN-aligned (a compiled call assumes the alignment
    its first inputs had). Each is a tensor of its own over that buffer, not a view: its own
    version counter, and a module may write it in place under grad mode."""
    k, numel, isz = rows.shape[0], like.numel(), like.element_size()
    row = -(-numel * isz // ALIGN) * ALIGN // isz  # elements a copy takes, padding included
    buf = torch.empty(k, row, dtype=like.dtype, device=like.device)
    buf[:, :numel].copy_(rows)
    storage, out = buf.untyped_storage(), []
    for i in range(k):
        y = torch.empty(0, dtype=like.dtype, device=like.device)
        y.set_(storage, i * row, like.shape, like.stride())
        out.append(y)
    return out


STACK_MAX_BYTES = 1 << 20  # larger tensors: a clone each (see _stackable)


def _stackable(t) -> bool:
    """Whether copies of ``t`` are made as rows of one buffer: a plain contiguous tensor outside
    autograd (a copy made so has its shape, strides and, not requiring grad, autograd shape) of
    at most STACK_MAX_BYTES. What making them at once saves is launches, which only small
    tensors' copies are made of; a large tensor's copies in one buffer cost a CPU replay page
    faults on every call (a buffer that size is mapped afresh each time, where a clone's
    memory is reused: benchmarks/probes/probe_input_copies.py)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.numel() > 0
            and t.numel() * t.element_size() <= STACK_MAX_BYTES
            and t.is_contiguous() and not t.requires_grad and not t.is_quantized
            and not t.is_complex() and not t.is_nested and not t.is_conj() and not t.is_neg())


def copies_of(x, k: int) -> list:
    """``k`` deep copies of the nested structure ``x``: what ``clone_like`` copies, except that
    the copies of each plain contiguous tensor are made at once (one buffer, one kernel for
    all; ``_rows``) and a tensor that ``x`` holds twice is one tensor in each copy, as in
    ``x``."""
    found: list = []
    map_tensors(lambda t: found.append(t) or t, x)  # the tensors clone_like would copy
    stacked = {}
    with torch.no_grad():
        for t in found:
            if _stackable(t) and id(t) not in stacked:
                stacked[id(t)] = _rows(t.reshape(1, -1).expand(k, -1), t)
    return [map_tensors(lambda t, i=i: stacked[id(t)][i] if id(t) in stacked else _clone(t), x)
            for i in range(k)]
