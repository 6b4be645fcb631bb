"""What an O1 session does to torch's compiler: pre-imports, dynamo's rule map, resets, caches.

Patching torch functions interacts with tables the compiler fills by identity and with caches
keyed on what dynamo sees; `patch.activate`/`deactivate` call these around the patches
(docs/compile.md).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import torch

from .regions import run_region_frames_as_python
from .registry import PATCHES

__all__ = ["drop_rules_built_during_session", "hold_autograd_cache", "prepare", "reset_compiled"]

logger = logging.getLogger("ampx")

_PRE_IMPORTS = (
    # Modules that capture torch functions by identity at import: dynamo's trace rules (a
    # captured wrapper would be "skipped" for good), inductor's extern kernels (mm, bmm...),
    # the TorchScript-compiled jvp decompositions. Imported before the first patch.
    "torch._dynamo",
    "torch._inductor.select_algorithm",
    "torch._inductor.kernel.mm",
    "torch._inductor.kernel.bmm",
    "torch._decomp.decompositions_for_jvp",
)


def prepare() -> None:
    """Before a session's patches: import what captures torch functions, keep the rule map."""
    if not PATCHES.compiler_ready:
        for name in _PRE_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a torch build without the compiler: nothing to protect
                logger.debug("ampx: could not import %s before patching: %s", name, exc)
        if "torch._dynamo" in sys.modules:
            run_region_frames_as_python()
        PATCHES.compiler_ready = True
    rules = sys.modules.get("torch._dynamo.trace_rules")
    if rules is not None:
        # dynamo's map of torch functions is cached on first use, and torch clears it at
        # times (init_process_group): build it from the originals before patching.
        PATCHES.rule_map = rules.get_torch_obj_rule_map()


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
