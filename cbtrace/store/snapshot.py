"""Snapshotter: copy a module call's live inputs at entry, write them to Parquet after the step.

``plan(args, kwargs)`` walks the inputs with the registered serializers, copies tensor data on
its own device (no host sync) and returns ``inputs_ref``, a JSON string of the (args, kwargs)
tree with tensors by reference to chunks in ``inputs/tensors-NNNNN.parquet``. ``flush()``
moves the copies to the host and writes the shards. ``store.ref_format`` owns the format.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from cbtrace import registry
from cbtrace.store import ref_format, shards, synth
from cbtrace.store.codec import EncodeContext, by_name
from cbtrace.store.tensor_store import ShardPlan, TensorStore, run_copies, tensor_meta

__all__ = ["Snapshotter", "tensor_meta", "run_copies"]

# One shard per writer thread, each fsynced: large enough that many small fsyncs do not queue
# on the disk, small enough that a capture of a few hundred MB still uses several writers.
SHARD_BYTES = 64 << 20
WRITERS = max(2, min(8, os.cpu_count() or 2))  # shards written concurrently by flush()


class Snapshotter:
    """Copies inputs at ``plan()``, writes them at ``flush()``.

    Args:
        inputs_dir: the run's ``inputs/`` directory (created if missing).
        synthesize_above_bytes: tensors spanning more bytes are kept as statistics only.
        max_pending_bytes: write shards early once this many copied bytes are held.
        shard_bytes: target size of one Parquet shard (default ``SHARD_BYTES``, read when
            the object is made, as ``WRITERS`` is at each flush: benchmarks vary both).
        serializers: default ``cbtrace.registry.serializers()`` (third-party first).
    """

    def __init__(self, inputs_dir: Path, *, synthesize_above_bytes: int | None = None,
                 max_pending_bytes: int | None = None, shard_bytes: int | None = None,
                 serializers=None):
        if serializers is None:
            serializers = registry.serializers()
        self.inputs_dir = Path(inputs_dir)
        self.max_pending_bytes = max_pending_bytes
        self._serializers = list(serializers)
        by_name(self._serializers)  # a clash between plugins fails here, not mid-capture
        self._plan = ShardPlan(shard_bytes or SHARD_BYTES, shards.PART_BYTES)
        self._store = TensorStore(self._plan, synthesize_above_bytes)
        self._files: list[Path] = []
        self.last_input_bytes = 0
        self.last_synthesized = False
        self.bytes_written = 0
        self._type_cache: dict = {}  # type -> serializer, shared by every plan()
        self.digests: dict[Path, str] = {}  # sha256 of each shard, computed while writing

    def plan(self, args: tuple, kwargs: dict) -> tuple[str, list]:
        """The call's ``inputs_ref`` JSON and the copies still to run (``run_copies``) before the
        call may go on. Pending shards are written early here, before any
        chunk of this call exists, once more than ``max_pending_bytes`` are held."""
        if self.max_pending_bytes is not None and self._plan.pending_bytes > self.max_pending_bytes:
            self._plan.close()
            self._write(self._plan.pop_closed())
        pending: list = []

        def put_tensor(t):
            node: dict = {}
            pending.append((t, node))
            return node

        ctx = EncodeContext(self._serializers, put_tensor, self._type_cache)
        arg_nodes = [ctx.encode(a) for a in args]
        kw_nodes = {str(k): ctx.encode(v) for k, v in kwargs.items()}
        used, self.last_input_bytes, self.last_synthesized, copies = self._store.commit(pending)
        chunks = {i: c.ref() for i, c in sorted(used.items())}
        return ref_format.build(arg_nodes, kw_nodes, chunks), copies

    def flush(self) -> list[Path]:
        """Write every pending chunk; returns all shard files written so far."""
        self._plan.close()
        self._write(self._plan.pop_closed())
        self._store.forget_dead()
        return list(self._files)

    def _write(self, closed) -> None:
        """Write closed shards, several at once: device-to-host copies, CRCs, Parquet encoding,
        hashing and disk writes of different shards overlap (each releases the GIL)."""
        if not closed:
            return
        self.inputs_dir.mkdir(parents=True, exist_ok=True)
        _sync_devices(c.payload for _, chunks in closed for c in chunks)

        def one(item):
            shard, chunks = item
            path = self.inputs_dir / shards.shard_name(shard)
            n = shards.write_shard(path, _rows(chunks, self._plan.part_bytes), self.digests,
                                   sync_dir=False)
            for c in chunks:
                c.payload = None  # free the copy
            return path, n, sum(c.nbytes for c in chunks)

        with ThreadPoolExecutor(min(WRITERS, len(closed))) as pool:
            for path, n, pending in pool.map(one, closed):
                self.bytes_written += n
                self._plan.pending_bytes -= pending
                self._files.append(path)
        shards.fsync_dir(self.inputs_dir)


def _sync_devices(payloads) -> None:
    """Wait for the copies queued on any CUDA stream (the step may have used side streams)."""
    tensors = (p[1] if isinstance(p, tuple) else p for p in payloads)  # stats: (kind, t, n)
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
    for d in devices:
        torch.cuda.synchronize(d)


def _rows(chunks, part_bytes: int):
    """(chunk_id, part, kind, uint8 ndarray) rows. Parts of device copies are views of this
    thread's pinned staging buffer, valid until the next row is drawn (write_shard's contract)."""
    for c in chunks:
        if c.kind == "s":
            kind, stats, numel = c.payload
            doc = synth.stats_doc(kind, stats.cpu().tolist(), numel)
            yield c.id, 0, "s", np.frombuffer(json.dumps(doc).encode(), np.uint8)
            continue
        parts = (_host_parts(c.payload, part_bytes) if c.payload is not None
                 else _zero_parts(c.nbytes, part_bytes))  # its copy failed: the capture failed
        for i, part in enumerate(parts):
            yield c.id, i, "d", part


def _zero_parts(nbytes: int, part_bytes: int):
    """Zeros in the parts a chunk of ``nbytes`` was planned with (its rows stay in place)."""
    for lo in range(0, max(nbytes, 1), part_bytes):
        yield np.zeros(min(part_bytes, nbytes - lo), np.uint8)


_stage = threading.local()


def _host_parts(t, part_bytes: int):
    """A uint8 tensor's bytes as numpy arrays of at most ``part_bytes``.

    A CUDA tensor goes through a pinned staging buffer of this thread, one part at a time,
    and each part is a view of that buffer (no host copy, no page faults on fresh memory):
    pageable device-to-host copies from several threads at once are far slower than pinned
    ones. Stages return to torch's pinned-memory cache when the writer threads end.
    """
    if t.device.type != "cuda":
        arr = (t if t.device.type == "cpu" else t.cpu()).numpy()
        for lo in range(0, max(arr.size, 1), part_bytes):
            yield arr[lo:lo + part_bytes]
        return
    stage = getattr(_stage, "buf", None)
    if stage is None or stage.numel() < part_bytes:
        stage = _stage.buf = torch.empty(part_bytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream(t.device)
    for lo in range(0, max(t.numel(), 1), part_bytes):
        hi = min(t.numel(), lo + part_bytes)
        stage[:hi - lo].copy_(t[lo:hi], non_blocking=True)
        stream.synchronize()
        yield stage[:hi - lo].numpy()
