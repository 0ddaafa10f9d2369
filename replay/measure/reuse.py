"""What replay can reuse between calls that are the same work: the counted cost and the
profiled pass.

Two calls are the same work when their module's class, parameters and buffers (names, shapes,
dtypes), their inputs' metadata and their modes (train/eval, grad, autocast) are equal —
``signature`` — AND their counted cost (FLOPs, bytes, ops without a formula, compute dtype) came
out the same: a call whose cost depends on its values (an MoE's routing, embedding ids, a mask)
shows it there and is profiled on its own. The 12 blocks of GPT-2 small are profiled once; the
profiled pass (torch.profiler's start and stop) was a third of a call's replay wall.

The count itself (``CountCache``) is reused only where it cannot differ: the same ``call_key``
(the signature, every setting of the module, and every argument as captured but the tensors'
data; no objects, callables or hooks the key would not see into), a first count that was
``value_free``, and a second count equal to the first.
"""
from __future__ import annotations

import enum
import hashlib
import json

import torch

from cbtrace.errors import SerializationError
from cbtrace.store import ref_format


def signature(module, rec) -> str:
    """A digest of what decides a call's work apart from its values."""
    h = hashlib.sha256(f"{type(module).__module__}.{type(module).__qualname__}".encode())
    for kind, named in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, t in named:
            h.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}".encode())
    h.update(f"{rec.input_meta}|{rec.training}|{rec.grad_enabled}|{rec.autocast_dtype}".encode())
    return h.hexdigest()


COST_KEYS = ("flops", "flops_executed", "bytes", "unknown_ops", "compute_dtype")

# serializers whose nodes hold the whole value (or a tensor's metadata): an argument of any other
# kind (a dataclass, a transformers Cache, a KeyedJaggedTensor) is an object with state of its own
PLAIN = frozenset({"tensor", "none", "ellipsis", "bool", "int", "float", "complex", "str", "bytes",
                   "torch_enum", "device", "size", "slice", "enum", "tuple", "list", "dict"})


def call_key(module, rec) -> str | None:
    """``signature``, every setting of the module and its submodules (``eps``, ``stride``,
    ``is_causal``, ``n_head``: what two modules of one class may differ in), and the call's
    captured arguments with each tensor's data reference left out. None where the key could
    miss what decides the work: an argument that is not PLAIN, a module attribute that is not
    a plain value (a callable, an object, an unregistered tensor), or a hook on a module."""
    try:
        doc = ref_format.parse(rec.inputs_ref)
        tree = [doc["args"], doc["kwargs"]]
        if any(n["t"] not in PLAIN for n in ref_format.nodes(tree)):
            return None
        tree = ref_format.without_data(tree)
        h = hashlib.sha256(signature(module, rec).encode())
        h.update(json.dumps(tree, sort_keys=True).encode())
        for name, m in module.named_modules(remove_duplicate=False):
            if any(getattr(m, hooks) for hooks in HOOKS):
                return None
            attrs = sorted((k, _plain(v)) for k, v in vars(m).items() if k not in MODULE_SLOTS)
            kind = f"{type(m).__module__}.{type(m).__qualname__}"
            h.update(f"{name}:{kind}:{attrs}".encode())
    except (SerializationError, ValueError, TypeError, KeyError, _NotPlain):
        return None
    return h.hexdigest()


