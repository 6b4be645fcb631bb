"""What an O1 session does to torch's compiler: its import, dynamo's rule map, resets, caches.

Patching torch functions interacts with tables the compiler fills by identity and with caches
keyed on what dynamo sees; `patch.activate`/`deactivate` call these around the patches
(docs/compile.md). The compiler is never imported here: while a session is installed, an
import hook (`pristine.py`) lets it import against torch's originals whenever something
imports it, and then does what a session needs of it (`_compiler_imported`).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import torch

from .pristine import ImportHook, captures_at_import, changing_patches, pristine_view
from .regions import run_region_frames_as_python
from .registry import PATCHES

__all__ = ["changing_patches", "drop_rules_built_during_session", "hold_autograd_cache",
           "prepare", "reset_compiled", "unwatch"]

logger = logging.getLogger("ampx")

def _originals() -> list[tuple[Any, str, Any]]:
    active = PATCHES.active
    return [] if active is None else active.patches.originals()


def _compiler_imported() -> None:
    """Torch's compiler is there: keep dynamo's rule map (built from the originals), keep it
    from compiling `disable_casts`'s frames, hold AOTAutograd's cache in a session."""
    if "torch._dynamo" not in sys.modules:
        return
    with pristine_view(_originals):
        if not PATCHES.compiler_ready:
            run_region_frames_as_python()
            PATCHES.compiler_ready = True
        rules = sys.modules.get("torch._dynamo.trace_rules")
        if rules is not None:
            # dynamo's map of torch functions is cached on first use, and torch clears it at
            # times (init_process_group): built from the originals, whatever is patched.
            PATCHES.rule_map = rules.get_torch_obj_rule_map()
    if PATCHES.active is not None:
        hold_autograd_cache(True)


# While O1 patches are installed: the compiler's modules import against the originals.
_HOOK = ImportHook(_originals, _compiler_imported)


def prepare() -> None:
    """Before a session's patches: watch for the compiler's import, or, if it is already
    imported, keep its rule map. Imports nothing."""
    _HOOK.install()
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if captures_at_import(name) and getattr(spec, "_initializing", False):
            # imported by another thread before the hook was there: let it finish first
            importlib.import_module(name)
    _compiler_imported()


def unwatch() -> None:
    """When no session is left: take the import hook off `sys.meta_path`."""
    if PATCHES.active is None:
        _HOOK.remove()


def reset_compiled() -> None:
    """When a session starts or ends: drop compiled frames (they recompile when next called)."""
    # dynamo does not guard Tensor-method patches: frames compiled with other patches (or
    # none) must go.
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()


_CACHE_FLAGS = ("enable_autograd_cache", "enable_remote_autograd_cache")


def hold_autograd_cache(hold: bool) -> None:
    """Turn AOTAutograd's cache off (`hold`) for a session, or back as it was."""
    # AOTAutograd's cache (memory and disk) is keyed on dynamo's graph, where a Tensor method
    # is a plain call (its wrapper runs only while AOT traces): off during a session, or it
    # serves a session's graphs to the next session and to plain code (other processes too).
    config: Any = sys.modules.get("torch._functorch.config")
    if config is None:
        return
    if hold:
        for flag in _CACHE_FLAGS:
            if flag not in PATCHES.cache_flags and hasattr(config, flag):
                PATCHES.cache_flags[flag] = getattr(config, flag)
                setattr(config, flag, False)
    else:
        for flag, value in PATCHES.cache_flags.items():
            setattr(config, flag, value)
        PATCHES.cache_flags.clear()


def drop_rules_built_during_session() -> None:
    """When a session ends: forget a dynamo rule map built while patched."""
    # A rule map rebuilt while patched holds the session's wrappers as torch functions and
    # lacks the originals ("does not know how to trace builtin torch.layer_norm"): forget it.
    rules: Any = sys.modules.get("torch._dynamo.trace_rules")
    if rules is not None and rules.get_torch_obj_rule_map.cache_info().currsize:
        if rules.get_torch_obj_rule_map() is not PATCHES.rule_map:
            rules.clear_lru_cache()
    PATCHES.rule_map = None
