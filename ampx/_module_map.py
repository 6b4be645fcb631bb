"""The package's import graph, read from the source (AST): the module map in docs/internals.md.

`python -m ampx._docs module-map` prints the map's table; tests/test_structure.py checks that
docs/internals.md holds it as generated and that the graph has no cycle. Only the standard
library is used, so nothing of ampx or torch is imported to draw it.
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["find_cycles", "import_graph", "module_map_markdown", "modules"]

PACKAGE = Path(__file__).resolve().parent


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (`ampx.compat.fairseq.optimizer`), sorted."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `name` imports anywhere in its source, TYPE_CHECKING blocks included.

    A type-only import still ties two modules' designs together, so it counts.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target in known:
                found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names
                         if f"{target}.{a.name}" in known)
    # A submodule naming its own package is how Python loads it, not a dependency.
    return {dep for dep in found if dep != name and not name.startswith(dep + ".")}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    mods = modules()
    known = set(mods)
    return {name: _imported(name, path, known) for name, path in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk, as the cycle it closes (`[a, b, a]`)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _job(path: Path) -> str:
    doc = ast.get_docstring(_tree(path)) or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return first.replace("|", "\\|")


def module_map_markdown() -> str:
    """The module map: each module, its job (its docstring's first paragraph), its imports."""
    graph = import_graph()
    mods = modules()
    lines = ["| module | job | imports (ampx) |", "| --- | --- | --- |"]
    for name in sorted(graph):
        short = name.removeprefix("ampx.") if name != "ampx" else "ampx"
        deps = ", ".join(sorted(d.removeprefix("ampx.") for d in graph[name])) or "—"
        lines.append(f"| `{short}` | {_job(mods[name])} | {deps} |")
    return "\n".join(lines) + "\n"
