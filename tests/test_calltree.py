"""cbtrace.calltree.CallTree on hand-built trees (answers worked out by hand) and a real capture."""
from __future__ import annotations

import pytest

from cbtrace.calltree import CallTree, bfs_order

# 0 a          4 d        6 f   (6's parent, 99, was not captured: a root too)
# |- 1 a.b     '- 5 d.e   '- 7 f.g
# |  |- 2 a.b.c
# |  '- 8 a.b.h            (called after 3: ids need not follow the pre-order)
# |- 3 a.i
# '- 9 a.j                 (after 5 and 7 in id order: breadth-first sorts each depth by id)
FOREST = {0: -1, 1: 0, 2: 1, 3: 0, 4: -1, 5: 4, 6: 99, 7: 6, 8: 1, 9: 0}


def test_roots_children_parent_depth():
    t = CallTree(FOREST)
    assert t.roots == [0, 4, 6]
    assert t.children == {0: [1, 3, 9], 1: [2, 8], 2: [], 3: [], 4: [5], 5: [], 6: [7], 7: [],
                          8: [], 9: []}
    assert t.parent == {0: None, 1: 0, 2: 1, 3: 0, 4: None, 5: 4, 6: None, 7: 6, 8: 1, 9: 0}
    assert t.depth == {0: 0, 1: 1, 2: 2, 3: 1, 4: 0, 5: 1, 6: 0, 7: 1, 8: 2, 9: 1}


def test_orders_and_descendants():
    t = CallTree(FOREST)
    assert t.breadth_first == [0, 4, 6, 1, 3, 5, 7, 9, 2, 8]
    assert bfs_order(FOREST) == t.breadth_first
    assert t.pre_order == [0, 1, 2, 8, 3, 9, 4, 5, 6, 7]
    assert t.post_order == [2, 8, 1, 3, 9, 0, 5, 4, 7, 6]
    assert t.descendants == {0: 5, 1: 2, 2: 0, 3: 0, 4: 1, 5: 0, 6: 1, 7: 0, 8: 0, 9: 0}


def test_input_order_does_not_matter():
    shuffled = dict(sorted(FOREST.items(), key=lambda kv: -kv[0]))
    a, b = CallTree(FOREST), CallTree(shuffled)
    assert (a.children, a.pre_order, a.breadth_first) == (b.children, b.pre_order, b.breadth_first)


def test_empty_and_single():
    empty = CallTree({})
    assert (empty.roots, empty.breadth_first, empty.pre_order, empty.post_order) == ([], [], [], [])
    one = CallTree({7: -1})
    assert (one.roots, one.depth, one.descendants) == ([7], {7: 0}, {7: 0})


def test_deep_chain_needs_no_recursion():
    n = 5000
    t = CallTree({i: i - 1 for i in range(n)})  # 0 is the root (its parent is -1)
    assert t.roots == [0] and t.depth[n - 1] == n - 1
    assert t.pre_order == t.breadth_first == list(range(n))
    assert t.post_order == list(range(n))[::-1]
    assert t.descendants[0] == n - 1 and t.descendants[n - 1] == 0


@pytest.mark.parametrize("parent_of", [{0: 0}, {0: -1, 1: 2, 2: 1}])
def test_a_cycle_is_an_error(parent_of):
    with pytest.raises(ValueError, match="parent_of"):
        CallTree(parent_of)


def test_icicle_tree_agrees_with_calltree_on_a_capture(tmp_path):
    import torch
    from torch import nn

    import cbtrace
    from cbtrace.rundir.read import read_modules
    from cbtrace.plugins.reporters.icicle_tree import build_tree, preorder, record_rows

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.b = nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(self.b(x)))  # b twice: call_index 1

    model = Net()
    with cbtrace.capture(model, tmp_path / "r", trace=False):
        model(torch.ones(1, 2))
    rows = record_rows(read_modules(tmp_path / "r"))
    tree = CallTree({r["call_id"]: r["parent_call_id"] for r in rows})
    nodes, root = build_tree(rows)
    assert root == f"c{tree.roots[0]}" and len(tree.roots) == 1
    assert [n for n in preorder(nodes, root) if n[0] == "c"] == [f"c{c}" for c in tree.pre_order]
    for r in rows:
        c = r["call_id"]
        node = nodes[f"c{c}"]
        assert node["depth"] == tree.depth[c] == r["depth"]
        assert [k for k in node["children"] if k[0] == "c"] == [f"c{k}" for k in tree.children[c]]
        assert node["parent"] == (None if tree.parent[c] is None else f"c{tree.parent[c]}")
    assert [r["fqn"] for r in rows] == ["", "b", "a", "a.0", "a.1", "b"]
    assert tree.descendants[tree.roots[0]] == len(rows) - 1
