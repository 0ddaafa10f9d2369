"""replay/'s layout: its modules import one way (no cycle, counting imports inside functions),
imports sit at the top but for the listed few, and no two of its files share a name."""
import ast
from pathlib import Path

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


def replay_imports(source: str, known: set) -> set:
    """The replay modules ``source`` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= set(names) & known
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


def graph_of(srcs: dict) -> dict:
    return {m: replay_imports(src, set(srcs)) - {m} for m, src in srcs.items()}


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
    found = set()
    for path in ROOT.rglob("*.py"):
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
                found |= {(path.relative_to(ROOT).as_posix(), m) for m in mods}
    assert found <= LAZY, sorted(found - LAZY)


def test_no_two_replay_files_share_a_name():
    names = [p.name for p in ROOT.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
