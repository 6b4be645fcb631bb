"""`apex` and `apex.amp` resolving to ampx, for legacy scripts run under `ampx run`.

`install()` puts an import finder at the front of `sys.meta_path` so that, in this process,
``from apex import amp``, ``import apex.amp`` and ``from apex.amp import _amp_state`` give
`ampx.amp` (apex's public names plus the `_amp_state` compatibility view, whose
`loss_scalers[i]` are the live `ampx.LossScaler` objects). It does so only when no real apex is
importable, unless `force=True`: a real install is never shadowed by accident. Nothing is
written to disk and no other process is affected; `uninstall()` removes the finder and the
modules it created.

Other apex packages (`apex.parallel`, `apex.optimizers`, ...) are not provided; importing one
raises `ModuleNotFoundError` with the torch replacement to use.

Example::

    from ampx.compat import apex_alias

    apex_alias.install()
    from apex import amp          # ampx.amp
    apex_alias.uninstall()
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["install", "is_installed", "real_apex_spec", "uninstall"]

logger = logging.getLogger("ampx")

# Modules the alias provides (built by `_ApexAliasLoader.exec_module`).
_PROVIDED = ("apex", "apex.amp", "apex.amp._amp_state")

# What to use instead of the apex packages ampx does not provide.
_REPLACEMENTS = {
    "apex.parallel": "torch.nn.parallel.DistributedDataParallel (and torch.nn.SyncBatchNorm)",
    "apex.optimizers": "torch.optim with fused=True (e.g. torch.optim.AdamW(..., fused=True))",
    "apex.normalization": "torch.nn.LayerNorm / torch.nn.RMSNorm",
    "apex.fp16_utils": "ampx.initialize(..., opt_level='O2') (FP16_Optimizer's job)",
    "apex.contrib": "the matching torch or torchao feature",
    "apex.transformer": "Megatron-Core or torch.distributed.tensor",
    "apex.multi_tensor_apply": "torch._foreach_* functions",
}


class _ApexAliasLoader(importlib.abc.Loader):
    """Builds the synthetic `apex` package; `apex.amp` is `ampx.amp` itself."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        from ampx import amp

        module.__doc__ = "apex alias provided by ampx (`ampx run`): `apex.amp` is `ampx.amp`."
        module.__dict__["__ampx_alias__"] = True
        module.__dict__["amp"] = amp
        state_module = types.ModuleType(
            "apex.amp._amp_state", "apex.amp._amp_state, provided by ampx's apex alias."
        )
        state_module.__dict__["__ampx_alias__"] = True
        state_module.__dict__["_amp_state"] = amp._amp_state
        state_module.__dict__["master_params"] = amp.master_params
        # The import system looks in sys.modules again after importing a parent package, so
        # `import apex.amp` and `import apex.amp._amp_state` find these entries.
        sys.modules["apex.amp"] = amp
        sys.modules["apex.amp._amp_state"] = state_module
        _CREATED.update({"apex.amp", "apex.amp._amp_state"})


class _ApexAliasFinder(importlib.abc.MetaPathFinder):
    """Finds `apex` (the alias package) and explains the apex packages ampx lacks."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "apex":
            spec = importlib.machinery.ModuleSpec("apex", _LOADER, is_package=True)
            _CREATED.add("apex")
            return spec
        if not fullname.startswith("apex.") or fullname in _PROVIDED:
            return None
        parent = sys.modules.get("apex")
        if parent is None or not getattr(parent, "__ampx_alias__", False):
            return None  # a real apex (forced aliasing was not asked for): not our business
        top = ".".join(fullname.split(".")[:2])
        instead = _REPLACEMENTS.get(top, "its torch equivalent")
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: `ampx run` provides only apex.amp (through ampx), "
            f"not {top}; use {instead}.",
            name=fullname,
        )


_LOADER = _ApexAliasLoader()
_FINDER = _ApexAliasFinder()
_CREATED: set[str] = set()


def real_apex_spec() -> importlib.machinery.ModuleSpec | None:
    """The spec of a real, importable `apex` package (ignoring the alias), or None.

    Returns:
        The spec another finder on `sys.meta_path` gives for "apex" (searched on the current
        `sys.path`), or the spec of an `apex` module already imported that is not the alias.
    """
    loaded = sys.modules.get("apex")
    if loaded is not None and not getattr(loaded, "__ampx_alias__", False):
        spec: Any = getattr(loaded, "__spec__", None)
        return spec if spec is not None else importlib.machinery.ModuleSpec("apex", None)
    for finder in sys.meta_path:
        if finder is _FINDER:
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            found = find_spec("apex", None)
        except (ImportError, ValueError):
            continue
        if found is not None:
            return found
    return None


def is_installed() -> bool:
    """Whether the alias finder is on `sys.meta_path`."""
    return _FINDER in sys.meta_path


def install(*, force: bool = False) -> bool:
    """Make `apex` / `apex.amp` importable as ampx in this process.

    Args:
        force: Install even when a real apex is importable (it is then shadowed; an apex
            already imported is removed from `sys.modules`).

    Returns:
        True when the alias is in place, False when a real apex was found and left alone.
    """
    if is_installed():
        return True
    real = real_apex_spec()
    if real is not None and not force:
        logger.info(
            "ampx run: a real apex is importable (%s); `from apex import amp` uses it. "
            "Pass --force-apex-alias to use ampx instead.", real.origin or real.name,
        )
        return False
    if real is not None:
        logger.info("ampx run: shadowing the real apex at %s with ampx (--force-apex-alias).",
                    real.origin or real.name)
        for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
            del sys.modules[name]
    sys.meta_path.insert(0, _FINDER)
    return True


def uninstall() -> None:
    """Remove the finder and every module the alias created (real modules are untouched)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    ours = sys.modules.get("ampx.amp")
    for name in sorted(_CREATED):
        module = sys.modules.get(name)
        if module is not None and (module is ours or getattr(module, "__ampx_alias__", False)):
            del sys.modules[name]
    _CREATED.clear()
