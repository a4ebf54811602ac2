"""The import graph, by parsing the source (every import statement, those inside functions and under
TYPE_CHECKING too): which modules import each other (docs/design.md section 2: layers that import one way).
An edge goes to the module an import names (``from package import module``: that module), as
``structure.py`` of the project's tools counts them; a package's ``__init__`` is not an edge of
every import of one of its modules."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Modules that import each other: none. A module may not join a cycle, and no cycle may form.
KNOWN_CYCLE: set[str] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "passes":  # installed as fsdp_compile.passes
        parts = ["fsdp_compile", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file."""
    files = {_module_name(p): p for folder in ("fsdp_compile", "passes") for p in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # ``from package import module`` imports that module; ``from module import name``, the module.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:  # a name imported from a module: the module
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != name:
                    graph[name].add(target)
    return graph


def modules_in_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "fsdp_compile.runtime.state" in graph and "fsdp_compile.passes.bucket" in graph, sorted(graph)  # parsed the tree
    components = modules_in_cycles(graph)
    assert all(component <= KNOWN_CYCLE for component in components), components
    assert components == [], components


def test_the_runtime_imports_nothing_of_the_compile_layer_nor_the_composition_root():
    graph = import_graph()
    upward = {
        (module, imported) for module, targets in graph.items() if module.startswith("fsdp_compile.runtime")
        for imported in targets
        if imported.startswith(("fsdp_compile.compile", "fsdp_compile.passes")) or imported == "fsdp_compile.module"
    }
    assert upward == set(), sorted(upward)


def test_the_passes_import_only_the_ops_vocabulary_of_the_compile_layer():
    graph = import_graph()
    reached = {
        (module, imported) for module, targets in graph.items() if module.startswith("fsdp_compile.passes")
        for imported in targets
        if imported.startswith(("fsdp_compile.runtime", "fsdp_compile.compile")) and imported != "fsdp_compile.compile.ops"
        or imported == "fsdp_compile.module"
    }
    assert reached == set(), sorted(reached)


def test_the_communication_context_imports_no_module_above_it():
    imported = import_graph()["fsdp_compile.runtime.comm_context"]
    assert imported <= {"fsdp_compile.runtime.device"}, imported


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert modules_in_cycles(graph) == [{"a", "b", "c"}]
