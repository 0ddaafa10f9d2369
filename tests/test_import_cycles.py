"""No import cycle inside cbtrace/attribution/: its modules import one way (filetable under
attribute and ranks, windows under filetable), counting imports inside functions too."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "cbtrace" / "attribution"


def imports_of(source: str, package: str, modules: set) -> set:
    """The package's modules that ``source`` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n[len(package) + 1:] for n in names if n.startswith(package + ".")} & modules
    return out


def cycle(graph: dict) -> list | None:
    """One import cycle of ``graph`` (module -> imported modules), or None."""
    state: dict = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def graph_of(sources: dict) -> dict:
    return {m: imports_of(src, "cbtrace.attribution", set(sources)) - {m}
            for m, src in sources.items()}


@pytest.fixture
def sources():
    return {p.stem: p.read_text() for p in PKG.glob("*.py") if p.stem != "__init__"}


def test_attribution_has_no_import_cycle(sources):
    graph = graph_of(sources)
    assert "filetable" in graph["ranks"] and "filetable" in graph["attribute"]
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_a_planted_cycle_is_found(sources):
    sources["windows"] += "\n\ndef _planted():\n    from cbtrace.attribution.attribute import table\n"
    found = cycle(graph_of(sources))
    assert found is not None and found[0] == found[-1] and "windows" in found


# imports left inside functions on purpose, each with its one-line reason beside it
LAZY = {("cost/dtypes.py", "torch"), ("cost/peaks.py", "torch"),  # attribution runs without torch
        ("attribution/model_names.py", "torch"),
        ("workflows/diff.py", "pandas"),  # `cbtrace diff --help` imports diff.py
        ("annotate/pftrace.py", "perfetto"), ("attribution/attribute.py", "hta")}  # extras


def test_imports_sit_at_the_top_but_the_lazy_few():
    root = PKG.parent
    found = set()
    for sub in ("attribution", "cost", "store", "capture", "workflows", "annotate"):
        for path in (root / sub).glob("*.py"):
            for fn in ast.walk(ast.parse(path.read_text())):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        mods = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        mods = [node.module or ""]
                    else:
                        continue
                    found |= {(f"{sub}/{path.name}", m.split(".")[0]) for m in mods}
    assert found <= LAZY, sorted(found - LAZY)
