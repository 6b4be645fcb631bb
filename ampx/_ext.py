"""Kernel backend switch: the native extension when it can run, the reference otherwise.

Other ampx modules call only the five contract functions here (``unscale_``,
``unscale_into_``, ``l2norm``, ``copy_``, ``update_scale_``), the compensated (Kahan)
half-weight optimizer steps ``compensated_sgd_`` / ``compensated_adam_`` (specified by
:mod:`ampx._reference_compensated`), the foreach helper ``mul_``, :func:`describe`,
``BACKEND`` and ``IMPORT_ERROR``. This is the one place where tensors
are grouped by device and reduced to contiguous layouts before a kernel runs. Per call,
the native kernels run when the extension is loaded and has kernels for the tensors'
device (CPU always, CUDA when compiled with CUDA and built for that GPU: otherwise one
``RuntimeWarning``); anything else runs :mod:`ampx._reference`, with the same results.

Loading is lazy and never compiles: the first call (or the first read of
``BACKEND``/``IMPORT_ERROR``) tries ``ampx._C`` (built by ``AMPX_BUILD_EXT=1 pip install``)
and then the cache that ``ampx build-ext`` fills. ``AMPX_DISABLE_EXT=1`` forces the
reference. Nothing is printed; why the reference is in use is kept in ``IMPORT_ERROR``
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

__all__ = ["compensated_adam_", "compensated_sgd_", "copy_", "describe", "l2norm", "mul_",
           "unscale_", "unscale_into_", "update_scale_"]

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
        self.cuda_problems: dict[int, Optional[str]] = {}  # device index -> why not / None


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


def _cuda_usable(state: _State, device: torch.device) -> bool:
    """Whether the loaded CUDA kernels run on `device` (checked once, warns if not)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in state.cuda_problems:
        from ._build_cuda import check_device

        check_device(state.native, index, state.cuda_problems, _lock)
    return state.cuda_problems[index] is None


def _native_module() -> Optional[ModuleType]:
    """Return the loaded extension module, or None (for tests and benchmarks)."""
    return _ensure_loaded().native


def _reference_kernels() -> ModuleType:
    """`ampx._reference`, imported where it first runs: with the extension loaded a CPU
    process never needs it (every module loaded is memory the process keeps)."""
    from . import _reference

    return _reference


def _impl(device: torch.device) -> Any:
    state = _state if _state.loaded else _ensure_loaded()
    native = state.native
    if native is not None and (device.type == "cpu" or (
            device.type == "cuda" and state.has_cuda and _cuda_usable(state, device))):
        return native
    return _reference_kernels()


def __getattr__(name: str) -> Any:
    if name == "BACKEND":
        return "native" if _ensure_loaded().native is not None else "reference"
    if name == "IMPORT_ERROR":
        return _ensure_loaded().error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# The contract (see ampx/_reference.py for the full specification)
#
# The implementations take contiguous tensors (any shape) on one device. This boundary groups
# tensors by device (one call each, flags moved there and merged back) and reduces any layout
# a torch optimizer accepts to contiguous ones: a dense tensor (channels_last, transposed) is
# viewed in memory order, a src/dst pair with different or non-dense layouts is staged
# through contiguous copies (exact: results are bitwise those of contiguous tensors).
# ---------------------------------------------------------------------------


def _dense(t: torch.Tensor) -> bool:
    """True when `t` covers exactly `numel` consecutive elements (any dimension order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _flat(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A contiguous 1-D view of `t` in memory order, or None when `t` is not dense."""
    if t.is_contiguous():
        return t.view(-1)
    if _dense(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset())
    return None


