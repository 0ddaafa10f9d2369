"""Streaming rewrite of a Chrome-trace JSON document (Kineto's ``*.pt.trace.json[.gz]``).

The trace passes through in chunks and is copied byte for byte, except:
- events that contain a marker (``cbtrace::``, ``nn.Module: ``, ``ProfilerStep#``) are parsed
  and handed to ``on_event``; if it returns a dict, that dict replaces the event;
- ``head`` (JSON members, e.g. ``"cbtrace": {...}``) is inserted after the top-level ``{``;
- ``tail()`` (a list of event dicts) is appended at the end of ``traceEvents``.

Event boundaries come from a vectorised structural scan (numpy): quote parity tells which
braces lie outside strings, and a running depth finds the items of the ``traceEvents`` array.
Memory is bounded by the chunk size plus the longest event; gzip inflation and nesting depth
are bounded as in ``cbtrace.trace_io`` (a hostile trace is one ``TraceLimitError`` line).
"""
from __future__ import annotations

import json
import queue
import re
import threading
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from cbtrace.errors import TraceError
from cbtrace.trace_io import MAX_EVENT_BYTES, TraceLimitError, check_ratio, max_gzip_ratio, too_deep

CHUNK_BYTES = 1 << 22
GZIP_LEVEL = 6  # near level 9's size at a fraction of its time
MARKERS = (b"cbtrace::", b"nn.Module: ", b"ProfilerStep#")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*$')
_OPEN = (ord("{"), ord("["))
MAX_DEPTH = 256  # Kineto's events nest under 10 deep; json.loads recurses once per level


