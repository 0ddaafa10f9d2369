"""The captured call tree: breadth-first order and children."""
from __future__ import annotations


def bfs_order(parent_of: dict[int, int]) -> list[int]:
    """call_ids breadth-first (roots first, then depth 1, ...), ties by call order."""
    children = children_of(parent_of)
    order, frontier = [], sorted(c for c, p in parent_of.items() if p == -1 or p not in parent_of)
    while frontier:
        order.extend(frontier)
        frontier = sorted(k for c in frontier for k in children.get(c, ()))
    return order


def children_of(parent_of: dict[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c, p in sorted(parent_of.items()):
        out.setdefault(p, []).append(c)
    return out


def post_order(parent_of: dict[int, int]) -> list[int]:
    """Children before parents (for aggregation)."""
    return list(reversed(bfs_order(parent_of)))