class _Staged:
    """Contiguous stand-ins for one call's outputs; `finish` writes them back."""

    def __init__(self) -> None:
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def output(self, t: torch.Tensor, *, keep: bool, any_order: bool) -> torch.Tensor:
        flat = t if t.is_contiguous() else _flat(t) if any_order else None
        if flat is not None:
            return flat
        staged = t.contiguous().view(-1) if keep else torch.empty(
            t.numel(), dtype=t.dtype, device=t.device)
        self.back.append((t, staged))
        return staged

    def pair(self, s: torch.Tensor, d: torch.Tensor, *, keep: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) views whose elements correspond (same layout: in memory order)."""
        if s.shape == d.shape and s.stride() == d.stride():
            fs, fd = (s, d) if s.is_contiguous() else (_flat(s), _flat(d))
            if fs is not None and fd is not None:
                return fs, fd
        src = s.view(-1) if s.is_contiguous() else s.contiguous().view(-1)
        return src, self.output(d, keep=keep, any_order=False)

    def finish(self) -> None:
        for t, staged in self.back:
            t.copy_(staged.view(t.shape))


def _by_device(*lists: Tensors) -> list[tuple[torch.device, list[int]]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(lists[0]):
        groups.setdefault(t.device, []).append(i)
    return list(groups.items())


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2): a view, so in-place results land in it."""
    return t.to_local() if hasattr(t, "to_local") else t


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def _flags_for(device: torch.device, found_inf: torch.Tensor, per_tensor: Optional[torch.Tensor],
               idx: list[int], whole: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    found = found_inf if found_inf.device == device else torch.zeros(
        1, dtype=torch.float32, device=device)
    if per_tensor is None:
        return found, None
    if whole and per_tensor.device == device:
        return found, per_tensor
    return found, torch.zeros(len(idx), dtype=torch.float32, device=device)


def _merge_flags(found_inf: torch.Tensor, found: torch.Tensor,
                 per_tensor: Optional[torch.Tensor], part: Optional[torch.Tensor],
                 idx: list[int]) -> None:
    if found is not found_inf:
        torch.maximum(found_inf, found.to(found_inf.device), out=found_inf)
    if per_tensor is not None and part is not None and part is not per_tensor:
        index = torch.tensor(idx, device=per_tensor.device)
        flat = per_tensor.view(-1)
        flat.index_copy_(0, index, torch.maximum(flat.index_select(0, index),
                                                 part.to(per_tensor.device)))


def unscale_(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor] = None,
) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place; flag inf/NaN in ``found_inf``.

    Any devices and layouts (section comment); arguments and errors: the reference's.
    """
    if not grads:
        return
    grads = [_local(g) for g in grads]
    groups = _by_device(grads)
    for device, idx in groups:
        staged = _Staged()
        outs = [staged.output(grads[i], keep=True, any_order=True) for i in idx]
        found, part = _flags_for(device, found_inf, per_tensor, idx, len(groups) == 1)
        _impl(device).unscale_(outs, _on(inv_scale, device), found, part)
        staged.finish()
        _merge_flags(found_inf, found, per_tensor, part, idx)


def unscale_into_(
    src: Tensors,
    dst: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    per_tensor: Optional[torch.Tensor] = None,
    accumulate: bool = False,
) -> None:
    """Write (or add) ``src * inv_scale`` into ``dst`` in one pass; flag inf/NaN.

    Any devices and layouts (section comment); arguments and errors: the reference's.
    """
    if not src or len(src) != len(dst):
        device = src[0].device if src else torch.device("cpu")
        _impl(device).unscale_into_(list(src), list(dst), inv_scale, found_inf, per_tensor,
                                    accumulate)
        return
    src, dst = [_local(t) for t in src], [_local(t) for t in dst]
    groups = _by_device(src)
    for device, idx in groups:
        staged = _Staged()
        pairs = [staged.pair(src[i], dst[i], keep=accumulate) for i in idx]
        found, part = _flags_for(device, found_inf, per_tensor, idx, len(groups) == 1)
        _impl(device).unscale_into_([s for s, _ in pairs], [d for _, d in pairs],
                                    _on(inv_scale, device), found, part, accumulate)
        staged.finish()
        _merge_flags(found_inf, found, per_tensor, part, idx)


def l2norm(
    tensors: Tensors, per_tensor: bool = False
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Return the float32 L2 norm of all tensors (and, optionally, of each).

    Tensors may be on several devices (the total is on the first one's) and in any layout
    (DTensors contribute their local shard). See :func:`ampx._reference.l2norm` for the
    arguments, result and errors.
    """
    if not tensors:
        return _reference_kernels().l2norm(tensors, per_tensor)
    flat = [_local(t) for t in tensors]
    flat = [f if f is not None else t.contiguous().view(-1)
            for t, f in zip(flat, (_flat(t) for t in flat))]
    groups = _by_device(flat)
    if len(groups) == 1:  # no index tensors: nothing copied from the host (graph capture)
        total, each = _impl(flat[0].device).l2norm(flat, True)
        return (total, each) if per_tensor else total
    first = flat[0].device
    totals: list[torch.Tensor] = []
    norms = torch.zeros(len(flat), dtype=torch.float32, device=first)
    for device, idx in groups:
        total, each = _impl(device).l2norm([flat[i] for i in idx], True)
        totals.append(total.to(first))
        if per_tensor:
            norms[torch.tensor(idx, device=first)] = each.to(first)
    total = totals[0] if len(totals) == 1 else torch.linalg.vector_norm(
        torch.stack(totals).double()).float()
    return (total, norms) if per_tensor else total


