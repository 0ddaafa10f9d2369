"""Which call of run A is which call of run B: by name, else by place in the call tree.

A call is first matched by its key (fqn, call_index). The calls left over on both sides are
matched by tree position, the path of (module_type, child index) from the root, so a renamed
module (and everything under it, whose fqns changed with it) still finds its counterpart.
What is left after that is only in A or only in B.
"""
from __future__ import annotations

from cbtrace.calltree import CallTree

NAME, POSITION, ONLY_A, ONLY_B = "name", "position", "only_a", "only_b"
Path = tuple[tuple[str, int], ...]  # ((module_type, child index), ...) from the root down


def tree_paths(rows: list[dict]) -> dict[int, Path]:
    """{call_id: its path of (module_type, index among its parent's children) from the root}.

    Roots are indexed among the roots; children and roots are in call order.
    """
    tree = CallTree({r["call_id"]: r["parent_call_id"] for r in rows})
    kind = {r["call_id"]: r["module_type"] for r in rows}
    paths: dict[int, Path] = {}
    for i, c in enumerate(tree.roots):
        paths[c] = ((kind[c], i),)
    for c in tree.breadth_first:  # a parent's path is set before its children's
        for i, k in enumerate(tree.children[c]):
            paths[k] = paths[c] + ((kind[k], i),)
    return paths


def align(rows_a: list[dict], rows_b: list[dict]) -> list[tuple[int | None, int | None, str]]:
    """(call_id in A or None, call_id in B or None, how matched) for every call of both runs.

    Pairs come in B's call order; calls only in A follow, in A's call order.
    """
    key_a = {(r["fqn"], r["call_index"]): r["call_id"] for r in rows_a}
    key_b = {(r["fqn"], r["call_index"]): r["call_id"] for r in rows_b}
    b_to_a = {key_b[k]: (key_a[k], NAME) for k in key_b.keys() & key_a.keys()}
    left_a = set(key_a.values()) - {a for a, _ in b_to_a.values()}
    left_b = set(key_b.values()) - set(b_to_a)
    if left_a and left_b:
        path_a = {p: c for c, p in tree_paths(rows_a).items() if c in left_a}
        for c, p in tree_paths(rows_b).items():
            if c in left_b and p in path_a:
                b_to_a[c] = (path_a[p], POSITION)
                left_a.discard(path_a[p])
    pairs = [(b_to_a[c][0], c, b_to_a[c][1]) if c in b_to_a else (None, c, ONLY_B)
             for c in sorted(key_b.values())]
    return pairs + [(c, None, ONLY_A) for c in sorted(left_a)]
