"""The shape of the package: no import cycles, between modules or between folders, and no function
too long to read in one sitting.

An import cycle (a imports b, b imports a) makes the order of imports matter and can load a
module twice (once as `__main__`, once by name); a learner reading one of the two can no longer
tell which one depends on which. The graph is built from the source, every `import` statement
counted, those inside functions too: a lazy import is still a dependency.

Two graphs are checked. Between modules; and between the package's units, where every folder at
any depth (`minidist.parallel`, `minidist.parallel.tensor`, `minidist.strategy.state`, ...) is one
node, holding the modules directly in it, and each top-level module (`minidist.finetune`,
`minidist.step`, ...) is one. The second sees what the first cannot: folders that use each other
through different modules (`memory.trace` imports `finetune`, `finetune` imports `memory.measure`)
are two wings that cannot be read apart. A module in a subfolder imports its parent folder too
(importing `minidist.parallel.tensor.ops` runs `minidist.parallel` first), so a parent that
imports its subfolder is a cycle: a lesson folder must not be pulled back into the folder around it.

And the written rules of the layout (`RULES`, `LESSON_FOLDERS`), each checked:

- `parallel/` holds the mechanisms the lessons teach, readable without the rest: it imports nothing
  from `strategy/` (how a run combines them), `runtime/` (but its one-line error types,
  `runtime.errors`), `hf/`, `chess/`, `checkpoint/`, `memory/` or `bench/`, nor the loop
  (`finetune`, `step`, `evaluate`; the batches' shapes, `batches`, it may read).
- A lesson folder (`parallel/tensor/`, `parallel/pipeline/`, and each axis to come) imports no
  sibling lesson folder: each axis is read on its own.

Length is a reading, not a rule, for modules: one idea per module matters more than a line count,
so modules over 300 lines of code (docstrings and comments not counted) are listed, not failed. A
function over 80 lines is a failure: it is where a learner loses the thread.
"""

import ast
import io
import itertools
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minidist"
MODULE_CODE_LINES = 300  # listed above this, not failed
FUNCTION_LINES = 80  # failed above this


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (importing a.b.c runs a and a.b first, too)."""
    modules = module_names(package)
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
                if target.split(".")[0] != package.name:
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # the packages on the way are imported too
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        graph[name].add(prefix)
    return graph


def unit_of(module: str, package: Path = PACKAGE) -> str:
    """The unit a module belongs to: the folder it sits in, at any depth (a package, by its own
    folder), or itself for a module at the package's top level."""
    parts = module.split(".")
    if (package.parent.joinpath(*parts)).is_dir():  # a package's __init__: its own folder
        return module
    if len(parts) > 2:
        return ".".join(parts[:-1])
    return module


def unit_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """The import graph with each folder under the package collapsed to one node."""
    graph = {}
    for module, imports in import_graph(package).items():
        unit = unit_of(module, package)
        graph.setdefault(unit, set()).update(u for target in imports if (u := unit_of(target, package)) != unit)
    for targets in list(graph.values()):
        for target in targets:
            graph.setdefault(target, set())
    return graph


def witnesses(cycle: list[str], package: Path = PACKAGE) -> list[str]:
    """For each edge of a unit cycle, the module imports that make it: `a.x -> b.y`."""
    modules = import_graph(package)
    lines = []
    for unit, nxt in itertools.pairwise(cycle):
        lines += [f"{module} -> {target}" for module, targets in sorted(modules.items()) for target in sorted(targets)
                  if unit_of(module, package) == unit and unit_of(target, package) == nxt]
    return lines


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


