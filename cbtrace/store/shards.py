"""Parquet shards of captured input data: ``inputs/tensors-NNNNN.parquet`` (the I/O edge).

One row per part of a chunk (a chunk is a copied storage span, or the JSON statistics of a
synthesized tensor); parts are at most ``PART_BYTES`` so each fits a Parquet BYTE_ARRAY.
Small rows are batched into row groups of about ``GROUP_BYTES``, large ones get their own,
so loading one call's inputs reads little more than its rows. Columns:
``chunk`` (id), ``part`` (0..n-1), ``kind`` ("d" data, "s" stats), ``crc32``, ``data``.
Files are written to a temp file, fsynced, then renamed: a reader never sees half a shard.
Writing streams: each large part is written as its own row group as soon as it is on the host,
and the kernel is asked to start writing it to disk at once (``start_writeback``).
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cbtrace.errors import SerializationError, one_line

try:  # ISA-L's CRC-32 is zlib's checksum (same values), faster (benchmarks/RESULTS.md)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a bare install still works
    from zlib import crc32

PART_BYTES = 32 << 20
GROUP_BYTES = 4 << 20
SCHEMA = pa.schema([("chunk", pa.int64()), ("part", pa.int32()), ("kind", pa.string()),
                    ("crc32", pa.int64()), ("data", pa.binary())])


def shard_name(index: int) -> str:
    return f"tensors-{index:05d}.parquet"


def _binary(arr: np.ndarray) -> pa.Array:
    """One-value BinaryArray over ``arr``'s memory (no copy)."""
    offsets = np.array([0, arr.nbytes], dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), 1, [None, pa.py_buffer(offsets), pa.py_buffer(arr)])


def fsync_dir(path: Path) -> None:
    """fsync a directory so renames into it survive a crash (best effort)."""
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


@functools.cache
def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except Exception:  # no such libc call (macOS), or no CDLL(None) (Windows)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages now, without waiting.

    Left alone, a large write sits in the page cache until fsync (background writeback only
    starts at 10 % of RAM dirty), so the disk idles while shards are encoded and then all of it
    waits at the end; kicked after each large row group, the disk works alongside.
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE; an error only means no early start


# Seconds spent in each phase of write_shard, summed over threads (capture reports them).
PHASE_S: dict[str, float] = {}
_phase_lock = threading.Lock()


def _add_phase(name: str, t0: float) -> float:
    now = time.perf_counter()
    with _phase_lock:
        PHASE_S[name] = PHASE_S.get(name, 0.0) + now - t0
    return now


def write_shard(path: Path, rows, digests: dict | None = None, sync_dir: bool = True) -> int:
    """Write rows of (chunk_id, part, kind, uint8 ndarray) atomically; returns data bytes.

    ``rows`` is consumed one at a time and each array is used (checksummed, and written or
    copied into a pending row group) before the next row is drawn, so a producer may hand out
    views of one reused staging buffer. If ``digests`` is given, the file's sha256 is stored
    under ``path`` (read back from the page cache right after writing, so the manifest need not
    read the shard again). ``sync_dir=False`` leaves the directory fsync to the caller (once
    for many shards).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            n = _write_rows(tmp, fd, rows)
            t = time.perf_counter()
            if digests is not None:
                digests[path] = _sha256_fd(fd)
                t = _add_phase("sha256", t)
            os.fsync(fd)
            _add_phase("fsync", t)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return n


_read_buf = threading.local()


def _sha256_fd(fd: int) -> str:
    """sha256 of a file's bytes, read through one reused buffer per thread."""
    buf = getattr(_read_buf, "buf", None)
    if buf is None:
        buf = _read_buf.buf = memoryview(bytearray(8 << 20))
    h, offset = hashlib.sha256(), 0
    if not hasattr(os, "preadv"):  # Windows, older macOS
        os.lseek(fd, 0, os.SEEK_SET)
        while block := os.read(fd, len(buf)):
            h.update(block)
        return h.hexdigest()
    while n := os.preadv(fd, [buf], offset):
        h.update(buf[:n])
        offset += n
    return h.hexdigest()


def _table(group) -> pa.Table:
    cols = [pa.array([r[0] for r in group], pa.int64()),
            pa.array([r[1] for r in group], pa.int32()),
            pa.array([r[2] for r in group], pa.string()),
            pa.array([r[3] for r in group], pa.int64()),
            pa.chunked_array([_binary(r[4]) for r in group], pa.binary())]
    return pa.Table.from_arrays(cols, schema=SCHEMA)


def _write_rows(where, fd: int, rows) -> int:
    """Stream rows into a Parquet file: rows of GROUP_BYTES or more get a row group of their
    own, written at once (and the file's writeback started); smaller ones are copied and
    batched until a group holds GROUP_BYTES."""
    total, group, size = 0, [], 0
    with pq.ParquetWriter(where, SCHEMA, compression="none", use_dictionary=False,
                          write_statistics=False) as writer:
        it = iter(rows)
        while True:
            t = time.perf_counter()
            row = next(it, None)
            t = _add_phase("to_host", t)
            if row is None:
                break
            c, p, k, arr = row
            arr = np.ascontiguousarray(arr, dtype=np.uint8).reshape(-1)
            crc = crc32(arr)
            total += arr.nbytes
            t = _add_phase("crc32", t)
            big = arr.nbytes >= GROUP_BYTES
            if not big:
                group.append((c, p, k, crc, arr.copy()))
                size += arr.nbytes
            if group and (big or size >= GROUP_BYTES):
                writer.write_table(_table(group), row_group_size=len(group))
                group, size = [], 0
            if big:
                writer.write_table(_table([(c, p, k, crc, arr)]), row_group_size=1)
                start_writeback(fd)
            _add_phase("parquet_write", t)
        if group:
            writer.write_table(_table(group), row_group_size=len(group))
    return total


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
        # one reader at a time: pyarrow's read of one ParquetFile from two threads (replay's
        # read-ahead and its context loads) fails ("ReadRangeCache did not find matching ...")
        self._lock = threading.Lock()

    def row(self, i: int):
        """(row group table, index within it) of row ``i``; the last group read is kept."""
        g = bisect.bisect_right(self.starts, i) - 1
        cached = self._cached  # one read: a read-ahead thread may replace it meanwhile
        if cached[0] == g:
            return cached[1], i - self.starts[g]
        with self._lock:
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
                                 f"({one_line(e, with_type=False)})") from None
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
                                     f"({one_line(e, with_type=False)})") from None
        rec = {name: table.column(name)[j].as_py() for name in ("chunk", "part", "kind", "crc32")}
        if rec["chunk"] != chunk_id or rec["part"] != i:
            raise SerializationError(f"{path}: row {row + i} holds chunk {rec['chunk']} part "
                                     f"{rec['part']}, expected chunk {chunk_id} part {i} "
                                     "(shard from another capture?)")
        arr = _value(table.column("data"), j)
        if crc32(arr) != rec["crc32"]:
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
