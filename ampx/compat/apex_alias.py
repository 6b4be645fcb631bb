"""`apex` and `apex.amp` resolving to ampx, for legacy scripts run under `ampx run`.

`install()` puts an import finder at the front of `sys.meta_path` so that, in this process,
``from apex import amp``, ``import apex.amp`` and ``from apex.amp import _amp_state`` give
`ampx.amp` (apex's public names plus the `_amp_state` compatibility view, whose
`loss_scalers[i]` are the live `ampx.LossScaler` objects). It does so only when no real apex is
importable, unless `force=True`: a real install is never shadowed by accident. While installed,
`importlib.metadata` also finds a distribution "apex" (version "0.1+ampx"), for frameworks
that check availability through metadata (transformers 4.x's `is_apex_available`). Nothing is
written to disk and no other process is affected; `uninstall()` removes the finder and the
modules it created.

The companion packages legacy scripts import in the same ``try:`` block resolve to ampx's own
implementations (`ampx.compat.apex`): ``apex.parallel``, ``apex.optimizers``,
``apex.normalization`` and ``apex.fp16_utils`` (and ``apex.multi_tensor_apply``, as apex had it
without its CUDA extension), plus the submodule paths scripts use
(``apex.parallel.LARC``, ``apex.normalization.fused_layer_norm``, ``apex.optimizers.fused_adam``,
``apex.fp16_utils.fp16_optimizer``, ...). They are imported on first use, so `install()` itself
imports nothing but the standard library (it is cheap enough for a ``sitecustomize``), and it is
idempotent, as is `uninstall()`. Other apex packages (`apex.contrib`, `apex.transformer`, ...)
are not provided; importing one raises `ModuleNotFoundError` with the torch replacement to use.

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

# apex companion packages: alias name -> ampx module, and the submodule paths each one brings.
_COMPANIONS = {
    "apex.parallel": "ampx.compat.apex.parallel",
    "apex.optimizers": "ampx.compat.apex.optimizers",
    "apex.normalization": "ampx.compat.apex.normalization",
    "apex.fp16_utils": "ampx.compat.apex.fp16_utils",
    "apex.multi_tensor_apply": "ampx.compat.apex.multi_tensor_apply",
}
_SUBMODULES = {
    "apex.parallel": {
        "apex.parallel.LARC": "ampx.compat.apex.larc",
        "apex.parallel.distributed": "ampx.compat.apex.parallel",
        "apex.parallel.sync_batchnorm": "ampx.compat.apex.parallel",
        "apex.parallel.optimized_sync_batchnorm": "ampx.compat.apex.parallel",
    },
    "apex.optimizers": {
        f"apex.optimizers.{name}": "ampx.compat.apex.optimizers"
        for name in ("fused_adam", "fused_sgd", "fused_lamb", "fused_novograd")
    },
    "apex.normalization": {
        "apex.normalization.fused_layer_norm": "ampx.compat.apex.normalization",
    },
    "apex.fp16_utils": {
        f"apex.fp16_utils.{name}": "ampx.compat.apex.fp16_utils"
        for name in ("fp16_optimizer", "fp16util", "loss_scaler")
    },
    "apex.multi_tensor_apply": {
        "apex.multi_tensor_apply.multi_tensor_apply": "ampx.compat.apex.multi_tensor_apply",
    },
}

# What to use instead of the apex packages ampx does not provide.
_REPLACEMENTS = {
    "apex.parallel.multiproc": "torchrun (python -m torch.distributed.run)",
    "apex.optimizers.fused_adagrad": "torch.optim.Adagrad(..., foreach=True)",
    "apex.optimizers.fused_mixed_precision_lamb": "apex.optimizers.FusedLAMB at ampx O2",
    "apex.normalization.instance_norm": "torch.nn.InstanceNorm3d",
    "apex.fp16_utils.fused_weight_norm": "torch.nn.utils.parametrizations.weight_norm",
    "apex.contrib": "the matching torch or torchao feature",
    "apex.transformer": "Megatron-Core or torch.distributed.tensor",
    "apex.mlp": "torch.nn.Sequential of torch.nn.Linear layers",
    "apex.fused_dense": "torch.nn.Linear (torch.compile fuses the bias and activation)",
    "apex.RNN": "torch.nn.LSTM / torch.nn.GRU",
    "apex.reparameterization": "torch.nn.utils.parametrizations.weight_norm",
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
        module.__dict__["__getattr__"] = _package_getattr
        state_module = types.ModuleType(
            "apex.amp._amp_state", "apex.amp._amp_state, provided by ampx's apex alias."
        )
        state_module.__dict__["__ampx_alias__"] = True
        state_module.__dict__["_amp_state"] = amp._amp_state
        state_module.__dict__["master_params"] = amp.master_params
        # The import system looks in sys.modules again after importing a parent package, so
        # `import apex.amp` and `import apex.amp._amp_state` find these entries.
        _register("apex.amp", amp)
        _register("apex.amp._amp_state", state_module)


class _CompanionLoader(importlib.abc.Loader):
    """Builds `apex.parallel` & co. over the ampx modules (and their submodule paths)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # a placeholder; exec_module puts the alias module in its place

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        package = _alias_module(name, importlib.import_module(_COMPANIONS[name]))
        # Registered now, so `import apex.parallel.LARC` and `import apex.fp16_utils.loss_scaler
        # as ls` find them (the import system reads the parent's attribute, then sys.modules).
        for alias, target in _SUBMODULES[name].items():
            sub = _alias_module(alias, importlib.import_module(target))
            _register(alias, sub)
            package.__dict__.setdefault(alias.rsplit(".", 1)[1], sub)
        _register(name, package)