def every_cycle(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle for each knot of the graph (a set of nodes that all reach each other), so that a
    failure names all of them at once, not only the first."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {node: reach(node) for node in graph}
    knots = {frozenset(n for n in reachable[node] if node in reachable[n]) for node in graph if node in reachable[node]}
    return sorted(find_cycle({n: graph[n] & knot for n in knot}) for knot in knots)


# The written rules: a unit (folder or top-level module) -> the units it must not import, by prefix.
WINGS = ("minidist.strategy", "minidist.hf", "minidist.chess", "minidist.checkpoint", "minidist.memory",
         "minidist.bench", "minidist.finetune", "minidist.step", "minidist.evaluate")
RULES = {"minidist.parallel": WINGS + ("minidist.runtime",)}
ALLOWED = {"minidist.runtime", "minidist.runtime.errors"}  # one-line error types: what a mechanism raises for bad input
LESSON_FOLDERS = "minidist.parallel"  # each folder directly in it is a lesson's (tensor/, pipeline/, ...)


def broken_rules(package: Path = PACKAGE) -> list[str]:
    """`a -> b` for each import that breaks a written rule: a module of `parallel/` (at any depth)
    importing a wing, or a lesson folder importing a sibling lesson folder."""
    broken = []
    lessons = {unit for unit in unit_graph(package) if unit.rsplit(".", 1)[0] == LESSON_FOLDERS
               and package.parent.joinpath(*unit.split(".")).is_dir()}
    for module, targets in sorted(import_graph(package).items()):
        for target in sorted(targets):
            for owner, banned in RULES.items():
                if (module == owner or module.startswith(owner + ".")) and target not in ALLOWED and any(
                        target == b or target.startswith(b + ".") for b in banned):
                    broken.append(f"{module} -> {target} ({owner} imports none of {', '.join(banned)})")
            mine = next((lesson for lesson in lessons if module == lesson or module.startswith(lesson + ".")), None)
            theirs = next((lesson for lesson in lessons if target == lesson or target.startswith(lesson + ".")), None)
            if mine and theirs and mine != theirs:
                broken.append(f"{module} -> {target} (a lesson folder imports no sibling lesson folder)")
    return broken


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and type(first.value.value) is str:
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    quiet = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
             tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in quiet:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def long_modules(package: Path = PACKAGE) -> dict[str, int]:
    """Module -> its code lines, for those over MODULE_CODE_LINES."""
    return {name: n for name, path in module_names(package).items()
            if (n := code_lines(path.read_text())) > MODULE_CODE_LINES}


def long_functions(package: Path = PACKAGE) -> dict[str, int]:
    """`module.qualified.name` -> its lines (from `def` to its last line), for those over FUNCTION_LINES."""
    found = {}

    def visit(node, module, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > FUNCTION_LINES:
                    found[f"{module}:{name}"] = n
                visit(child, module, name + ".")
            else:
                visit(child, module, prefix)

    for module, path in module_names(package).items():
        visit(ast.parse(path.read_text(), str(path)), module, "")
    return found


def test_the_search_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    two = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"e"}, "e": {"d"}}
    assert every_cycle(two) == [["a", "b", "a"], ["d", "e", "d"]]
    assert every_cycle({"a": {"b"}, "b": set()}) == []


def test_the_checks_see_what_they_are_for(tmp_path):
    """A planted package: two folders that use each other through different modules (one import
    lazy, inside a function), which only the unit graph sees; and one function too long."""
    package = tmp_path / "minidist"
    for folder in ("memory", "parallel"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "finetune.py").write_text("from minidist.memory import measure\n")
    (package / "memory" / "measure.py").write_text("X = 1\n")
    (package / "memory" / "trace.py").write_text("def loss():\n    from minidist.finetune import token_loss_sum\n")
    (package / "parallel" / "long.py").write_text(
        '"""A module docstring."""\n\n\ndef long():\n    """Its docstring."""\n'
        + "    # a comment\n" * 10 + "    x = 1\n" * (FUNCTION_LINES - 12) + "    return x\n")
    assert find_cycle(import_graph(package)) is None  # module by module there is none
    assert find_cycle(unit_graph(package)) == ["minidist.finetune", "minidist.memory", "minidist.finetune"]
    assert every_cycle(unit_graph(package)) == [["minidist.finetune", "minidist.memory", "minidist.finetune"]]
    assert witnesses(["minidist.finetune", "minidist.memory", "minidist.finetune"], package) == [
        "minidist.finetune -> minidist.memory", "minidist.finetune -> minidist.memory.measure",
        "minidist.memory.trace -> minidist.finetune"]
    assert long_functions(package) == {"minidist.parallel.long:long": FUNCTION_LINES + 1}
    assert code_lines((package / "parallel" / "long.py").read_text()) == 2 + FUNCTION_LINES - 12