# nn.Module's own bookkeeping in a module's __dict__ (parameters, buffers and submodules are in
# the signature; the hooks make the key None)
MODULE_SLOTS = frozenset(vars(torch.nn.Module()))
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _plain(v):
    """A value's stand-in in the key; _NotPlain for what the key cannot see into."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype,
                                   torch.device, torch.Size, enum.Enum)):
        return repr(v)
    if isinstance(v, (tuple, list, set, frozenset)):
        items = [_plain(x) for x in v]
        return f"{type(v).__name__}{sorted(items) if isinstance(v, (set, frozenset)) else items}"
    if isinstance(v, dict):
        return f"dict{sorted((_plain(k), _plain(x)) for k, x in v.items())}"
    raise _NotPlain(type(v).__qualname__)


class _NotPlain(Exception):
    pass


class CountCache:
    """call_key -> the counted cost of the first value-free call with that key. As with
    ``TimingReuse``, the second call of a key is counted too and must come out the same: the
    rest take the count only then (a value the module branches on in Python, which no op name
    shows, changes the second count)."""

    def __init__(self):
        self._seen: dict[str, dict] = {}  # key -> {"fields": ..., "verified": None|bool}

    def get(self, key) -> dict | None:
        g = self._seen.get(key) if key is not None else None
        return dict(g["fields"]) if g is not None and g["verified"] else None

    def put(self, key, fields: dict, value_free: bool) -> None:
        if key is None:
            return
        g = self._seen.get(key)
        if g is None:
            if value_free:
                self._seen[key] = {"fields": dict(fields), "verified": None}
        elif g["verified"] is None:
            g["verified"] = value_free and fields == g["fields"]


class ProfileCache:
    """(signature, counted cost) -> (first call's fqn, its profiled figures)."""

    def __init__(self):
        self._seen: dict[tuple, tuple[str, dict]] = {}

    @staticmethod
    def key(sig: str, row: dict) -> tuple | None:
        if any(k not in row for k in COST_KEYS):  # not counted: nothing to check it against
            return None
        return (sig, *(row[k] for k in COST_KEYS))

    def get(self, key):
        return self._seen.get(key) if key is not None else None

    def put(self, key, fqn: str, figures: dict) -> None:
        if key is not None:
            self._seen.setdefault(key, (fqn, figures))


# ---- timing reuse (ReplayConfig.reuse_timing, --reuse-timing): an option, off by default -----

# ops whose time depends on the values they read (which rows, how many, which experts)
VALUE_OPS = frozenset(f"aten::{n}" for n in (
    "embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only", "index",
    "index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index_add",
    "index_put", "index_put_", "index_copy", "masked_select", "masked_scatter", "nonzero",
    "topk", "sort", "argsort", "unique", "_unique2", "unique_dim", "unique_consecutive",
    "bincount", "histc", "multinomial", "repeat_interleave", "searchsorted", "bucketize",
    "where",
    # a value read by the host (.item(), bool(t), torch.equal): Python may branch on it
    "_local_scalar_dense", "is_nonzero", "equal"))
VERIFY_TOL = 0.03  # the verification call must read within 3 % of the call it would copy


def value_free(input_meta: str, op_names) -> bool:
    """Whether a call's time can depend only on its shapes: no integer or bool input (ids,
    offsets, masks, routing) and no op that reads values to decide its work."""
    try:
        metas = json.loads(input_meta or "[]")
    except ValueError:
        return False
    if any(not str(m.get("dtype", "")).startswith(("float", "bfloat", "complex"))
           for m in metas if isinstance(m, dict)):
        return False
    return not (set(op_names) & VALUE_OPS)


COPIED = "timed as "  # the display note of a copied timing; decisions read timing_copied_from


class TimingReuse:
    """Time once the calls that are the same work (``signature`` and counted cost equal) and
    whose time cannot depend on values (``value_free``): the first call of a group is timed,
    the second is timed too as a check, and the rest copy the first's timing only if the check
    read within ``VERIFY_TOL`` of it; otherwise every call of the group is timed."""

    def __init__(self, tol: float = VERIFY_TOL):
        self.tol = tol
        self._groups: dict[tuple, dict] = {}

    def lookup(self, key) -> tuple[str, dict] | None:
        """(fqn, timing fields with ``timing_copied_from``) to copy, or None: time the call
        (then ``record`` it)."""
        g = self._groups.get(key) if key is not None else None
        if g is None or not g.get("verified"):
            return None
        return g["fqn"], {**g["fields"], "timing_copied_from": g["fqn"]}

    def record(self, key, fqn: str, fields: dict) -> str | None:
        """A timed call of group ``key``; returns a note for the verification call."""
        if key is None or fields.get("isolated_ms") is None:
            return None
        g = self._groups.get(key)
        if g is None:
            self._groups[key] = dict(fqn=fqn, fields=dict(fields), verified=None)
            return None
        if g["verified"] is None:
            ref, got = g["fields"]["isolated_ms"], fields["isolated_ms"]
            off = abs(got / ref - 1) if ref else float("inf")
            g["verified"] = off <= self.tol
            return (f"timing-reuse check against {g['fqn'] or '(root)'}: {100 * off:.1f} % "
                    f"({'reused for the rest' if g['verified'] else 'each timed'})")
        return None
