"""Kernel backend switch: the native extension when it can run, the reference otherwise.

Other ampx modules call only the five contract functions here (``unscale_``,
``unscale_into_``, ``l2norm``, ``copy_``, ``update_scale_``) plus :func:`describe`,
``BACKEND`` and ``IMPORT_ERROR``. The choice is made per call: the native kernels
are used when the extension is loaded and has kernels for the tensors' device (CPU
always, CUDA when it was compiled with CUDA); anything else runs
:mod:`ampx._reference`, which computes the same results.

Loading is lazy and never compiles: the first call (or the first read of
``BACKEND``/``IMPORT_ERROR``) tries ``ampx._C`` (built ahead of time by
``AMPX_BUILD_EXT=1 pip install --no-build-isolation .``) and then the cache that
``ampx build-ext`` fills. ``AMPX_DISABLE_EXT=1`` forces the reference. Nothing is
printed or warned; the reason the reference is in use is kept in ``IMPORT_ERROR``
and logged at debug level on the ``ampx`` logger.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Union

import torch

from . import _reference

__all__ = [
    "copy_",
    "describe",
    "l2norm",
    "unscale_",
    "unscale_into_",
    "update_scale_",
]

_log = logging.getLogger("ampx")
_DISABLE_ENV = "AMPX_DISABLE_EXT"
_TRUE = ("1", "true", "yes", "on")
_CAPABILITY_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}

Tensors = Sequence[torch.Tensor]


class _State:
    """What the one-time load found (module-private; read through the accessors)."""

    def __init__(self) -> None:
        self.loaded = False
        self.native: Optional[ModuleType] = None
        self.has_cuda = False
        self.path: Optional[str] = None
        self.error: Optional[str] = None


_state = _State()
_lock = threading.Lock()


def _disabled() -> bool:
    return os.environ.get(_DISABLE_ENV, "").strip().lower() in _TRUE


def _load_from_path(path: Path) -> ModuleType:
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _capability_problem(native: ModuleType) -> Optional[str]:
    built = str(native.cpu_capability())
    try:
        here = str(torch.backends.cpu.get_cpu_capability()).upper()
    except Exception:  # pragma: no cover - unusual torch builds
        here = "DEFAULT"
    here = "AVX512" if here.startswith("AVX512") else here
    if _CAPABILITY_RANK.get(built, 0) > _CAPABILITY_RANK.get(here, 0):
        return (
            f"the extension was compiled for {built} but this CPU (per torch) supports "
            f"{here}; rebuild with `ampx build-ext` on this machine"
        )
    return None


def _find() -> tuple[Optional[ModuleType], Optional[str], Optional[str]]:
    """Return (module, path, reason it is not used)."""
    if _disabled():
        return None, None, f"disabled by {_DISABLE_ENV}={os.environ[_DISABLE_ENV]}"
    reasons: list[str] = []
    try:
        native = importlib.import_module("ampx._C")
        return native, getattr(native, "__file__", None), None
    except ImportError as exc:
        if not (isinstance(exc, ModuleNotFoundError) and exc.name == "ampx._C"):
            reasons.append(f"ampx._C failed to load: {exc}")
    from . import _build

    try:
        path = _build.find_built()
    except Exception as exc:  # a broken cache must not break ampx
        return None, None, f"cannot search the extension cache: {exc}"
    if path is None:
        build_error = _build.last_build_error()
        if build_error:
            reasons.append(f"the last `ampx build-ext` failed:\n{build_error.strip()}")
        else:
            reasons.append(
                "not built: run `ampx build-ext` (or install with AMPX_BUILD_EXT=1 "
                "pip install --no-build-isolation .)"
            )
        return None, None, "; ".join(reasons)
    try:
        return _load_from_path(path), str(path), None
    except Exception as exc:
        reasons.append(f"loading {path} failed: {exc}")
        return None, str(path), "; ".join(reasons)


def _ensure_loaded() -> _State:
    if _state.loaded:
        return _state
    with _lock:
        if _state.loaded:
            return _state
        native, path, error = _find()
        if native is not None:
            problem = _capability_problem(native)
            if problem is not None:
                native, error = None, problem
        _state.native = native
        _state.path = path
        _state.error = error
        _state.has_cuda = bool(native is not None and native.has_cuda())
        _state.loaded = True
        if error is not None:
            _log.debug("ampx: using the reference kernels: %s", error)
        else:
            _log.debug("ampx: using the native kernels from %s", path)
    return _state


def _native_module() -> Optional[ModuleType]:
    """Return the loaded extension module, or None (for tests and benchmarks)."""
    return _ensure_loaded().native


def _impl(device: torch.device) -> Any:
    state = _state if _state.loaded else _ensure_loaded()
    native = state.native
    if native is not None and (
        device.type == "cpu" or (device.type == "cuda" and state.has_cuda)
    ):
        return native
    return _reference


def __getattr__(name: str) -> Any:
    if name == "BACKEND":
        return "native" if _ensure_loaded().native is not None else "reference"
    if name == "IMPORT_ERROR":
        return _ensure_loaded().error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# The contract (see ampx/_reference.py for the full specification)
# ---------------------------------------------------------------------------


def unscale_(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor] = None,
) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place; flag inf/NaN in ``found_inf``.

    See :func:`ampx._reference.unscale_` for the arguments and errors.
    """
    if not grads:
        return
    _impl(grads[0].device).unscale_(list(grads), inv_scale, found_inf, per_tensor)