def test_minidist_has_no_import_cycle():
    graph = import_graph()
    assert "minidist.strategy" in graph and graph["minidist.finetune"], "the graph found no modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_minidist_has_no_import_cycle_between_its_folders():
    graph = unit_graph()
    assert {"minidist.parallel", "minidist.parallel.tensor", "minidist.strategy.state", "minidist.memory",
            "minidist.finetune"} <= graph.keys(), "the graph found no units"
    assert "minidist.strategy" in graph["minidist.finetune"], "the graph found no imports between units"
    assert "minidist.parallel" in graph["minidist.parallel.tensor"], "a subfolder imports its parent"
    cycles = every_cycle(graph)
    assert not cycles, "import cycles between units: " + "; ".join(
        " -> ".join(cycle) + " (through " + ", ".join(witnesses(cycle)) + ")" for cycle in cycles)


def test_the_rules_see_what_they_are_for(tmp_path):
    """A planted package: a mechanism that imports the runtime and a lesson folder that imports its
    sibling are named; a subfolder its parent imports is a cycle of the unit graph."""
    package = tmp_path / "minidist"
    for folder in ("runtime", "parallel", "parallel/tensor", "parallel/pipeline"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "runtime" / "errors.py").write_text("class UsageError(Exception): pass\n")
    (package / "runtime" / "launch.py").write_text("X = 1\n")
    (package / "parallel" / "comm.py").write_text("from minidist.runtime.errors import UsageError\n")
    (package / "parallel" / "mesh.py").write_text("from minidist.runtime.launch import X\n")
    (package / "parallel" / "tensor" / "ops.py").write_text("from minidist.parallel import comm\n")
    (package / "parallel" / "pipeline" / "loop.py").write_text("def f():\n    from minidist.parallel.tensor import ops\n")
    assert broken_rules(package) == [
        "minidist.parallel.mesh -> minidist.runtime.launch (minidist.parallel imports none of "
        + ", ".join(WINGS + ("minidist.runtime",)) + ")",
        "minidist.parallel.pipeline.loop -> minidist.parallel.tensor (a lesson folder imports no sibling lesson folder)",
        "minidist.parallel.pipeline.loop -> minidist.parallel.tensor.ops (a lesson folder imports no sibling lesson "
        "folder)"]
    assert every_cycle(unit_graph(package)) == []
    (package / "parallel" / "strategy.py").write_text("from minidist.parallel.pipeline import loop\n")
    assert every_cycle(unit_graph(package)) == [["minidist.parallel", "minidist.parallel.pipeline",
                                                 "minidist.parallel.tensor", "minidist.parallel"]]


def test_the_written_rules_hold():
    broken = broken_rules()
    assert not broken, "imports that break the layout's rules:\n" + "\n".join(broken)


# What a data-parallel strategy must not name: the axes, their groups and sizes, and what they cut.
AXIS_NAMES = {"tp_size", "pp_size", "tp_group", "pp_group", "tp_rank", "pp_rank", "tensor_parallel", "pipeline",
              "axis", "axes", "cut_layers", "cut_stage", "stage", "split", "sequence_parallel", "pp_schedule"}


def names_used(path: Path, classes_only: bool = True) -> dict[str, set[str]]:
    """Class -> every name and attribute its code uses (docstrings and comments are not code)."""
    used = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) or not classes_only:
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            used[getattr(node, "name", "")] = names
    return used


def test_the_data_parallel_strategies_know_no_axis():
    """Axes, not branches: a class of `strategy/data.py` names no axis, no axis's group or size, and
    nothing an axis cuts; where an axis shows, `strategy/base.py` asks the axes."""
    used = names_used(PACKAGE / "strategy" / "data.py")
    assert {"MinidistDDP", "MinidistFSDP", "TorchFSDP"} <= used.keys(), "no data-parallel class found"
    knowing = {cls: sorted(names & AXIS_NAMES) for cls, names in used.items() if names & AXIS_NAMES}
    assert not knowing, f"data-parallel strategies that name an axis: {knowing}"


def test_no_function_is_over_80_lines_and_long_modules_are_listed(record_property):
    modules = long_modules()
    # A reading, not a rule: printed (`-s`), and at the end of the session (tests/conftest.py).
    print(f"modules over {MODULE_CODE_LINES} code lines (docstrings and comments not counted): "
          + (", ".join(f"{name} ({n})" for name, n in sorted(modules.items())) or "none"))
    record_property("long_modules", modules)
    functions = long_functions()
    assert not functions, f"functions over {FUNCTION_LINES} lines: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(functions.items(), key=lambda item: -item[1]))
