"""Parquet shards of captured input data: ``inputs/tensors-NNNNN.parquet`` (the I/O edge).

One row per part of a chunk (a chunk is a copied storage span, or the JSON statistics of a
synthesized tensor); parts are at most ``PART_BYTES`` so each fits a Parquet BYTE_ARRAY.
Small rows are batched into row groups of about ``GROUP_BYTES``, large ones get their own,
so loading one call's inputs reads little more than its rows. Columns:
``chunk`` (id), ``part`` (0..n-1), ``kind`` ("d" data, "s" stats), ``crc32``, ``data``.
Files are written to a temp file, fsynced, then renamed: a reader never sees half a shard.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import os
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cbtrace.errors import SerializationError

PART_BYTES = 64 << 20
GROUP_BYTES = 4 << 20
SCHEMA = pa.schema([("chunk", pa.int64()), ("part", pa.int32()), ("kind", pa.string()),
                    ("crc32", pa.int64()), ("data", pa.binary())])


def shard_name(index: int) -> str:
    return f"tensors-{index:05d}.parquet"


def _binary(arr: np.ndarray) -> pa.Array:
    """One-value BinaryArray over ``arr``'s memory (no copy)."""
    offsets = np.array([0, arr.nbytes], dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), 1, [None, pa.py_buffer(offsets), pa.py_buffer(arr)])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _groups(rows):
    """Consecutive rows batched until a group holds GROUP_BYTES."""
    group, size = [], 0
    for r in rows:
        group.append(r)
        size += r[3].nbytes
        if size >= GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


# Seconds spent in each phase of write_shard, summed over threads (capture reports them).
PHASE_S: dict[str, float] = {}
_phase_lock = threading.Lock()


def _add_phase(name: str, t0: float) -> float:
    now = time.perf_counter()
    with _phase_lock:
        PHASE_S[name] = PHASE_S.get(name, 0.0) + now - t0
    return now


def write_shard(path: Path, rows, digests: dict | None = None) -> int:
    """Write rows of (chunk_id, part, kind, uint8 ndarray) atomically; returns data bytes.

    If ``digests`` is given, the finished file's sha256 is stored under ``path`` (hashed from the
    page cache right after the write, so the manifest need not read the shard again).
    """
    path = Path(path)
    t = time.perf_counter()
    rows = [(c, p, k, np.ascontiguousarray(a, dtype=np.uint8).reshape(-1)) for c, p, k, a in rows]
    t = _add_phase("to_host", t)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        # checksums run in threads (zlib releases the GIL) while earlier rows are written
        with ThreadPoolExecutor(2) as pool:
            _write_rows(tmp, rows, pool)
        t = _add_phase("parquet_write", t)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t = _add_phase("fsync", t)
        if digests is not None:
            digests[path] = _sha256(tmp)
            _add_phase("sha256", t)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return sum(r[3].nbytes for r in rows)


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_rows(where, rows, pool) -> None:
    with pq.ParquetWriter(where, SCHEMA, compression="none", use_dictionary=False,
                          write_statistics=False) as writer:
        crcs = [pool.submit(zlib.crc32, r[3]) for r in rows]
        done = 0
        for group in _groups(rows):
            cols = [pa.array([r[0] for r in group], pa.int64()),
                    pa.array([r[1] for r in group], pa.int32()),
                    pa.array([r[2] for r in group], pa.string()),
                    pa.array([c.result() for c in crcs[done:done + len(group)]], pa.int64()),
                    pa.chunked_array([_binary(r[3]) for r in group], pa.binary())]
            done += len(group)
            writer.write_table(pa.Table.from_arrays(cols, schema=SCHEMA),
                               row_group_size=len(group))


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class _Shard:
    """An open shard and the first row of each of its row groups."""

    def __init__(self, path: str):
        self.pf = pq.ParquetFile(path, memory_map=True)
        meta = self.pf.metadata
        self.starts = [0]
        for i in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(i).num_rows)
        self.num_rows = self.starts[-1]
        self._cached = (None, None)

    def row(self, i: int):
        """(row group table, index within it) of row ``i``; the last group read is kept."""
        g = bisect.bisect_right(self.starts, i) - 1
        if self._cached[0] == g:
            return self._cached[1], i - self.starts[g]
        table = self.pf.read_row_group(g)
        self._cached = (g, table) if table.nbytes <= 2 * GROUP_BYTES else (None, None)
        return table, i - self.starts[g]


@functools.lru_cache(maxsize=4)  # each may hold one small row group
def _open(path: str, mtime_ns: int, size: int) -> _Shard:
    return _Shard(path)


def open_shard(path: Path) -> _Shard:
    """A cached ParquetFile; missing or corrupt files raise SerializationError naming them."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SerializationError(f"{path}: input shard is missing") from None
    try:
        shard = _open(str(path), st.st_mtime_ns, st.st_size)
    except (pa.ArrowException, OSError) as e:
        raise SerializationError(f"{path}: corrupt or truncated Parquet "
                                 f"({_first_line(e)})") from None
    names = shard.pf.schema_arrow.names
    if names != SCHEMA.names:
        raise SerializationError(f"{path}: not a cbtrace input shard (columns {names})")
    return shard


def read_chunk(path: Path, row: int, nparts: int, chunk_id: int) -> tuple[str, list]:
    """(kind, [uint8 ndarray per part]) of one chunk, with its ids and checksums verified."""
    shard = open_shard(path)
    if row + nparts > shard.num_rows:
        raise SerializationError(f"{path}: has {shard.num_rows} rows, chunk {chunk_id} needs "
                                 f"rows {row}..{row + nparts - 1} (truncated or stale shard)")
    kind, parts = None, []
    for i in range(nparts):
        try:
            table, j = shard.row(row + i)
        except (pa.ArrowException, OSError) as e:
            raise SerializationError(f"{path}: corrupt Parquet near row {row + i} "
                                     f"({_first_line(e)})") from None
        rec = {name: table.column(name)[j].as_py() for name in ("chunk", "part", "kind", "crc32")}
        if rec["chunk"] != chunk_id or rec["part"] != i:
            raise SerializationError(f"{path}: row {row + i} holds chunk {rec['chunk']} part "
                                     f"{rec['part']}, expected chunk {chunk_id} part {i} "
                                     "(shard from another capture?)")
        arr = _value(table.column("data"), j)
        if zlib.crc32(arr) != rec["crc32"]:
            raise SerializationError(f"{path}: checksum mismatch in chunk {chunk_id} "
                                     f"(row {row + i}); the file is corrupted")
        kind = rec["kind"]
        parts.append(arr)
    return kind, parts


def _value(column: pa.ChunkedArray, j: int) -> np.ndarray:
    """The j-th binary value of a column as a uint8 ndarray over Arrow's memory (no copy)."""
    for col in column.chunks:
        if j < len(col):
            break
        j -= len(col)
    start, end = np.frombuffer(col.buffers()[1], np.int32)[col.offset + j:col.offset + j + 2]
    buf = col.buffers()[2]
    if buf is None:
        return np.zeros(0, np.uint8)
    return np.frombuffer(buf, np.uint8, count=int(end - start), offset=int(start))
