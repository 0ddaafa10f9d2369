"""Reading and writing Kineto traces (docs/ARCHITECTURE.md): whole traces read and written, the
capture trace compressed (``gzip_trace``) and traces streamed; the annotated copy is the one trace
written elsewhere, by ``annotate/rewrite_json.py``'s byte-preserving rewrite.

``.json`` and ``.json.gz`` are told apart by suffix. ``read_trace`` loads a whole trace as a
dict (for small traces and for writing annotated copies); ``stream_trace`` decodes the
``traceEvents`` array chunk by chunk, so a trace larger than memory can still be read: only one
chunk of decompressed bytes is held at a time, and the caller keeps only what it decodes.

A trace may be hostile: gzip input is inflated at most ``max_gzip_ratio()`` times its compressed
size (checked as it streams, once past ``RATIO_FLOOR_BYTES``), JSON nested deeper than the
decoders' recursion limit is refused, and so is an event with no end in ``MAX_EVENT_BYTES``;
each is one ``TraceLimitError`` line.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Callable, Iterator

from cbtrace.errors import TraceError

try:  # ISA-L inflate: same API as zlib, faster (optional: pip install isal)
    from isal import isal_zlib as _inflate
except ImportError:  # pragma: no cover - depends on the environment
    _inflate = zlib

CHUNK_BYTES = 1 << 20  # decompressed bytes decoded at a time
_READ_BYTES = 1 << 20  # compressed bytes read at a time
_PIECE_BYTES = 1 << 20  # most decompressed bytes produced at a time
_KEY = b'"traceEvents"'
RATIO_ENV = "CBTRACE_MAX_GZIP_RATIO"
# Kineto's JSON gzips about 10-30x; a gzip bomb inflates about 1000x
DEFAULT_MAX_RATIO = 200
RATIO_FLOOR_BYTES = 32 << 20  # a small trace may inflate at any ratio
MAX_EVENT_BYTES = 256 << 20  # undecoded bytes with no event boundary: not a Kineto trace


class TraceLimitError(TraceError):
    """A trace past a safety limit (inflation ratio, nesting, event size): refused outright."""


def max_gzip_ratio() -> float:
    """The most a gzip trace may inflate (times its compressed size); 0: no limit."""
    text = os.environ.get(RATIO_ENV, "")
    try:
        return float(text) if text.strip() else DEFAULT_MAX_RATIO
    except ValueError:
        raise TraceError(f"{RATIO_ENV}={text!r}: expected a number (0: no limit)") from None


def check_ratio(path, compressed: int, inflated: int, limit: float) -> None:
    """TraceLimitError if ``inflated`` bytes from ``compressed`` bytes pass ``limit``."""
    if limit and inflated > RATIO_FLOOR_BYTES and inflated > limit * max(compressed, 1):
        raise TraceLimitError(
            f"{path}: gzip data inflates over {limit:g}x ({compressed} bytes read gave "
            f"{inflated}): refusing a possible gzip bomb (raise the limit with {RATIO_ENV}=N, "
            "0 for none)")


def too_deep(path) -> TraceLimitError:
    return TraceLimitError(f"{path}: JSON nested too deeply to decode (past the decoder's "
                           "recursion limit): not a Kineto trace")


def is_gzip(path) -> bool:
    return str(path).endswith(".gz")


def iter_bytes(path, read_bytes: int = _READ_BYTES) -> Iterator[bytes]:
    """Decompressed bytes of a trace file, in pieces (gzip by suffix; multi-member gzip ok)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TraceError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        if not is_gzip(path):
            while piece := f.read(read_bytes):
                yield piece
            return
        d = _inflate.decompressobj(wbits=31)
        limit, inflated = max_gzip_ratio(), 0
        try:
            while piece := f.read(read_bytes):
                while piece:
                    out = d.decompress(piece, _PIECE_BYTES)
                    inflated += len(out)
                    check_ratio(path, f.tell() - len(d.unconsumed_tail) - len(d.unused_data),
                                inflated, limit)
                    yield out
                    piece = d.unconsumed_tail
                    if not piece and d.unused_data:  # next gzip member
                        piece, d = d.unused_data, _inflate.decompressobj(wbits=31)
            yield d.flush()
        except (zlib.error, _inflate.error) as e:
            raise TraceError(f"{path}: corrupt gzip data ({e})") from None


def read_trace(path) -> dict:
    """The whole trace as a dict (``{"traceEvents": [...]}`` for a bare event array)."""
    data = b"".join(iter_bytes(path))
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise too_deep(path) from None
    if isinstance(obj, list):
        obj = {"traceEvents": obj}
    if not isinstance(obj, dict):
        raise TraceError(f"{path}: not a Kineto trace (top level is {type(obj).__name__})")
    return obj


CAPTURE_GZIP_LEVEL = 1  # the fastest level: a capture waits on it, and the trace is read once or twice


def gzip_trace(raw, path, level: int = CAPTURE_GZIP_LEVEL) -> None:
    """Compress the trace file ``raw`` (as exported by torch.profiler) into ``path``."""
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=level) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def write_trace(path, trace: dict) -> None:
    """Write a trace as .json or .json.gz (by suffix)."""
    path = Path(path)
    data = json.dumps(trace).encode()
    if is_gzip(path):
        with gzip.open(path, "wb", compresslevel=6) as f:
            f.write(data)
    else:
        path.write_bytes(data)


