"""The shape of the package: no import cycles, and every module readable in one sitting.

An import cycle (a imports b, b imports a) makes the order of imports matter and can load a
module twice (once as `__main__`, once by name); a learner reading one of the two can no longer
tell which one depends on which. The graph is built from the source, every `import` statement
counted, those inside functions too: a lazy import is still a dependency.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minidist"
MAX_LINES = 300


def module_names() -> dict[str, Path]:
    """Every module of minidist by its dotted name (a package by its own name)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the minidist modules it imports (importing a.b.c runs a and a.b first, too)."""
    modules = module_names()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from minidist.parallel import comm` imports the module comm, if it is one
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            for target in targets:
                if not target.startswith("minidist"):
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # the packages on the way are imported too
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        graph[name].add(prefix)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None: a depth-first search that meets a module on its own path."""
    state = {}  # module -> "open" while on the current path, "done" after

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_search_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_minidist_has_no_import_cycle():
    graph = import_graph()
    assert "minidist.parallel.strategy" in graph and graph["minidist.finetune"], "the graph found no modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_is_over_300_lines():
    long = {name: n for name, path in module_names().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
