"""ampx implementations of apex's companion modules, for legacy scripts.

Legacy apex scripts import more than `apex.amp` in the same ``try:`` block:
`apex.parallel`, `apex.optimizers`, `apex.normalization` and `apex.fp16_utils`. These modules
are ampx's own implementations of those names, written from apex's documented signatures and
update rules and built on today's torch (no CUDA extension needed; they run on any device).
They are importable directly (``from ampx.compat.apex.optimizers import FusedAdam``) and, under
`ampx run` (or `ampx.compat.apex_alias.install()`), as ``apex.parallel``, ``apex.optimizers``,
``apex.normalization`` and ``apex.fp16_utils`` when no real apex is installed.

docs/migrating-from-apex.md ("Companion modules") lists, name by name, what is the same as in
apex and what changed. An apex name that ampx does not provide raises ImportError naming the
torch replacement.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["missing_name"]


def missing_name(module: str, name: str, replacements: Mapping[str, str]) -> None:
    """Raise the error for an apex name a companion module lacks (used by `__getattr__`).

    Args:
        module: The apex module name the script imports from, e.g. "apex.optimizers".
        name: The attribute asked for.
        replacements: apex names this module knows to be out of scope, with their torch
            replacements.

    Raises:
        ImportError: For a known apex name (so ``from apex.x import Name`` says what to use).
        AttributeError: For any other name (so `hasattr` and introspection behave).
    """
    if name in replacements:
        raise ImportError(
            f"cannot import name {name!r} from {module!r}: ampx's apex companions do not "
            f"provide it; use {replacements[name]}.",
            name=module,
        )
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