def copy_(src: Tensors, dst: Tensors) -> None:
    """Copy ``src[i]`` into ``dst[i]`` for every ``i``, converting the dtype.

    Any devices and layouts (section comment); arguments and errors: the reference's.
    """
    if type(src) is list and type(dst) is list and src and len(src) == len(dst):
        plain = getattr(_impl(src[0].device), "copy_plain", None)
        if plain is not None and plain(src, dst):  # the usual lists (O2's step copy): one call
            return
    if not src or len(src) != len(dst):
        device = src[0].device if src else torch.device("cpu")
        _impl(device).copy_(list(src), list(dst))
        return
    src, dst = [_local(t) for t in src], [_local(t) for t in dst]
    for device, idx in _by_device(src):
        staged = _Staged()
        pairs = [staged.pair(src[i], dst[i], keep=False) for i in idx]
        _impl(device).copy_([s for s, _ in pairs], [d for _, d in pairs])
        staged.finish()


def mul_(tensors: Tensors, factor: Union[float, torch.Tensor]) -> None:
    """Multiply every tensor in place by `factor` (a number or a 1-element tensor).

    Not a contract kernel: torch's foreach multiply, grouped by device and dtype here.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        t = _local(t)
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in groups.items():
        f = factor if isinstance(factor, (int, float)) else _on(factor, device).reshape(())
        torch._foreach_mul_(group, f)


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
        scale, growth_tracker, hysteresis_tracker, found_inf, float(growth), float(backoff),
        int(interval), int(hysteresis), float(min_scale), float(max_scale))


# ---------------------------------------------------------------------------
# Compensated (Kahan) half-weight optimizer steps: numerics, arguments and errors are
# ampx/_reference_compensated.py's. Contiguous tensors only (the optimizer's own state);
# several devices: one call per device, the whole lists checked first (global indices).
# ---------------------------------------------------------------------------


def _compensated(name: str, lists: tuple[Tensors, ...], state: tuple[str, ...],
                 kwargs: dict[str, Any]) -> None:
    lists = tuple([_local(t) for t in items] for items in lists)
    params = lists[0]
    groups = _by_device(params) if params else [(torch.device("cpu"), [])]
    if len(groups) > 1:
        from ._reference_compensated import _check

        _check(name, lists[0], lists[1], lists[2], dict(zip(state, lists[3:])))
    for device, idx in groups:
        part = lists if len(groups) == 1 else tuple(
            [items[i] for i in idx] if len(items) == len(params) else items for items in lists)
        getattr(_impl(device), name)(*part, **kwargs)


def compensated_sgd_(params: Tensors, comps: Tensors, grads: Tensors, momentum_bufs: Tensors,
                     *, lr: float, weight_decay: float, momentum: float, dampening: float,
                     nesterov: bool, maximize: bool, first: bool) -> None:
    """One SGD step on compensated half weights, in place: one native pass per device
    (:func:`ampx._reference_compensated.compensated_sgd_`: numerics, arguments, errors)."""
    _compensated("compensated_sgd_", (params, comps, grads, momentum_bufs),
                 ("momentum_bufs",) if momentum else (), dict(
                     lr=lr, weight_decay=weight_decay, momentum=momentum, dampening=dampening,
                     nesterov=nesterov, maximize=maximize, first=first))


def compensated_adam_(params: Tensors, comps: Tensors, grads: Tensors, exp_avgs: Tensors,
                      exp_avg_sqs: Tensors, *, lr: float, beta1: float, beta2: float,
                      eps: float, weight_decay: float, decoupled: bool, maximize: bool,
                      step_size: float, bias2_sqrt: float) -> None:
    """One Adam (``decoupled``: AdamW) step on compensated half weights, in place: one
    native pass per device (:func:`ampx._reference_compensated.compensated_adam_`)."""
    _compensated("compensated_adam_", (params, comps, grads, exp_avgs, exp_avg_sqs),
                 ("exp_avgs", "exp_avg_sqs"), dict(
                     lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     decoupled=decoupled, maximize=maximize, step_size=step_size,
                     bias2_sqrt=bias2_sqrt))


# ---------------------------------------------------------------------------
# One call per pass (native only): the clean unscale pass and the scaler's next state.
# Each returns None where the native kernels do not serve the device (or, for the pass,
# where the pass is not clean); the caller then takes its general path, whose results are
# bitwise these (same rules, same kernels).
# ---------------------------------------------------------------------------


def unscale_pass(sources: list[torch.Tensor], targets: list[torch.Tensor],
                 inv_scale: torch.Tensor, unit: bool, per_tensor: bool,
                 found_inf: Optional[torch.Tensor] = None, written: Optional[list] = None
                 ) -> Optional[tuple]:
    """The clean unscale pass of `ampx.scaling.unscale` in one native call, or None.

    Clean: every gradient in `sources[i].grad` is a contiguous plain tensor on `inv_scale`'s
    device and every master target has no gradient yet. Without `written` nothing is
    assigned to `.grad`; with it (a list) the pass commits its gradients itself, appending
    the masters it gave a gradient to `written`.

    Returns:
        None (nothing was written), or (found_inf, flags or None, assign, results, clear,
        flag_params), as `ampx/csrc/grad_pass.cpp` describes.
    """
    native = (_state if _state.loaded else _ensure_loaded()).native
    if native is None or _impl(inv_scale.device) is not native:  # the reference serves it
        return None
    return native.unscale_pass(sources, targets, inv_scale, unit, per_tensor, found_inf,
                               written)


def assign(triples: tuple[Any, ...]) -> None:
    """`setattr` for each (object, name, value) of a flat tuple, in order: all or none.

    The commit of a transition: natively one call in which no Python bytecode runs between two
    assignments, so an interrupt cannot cut it half-way; without the extension the same
    assignments in Python, put back if one raises (any exception, KeyboardInterrupt included).
    """
    native = _state.native if _state.loaded else _ensure_loaded().native
    if native is not None:
        native.assign(triples)
        return
    done: list[tuple[Any, str, Any]] = []
    try:
        for i in range(0, len(triples), 3):
            obj, name, value = triples[i:i + 3]
            done.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
    except BaseException:
        for obj, name, old in reversed(done):
            setattr(obj, name, old)
        raise


def drop_grads(params: list[torch.Tensor]) -> None:
    """`p.grad = None` for every parameter of `params` (natively one call: no interrupt
    lands half-way)."""
    native = _state.native if _state.loaded else _ensure_loaded().native
    if native is None:
        for p in params:
            p.grad = None
        return
    native.drop_grads(params)


def with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of `params` that have a gradient, in order."""
    native = _state.native if _state.loaded else _ensure_loaded().native
    if native is None:
        return [p for p in params if p.grad is not None]
    return native.with_grads(params)


