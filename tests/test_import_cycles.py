"""No import cycle inside cbtrace/attribution/: its modules import one way (filetable under
attribute and ranks, windows under filetable), counting imports inside functions too."""
from pathlib import Path

import pytest

from helpers.imports import cycle, imported_names, imports_inside_functions

PKG = Path(__file__).resolve().parent.parent / "cbtrace" / "attribution"


def graph_of(sources: dict) -> dict:
    """attribution module -> the attribution modules it imports (short names)."""
    pkg = "cbtrace.attribution."
    return {m: {n[len(pkg):] for n in imported_names(src) if n.startswith(pkg)} & set(sources) - {m}
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
    found = {(f"{sub}/{path.name}", m.split(".")[0])
             for sub in ("attribution", "cost", "store", "capture", "workflows", "annotate")
             for path in (root / sub).glob("*.py")
             for m in imports_inside_functions(path.read_text())}
    assert found <= LAZY, sorted(found - LAZY)