def unscale_into_(
    src: Tensors,
    dst: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> None:
    """Write (or add) ``src * inv_scale`` into ``dst`` in one pass; flag inf/NaN.

    See :func:`ampx._reference.unscale_into_` for the arguments and errors.
    """
    device = src[0].device if src else torch.device("cpu")
    _impl(device).unscale_into_(list(src), list(dst), inv_scale, found_inf, per_tensor, accumulate)


def l2norm(
    tensors: Tensors, per_tensor: bool = False
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Return the float32 L2 norm of all tensors (and, optionally, of each).

    See :func:`ampx._reference.l2norm` for the arguments, result and errors.
    """
    if not tensors:
        return _reference.l2norm(tensors, per_tensor)
    impl = _impl(tensors[0].device)
    if impl is _reference:
        return _reference.l2norm(tensors, per_tensor)
    total, norms = impl.l2norm(list(tensors), per_tensor)
    return (total, norms) if per_tensor else total


def copy_(src: Tensors, dst: Tensors) -> None:
    """Copy ``src[i]`` into ``dst[i]`` for every ``i``, converting the dtype.

    See :func:`ampx._reference.copy_` for the arguments and errors.
    """
    device = src[0].device if src else torch.device("cpu")
    _impl(device).copy_(list(src), list(dst))


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> None:
    """Update the dynamic loss scale on its device, without a host sync.

    See :func:`ampx._reference.update_scale_` for the rule, arguments and errors.
    """
    _impl(scale.device).update_scale_(
        scale,
        growth_tracker,
        hysteresis_tracker,
        found_inf,
        float(growth),
        float(backoff),
        int(interval),
        int(hysteresis),
        float(min_scale),
        float(max_scale),
    )


def describe() -> dict[str, Any]:
    """Report which kernels are active and why, for ``ampx info``.

    Loads the extension if that has not happened yet (never compiles).

    Returns:
        A dict with ``backend`` (``"native"`` or ``"reference"``), ``import_error``
        (why the native kernels are not active, or None), ``extension_path``,
        ``cuda_kernels`` (whether the loaded extension has CUDA kernels),
        ``cpu_capability`` (the instruction set it was compiled for), ``disabled_by_env``,
        ``build_error`` (the compiler output of the last failed ``ampx build-ext`` for
        the current sources, or None), ``cache_dir``, ``torch_version`` and
        ``python_version``.
    """
    from . import _build

    state = _ensure_loaded()
    native = state.native
    return {
        "backend": "native" if native is not None else "reference",
        "import_error": state.error,
        "extension_path": state.path,
        "cuda_kernels": state.has_cuda,
        "cpu_capability": str(native.cpu_capability()) if native is not None else None,
        "disabled_by_env": _disabled(),
        "build_error": _build.last_build_error(),
        "cache_dir": str(_build.cache_dir()),
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
    }