def next_scale_state(state: tuple[torch.Tensor, ...], found_inf: torch.Tensor,
                     rule: tuple[float, float, int, int, float, float],
                     spare: Optional[tuple[torch.Tensor, ...]] = None
                     ) -> Optional[tuple[torch.Tensor, ...]]:
    """`LossScaler.next_state` in one native call: (scale, growth tracker, hysteresis
    tracker, overflows since report, scale before overflow, 1/scale, the scale as a 0-d
    view); None on the reference.

    Fresh tensors, or (CPU) `spare` itself written in place: a set of the same seven that
    nothing but the `spare` tuple holds (`grad_pass.cpp` spare_set checks the reference
    counts). `rule` is (growth, backoff, interval, hysteresis, floor, ceiling).
    """
    native = (_state if _state.loaded else _ensure_loaded()).native
    if native is None or _impl(found_inf.device) is not native:  # the reference serves it
        return None
    return native.next_scale_state(state, found_inf, rule, spare)


def describe() -> dict[str, Any]:
    """Report which kernels are active and why, for ``ampx info``.

    Loads the extension if that has not happened yet (never compiles).

    Returns:
        A dict with ``backend`` (``"native"`` or ``"reference"``), ``import_error``
        (why the native kernels are not active, or None), ``extension_path``,
        ``cuda_kernels`` (whether the loaded extension has CUDA kernels), ``cuda_archs``
        (which, as ``80_90p``), ``cuda_unusable`` (devices they cannot run on, and why),
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
        "cuda_archs": (str(native.cuda_archs()) or None)
        if native is not None and hasattr(native, "cuda_archs") else None,
        "cuda_unusable": {f"cuda:{i}": p for i, p in state.cuda_problems.items()
                          if p is not None},
        "cpu_capability": str(native.cpu_capability()) if native is not None else None,
        "disabled_by_env": _disabled(),
        "build_error": _build.last_build_error(),
        "cache_dir": str(_build.cache_dir()),
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
    }
