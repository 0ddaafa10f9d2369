"""Load side: rebuild a captured call's (args, kwargs) from its ``inputs_ref`` and the shards.

Tensors come back with the captured dtype, shape, strides and bytes; views of one chunk share
one storage, so aliasing between arguments survives. The storage offset is kept exactly when
the copied span starts in the first MiB of the original storage; further in, the copy is
placed at the same offset mod 4096 from the storage start (so the address alignment that
kernels see is kept) instead of allocating the unused prefix.
Nothing is unpickled: data are raw bytes, structure is JSON.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from cbtrace import registry
from cbtrace.cost.dtypes import torch_dtype
from cbtrace.errors import RunDirError, SerializationError
from cbtrace.rundir.read import read_modules
from cbtrace.store import ref_format, shards, synth
from cbtrace.store.autograd_shape import as_non_leaf
from cbtrace.store.codec import DecodeContext
from cbtrace.store.tensor_store import ALIGN, span_bytes

EXACT_OFFSET_BYTES = 1 << 20
PAGE = 4096


def _pad(lo: int) -> int:
    """Bytes placed before a copied span at load time (see module docstring)."""
    return lo if lo < EXACT_OFFSET_BYTES else lo % PAGE


def load_device(captured: str, device=None) -> torch.device:
    """``device`` if given, else the captured device when present here, else CPU."""
    if device is not None:
        return torch.device(device)
    d = torch.device(captured)
    if d.type in ("cpu", "meta"):
        return d
    if d.type == "cuda":
        ok = torch.cuda.is_available() and (d.index is None or d.index < torch.cuda.device_count())
    else:
        mod = getattr(torch, d.type, None)
        ok = bool(mod is not None and getattr(mod, "is_available", lambda: False)())
    return d if ok else torch.device("cpu")


def _dtype(name: str) -> torch.dtype:
    try:
        return torch_dtype(name)
    except ValueError as e:
        raise SerializationError(f"inputs_ref: {e}") from None


class _TensorLoader:
    """Reads chunks once per call and builds tensors over them."""

    def __init__(self, inputs_dir: Path, chunks: dict, device, chunks_read: dict | None = None):
        self.inputs_dir, self.chunks, self.device = inputs_dir, chunks, device
        self._read_ahead = dict(chunks_read or {})  # cid -> _read's result (read_call_chunks)
        self._storages: dict = {}
        self._grad_bases: dict = {}  # storage -> its non-leaf copy (autograd_shape.as_non_leaf)

    def _read(self, cid: int):
        if str(cid) in self._read_ahead:
            return self._read_ahead.pop(str(cid))
        try:
            shard, row, nparts, lo, nbytes, kind = self.chunks[str(cid)]
        except (KeyError, ValueError, TypeError):
            raise SerializationError(f"inputs_ref: chunk {cid} is not listed") from None
        path = self.inputs_dir / shards.shard_name(shard)
        got_kind, parts = shards.read_chunk(path, row, nparts, cid)
        if got_kind != kind or (kind == "d" and sum(p.nbytes for p in parts) != nbytes):
            raise SerializationError(f"{path}: chunk {cid} has kind {got_kind}/"
                                     f"{sum(p.nbytes for p in parts)} bytes, expected "
                                     f"{kind}/{nbytes} (stale shard?)")
        return lo, nbytes, parts

    def _storage(self, cid: int, dev: torch.device):
        """(untyped storage, byte shift) for a data chunk; shared by every tensor of the call."""
        key = (cid, str(dev))
        if key not in self._storages:
            ahead = self._read_ahead.get(str(cid))
            if isinstance(ahead, HostChunk):  # assembled on the read-ahead thread
                del self._read_ahead[str(cid)]
            else:
                ahead = HostChunk(*self._read(cid))
            raw = ahead.data
            # from pinned memory the copy is asynchronous (ordered on the current stream; a
            # buffer is not reused before it is done: torch's host allocator, or the owner of a
            # borrowed one); on the host, a borrowed buffer is copied out of
            if dev.type != "cpu":
                raw = raw.to(dev, non_blocking=ahead.pinned)
            elif ahead.borrowed:
                raw = raw.clone()
            self._storages[key] = (raw.untyped_storage(), ahead.shift)
        return self._storages[key]

    def _synth_storage(self, node: dict, cid: int, dtype, dev):
        _, _, parts = self._read(cid)
        try:
            doc = json.loads(bytes(parts[0]))
        except (ValueError, UnicodeDecodeError):
            raise SerializationError(f"{self.inputs_dir}: statistics of chunk {cid} are not "
                                     "valid JSON") from None
        isz = dtype.itemsize
        lo, hi = span_bytes(node["shape"], node["stride"], node["off"], isz)
        lo -= lo % ALIGN
        pad = _pad(lo)
        raw = torch.zeros(pad + hi - lo, dtype=torch.uint8, device=dev)
        values = synth.synthesize(doc, dtype, (hi - lo) // isz, dev, synth.SEED + cid)
        raw[pad:].view(dtype).copy_(values)
        return raw.untyped_storage(), lo - pad

    def tensor(self, node: dict) -> torch.Tensor:
        dtype = _dtype(node["dtype"])
        dev = load_device(node["dev"], self.device)
        shape, stride, off = node["shape"], node["stride"], node["off"]
        cid = node.get("c")
        isz = dtype.itemsize
        if cid is None:  # no elements, or a meta tensor: nothing was copied
            dev = torch.device("meta") if node["dev"] == "meta" else dev
            storage = torch.empty(span_bytes(shape, stride, off, isz)[1], dtype=torch.uint8,
                                  device=dev).untyped_storage()
            shift = 0
        elif node.get("syn"):
            storage, shift = self._synth_storage(node, cid, dtype, dev)
        else:
            storage, shift = self._storage(cid, dev)
        t = torch.empty(0, dtype=dtype, device=dev)
        t.set_(storage, off - shift // isz, shape, stride)
        if node.get("nl"):  # before the conj/neg views, which keep its autograd shape
            t = as_non_leaf(t, self._grad_bases)
        if node.get("conj"):
            t = t.conj()
        if node.get("neg"):
            t = torch._neg_view(t)
        if node.get("param"):
            return torch.nn.Parameter(t, requires_grad=bool(node["rg"]))
        if node["rg"] and t.is_leaf:
            t.requires_grad_(True)
        return t


class HostChunk:
    """A data chunk's bytes in one host buffer, after a pad that aligns its storage: ``data``
    (a uint8 tensor whose storage is exactly these bytes), ``shift`` (the byte offset of data[0]
    in the captured storage) and ``pinned`` (data is in pinned memory: its copy to a GPU need not
    wait).

    The buffer is ``out`` when given (a uint8 numpy array of ``host_size(lo, nbytes)`` bytes or
    more, e.g. a slice of a pinned ring: its owner keeps it unchanged until the copies out of
    it are done), and ``pin`` then only says whether it is pinned. Else it is a fresh tensor,
    pinned when ``pin``: torch's caching host allocator makes CUDA calls for that (cudaHostAlloc,
    cudaEventQuery), so only the thread that issues the device work may ask for it."""

    __slots__ = ("data", "shift", "pinned", "borrowed")

    def __init__(self, lo: int, nbytes: int, parts: list, pin: bool = False, out=None):
        pad = _pad(lo)
        if out is None:
            self.data = torch.empty(pad + nbytes, dtype=torch.uint8, pin_memory=pin)
        else:
            assert out.nbytes >= pad + nbytes, (out.nbytes, pad + nbytes)
            self.data = torch.from_numpy(out[:pad + nbytes])  # no copy, no CUDA call
        # ``borrowed``: the bytes are the owner's (reused once copied out): a host tensor made
        # from them must copy them
        self.shift, self.pinned, self.borrowed = lo - pad, pin, out is not None
        raw = self.data.numpy()  # numpy copies release the GIL
        raw[:pad] = 0
        pos = pad
        for p in parts:
            raw[pos:pos + p.nbytes] = p
            pos += p.nbytes


def host_size(lo: int, nbytes: int) -> int:
    """Bytes a data chunk takes in a shared host buffer: its pad and bytes, to a page boundary
    (where a buffer of its own would start)."""
    return -(-(_pad(lo) + nbytes) // PAGE) * PAGE


def host_bytes(run_dir: Path, inputs_ref: str) -> int:
    """What ``read_call_chunks(..., into=)`` takes of ``into`` for this ``inputs_ref``."""
    doc = ref_format.parse(inputs_ref, run_dir)
    try:
        return sum(host_size(int(e[3]), int(e[4])) for e in doc["chunks"].values()
                   if ref_format.is_data_chunk(e))
    except (TypeError, ValueError):
        raise SerializationError(f"{run_dir}: inputs_ref lists a malformed chunk") from None


def read_call_chunks(run_dir: Path, inputs_ref: str, pin: bool = False, into=None) -> dict:
    """Every chunk of one call's inputs read from its shard and checksummed, for
    ``load_call_inputs(..., chunks_read=)``: the slow half of loading (Parquet reads, CRCs and
    copies, which release the GIL), so replay runs it on a thread while another call is timed.
    ``into``: a uint8 numpy array of ``host_bytes(run_dir, inputs_ref)`` bytes or more, where
    the data chunks are placed one after another (``host_size`` each) instead of in fresh
    tensors: with it no CUDA call is made, even when ``pin`` says it is pinned memory, whose
    copies to a GPU need not wait. Without it ``pin`` allocates pinned memory (CUDA calls)."""
    doc = ref_format.parse(inputs_ref, run_dir)
    loader = _TensorLoader(Path(run_dir) / "inputs", doc["chunks"], None)
    out, pos = {}, 0
    for cid, entry in doc["chunks"].items():
        got = loader._read(int(cid))
        if not ref_format.is_data_chunk(entry):
            out[cid] = got
            continue
        buf = None
        if into is not None:
            size = host_size(got[0], got[1])
            buf, pos = into[pos:pos + size], pos + size
        # data chunks assembled here too: numpy copies release the GIL, so the replay thread
        # need not do it
        out[cid] = HostChunk(*got, pin=pin, out=buf)
    return out


def load_call_inputs(run_dir: Path, inputs_ref: str, device=None, *, serializers=None,
                     chunks_read: dict | None = None):
    """``(args, kwargs)`` of one captured call, bit-identical to what the module received.

    Args:
        run_dir: the run directory (holding ``inputs/``).
        inputs_ref: the call's ``inputs_ref`` column (what ``Snapshotter.take`` returned).
        device: put tensors there; default: the captured device if present, else CPU.
        serializers: default ``cbtrace.registry.serializers()``.
        chunks_read: what ``read_call_chunks`` returned for this ``inputs_ref`` (read ahead).
    """
    doc = ref_format.parse(inputs_ref, run_dir)
    if serializers is None:
        serializers = registry.serializers()
    loader = _TensorLoader(Path(run_dir) / "inputs", doc["chunks"], device, chunks_read)
    ctx = DecodeContext(serializers, loader.tensor)
    with torch.no_grad():
        args = tuple(ctx.decode(n) for n in doc["args"])
        kwargs = {k: ctx.decode(n) for k, n in doc["kwargs"].items()}
    return args, kwargs


def load_inputs(run, fqn: str, call_index: int = 0, device=None):
    """``(args, kwargs)`` of one captured call, bit-identical to what the module received.

    Args:
        run: run directory.
        fqn: module path as in ``named_modules()`` ("" for the root).
        call_index: which call of that module (0 = first).
        device: move tensors there (default: the device they were captured on, if present).
    """
    df = read_modules(run)
    rows = df[(df["fqn"] == fqn) & (df["call_index"] == call_index)]
    if rows.empty:
        known = ", ".join(sorted(set(df["fqn"]))[:8])
        raise RunDirError(f"{run}: no captured call '{fqn}' #{call_index} (known: {known} ...)")
    return load_call_inputs(Path(run), rows.iloc[0]["inputs_ref"], device=device)
