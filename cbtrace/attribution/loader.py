"""Fast trace loader: decode only what attribution needs, chunk by chunk, into numpy columns.

A typed msgspec decoder (a union tagged by ``ph``) skips every field and arg that attribution
does not read, and every event that is neither complete (``X``) nor a flow end (``f``). Each
decoded chunk is turned into columns at once and its Python objects dropped, so memory holds
about 60 bytes per complete event (a Kineto event is ~300 bytes of JSON) plus one chunk: names,
categories and pids/tids are interned into small tables, op shapes become a cost code through
the ``on_op`` callback while the chunk is alive. ``Columns.idx`` is the event's position in
``traceEvents``: HTA's ``index`` column (``TraceAnalysis(...).t.get_trace(rank)["index"]``).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Callable, Protocol, Union

import msgspec
import numpy as np

from cbtrace import trace_io
from cbtrace.errors import TraceError

_RAW = msgspec.Raw()
# Chrome trace-event phases; ``X`` and ``f`` are kept, the rest decode to empty structs.
_PHASES = "B E X i I C b n e S T p F s t f P N O D M V v R c ( )".split()


class Args(msgspec.Struct, frozen=True, gc=False):
    corr: int = msgspec.field(default=-1, name="correlation")
    seq: int = msgspec.field(default=-1, name="Sequence number")
    hierarchy: str = msgspec.field(default="", name="Module Hierarchy")
    dims: msgspec.Raw = msgspec.field(default=_RAW, name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=_RAW, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=_RAW, name="Concrete Inputs")


_NO_ARGS = Args()


class Complete(msgspec.Struct, tag_field="ph", tag="X", gc=False):
    cat: str = ""
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts: float = 0.0
    dur: float = 0.0
    args: Args = _NO_ARGS


class FlowEnd(msgspec.Struct, tag_field="ph", tag="f", gc=False):
    cat: str = ""
    id: int | str | None = None
    pid: int | str | None = None
    tid: int | str | None = None
    ts: float = 0.0


_OTHER = tuple(msgspec.defstruct(f"Phase{i}", [], tag_field="ph", tag=ph, gc=False)
               for i, ph in enumerate(_PHASES) if ph not in ("X", "f"))
_TYPED = msgspec.json.Decoder(list[Union[(Complete, FlowEnd) + _OTHER]])
_LOOSE = msgspec.json.Decoder()
_RAW_ARGS = ("Input Dims", "Input type", "Concrete Inputs")
_BASIC = ("ph", "cat", "name", "pid", "tid", "ts", "dur", "id")
_FIELDS = attrgetter("ts", "dur", "pid", "tid", "name", "cat", "args.corr", "args.seq",
                     "args.hierarchy", "args.dims")


def _decode(data: bytes) -> list:
    """Typed decoding; a chunk with an unexpected field type or phase is converted per event."""
    try:
        return _TYPED.decode(data)
    except msgspec.ValidationError:
        return [_lenient(d) for d in _LOOSE.decode(data)]


def _lenient(d):
    """One event decoded loosely ("12" -> 12); its args are dropped if they still do not fit."""
    if not isinstance(d, dict) or d.get("ph") not in ("X", "f"):
        return None
    cls = Complete if d["ph"] == "X" else FlowEnd
    d = {k: v for k, v in d.items() if k in _BASIC or k == "args"}
    if isinstance(d.get("args"), dict):  # shapes stay raw JSON, as in the typed decoder
        d["args"] = {k: msgspec.Raw(msgspec.json.encode(v)) if k in _RAW_ARGS else v
                     for k, v in d["args"].items()}
    for attempt in (d, {k: v for k, v in d.items() if k != "args"}):
        try:
            return msgspec.convert(attempt, cls, strict=False)
        except msgspec.ValidationError:
            continue
    return None


@dataclass
class Columns:
    """Complete events of one trace as parallel arrays, in file order (one row per event)."""
    path: str
    meta: dict = field(default_factory=dict)  # top-level keys other than traceEvents
    n_events: int = 0                          # all events in traceEvents
    strings: list = field(default_factory=list)  # names, categories, module hierarchies
    ids: list = field(default_factory=list)      # raw pid / tid values ("stream 7", 25738)
    idx: np.ndarray = None    # int64 position in traceEvents
    ts: np.ndarray = None     # float64 µs
    dur: np.ndarray = None    # float64 µs
    pid: np.ndarray = None    # int32 code into ids
    tid: np.ndarray = None    # int32 code into ids
    name: np.ndarray = None   # int32 code into strings
    cat: np.ndarray = None    # int32 code into strings
    corr: np.ndarray = None   # int64 correlation id, -1 without
    seq: np.ndarray = None    # int64 autograd sequence number, -1 without
    hier: np.ndarray = None   # int32 code into strings of "Module Hierarchy", -1 without
    cost: np.ndarray = None   # int32 code returned by on_op, -1 without shapes
    flows: list = field(default_factory=list)  # ac2g flow ends: (id, pid code, tid code, ts)

    def __len__(self):
        return 0 if self.ts is None else len(self.ts)


SHAPED = -2  # OpCallback.by_name: the cost depends on the op's shapes
FLOW = "~flow end"  # the category ``keep`` sees for flow ends
Keep = Callable[[np.ndarray, list, list], np.ndarray]


class OpCallback(Protocol):
    """Turns ops with shapes into cost codes (see insitu_flops.OpCoster)."""

    def by_name(self, name: str) -> int:
        """The code of every call of ``name``, or SHAPED when it depends on the args."""

    def __call__(self, name: str, dims: msgspec.Raw, types: msgspec.Raw,
                 concrete: msgspec.Raw) -> int:
        """The code of one call; the Raw args are valid during the call only."""


def load(path, *, on_op: OpCallback | None = None, keep: Keep | None = None,
         chunk_bytes: int = trace_io.CHUNK_BYTES) -> Columns:
    """Load the parts of a Kineto trace that attribution uses, as columns.

    Args:
        path: .json or .json.gz trace.
        on_op: gives ``Columns.cost`` of each event with ``Input Dims``: ``by_name(name)``
            once per name, ``on_op(name, input_dims, input_types, concrete_inputs)`` (raw JSON)
            per event when that says SHAPED.
        keep: ``keep(ts, cats, names) -> bool array`` per chunk of complete events (and of
            flow ends, with the category ``FLOW``): only those kept are stored (windows.py
            loads one window of steps at a time this way).
        chunk_bytes: decompressed bytes decoded at a time (bounds the transient memory).
    """
    b = _Builder(str(path), on_op, keep)
    enabled = gc.isenabled()
    gc.disable()  # many small allocations, no cycles: GC passes only cost time
    try:
        for kind, payload in trace_io.stream_trace(path, _decode, chunk_bytes=chunk_bytes):
            if kind == "meta":
                b.out.meta = payload
            else:
                b.add(payload)
    except msgspec.DecodeError as e:
        raise TraceError(f"{path}: not valid JSON ({e})") from None
    finally:
        if enabled:
            gc.enable()
    return b.finish()


def _take(seq, sel: np.ndarray) -> list:
    """``[seq[i] for i in sel]`` at C speed."""
    sel = sel.tolist()
    if len(sel) == 1:
        return [seq[sel[0]]]
    return list(itemgetter(*sel)(seq)) if sel else []


def _pick(events: list, kinds: np.ndarray, cls) -> list:
    """The events of one struct type (``kinds``: id of each event's type)."""
    pos = np.flatnonzero(kinds == id(cls)).tolist()
    if len(pos) == 1:
        return [events[pos[0]]]
    return list(itemgetter(*pos)(events)) if pos else []


class _Builder:
    """Chunk lists -> column arrays, with the string and id tables."""

    def __init__(self, path, on_op, keep):
        self.out = Columns(path)
        self.on_op = on_op
        self.keep = keep
        self.strings: dict = {}
        self.string_list: list = []  # the keys of strings, in code order
        self.name_cost: list = []  # per string code: on_op.by_name(string)
        self.ids: dict = {}
        self.parts: list = []

    def _codes(self, table: dict, values) -> np.ndarray:
        for v in set(values).difference(table):
            table[v] = len(table)
            if table is self.strings:
                self.string_list.append(v)
        return np.array(list(map(table.__getitem__, values)), np.int32)

    def _id_codes(self, values) -> np.ndarray:
        """pid / tid codes; all-int columns (the usual case) are interned per distinct value."""
        a = np.array(values)
        if a.dtype.kind != "i":
            return self._codes(self.ids, values)
        uniq, inv = np.unique(a, return_inverse=True)
        return self._codes(self.ids, uniq.tolist())[inv.ravel()]

    def add(self, events: list) -> None:
        base = self.out.n_events
        self.out.n_events += len(events)
        kinds = np.fromiter(map(id, map(type, events)), np.int64, len(events))
        flows = [(e.id, e.pid, e.tid, e.ts) for e in _pick(events, kinds, FlowEnd)
                 if e.cat in ("ac2g", "async") and e.id is not None]
        if flows and self.keep is not None:  # a flow end sits at its device event's ts
            k = self.keep(np.array([f[3] for f in flows]), [FLOW] * len(flows), [""] * len(flows))
            flows = _take(flows, np.flatnonzero(k))
        self.out.flows += flows
        pos = np.flatnonzero(kinds == id(Complete))
        if not len(pos):
            return
        xs = _pick(events, kinds, Complete)
        ts, dur, pid, tid, name, cat, corr, seq, hier, dims = zip(*map(_FIELDS, xs))
        if self.keep is not None:
            sel = np.flatnonzero(self.keep(np.array(ts, np.float64), cat, name))
            if len(sel) < len(xs):
                pos, xs = pos[sel], _take(xs, sel)
                ts, dur, pid, tid, name, cat, corr, seq, hier, dims = (
                    _take(c, sel) for c in (ts, dur, pid, tid, name, cat, corr, seq, hier, dims))
            if not len(pos):
                return
        name_codes = self._codes(self.strings, name)
        hier_codes = self._codes(self.strings, hier)
        hier_codes[hier_codes == self.strings.get("", -2)] = -1
        self.parts.append((pos + base, np.array(ts, np.float64), np.array(dur, np.float64),
                           self._id_codes(pid), self._id_codes(tid), name_codes,
                           self._codes(self.strings, cat), np.array(corr, np.int64),
                           np.array(seq, np.int64), hier_codes,
                           self._costs(xs, name, name_codes, dims)))

    def _costs(self, xs, name, name_codes, dims) -> np.ndarray:
        """Cost code per event: by name where that decides it, else from the op's args."""
        cost = np.full(len(xs), -1, np.int32)
        if self.on_op is None:
            return cost
        has = np.flatnonzero(np.fromiter(map(len, dims), np.int64, len(dims)))
        while len(self.name_cost) < len(self.strings):
            self.name_cost.append(self.on_op.by_name(self.string_list[len(self.name_cost)]))
        by_name = np.array(self.name_cost, np.int32)[name_codes[has]]
        cost[has] = by_name
        for i in has[by_name == SHAPED].tolist():
            a = xs[i].args
            cost[i] = self.on_op(name[i], a.dims, a.types, a.concrete)
        return cost

    def finish(self) -> Columns:
        out = self.out
        names = ("idx", "ts", "dur", "pid", "tid", "name", "cat", "corr", "seq", "hier", "cost")
        dtypes = (np.int64, np.float64, np.float64, np.int32, np.int32, np.int32, np.int32,
                  np.int64, np.int64, np.int32, np.int32)
        columns = [list(c) for c in zip(*self.parts)] or [[] for _ in names]
        self.parts.clear()
        for n, dt, arrays in zip(names, dtypes, columns):
            setattr(out, n, np.concatenate(arrays) if arrays else np.zeros(0, dt))
            arrays.clear()  # one column's chunks and its array at a time
        out.strings = list(self.strings)
        out.ids = list(self.ids)
        ids = self.ids
        out.flows = [(f, ids.setdefault(p, len(ids)), ids.setdefault(t, len(ids)), ts)
                     for f, p, t, ts in out.flows]
        out.ids = list(ids)
        return out