def _package_getattr(name: str) -> types.ModuleType:
    """`apex.<companion>` after a bare ``import apex`` (apex's __init__ imported them all)."""
    if f"apex.{name}" in _COMPANIONS:
        return importlib.import_module(f"apex.{name}")
    raise AttributeError(f"module 'apex' has no attribute {name!r}")


def _alias_module(alias: str, target: types.ModuleType) -> types.ModuleType:
    """A module named `alias` holding `target`'s public names (the same objects).

    A separate module object, so that the ampx module keeps its own name and attributes while
    `apex.x.y` lookups (which go by the module's `__name__`) work; `target`'s `__getattr__`
    comes along, so apex names ampx lacks raise ImportError naming their replacement.
    """
    module = types.ModuleType(alias, target.__doc__)
    names = list(getattr(target, "__all__", ()))
    module.__dict__.update({n: getattr(target, n) for n in names})
    if "__getattr__" in vars(target):
        module.__dict__["__getattr__"] = vars(target)["__getattr__"]
    module.__dict__.update(__all__=names, __ampx_alias__=True, __ampx_module__=target.__name__,
                           __path__=[])  # a package: unknown submodules reach the finder
    return module


def _register(alias: str, module: types.ModuleType) -> None:
    # The import system reads sys.modules again after exec_module, so the alias name
    # resolves to this object.
    sys.modules[alias] = module


class _ApexAliasFinder(importlib.abc.MetaPathFinder):
    """Finds `apex` (the alias package) and explains the apex packages ampx lacks.

    It also answers `importlib.metadata` for the distribution "apex" (`find_distributions`),
    so availability checks that read installed metadata rather than importing (transformers'
    `is_apex_available`: `find_spec` plus `importlib.metadata.version`) see the alias while it
    is installed. The finder is only installed when no real apex is importable, so a real
    install's metadata always wins.
    """

    def find_distributions(self, context: Any = None) -> list[Any]:
        """The alias's distribution for `importlib.metadata` (name "apex", or every name)."""
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("-", "_") != "apex":
            return []
        return [_alias_distribution()]

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "apex":
            return importlib.machinery.ModuleSpec("apex", _LOADER, is_package=True)
        if not fullname.startswith("apex.") or fullname in _PROVIDED:
            return None
        parent = sys.modules.get("apex")
        if parent is None or not getattr(parent, "__ampx_alias__", False):
            return None  # a real apex (forced aliasing was not asked for): not our business
        if fullname in _COMPANIONS:
            return importlib.machinery.ModuleSpec(fullname, _COMPANION_LOADER, is_package=True)
        raise ModuleNotFoundError(_missing_message(fullname), name=fullname)


_METADATA = ("Metadata-Version: 2.1\nName: apex\nVersion: 0.1+ampx\n"
             "Summary: apex alias provided by ampx (`ampx run`): apex.amp is ampx.amp\n")


def _alias_distribution() -> Any:
    """An `importlib.metadata.Distribution` for the alias (imported here: install stays cheap)."""
    import importlib.metadata
    import pathlib

    class _AliasDistribution(importlib.metadata.Distribution):
        def read_text(self, filename: str) -> str | None:
            return {"METADATA": _METADATA, "top_level.txt": "apex\n"}.get(filename)

        def locate_file(self, path: Any) -> pathlib.Path:
            return pathlib.Path(path)

    return _AliasDistribution()


def _missing_message(fullname: str) -> str:
    parts = fullname.split(".")
    top = ".".join(parts[:2])
    instead = _REPLACEMENTS.get(".".join(parts[:3]), _REPLACEMENTS.get(top))
    if top in _COMPANIONS:
        return (f"No module named {fullname!r}: ampx's {top} (ampx.compat.apex) does not "
                f"provide it; use {instead or 'the names in ' + top}.")
    return (f"No module named {fullname!r}: `ampx run` provides apex.amp, "
            f"{', '.join(_COMPANIONS)} (through ampx), not {top}; "
            f"use {instead or 'its torch equivalent'}.")


_LOADER = _ApexAliasLoader()
_COMPANION_LOADER = _CompanionLoader()
_FINDER = _ApexAliasFinder()


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
    """Remove the finder and every module entry the alias created (idempotent).

    Real modules are untouched: `ampx.amp` and `ampx.compat.apex.*` stay importable under
    their own names; only the `apex...` entries that still hold what the alias put there go.
    """
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in sorted(n for n in sys.modules if n == "apex" or n.startswith("apex.")):
        if _made_by_alias(sys.modules[name]):
            del sys.modules[name]


def _made_by_alias(module: types.ModuleType) -> bool:
    """An `apex...` entry of the alias: its synthetic modules, or ampx's own under apex names."""
    return bool(getattr(module, "__ampx_alias__", False)) or (
        getattr(module, "__name__", "").split(".")[0] == "ampx")