def read_chunks(path: Path, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Decompressed bytes of a .json or .json.gz file (multi-member gzip too), ``size`` at most."""
    gz = Path(path).name.endswith(".gz")
    with open(path, "rb") as f:
        if not gz:
            while block := f.read(size):
                yield block
            return
        d = zlib.decompressobj(47)
        limit, inflated = max_gzip_ratio(), 0
        while block := f.read(1 << 20):
            while block:
                out = d.decompress(block, size)
                inflated += len(out)
                check_ratio(path, f.tell() - len(d.unconsumed_tail) - len(d.unused_data),
                            inflated, limit)
                if out:
                    yield out
                if d.unconsumed_tail:
                    block = d.unconsumed_tail
                elif d.eof:
                    block, d = d.unused_data, zlib.decompressobj(47)
                else:
                    block = b""
        if tail := d.flush():
            yield tail


class Sink:
    """Writes bytes to a file; gzip-compresses on a helper thread when ``gz`` (zlib drops the
    GIL while compressing, so scanning and compressing overlap on two cores)."""

    def __init__(self, f, gz: bool):
        self.f, self.bytes_in, self.pending = f, 0, bytearray()
        self.q = self.thread = self.error = None
        if gz:
            self.q = queue.Queue(maxsize=4)
            self.thread = threading.Thread(target=self._compress, daemon=True)
            self.thread.start()

    def _compress(self) -> None:
        z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
        try:
            while (data := self.q.get()) is not None:
                self.f.write(z.compress(data))
            self.f.write(z.flush())
        except BaseException as e:  # reported by close()
            self.error = e
            while self.q.get() is not None:
                pass

    def write(self, data) -> None:
        self.bytes_in += len(data)
        if self.q is None:
            self.f.write(data)
            return
        self.pending += data
        if len(self.pending) >= CHUNK_BYTES:
            self.q.put(bytes(self.pending))
            self.pending.clear()

    def close(self) -> None:
        if self.q is None:
            return
        self.q.put(bytes(self.pending))
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


class Scanner:
    """Finds the items of ``traceEvents`` in a stream fed chunk by chunk."""

    def __init__(self, path=None):
        self.path = path
        self.pos = 0          # absolute offset of the next chunk
        self.in_str = 0       # 1 if the previous chunk ended inside a string
        self.depth = 0        # nesting depth at the end of the previous chunk
        self.bs_run = 0       # backslashes at the end of the previous chunk
        self.lookback = b""   # last bytes of the previous chunk (to read a key before '[')
        self.top_open = None  # absolute position of the document's '{'
        self.array = None     # (open, close) of traceEvents; close None until seen
        self.n_items = 0

    def feed(self, chunk: bytes):
        """Scan one chunk -> (item starts, item ends) as absolute positions (inclusive)."""
        a = np.frombuffer(chunk, np.uint8)
        q = self._quotes(a, chunk)
        s = np.flatnonzero((a == 123) | (a == 125) | (a == 91) | (a == 93))
        outside = ((np.searchsorted(q, s) + self.in_str) & 1) == 0
        s = s[outside]
        c = a[s]
        delta = np.where((c == 123) | (c == 91), 1, -1).astype(np.int32)
        after = self.depth + np.cumsum(delta, dtype=np.int32)
        before = after - delta
        starts, ends = self._items(chunk, s, c, before, after)
        self.in_str = (self.in_str + len(q)) & 1
        if len(after):
            self.depth = int(after[-1])
            if after.max() > MAX_DEPTH:
                raise TraceLimitError(f"{self.path}: JSON nested over {MAX_DEPTH} deep near byte "
                                      f"{self.pos}: not a Kineto trace")
        stripped = chunk.rstrip(b"\\")
        self.bs_run = (self.bs_run if not stripped else 0) + len(chunk) - len(stripped)
        self.lookback = (self.lookback + chunk)[-64:]
        self.pos += len(chunk)
        return starts, ends

    def _quotes(self, a, chunk: bytes):
        q = np.flatnonzero(a == 34)
        if not self.bs_run and chunk.find(b"\\") < 0:
            return q
        keep = np.ones(len(q), bool)
        for k in np.flatnonzero((a[np.maximum(q - 1, 0)] == 92) | (q == 0)):
            i, n = int(q[k]) - 1, 0
            while i >= 0 and chunk[i] == 92:
                n, i = n + 1, i - 1
            if i < 0:
                n += self.bs_run
            keep[k] = n % 2 == 0
        return q[keep]

    def _items(self, chunk, s, c, before, after):
        """Items of traceEvents: '{' entered at depth 2 / '}' left to depth 2, inside the array."""
        lo, hi = 0, len(s)
        if self.array is None or self.array[1] is None:
            for k in np.flatnonzero((before <= 1) | (after <= 1)):
                p, ch = int(s[k]), int(c[k])
                if before[k] == 0 and ch == 123 and self.top_open is None:
                    self.top_open = self.pos + p
                elif before[k] == 1 and ch == 91 and self.array is None:
                    if _EVENTS_KEY.search((self.lookback + chunk[:p])[-80:]):
                        self.array, lo = (self.pos + p, None), k + 1
                elif after[k] == 1 and ch == 93 and self.array and self.array[1] is None:
                    self.array, hi = (self.array[0], self.pos + p), k
                    break
        if self.array is None or (self.array[1] is not None and self.array[1] < self.pos):
            return np.empty(0, np.int64), np.empty(0, np.int64)
        sl = slice(lo, hi)
        cs, b, a2, ss = c[sl], before[sl], after[sl], s[sl]
        starts = ss[(cs == 123) & (b == 2)] + self.pos
        ends = ss[(cs == 125) & (a2 == 2)] + self.pos
        self.n_items += len(starts)
        return starts.astype(np.int64), ends.astype(np.int64)


def rewrite(src: Path, dst_file, *, on_event: Callable[[dict], dict | None],
            head: bytes = b"", tail: Callable[[], list] = list, gz: bool = False,
            chunk_bytes: int | None = None) -> dict:
    """Stream ``src`` into ``dst_file`` (binary), rewriting marked events; returns byte counts."""
    sink, scan = Sink(dst_file, gz), Scanner(src)
    buf, buf_at, written = bytearray(), 0, 0  # buf holds stream bytes [buf_at, buf_at+len(buf))
    pending = None  # start of an item whose end has not been seen yet
    head_done, tail_done = not head, False
    for chunk in read_chunks(src, chunk_bytes or CHUNK_BYTES):
        starts, ends = scan.feed(chunk)
        buf += chunk
        if not head_done and scan.top_open is not None:
            cut = scan.top_open + 1
            sink.write(buf[written - buf_at:cut - buf_at])
            sink.write(head)
            written, head_done = cut, True
        starts, ends, pending = _pair(pending, starts, ends)
        written = _rewrite_spans(buf, buf_at, written, starts, ends, sink, on_event)
        close = scan.array[1] if scan.array else None
        if close is not None and not tail_done:
            sink.write(buf[written - buf_at:close - buf_at])
            sink.write(_tail_bytes(tail(), scan.n_items > 0))
            written, tail_done = close, True
        keep = max(written, pending if pending is not None else scan.pos)
        if scan.pos - keep > MAX_EVENT_BYTES:
            raise TraceLimitError(f"{src}: an event of over {MAX_EVENT_BYTES >> 20} MiB at byte "
                                  f"{keep}: not a Kineto trace")
        sink.write(buf[written - buf_at:keep - buf_at])
        del buf[:keep - buf_at]
        written = buf_at = keep
    sink.write(buf)
    sink.close()
    if scan.array is None or scan.array[1] is None:
        raise TraceError(f"{src}: not a Chrome trace (no complete traceEvents array)")
    return {"bytes_in": scan.pos, "bytes_out": sink.bytes_in, "events": scan.n_items}


def _pair(pending, starts, ends):
    """Match item starts and ends (items never nest at depth 2) -> (starts, ends, open start)."""
    if pending is not None:
        starts = np.concatenate(([pending], starts))
    n = len(ends)
    return starts[:n], ends, (int(starts[n]) if len(starts) > n else None)


def _hits(buf, lo: int, hi: int) -> list[int]:
    """Offsets in buf[lo:hi] where a marker starts (bytes.find: memchr speed)."""
    out = []
    for m in MARKERS:
        i = buf.find(m, lo, hi)
        while i >= 0:
            out.append(i)
            i = buf.find(m, i + 1, hi)
    return sorted(out)


def _rewrite_spans(buf, buf_at, written, starts, ends, sink, on_event) -> int:
    if not len(starts):
        return written
    hits = _hits(buf, int(starts[0]) - buf_at, int(ends[-1]) - buf_at + 1)
    seen = -1
    for h in hits:
        k = int(np.searchsorted(starts, h + buf_at, side="right")) - 1
        if k <= seen or k < 0 or h + buf_at > ends[k]:
            continue
        seen = k
        s, e = int(starts[k]), int(ends[k])
        try:
            ev = json.loads(bytes(buf[s - buf_at:e - buf_at + 1]))
        except ValueError as err:
            raise TraceError(f"trace event at byte {s} is not valid JSON ({err})") from None
        except RecursionError:
            raise too_deep(f"trace event at byte {s}") from None
        new = on_event(ev)
        if new is not None:
            sink.write(buf[written - buf_at:s - buf_at])
            sink.write(json.dumps(new, separators=(",", ":")).encode())
            written = e + 1
    return written


def _tail_bytes(events: list, non_empty: bool) -> bytes:
    if not events:
        return b""
    body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
    return ((",\n" if non_empty else "\n") + body + "\n").encode()
