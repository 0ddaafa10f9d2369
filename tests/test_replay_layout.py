"""replay/'s layout: its modules import one way (no cycle, counting imports inside functions),
imports sit at the top but for the listed few, and no two of its files share a name."""
from pathlib import Path

from helpers.imports import cycle, imported_names, imports_inside_functions
from helpers.paths import REPO

ROOT = REPO / "replay"

# imports left inside functions on purpose, each with its one-line reason beside it
LAZY = {("modes/opportunity.py", "torch"),  # `cbtrace replay --help` and report import it
        ("modes/opportunity.py", "cbtrace.device"),
        ("modes/opportunity.py", "cbtrace.replay.modes.compile_cudagraph"),
        ("modes/opportunity.py", "cbtrace.capture.from_spec"),
        ("modes/opportunity.py", "cbtrace.cost.dtypes"),
        ("modes/opportunity.py", "cbtrace.model.spec"),
        ("modes/compile_cudagraph.py", "torch._dynamo.utils"),  # dynamo only when compiling
        ("timer/choice.py", "torch")}  # the CLI's --timer choices read it


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("cbtrace.replay", *[p for p in parts if p != "__init__"]))


def sources() -> dict:
    return {module_name(p): p.read_text() for p in ROOT.rglob("*.py")}


def graph_of(srcs: dict) -> dict:
    return {m: imported_names(src) & set(srcs) - {m} for m, src in srcs.items()}


def test_replay_has_no_import_cycle():
    graph = graph_of(sources())
    assert "cbtrace.replay.modes.compile_cudagraph" in graph["cbtrace.replay.measure.plan"]
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_a_planted_cycle_is_found():
    srcs = sources()
    srcs["cbtrace.replay.measure.prepare"] += (
        "\n\ndef _planted():\n    from cbtrace.replay.measure.context import in_context\n")
    found = cycle(graph_of(srcs))
    assert found is not None and "cbtrace.replay.measure.context" in found


def test_imports_sit_at_the_top_but_the_lazy_few():
    found = {(path.relative_to(ROOT).as_posix(), m) for path in ROOT.rglob("*.py")
             for m in imports_inside_functions(path.read_text())}
    assert found <= LAZY, sorted(found - LAZY)


def test_no_two_replay_files_share_a_name():
    names = [p.name for p in ROOT.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
