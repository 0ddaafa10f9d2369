"""Capture side of tensor storage: copy storage spans once, let views reference them.

A tensor is stored as a *chunk*: a copy of the bytes ``[lo, hi)`` of its storage that it
covers (``lo`` rounded down to 16 bytes so every dtype's offset stays whole). Tensors of one
call that overlap in a storage share one chunk, so aliasing between arguments survives the
round trip. A later call that sees the same storage, with the same ``_version`` and a span
inside an existing chunk, reuses it: a tensor passed to several modules is stored once. A
weak reference to the storage proves it is still the same allocation (no address reuse).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch

from cbtrace.cost.dtypes import name_of
from cbtrace.store import synth
from cbtrace.store.autograd_shape import is_non_leaf
from cbtrace.store.codec import unsupported

ALIGN = 16  # largest element size (complex128)


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: the canonical name of the one dtype table (cost/dtypes.py)."""
    return name_of(dtype)


# dtype -> name for every torch dtype, looked up once (capture names each input's dtype)
_DTYPE_NAMES = {d: name_of(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def tensor_meta(t: torch.Tensor) -> dict:
    """Shape, dtype, strides, offset, device and requires_grad of a tensor (JSON-able)."""
    return meta_dict(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


def meta_dict(shape, stride, offset: int, dtype: torch.dtype, device, requires_grad: bool) -> dict:
    """``tensor_meta``'s dict from metadata read earlier (capture reads it in its post hook)."""
    return {"shape": list(shape), "dtype": dtype_name(dtype), "stride": list(stride),
            "storage_offset": offset, "device": str(device), "requires_grad": requires_grad}


def span_bytes(shape, stride, offset: int, itemsize: int) -> tuple[int, int]:
    """[lo, hi) byte range of a storage that a strided tensor touches; empty if no elements."""
    lo = last = offset * itemsize
    for n, s in zip(shape, stride):  # a loop, not generators: capture plans every call's inputs
        if n == 0:
            return lo, lo
        last += (n - 1) * s * itemsize
    return lo, last + itemsize


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


@dataclass
class Chunk:
    id: int
    kind: str            # "d": storage bytes, "s": statistics of a synthesized tensor
    shard: int
    row: int
    nparts: int
    lo: int              # byte offset of the copy in the original storage
    nbytes: int          # bytes copied (0 for stats)
    payload: object      # device uint8 tensor, or (stats kind, tensor, numel); None until
                         # copied (run_copies) and again once written

    def ref(self) -> list:
        return [self.shard, self.row, self.nparts, self.lo, self.nbytes, self.kind]


class ShardPlan:
    """Assigns each chunk its shard and rows when it is created, so refs are final at once."""

    def __init__(self, shard_bytes: int, part_bytes: int):
        self.shard_bytes, self.part_bytes = shard_bytes, part_bytes
        self.shard, self.rows, self.bytes = 0, 0, 0
        self.pending: dict[int, list[Chunk]] = {}
        self.pending_bytes = 0
        self._next_id = 0

    def add(self, kind: str, nbytes: int, lo: int, payload) -> Chunk:
        if self.rows and self.bytes + nbytes > self.shard_bytes:
            self.close()
        nparts = max(1, -(-nbytes // self.part_bytes))
        chunk = Chunk(self._next_id, kind, self.shard, self.rows, nparts, lo, nbytes, payload)
        self._next_id += 1
        self.rows += nparts
        self.bytes += nbytes
        self.pending_bytes += nbytes
        self.pending.setdefault(self.shard, []).append(chunk)
        return chunk

    def close(self) -> None:
        """Start a new shard; the current one takes no more chunks."""
        if self.rows:
            self.shard, self.rows, self.bytes = self.shard + 1, 0, 0

    def pop_closed(self) -> list[tuple[int, list[Chunk]]]:
        """Shards that take no more chunks, removed from pending."""
        done = sorted(s for s in self.pending if s < self.shard)
        return [(s, self.pending.pop(s)) for s in done]


@dataclass
class _Seen:
    storage: weakref.ref
    chunks: list = field(default_factory=list)  # (version, lo, hi, Chunk)


class TensorStore:
    """Turns the tensors met while encoding one call into chunk references."""

    def __init__(self, plan: ShardPlan, synthesize_above_bytes: int | None = None):
        self.plan = plan
        self.synth_above = synthesize_above_bytes
        self._seen: dict[tuple, _Seen] = {}

    def commit(self, pending: list) -> tuple[dict, int, bool, list]:
        """Fill the nodes of ``pending`` [(tensor, node)].

        Returns (chunks used, bytes, synthesized, copies): ``copies`` lists each new chunk with
        its source span, which the caller copies with ``run_copies`` before the call runs; a
        chunk becomes reusable by later calls only once its copy exists.
        """
        copies: list = []
        used: dict[int, Chunk] = {}
        groups: dict[tuple, list] = {}
        spans: dict[tuple, list] = {}
        synthesized = False
        for t, node in pending:
            try:
                if t.is_quantized or t.is_nested or t.layout != torch.strided:
                    raise TypeError(f"{t.layout} / quantized / nested tensors are not supported")
                node.update(self._meta(t))
                if t.device.type == "meta" or t.numel() == 0:
                    continue
                st = t.untyped_storage()
                key = (str(t.device), st.data_ptr())
                lo, hi = span_bytes(t.shape, t.stride(), t.storage_offset(), t.element_size())
                spans.setdefault(key, []).append((lo, hi))
                if self.synth_above is not None and hi - lo > self.synth_above:
                    chunk = self._synth_chunk(t)
                    if chunk is not None:
                        node["c"], node["syn"] = chunk.id, 1
                        used[chunk.id] = chunk
                        synthesized = True
                        continue
                groups.setdefault(key, []).append((t, st, node, lo, hi))
            except Exception as e:  # never let one odd tensor break the capture
                node.clear()
                node.update(unsupported(t, f"tensor: {e}"))
        for key, items in groups.items():
            for cluster in (items,) if len(items) == 1 else _overlapping(items):
                chunk = self._chunk_for(key, cluster, copies)
                used[chunk.id] = chunk
                for _, _, node, _, _ in cluster:
                    node["c"] = chunk.id
        nbytes = 0
        for s in spans.values():
            nbytes += s[0][1] - s[0][0] if len(s) == 1 else _union_bytes(s)
        return used, nbytes, synthesized, copies

    @staticmethod
    def _meta(t: torch.Tensor) -> dict:
        node = {"dtype": _DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype), "shape": list(t.shape),
                "stride": list(t.stride()), "off": t.storage_offset(), "dev": str(t.device),
                "rg": t.requires_grad, "c": None}
        if node["rg"] and is_non_leaf(t):  # (a call only for tensors that require grad)
            node["nl"] = 1  # made by an op: rebuilt as a view of a non-leaf (autograd_shape.py)
        if t.is_conj():
            node["conj"] = 1
        if t.is_neg():
            node["neg"] = 1
        if type(t) is torch.nn.Parameter:
            node["param"] = 1
        return node

    def forget_dead(self) -> None:
        """Drop dedup entries whose storage has been freed."""
        self._seen = {k: v for k, v in self._seen.items() if v.storage() is not None}

    def _chunk_for(self, key, cluster, copies: list) -> Chunk:
        st = cluster[0][1]
        if len(cluster) == 1:  # the common case, without generators (one frame each)
            lo, hi, version = cluster[0][3], cluster[0][4], _version(cluster[0][0])
        else:
            lo = min(c[3] for c in cluster)
            hi = max(c[4] for c in cluster)
            versions = {_version(c[0]) for c in cluster}
            version = versions.pop() if len(versions) == 1 else None
        seen = self._seen.get(key)
        if seen is None or seen.storage() is not st:
            seen = self._seen[key] = _Seen(weakref.ref(st))
        if version is not None:
            for v, clo, chi, chunk in seen.chunks:
                if v == version and clo <= lo and hi <= chi:
                    return chunk
        lo -= lo % ALIGN
        src = torch.empty(0, dtype=torch.uint8, device=cluster[0][0].device)  # no grad: a
        src.set_(st, lo, (hi - lo,), (1,))  # set_ records nothing (a no_grad context cost more)
        chunk = self.plan.add("d", hi - lo, lo, None)
        # reusable by later calls only once its copy exists (run_copies registers it)
        entry = (seen.chunks, (version, lo, hi, chunk)) if version is not None else None
        copies.append((chunk, src, _buffer_like(src), entry))
        return chunk

    def _synth_chunk(self, t: torch.Tensor) -> Chunk | None:
        if _sorted_ints(t):
            return None  # offsets / cumulative lengths: random values would break them; keep
        try:
            kind, stats = synth.stats_of(t)
        except (TypeError, RuntimeError, NotImplementedError):
            return None  # dtype without statistics: store its data instead
        return self.plan.add("s", 0, 0, (kind, stats, t.numel()))


# Tensor.copy_ called from C through a partial: the profiler's Python tracer records no event
# for it (capture runs the copies inside the traced step; the aten::copy_ op stays in the trace)
_COPY = functools.partial(torch.Tensor.copy_)


def run_copies(copies: list) -> None:
    """Copy each new chunk's storage span into the buffer planned for it (on the tensor's own
    device: no host sync).

    Capture plans a call's chunks, and allocates their buffers, on a helper thread the profiler
    does not trace, and runs the copies here, on the calling thread, so they stay inside its
    ``cbtrace.copy::`` range: one ``aten::copy_`` each.
    """
    for chunk, src, dst, entry in copies:
        if dst is None:  # planning could not allocate it: allocate (or fail) here, in the call
            dst = src.clone()
        else:
            _COPY(dst, src)
        chunk.payload = dst
        if entry is not None:
            entry[0].append(entry[1])


def _buffer_like(src: torch.Tensor) -> torch.Tensor | None:
    """An empty copy buffer, or None when allocating it fails (e.g. out of memory): planning
    must not raise, or the call would lose its record; ``run_copies`` then allocates it on
    the calling thread, where a failure marks the call."""
    try:
        return torch.empty_like(src)
    except Exception:  # noqa: BLE001 - OutOfMemoryError, AcceleratorError, ...
        return None


def _sorted_ints(t: torch.Tensor) -> bool:
    """A 1-D integer tensor in non-decreasing order (EmbeddingBag offsets, jagged offsets)."""
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return False
    return t.numel() < 2 or bool((t[1:] >= t[:-1]).all())  # a sync, for large int inputs only


def _overlapping(items: list) -> list[list]:
    """Split (tensor, storage, node, lo, hi) items into clusters of overlapping spans."""
    items = sorted(items, key=lambda c: c[3])
    clusters, hi = [], -1
    for item in items:
        if item[3] < hi:
            clusters[-1].append(item)
            hi = max(hi, item[4])
        else:
            clusters.append([item])
            hi = item[4]
    return clusters


def _union_bytes(spans: list) -> int:
    total, cur_lo, cur_hi = 0, None, None
    for lo, hi in sorted(spans):
        if cur_hi is None or lo > cur_hi:
            total += (cur_hi - cur_lo) if cur_hi is not None else 0
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    return total + ((cur_hi - cur_lo) if cur_hi is not None else 0)
