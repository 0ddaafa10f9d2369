"""Reading a package's imports from its source with ast: which modules a file imports, which it
imports inside functions, and whether an import graph has a cycle."""
import ast


def imported_names(source: str) -> set:
    """Every dotted name ``source`` imports, anywhere in it (``from a import b``: a and a.b)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def imports_inside_functions(source: str) -> set:
    """The modules ``source`` imports inside a function body."""
    out = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                out.add(node.module or "")
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
