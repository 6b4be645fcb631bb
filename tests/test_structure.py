"""The package's shape: modules with one stated job, imports that run one way, no cycle.

These are the architecture rules in docs/internals.md, checked on the source (AST), so a
change that breaks one fails here rather than in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ampx._module_map import find_cycles, import_graph, module_map_markdown

PACKAGE = Path(__file__).resolve().parent.parent / "ampx"
# Size serves the concept: aim for 100-400 lines and split a module past ~600 along a real
# seam. The limits below are the point where a split is due, not targets to fill.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "csrc" not in p.parts)


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_module_is_small_and_says_its_job(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)} has {lines} lines"
    doc = ast.get_docstring(_tree(path))
    assert doc and len(doc.split()) >= 3, f"{_name(path)} has no docstring stating its job"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_functions_are_short(path: Path) -> None:
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(_tree(path))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{_name(path)}: {long}"


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


def test_no_import_cycle() -> None:
    # A package's __init__ re-exporting its submodules is not a design cycle; any cycle
    # through a plain module is.
    cycles = [c for c in find_cycles(import_graph()) if not all(_is_package(m) for m in c[:-1])]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle() -> None:
    """The checker itself is not vacuous."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


MAP_START = "<!-- module-map:start (python -m ampx._docs module-map) -->"
MAP_END = "<!-- module-map:end -->"


def test_internals_module_map_is_the_real_import_graph() -> None:
    text = (PACKAGE.parent / "docs" / "internals.md").read_text(encoding="utf-8")
    assert MAP_START in text and MAP_END in text, "docs/internals.md lost its module map"
    committed = text.split(MAP_START, 1)[1].split(MAP_END, 1)[0].strip()
    assert committed == module_map_markdown().strip(), (
        "docs/internals.md's module map is stale: regenerate it with "
        "`python -m ampx._docs module-map` and paste it between the markers")


# Imports run one way (docs/internals.md): cli -> integrations/compat -> session/frontend ->
# o1/scaling/overflow/model -> registry/distributed/telemetry -> options -> kernels.
_LAYERS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (0, ("ampx._version", "ampx._reference", "ampx._ext", "ampx._build", "ampx._build_cuda")),
    (1, ("ampx.options",)),
    (2, ("ampx.registry", "ampx.distributed", "ampx.telemetry")),
    (3, ("ampx.o1", "ampx.scaling", "ampx.overflow", "ampx.model")),
    (4, ("ampx.initializer", "ampx.session", "ampx.frontend", "ampx.amp")),
    (5, ("ampx.compat", "ampx.integrations", "ampx.examples")),
)
_TOP = 6  # the command line, entry points (`__main__`), the docs generators, the package


def layer(module: str) -> int:
    """The layer of `module`: an import may only go to the same layer or a lower one."""
    if module.endswith(".__main__") or module == "ampx":
        return _TOP
    for rank, prefixes in _LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return _TOP


def test_imports_run_one_way() -> None:
    graph = import_graph()
    up = [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
          if layer(b) > layer(a)]
    assert not up, "imports running back up the layers: " + "; ".join(up)


def test_every_module_has_a_layer() -> None:
    """A new top-level module must be placed on purpose (the cli layer is not a catch-all)."""
    top_level = {m for m in import_graph() if layer(m) == _TOP}
    allowed = {"ampx", "ampx._docs", "ampx._module_map", "ampx.__main__"}
    stray = sorted(m for m in top_level - allowed
                   if not m.startswith("ampx.cli") and not m.endswith(".__main__"))
    assert not stray, f"modules with no layer in tests/test_structure.py: {stray}"


def test_the_layer_check_finds_a_back_edge() -> None:
    """The checker itself is not vacuous: the core importing compat is caught."""
    assert layer("ampx.compat.apex_alias") > layer("ampx.frontend") > layer("ampx.scaling.scaler")
