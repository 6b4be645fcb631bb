"""The package's shape: modules with one stated job, imports that run one way, no cycle.

These are the architecture rules in docs/internals.md, checked on the source (AST), so a
change that breaks one fails here rather than in review.
"""

from __future__ import annotations

import ast
import re
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


# Imports run one way (docs/internals.md): cli -> integrations/compat (and `ampx.amp`, apex's
# namespace) -> session/frontend -> o1/scaling/overflow/model -> registry/distributed/telemetry
# -> options -> kernels.
_LAYERS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (0, ("ampx._version", "ampx._reference", "ampx._reference_compensated", "ampx._ext",
         "ampx._build", "ampx._build_cuda")),
    (1, ("ampx.options",)),
    (2, ("ampx.registry", "ampx.distributed", "ampx.telemetry")),
    (3, ("ampx.o1", "ampx.scaling", "ampx.overflow", "ampx.model")),
    (4, ("ampx.initializer", "ampx.session", "ampx.frontend")),
    (5, ("ampx.compat", "ampx.integrations", "ampx.examples", "ampx.amp")),
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


# -- apex as the outer shell: the engine holds none of apex's private names --------------------

# apex's private names: `_amp_state`, `_amp_stash`, `_amp_lazy_init`, `_prepare_amp_backward`,
# `_post_amp_backward` (all of them hold "_amp_"), the other private optimizer methods, and
# LossScaler's private members. Torch's own names that hold "_amp_" are not apex's.
_APEX_PATTERN = re.compile(r"_amp_")
_APEX_NAMES = frozenset({
    "_lazy_init_maybe_master_weights", "_master_params_to_model_params", "_loss_scale",
    "_unskipped", "_scale_seq_len", "_min_loss_scale", "_max_loss_scale", "_has_overflow",
    "clear_overflow_state", "unscale_with_stashed", "update_scale",
})
_TORCH_NAMES = frozenset({"_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
                          "_step_supports_amp_scaling"})
# What may import ampx.compat: compat itself, the command line, the integrations, and the
# public surface (the package's `__init__`, `ampx.amp`: apex's namespace).
_COMPAT_IMPORTERS = ("ampx.compat", "ampx.cli", "ampx.integrations")
_PUBLIC = ("ampx", "ampx.amp", "ampx.__main__")


def _names(tree: ast.AST) -> set[str]:
    """Every identifier a module defines or uses, and every identifier-like string in it."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.update((node.asname or node.name).split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier():
            out.add(node.value)
    return out


def apex_names(tree: ast.AST) -> list[str]:
    """apex's private names in a module (see `_APEX_PATTERN`, `_APEX_NAMES`)."""
    return sorted(n for n in _names(tree) - _TORCH_NAMES
                  if _APEX_PATTERN.search(n) or n in _APEX_NAMES)


_ENGINE = [p for p in MODULES if layer(_name(p)) < layer("ampx.compat")]


@pytest.mark.parametrize("path", _ENGINE, ids=_name)
def test_the_engine_holds_no_apex_private_name(path: Path) -> None:
    found = apex_names(_tree(path))
    assert not found, (f"{_name(path)} names apex's private {found}: they belong to the apex "
                       "shell (ampx/compat/apex), attached through the session's hooks")


def test_the_apex_name_check_finds_apex_names() -> None:
    """The checker itself is not vacuous, and the engine list is not empty."""
    tree = ast.parse("opt._amp_stash = 1\nhasattr(s, '_loss_scale')\ngetattr(o, '_ampx')\n"
                     "torch._amp_update_scale_(x)\nfrom apex.amp import _amp_state")
    assert apex_names(tree) == ["_amp_stash", "_amp_state", "_loss_scale"]
    assert {"ampx.session", "ampx.scaling.scaler", "ampx.frontend"} <= set(map(_name, _ENGINE))


def test_only_the_outer_layers_import_compat() -> None:
    graph = import_graph()
    inward = [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
              if (b == "ampx.compat" or b.startswith("ampx.compat."))
              and a not in _PUBLIC and not any(a == p or a.startswith(p + ".")
                                               for p in _COMPAT_IMPORTERS)]
    assert not inward, "imports of ampx.compat from inside: " + "; ".join(inward)


def test_the_exports_are_data_and_match_the_type_checking_block() -> None:
    """`ampx._EXPORTS` (read at run time) names what the TYPE_CHECKING imports name."""
    import ampx

    tree = _tree(PACKAGE / "__init__.py")
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    imported = {alias.name: node.module or alias.name for node in block.body
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert imported == ampx._exports()
    assert "ast" not in {alias.name for node in ast.walk(tree)
                         if isinstance(node, ast.Import) for alias in node.names}
