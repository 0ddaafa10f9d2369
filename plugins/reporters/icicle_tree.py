"""The module-call tree of a run and its icicle layout (pure: a DataFrame in, dicts out).

Node ids: ``c<call_id>`` for a captured call, ``r<call_id>`` for the residual "(self)" node of a
parent (its own kernels: ``residual_ms``, else parent minus children), ``root`` for the synthetic
step node that holds several root calls. Widths, per size mode:

- ``isolated`` / ``insitu``: a node is as wide as max(its time, sum of its children + residual),
  so children whose times add up to more than their parent's (noise) widen it;
- ``calls`` (the fallback for a run captured but not replayed): 1 + the calls in its subtree.
"""
from __future__ import annotations

import math

from cbtrace.calltree import CallTree

TIME_COLUMN = {"isolated": "isolated_ms", "insitu": "insitu_ms"}
MODES = ("isolated", "insitu", "calls")


def clean(v):
    """numpy / pandas scalars -> plain Python; NaN, NaT and NA -> None."""
    if v is None or isinstance(v, (str, bool, int)):
        return v
    if type(v).__name__ in ("NAType", "NaTType"):
        return None
    if hasattr(v, "item") and not isinstance(v, bytes):
        try:
            v = v.item()
        except (ValueError, AttributeError):
            return v
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def record_rows(df) -> list[dict]:
    """The records of a modules DataFrame as plain dicts, ordered by call_id."""
    rows = [{k: clean(v) for k, v in r.items()} for r in df.to_dict("records")]
    return sorted(rows, key=lambda r: r.get("call_id") or 0)


def _label(row: dict, parent: str | None) -> str:
    """The fqn relative to the enclosing call ("layers.0" under a skipped ModuleList)."""
    fqn = row.get("fqn") or ""
    if not fqn:
        name = f"({row.get('module_type') or 'model'})"
    elif parent and fqn.startswith(parent + "."):
        name = fqn[len(parent) + 1:]
    elif parent == "" or parent is None:
        name = fqn
    else:
        name = fqn.rsplit(".", 1)[-1]
    k = row.get("call_index") or 0
    return f"{name} #{k}" if k else name


def build_tree(rows: list[dict]) -> tuple[dict[str, dict], str]:
    """(nodes by id, root id). Each node: id, parent, children, depth, kind, name, row.

    The nodes are inserted in pre-order, a residual right after its parent's subtree.
    """
    by_id = {r["call_id"]: r for r in rows}
    tree = CallTree({c: r.get("parent_call_id") for c, r in by_id.items()})
    top = None if len(tree.roots) == 1 else "root"
    shift = 0 if top is None else 1  # the synthetic root takes depth 0
    nodes: dict[str, dict] = {}
    if top is not None:
        nodes[top] = _node(top, "root", "(step)", None, [f"c{c}" for c in tree.roots], None, 0)
    closes = _residuals_after(tree)
    for c in tree.pre_order:
        p, kids = tree.parent[c], [f"c{k}" for k in tree.children[c]]
        name = _label(by_id[c], None if p is None else by_id[p].get("fqn") or "")
        nodes[f"c{c}"] = _node(f"c{c}", "module", name, by_id[c],
                               (kids + [f"r{c}"]) if kids else [], top if p is None else f"c{p}",
                               tree.depth[c] + shift)
        for x in closes.get(c, ()):
            nodes[f"r{x}"] = _node(f"r{x}", "residual", "(self)", None, [], f"c{x}",
                                   tree.depth[x] + shift + 1)
    return nodes, top or f"c{tree.roots[0]}"


def _node(nid, kind, name, row, children, parent, depth) -> dict:
    return {"id": nid, "kind": kind, "name": name, "row": row, "children": children,
            "parent": parent, "depth": depth}


def _residuals_after(tree: CallTree) -> dict[int, list[int]]:
    """{call: the parents whose subtree ends with it}, innermost first.

    A parent's subtree is itself and the ``descendants`` calls after it in pre-order; its
    residual node is its last child, so it comes right after that subtree.
    """
    order, out = tree.pre_order, {}
    for i, c in enumerate(order):
        if tree.children[c]:
            out.setdefault(order[i + tree.descendants[c]], []).insert(0, c)
    return out


def preorder(nodes: dict[str, dict], root: str) -> list[str]:
    """Ids in pre-order (parents before children, children in call order).

    That is the order build_tree inserts the nodes in.
    """
    assert next(iter(nodes)) == root, "preorder walks a whole tree from build_tree"
    return list(nodes)


def own_value(node: dict, mode: str) -> float | None:
    """A node's own figure in a time mode (None if missing or synthetic)."""
    return _own(node, mode)


def _own(node: dict, mode: str) -> float | None:
    if node["row"] is None:
        return None
    v = node["row"].get(TIME_COLUMN[mode])
    return None if v is None else max(float(v), 0.0)


def values(nodes: dict[str, dict], root: str, mode: str) -> dict[str, float]:
    """Width of every node (bottom-up) in one size mode."""
    val: dict[str, float] = {}
    for nid in reversed(preorder(nodes, root)):
        n = nodes[nid]
        if n["kind"] == "residual":
            continue  # its width is set below, by its parent
        kids = [c for c in n["children"] if nodes[c]["kind"] != "residual"]
        kid_sum = sum(val[c] for c in kids)
        if mode == "calls":
            res = 0.0
            own = kid_sum + (1.0 if n["kind"] == "module" else 0.0)
        else:
            own = _own(n, mode)
            res = 0.0
            if n["kind"] == "module" and kids:
                # residual_ms = parent - sum(children isolated), recomputed against the
                # children's drawn widths so that noisy children (sum > parent) never count twice
                given = n["row"].get("residual_ms") if mode == "isolated" else None
                if own is not None:
                    res = max(own - kid_sum, 0.0)
                elif given is not None:
                    res = max(float(given), 0.0)
        if n["kind"] == "module" and kids:
            val["r" + nid[1:]] = res
        val[nid] = max(own or 0.0, kid_sum + res)
    return val


def layout(nodes: dict[str, dict], root: str, mode: str) -> dict[str, tuple[float, float]]:
    """[x0, x1] of every node as a fraction of the root's width, children left to right."""
    val = values(nodes, root, mode)
    total = val[root]
    xs: dict[str, tuple[float, float]] = {root: (0.0, 1.0 if total > 0 else 0.0)}
    for nid in preorder(nodes, root):
        x0, x1 = xs[nid]
        span = x1 - x0
        here = val[nid]
        cursor = x0
        for c in nodes[nid]["children"]:
            w = span * val[c] / here if here > 0 else 0.0
            xs[c] = (cursor, cursor + w)
            cursor += w
    return xs


def available_modes(rows: list[dict]) -> list[str]:
    """Size modes with data: a time mode needs at least one positive figure; calls always."""
    out = [m for m, col in TIME_COLUMN.items()
           if any((r.get(col) or 0) > 0 for r in rows)]
    return out + ["calls"]
