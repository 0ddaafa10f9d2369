"""The ``inputs_ref`` format: a call's (args, kwargs) as JSON, tensors by reference to chunks.

Every build and parse of an ``inputs_ref`` (and ``grads_ref``, the same format) goes through
here: capture builds them (``store.snapshot``), the loader, replay's read-ahead and its reuse
key read them. Format::

    {"v": 1, "args": [node, ...], "kwargs": {name: node},
     "chunks": {id: [shard, row, nparts, lo_bytes, nbytes, "d" | "s"]}}

A node is ``{"t": kind, ...}`` of a registered serializer (``store.codec``). A tensor node:
{"t": "tensor", "dtype", "shape", "stride", "off", "dev", "rg", "c": chunk id, optional "syn": 1
(synthesized from statistics), "conj"/"neg"/"param": 1, "nl": 1 (a non-leaf that requires grad:
made by an op in the step). A chunk of kind "d" holds data bytes, "s" a synthesized tensor's
statistics.
"""
from __future__ import annotations

import json

from cbtrace.errors import SerializationError

FORMAT_VERSION = 1
# compact and strict; built once (json.dumps with these arguments makes a new encoder per call,
# and capture makes one reference per module call)
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def build(args: list, kwargs: dict, chunks: dict) -> str:
    """The ``inputs_ref`` JSON of encoded argument nodes and their chunks ({id: entry})."""
    return _ENCODE({"v": FORMAT_VERSION, "args": args, "kwargs": kwargs,
                    "chunks": {str(i): c for i, c in chunks.items()}})


MAX_DEPTH = 200  # nesting of a call's arguments; far above any model's, far below recursion's


def _depth(doc) -> int:
    """How deeply lists and dicts nest in a decoded JSON document (no recursion)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def parse(inputs_ref: str, where="") -> dict:
    """The document of an ``inputs_ref``; a one-line SerializationError, prefixed by ``where``
    (the run directory), if it is none or of another format version."""
    prefix = f"{where}: " if str(where) else ""
    try:
        doc = json.loads(inputs_ref)
    except (TypeError, ValueError):
        doc = None
    except RecursionError:
        raise SerializationError(f"{prefix}inputs_ref is nested too deeply") from None
    if _depth(doc) > MAX_DEPTH:  # the walks over it recurse
        raise SerializationError(f"{prefix}inputs_ref is nested deeper than {MAX_DEPTH}")
    if not isinstance(doc, dict) or "chunks" not in doc:
        raise SerializationError(f"{prefix}inputs_ref is not a cbtrace inputs reference "
                                 f"({str(inputs_ref)[:60]!r})")
    if doc.get("v") != FORMAT_VERSION:
        raise SerializationError(f"{prefix}inputs_ref format v{doc.get('v')} is not supported "
                                 f"(this cbtrace reads v{FORMAT_VERSION})")
    return doc


def merge(refs: list) -> str:
    """One reference whose args are the first arg of each of ``refs`` in order (a missing one,
    None, becomes a None node): gradients stored one by one, merged. Chunk ids are one
    snapshot's own, so their chunk tables merge."""
    docs = [parse(r) if r is not None else None for r in refs]
    chunks: dict = {}
    args = []
    for d in docs:
        if d is None:
            args.append({"t": "none"})
            continue
        args.append(d["args"][0])
        chunks.update(d["chunks"])
    return build(args, {}, chunks)


def is_data_chunk(entry) -> bool:
    """A ``chunks`` entry (shard, row, nparts, lo, nbytes, kind) of a data chunk."""
    return isinstance(entry, list) and len(entry) == 6 and entry[-1] == "d"


def nodes(tree):
    """Every typed node of an (args, kwargs) tree, depth first in order, containers first."""
    if isinstance(tree, dict):
        if "t" in tree:
            yield tree
        for v in tree.values():
            yield from nodes(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from nodes(v)


def tensor_nodes(doc: dict) -> list[dict]:
    """The tensor nodes of a parsed reference's args and kwargs, in order."""
    return [n for n in nodes([doc.get("args", []), doc.get("kwargs", {})])
            if n.get("t") == "tensor"]


def without_data(tree):
    """The tree with each node's chunk reference left out: what it says but the data."""
    if isinstance(tree, list):
        return [without_data(n) for n in tree]
    if isinstance(tree, dict):
        return {k: without_data(v) for k, v in tree.items() if not (k == "c" and "t" in tree)}
    return tree
