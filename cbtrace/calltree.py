"""The captured call tree: built once from ``{call_id: parent_call_id}``, walked without recursion.

Capture, replay, annotate and the icicle all read the tree from here. No walk recurses:
a captured tree can be thousands of calls deep.
"""
from __future__ import annotations

from functools import cached_property


class CallTree:
    """Who encloses whom in one captured step, and the orders to walk it in.

    A call is a root when its parent is -1 or not among the calls. Children, roots and every
    order list calls in call order (ascending call_id). A cycle raises ``ValueError``.
    """

    def __init__(self, parent_of: dict[int, int]):
        self.parent: dict[int, int | None] = {
            c: None if p == -1 or p not in parent_of else p for c, p in sorted(parent_of.items())}
        self.children: dict[int, list[int]] = {c: [] for c in self.parent}
        for c, p in self.parent.items():
            if p is not None:
                self.children[p].append(c)
        self.roots = [c for c, p in self.parent.items() if p is None]
        self.breadth_first, self.depth = _levels(self.roots, self.children)
        if len(self.breadth_first) < len(self.parent):
            cycle = sorted(set(self.parent) - set(self.depth))
            raise ValueError(f"parent_of: calls {cycle[:10]} are their own ancestors")

    @cached_property
    def pre_order(self) -> list[int]:
        """Each call before its children, children left to right (the order calls begin)."""
        out, stack = [], self.roots[::-1]
        while stack:
            c = stack.pop()
            out.append(c)
            stack.extend(reversed(self.children[c]))
        return out

    @cached_property
    def post_order(self) -> list[int]:
        """Each call after its children, children left to right (the order calls end)."""
        out, stack = [], list(self.roots)
        while stack:  # pre-order with children right to left, reversed
            c = stack.pop()
            out.append(c)
            stack.extend(self.children[c])
        return out[::-1]

    @cached_property
    def descendants(self) -> dict[int, int]:
        """Number of calls nested inside each call, at any depth."""
        out: dict[int, int] = {}
        for c in self.post_order:
            out[c] = sum(out[k] + 1 for k in self.children[c])
        return out


def _levels(roots: list[int], children: dict[int, list[int]]) -> tuple[list[int], dict[int, int]]:
    """(calls breadth-first: roots, then depth 1, ..., each depth by call_id; depth of each)."""
    order, depth, frontier, d = [], {}, list(roots), 0
    while frontier:
        order.extend(frontier)
        depth.update((c, d) for c in frontier)
        frontier, d = sorted(k for c in frontier for k in children[c]), d + 1
    return order, depth


def bfs_order(parent_of: dict[int, int]) -> list[int]:
    """call_ids breadth-first (roots first, then depth 1, ...), ties by call order."""
    return CallTree(parent_of).breadth_first
