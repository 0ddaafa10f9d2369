"""Fast trace loader: decode only what attribution needs, chunk by chunk.

A typed msgspec decoder skips every field and arg that attribution does not read; only complete
(``ph == "X"``) events and ``ac2g`` flow ends are kept. Op shapes (``Input Dims`` ...) are kept as
raw JSON only until the chunk's ``on_op`` callback has turned them into a cost, so no chunk buffer
outlives its decoding. ``Event.idx`` is the event's position in ``traceEvents``: HTA's ``index``
column (``TraceAnalysis(...).t.get_trace(rank)["index"]``), the key to join with HTA.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from cbtrace import trace_io
from cbtrace.errors import TraceError

_RAW = msgspec.Raw()


class Args(msgspec.Struct, gc=False):
    ext: int | str | None = msgspec.field(default=None, name="External id")
    ext_lc: int | str | None = msgspec.field(default=None, name="external id")  # torch 1.9
    corr: int | str | None = msgspec.field(default=None, name="correlation")
    seq: int | None = msgspec.field(default=None, name="Sequence number")
    py_id: int | None = msgspec.field(default=None, name="Python id")
    py_parent: int | None = msgspec.field(default=None, name="Python parent id")
    hierarchy: str | None = msgspec.field(default=None, name="Module Hierarchy")
    dims: msgspec.Raw = msgspec.field(default=_RAW, name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=_RAW, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=_RAW, name="Concrete Inputs")


class Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str | None = None
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts: float = 0.0
    dur: float = 0.0
    id: int | str | None = None
    args: Args | None = None
    idx: int = msgspec.field(default=-1, name="~cbtrace.idx")  # position in traceEvents
    cost: object = msgspec.field(default=None, name="~cbtrace.cost")  # set by on_op


_TYPED = msgspec.json.Decoder(list[Event])
_LOOSE = msgspec.json.Decoder()


def _decode(data: bytes) -> list[Event]:
    """Typed decoding; an event whose fields have unexpected types is converted leniently."""
    try:
        return _TYPED.decode(data)
    except msgspec.ValidationError:
        return [_lenient(d) for d in _LOOSE.decode(data)]


def _lenient(d) -> Event:
    if not isinstance(d, dict):
        return Event()
    try:
        return msgspec.convert(d, Event, strict=False)
    except msgspec.ValidationError:
        d = {k: v for k, v in d.items() if k in ("ph", "cat", "name", "pid", "tid", "ts", "dur")}
        try:
            return msgspec.convert(d, Event, strict=False)
        except msgspec.ValidationError:
            return Event()


@dataclass
class LoadedTrace:
    path: str
    meta: dict                        # top-level keys other than traceEvents
    events: list[Event]               # complete ("X") events, in file order
    flow_ends: dict = field(default_factory=dict)  # ac2g flow id -> (pid, tid, ts) of its "f"
    n_events: int = 0                 # all events in traceEvents


OpCallback = Callable[[str, bytes, bytes, bytes], object]


def load(path, *, on_op: OpCallback | None = None,
         chunk_bytes: int = trace_io.CHUNK_BYTES) -> LoadedTrace:
    """Load the parts of a Kineto trace that attribution uses.

    Args:
        path: .json or .json.gz trace.
        on_op: called as ``on_op(name, input_dims, input_types, concrete_inputs)`` (raw JSON
            bytes) for each event with ``Input Dims``; its result is stored in ``Event.cost``.
        chunk_bytes: decompressed bytes decoded at a time (bounds peak memory).
    """
    out = LoadedTrace(str(path), {}, [])
    enabled = gc.isenabled()
    gc.disable()  # millions of small allocations, no cycles: GC passes only cost time
    try:
        for kind, payload in trace_io.stream_trace(path, _decode, chunk_bytes=chunk_bytes):
            if kind == "meta":
                out.meta = payload
            else:
                _keep(out, payload, on_op)
    except msgspec.DecodeError as e:
        raise TraceError(f"{path}: not valid JSON ({e})") from None
    finally:
        if enabled:
            gc.enable()
    return out


def _keep(out: LoadedTrace, events: list[Event], on_op) -> None:
    base = out.n_events
    out.n_events += len(events)
    keep = out.events
    for i, e in enumerate(events):
        ph = e.ph
        if ph == "X":
            e.idx = base + i
            keep.append(e)
            a = e.args
            if a is not None and len(a.dims):
                if on_op is not None:
                    e.cost = on_op(e.name, bytes(a.dims), bytes(a.types), bytes(a.concrete))
                a.dims = a.types = a.concrete = _RAW  # release the chunk buffer
        elif ph == "f" and e.cat in ("ac2g", "async") and e.id is not None:
            out.flow_ends[e.id] = (e.pid, e.tid, e.ts)