def _decode_meta(path, text: bytes, *, head: bool) -> dict:
    """Decode the top-level keys before (``{"k": v,``) or after (``, "k": v}``) traceEvents."""
    text = text.strip()
    text = text.rstrip(b", \t\r\n") + b"}" if head else b"{" + text.lstrip(b", \t\r\n")
    if text.replace(b" ", b"") in (b"{}", b"{{}", b"{}}"):
        return {}
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: corrupt trace metadata ({e})") from None
    except RecursionError:
        raise too_deep(path) from None
    return meta if isinstance(meta, dict) else {}


def _split(path, buf: bytearray, start: int, decode: Callable[[bytes], list]):
    """Decode the complete events in ``buf[start:]``; return (events, end of the decoded part)."""
    pos, tried = len(buf), 0
    while tried < 8:  # a boundary inside nested args fails to decode: try an earlier one
        pos = buf.rfind(b"{", start, pos)
        if pos < 0:
            break
        end = _boundary_end(buf, pos, start)
        if end is None:
            continue
        tried += 1
        try:
            return decode(_bracketed(buf, start, end)), end
        except ValueError:
            continue
    return None, start


def _bracketed(buf: bytearray, start: int, end: int) -> bytes:
    """``b"[" + buf[start:end] + b"]"`` with a single copy."""
    with memoryview(buf) as view:
        return b"".join((b"[", view[start:end], b"]"))


def _boundary_end(buf: bytearray, brace: int, start: int) -> int | None:
    """If ``buf[brace]`` opens an event after ``},``, the offset just past that ``}``."""
    i = brace - 1
    while i > start and buf[i] in b" \t\r\n":
        i -= 1
    if i <= start or buf[i] != 0x2C:  # ","
        return None
    i -= 1
    while i > start and buf[i] in b" \t\r\n":
        i -= 1
    return i + 1 if buf[i] == 0x7D else None  # "}"


def stream_trace(path, decode: Callable[[bytes], list], *, chunk_bytes: int = CHUNK_BYTES):
    """Yield ``("events", list)`` per decoded chunk, then one ``("meta", dict)``.

    ``decode(b"[...]")`` turns a JSON array of events into a list (e.g. a typed msgspec decoder);
    it must raise ``ValueError`` (msgspec's DecodeError is one) on malformed input.
    Memory: the undecoded tail plus about ``chunk_bytes`` of text and its decoded list.
    """
    try:
        yield from _stream(path, decode, chunk_bytes)
    except RecursionError:
        raise too_deep(path) from None


def _stream(path, decode, chunk_bytes: int):
    pieces = iter_bytes(path)
    buf = bytearray()
    meta: dict = {}
    start = -1  # offset of the first undecoded event in buf, once inside traceEvents
    for piece in pieces:
        buf += piece
        if start < 0:
            k = buf.find(_KEY)
            if k < 0:
                if len(buf) > 64 << 20:
                    raise TraceError(f"{path}: not a Kineto trace (no traceEvents)")
                continue
            bracket = buf.find(b"[", k)
            if bracket < 0:
                continue
            meta.update(_decode_meta(path, bytes(buf[:k]), head=True))
            del buf[: bracket + 1]
            start = 0
        if len(buf) - start < chunk_bytes:
            continue
        events, end = _split(path, buf, start, decode)
        if events is None and len(buf) - start > MAX_EVENT_BYTES:
            raise TraceLimitError(f"{path}: no event boundary in {MAX_EVENT_BYTES >> 20} MiB of "
                                  "traceEvents: not a Kineto trace")
        if events is not None:
            yield "events", events
            del buf[:end]
            comma = buf.find(b",")
            start = comma + 1 if comma >= 0 else 0
    if start < 0:
        yield from _whole(path, bytes(buf), decode)
        return
    events, tail = _last_events(path, buf, start, decode)
    if events:
        yield "events", events
    meta.update(_decode_meta(path, tail, head=False))
    yield "meta", meta


def _last_events(path, buf: bytearray, start: int, decode):
    """Split the final piece into its events and the text after the closing ``]``.

    The ``]`` that closes traceEvents is the last one whose following text is the rest of a JSON
    object (cheap to check: the tail is small); only then are the events decoded.
    """
    pos = len(buf)
    for _ in range(10000):
        pos = buf.rfind(b"]", start, pos)
        if pos < 0:
            break
        tail = bytes(buf[pos + 1:])
        try:
            _decode_meta(path, tail, head=False)
        except TraceError:
            continue
        body = bytes(buf[start:pos]).strip()
        try:
            return (decode(b"[" + body + b"]") if body else []), tail
        except ValueError:
            continue
    raise TraceError(f"{path}: truncated or corrupt traceEvents array")


def _whole(path, data: bytes, decode):
    """A file without a traceEvents key: a bare event array, or not a trace at all."""
    s = data.lstrip()
    if s.startswith(b"["):
        try:
            yield "events", decode(s)
        except ValueError as e:
            raise TraceError(f"{path}: not valid JSON ({e})") from None
        yield "meta", {}
        return
    if not s:
        raise TraceError(f"{path}: empty file")
    try:
        keys = list(json.loads(s))[:5] if s.startswith(b"{") else []
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TraceError(f"{path}: not valid JSON") from None
    raise TraceError(f"{path}: not a Kineto trace (no traceEvents; keys: {', '.join(keys)})")
