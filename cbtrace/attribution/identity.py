"""Which host events are module calls, and their names, best source first.

(a) ``cbtrace::<fqn>`` ranges from cbtrace's capture: exact paths ("cbtrace::" is the root, fqn
"") and ``cbtrace.copy::<fqn>`` ranges, cbtrace's own overhead; (b) eager ``nn.Module: Class_N``
python_function events (``with_stack=True``), named by their class-and-index chain, or by the real
attribute path when a capture run of the same model is given; (c) user ``record_function``
annotations; (d) TorchScript ``Module Hierarchy`` args. One source per trace: the best present.
"""
from __future__ import annotations

import re

from cbtrace.attribution.tree import Forest

CBTRACE = "cbtrace::"
COPY = "cbtrace.copy::"
NN_MODULE = "nn.Module: "
_NOT_USER = re.compile(r"^(ProfilerStep#\d+|cbtrace(\.copy)?::.*|## .* ##)$")
_USER_CATS = ("user_annotation", "Operator")  # torch 1.9 put record_function under Operator
_HIER_SEG = re.compile(r"^(\w+)\((\w+)\)(?:::\w+)?$")


def choose_source(forest: Forest) -> str | None:
    names = [e.name for e in forest.host]
    if any(n.startswith(CBTRACE) for n in names):
        return "cbtrace"
    if any(n.startswith(NN_MODULE) for n in names):
        return "nn.Module"
    if any(_is_user_range(e) for e in forest.host):
        return "record_function"
    if any(e.args is not None and e.args.hierarchy for e in forest.host):
        return "module_hierarchy"
    return None


def _is_user_range(e) -> bool:
    return e.cat in _USER_CATS and e.cat != "cpu_op" and not _NOT_USER.match(e.name) and (
        e.cat == "user_annotation" or not e.name.startswith(("aten::", "autograd::")))


def label(forest: Forest, i: int, source: str | None) -> tuple[str | None, bool]:
    """(module label, is_overhead) of host event i; label None when it is not a module call."""
    e = forest.host[i]
    name = e.name
    if source == "cbtrace":
        if name.startswith(CBTRACE):
            return name[len(CBTRACE):], False
        return (None, name.startswith(COPY))
    if source == "nn.Module":
        return (name[len(NN_MODULE):] if name.startswith(NN_MODULE) and e.cat == "python_function"
                else None), False
    if source == "record_function":
        return (name if e.cat == "user_annotation" and _is_user_range(e) else None), False
    if source == "module_hierarchy" and e.args is not None and e.args.hierarchy:
        path = hierarchy_path(e.args.hierarchy)  # outermost op of each path is one call
        p = forest.parent[i]
        outer = p < 0 or (forest.host[p].args is None or forest.host[p].args.hierarchy != e.args.hierarchy)
        return (path if outer else None), False
    return None, False


def class_index_map(modules_df) -> dict[str, str]:
    """"Class_N" -> fqn from a capture's modules table.

    The profiler numbers instances of a class in the order it first sees them called; the
    capture records calls in order (call_id), so the N-th distinct fqn of a class is Class_N.
    """
    out, seen = {}, {}
    for row in modules_df.sort_values("call_id").itertuples():
        cls = row.module_type
        names = seen.setdefault(cls, [])
        if row.fqn not in names:
            names.append(row.fqn)
            out[f"{cls}_{len(names) - 1}"] = row.fqn
    return out


def hierarchy_path(text: str) -> str | None:
    """TorchScript "TOP(Net)::forward.layer1(Sequential)::forward.0(Block)::forward" -> "layer1.0"."""
    if not text:
        return None
    parts = []
    for seg in re.split(r"\.(?=\w+\(\w+\))", text):
        m = _HIER_SEG.match(seg)
        if m is None:
            return None
        if m.group(1) not in ("TOP", "SELF"):
            parts.append(m.group(1))
    return ".".join(parts)
