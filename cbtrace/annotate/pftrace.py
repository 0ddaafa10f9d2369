"""Native Perfetto protobuf (``.pftrace``) of an annotated trace, via ``perfetto.trace_builder``.

Holds the module slices (figures as debug annotations), the ``cbtrace`` process (isolated
replay, metadata slice) and the counter tracks: the events cbtrace adds, on tracks named like the
JSON's processes and threads. Slices are written as properly nested BEGIN/END pairs per track.
"""
from __future__ import annotations

import json
import zlib

from cbtrace.annotate.appended import perfetto_ns  # the JSON's ns, so both outputs agree

SEQ_ID = 0xCB7  # trusted_packet_sequence_id of every packet (one writer)


def _uuid(*parts) -> int:
    """A stable 63-bit track uuid from a track's identity."""
    s = "\x1f".join(str(p) for p in parts).encode()
    return (zlib.crc32(s) << 31 | zlib.adler32(s)) & ((1 << 63) - 1) or 1


def _int_id(v) -> int:
    return v if isinstance(v, int) and 0 <= v < 2**31 else zlib.crc32(str(v).encode()) & 0x7FFFFFFF


def _annotate(te, args: dict) -> None:
    for k, v in args.items():
        d = te.debug_annotations.add()
        d.name = str(k)
        if isinstance(v, bool):
            d.bool_value = v
        elif isinstance(v, int) and -2**63 <= v < 2**63:
            d.int_value = v
        elif isinstance(v, float):
            d.double_value = v
        elif isinstance(v, str):
            d.string_value = v
        else:
            d.string_value = json.dumps(v)


class _Tracks:
    """Track descriptors, created on first use: process -> thread, process -> counter."""

    def __init__(self, builder, names: dict):
        self.b, self.names, self.made = builder, names, set()

    def _new(self, uuid):
        if uuid in self.made:
            return None
        self.made.add(uuid)
        p = self.b.add_packet()
        p.trusted_packet_sequence_id = SEQ_ID
        p.track_descriptor.uuid = uuid
        return p.track_descriptor

    def process(self, pid) -> int:
        uuid = _uuid("p", pid)
        if (td := self._new(uuid)) is not None:
            td.process.pid = _int_id(pid)
            td.process.process_name = self.names.get(("p", pid), str(pid))
        return uuid

    def thread(self, pid, tid) -> int:
        parent, uuid = self.process(pid), _uuid("t", pid, tid)
        if (td := self._new(uuid)) is not None:
            td.parent_uuid = parent
            td.name = self.names.get(("t", pid, tid), f"thread {tid}")
        return uuid

    def counter(self, pid, name) -> int:
        parent, uuid = self.process(pid), _uuid("c", pid, name)
        if (td := self._new(uuid)) is not None:
            td.parent_uuid = parent
            td.name = name
            td.counter.SetInParent()
        return uuid


def _nested(slices: list[dict]):
    """(ts_ns, is_begin, slice) in an order that nests: children end before their parents."""
    out, stack = [], []
    for s in sorted(slices, key=lambda s: (s["ts"], -(s.get("dur") or 0))):
        t0 = perfetto_ns(s["ts"])
        while stack and stack[-1][0] <= t0:
            out.append((stack.pop()[0], False, None))
        t1 = t0 + max(perfetto_ns(s.get("dur") or 0), 0)
        if stack:
            t1 = min(t1, stack[-1][0])  # clamp a slice that outlives its parent
        stack.append((t1, s))
        out.append((t0, True, s))
    while stack:
        out.append((stack.pop()[0], False, None))
    return out


def unavailable_reason() -> str | None:
    """Why no .pftrace can be written here (the optional ``perfetto`` package), or None."""
    try:  # perfetto is an optional extra: imported only where a .pftrace is written
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2  # noqa: F401
        from perfetto.trace_builder import proto_builder  # noqa: F401
    except ImportError:
        return "the perfetto package is not installed: pip install 'cbtrace[perfetto]'"
    except Exception as e:  # installed but broken, e.g. a protobuf it cannot load
        return f"the perfetto package does not load ({type(e).__name__}: {e})"
    return None


def build(slices: list[dict], extra: list[dict]) -> bytes:
    """Serialized Trace proto from module slices and the appended Chrome-format events."""
    # the optional perfetto extra, as in unavailable_reason
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent
    from perfetto.trace_builder.proto_builder import TraceProtoBuilder

    names = {}
    for e in extra:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[("p", e["pid"])] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            names[("t", e["pid"], e["tid"])] = e["args"]["name"]
    b = TraceProtoBuilder()
    tracks = _Tracks(b, names)
    per_track: dict[int, list[dict]] = {}
    for s in slices + [e for e in extra if e.get("ph") == "X"]:
        per_track.setdefault(tracks.thread(s.get("pid"), s.get("tid")), []).append(s)
    packets = []  # (ts_ns, order, fill)
    for uuid, group in per_track.items():
        for ts, begin, s in _nested(group):
            packets.append((ts, len(packets), uuid, begin, s))
    for e in extra:
        if e.get("ph") == "C":
            for key, value in e["args"].items():  # one track per series, as Perfetto's JSON import
                uuid = tracks.counter(e["pid"], f'{e["name"]} {key}')
                packets.append((round(e["ts"] * 1000), len(packets), uuid, None, value))
    for ts, _, uuid, begin, s in sorted(packets, key=lambda p: (p[0], p[1])):
        p = b.add_packet()
        p.timestamp = ts
        p.trusted_packet_sequence_id = SEQ_ID
        te = p.track_event
        te.track_uuid = uuid
        if begin is None:  # counter
            te.type = TrackEvent.Type.TYPE_COUNTER
            te.double_counter_value = float(s)
        elif begin:
            te.type = TrackEvent.Type.TYPE_SLICE_BEGIN
            te.name = str(s.get("name", ""))
            _annotate(te, s.get("args") or {})
        else:
            te.type = TrackEvent.Type.TYPE_SLICE_END
    return b.serialize()
