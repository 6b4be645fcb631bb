"""O1 function patching: cast policies, an exactly-undoable patch set, user registrations.

The torch namespace is the one process-global thing ampx touches. Every replacement goes
through a `PatchSet`, which remembers whether the attribute was the owner's own or inherited,
so `restore()` puts back the very same objects (or deletes what was inherited). At most one
set of O1 patches is active per process (`activate` replaces the previous one cleanly).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import wrapt

from .casting import WeightCastCache
from .lists import ListEntry, Policy, owner_object, resolve

__all__ = [
    "CastError",
    "CastConfig",
    "PatchSet",
    "activate",
    "active",
    "casts_enabled",
    "deactivate",
    "disable_casts",
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]

logger = logging.getLogger("ampx")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_HALF_TYPES = frozenset({torch.float16, torch.bfloat16})
_MISSING = object()

# Per thread and per asyncio task: casts are disabled only where disable_casts() was entered.
_CASTS_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ampx_casts_disabled", default=False
)

F = TypeVar("F", bound=Callable[..., Any])


class CastError(NotImplementedError):
    """A function that cannot run safely on half-precision inputs was called with them.

    A NotImplementedError, as in apex, because legacy code catches that type.
    """


_BANNED_MESSAGE = (
    "ampx: {name} was called with half-precision inputs. It is unsafe in half precision "
    "(its input is a probability computed by a sigmoid, which rounds to exactly 0 or 1), so "
    "O1 refuses it.\nTo fix it, do one of these:\n"
    "  1. compute the loss from logits with F.binary_cross_entropy_with_logits or "
    "nn.BCEWithLogitsLoss (fast and safe);\n"
    "  2. run the sigmoid in float32: ampx.register_float_function(torch, 'sigmoid');\n"
    "  3. pass allow_banned=True to ampx.initialize to run {name} in float32."
)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run a block with O1's casts off (in this thread / task only).

    Nestable and exception-safe; a no-op at O0, O2 and O3 (there are no casts to disable).

    Example::

        with ampx.disable_casts():
            out = my_custom_kernel(x.float())
    """
    token = _CASTS_DISABLED.set(True)
    try:
        yield
    finally:
        _CASTS_DISABLED.reset(token)


def casts_enabled() -> bool:
    """True when O1 patches are active and not disabled in the current context."""
    return _ACTIVE is not None and not _CASTS_DISABLED.get()


class PatchSet:
    """Attribute replacements that can be undone exactly.

    Each `apply` records whether the owner held the attribute itself (then the very same
    object is put back) or inherited it (then the override is deleted). Applying the same
    attribute twice keeps the first original, so wrappers never stack.
    """

    def __init__(self) -> None:
        self._records: dict[tuple[int, str], tuple[Any, str, Any]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: tuple[Any, str]) -> bool:
        return (id(key[0]), key[1]) in self._records

    def original(self, owner: Any, name: str) -> Any:
        """The attribute as it was before this set first replaced it (resolved via getattr)."""
        record = self._records.get((id(owner), name))
        if record is None:
            return getattr(owner, name)
        own = record[2]
        return getattr(owner, name) if own is _MISSING else own

    def apply(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace `owner.name` with `replacement`, remembering what to put back."""
        key = (id(owner), name)
        if key not in self._records:
            own = vars(owner).get(name, _MISSING)
            self._records[key] = (owner, name, own)
        setattr(owner, name, replacement)

    def restore(self) -> None:
        """Put every replaced attribute back, newest first."""
        errors = []
        for owner, name, own in reversed(list(self._records.values())):
            try:
                if own is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, own)
            except Exception as exc:  # keep restoring the rest, then report
                errors.append(f"{getattr(owner, '__name__', owner)}.{name}: {exc}")
        self._records.clear()
        if errors:
            raise RuntimeError("ampx.restore: could not restore " + "; ".join(errors))

    def __enter__(self) -> PatchSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


@dataclass(frozen=True)
class CastConfig:
    """What O1's casts do: target dtype, which devices, banned handling, cast logging."""

    dtype: torch.dtype
    device_types: frozenset[str]
    allow_banned: bool = False
    verbose: bool = False


_Converter = Callable[[tuple, dict], "tuple[tuple, dict] | None"]


class Caster:
    """Builds the argument converters of each policy for one `CastConfig`.

    A converter takes the full positional arguments (self first, for methods) and kwargs, and
    returns converted ones, or None when nothing needs casting (the common fast path).
    """

    def __init__(self, config: CastConfig) -> None:
        self.config = config
        self.cache = WeightCastCache()
        self._eligible = _device_predicate(config.device_types)
        half = config.dtype
        self._lower_from = frozenset({torch.float32} | (_HALF_TYPES - {half}))

    # -- element casts -------------------------------------------------------------------
    def _to_half(self, value: Any, name: str) -> Any:
        if isinstance(value, _Tensor):
            if value.dtype in self._lower_from and self._eligible(value):
                if self.config.verbose:
                    logger.info("%s->%s (%s)", value.dtype, self.config.dtype, name)
                if value.is_leaf and (value.requires_grad or isinstance(value, _Parameter)):
                    return self.cache.cast(value, self.config.dtype)
                return value.to(self.config.dtype)
            return value
        if type(value) in (list, tuple):
            cast = [self._to_half(v, name) for v in value]
            return value if all(a is b for a, b in zip(cast, value)) else type(value)(cast)
        return value

    def _to_dtype(self, value: Any, dtype: torch.dtype, sources: frozenset, name: str) -> Any:
        if isinstance(value, _Tensor):
            if value.dtype in sources and value.dtype != dtype and self._eligible(value):
                if self.config.verbose:
                    logger.info("%s->%s (%s)", value.dtype, dtype, name)
                return value.to(dtype)
            return value
        if type(value) in (list, tuple):
            cast = [self._to_dtype(v, dtype, sources, name) for v in value]
            return value if all(a is b for a, b in zip(cast, value)) else type(value)(cast)
        return value

    # -- converters ------------------------------------------------------------------------
    def converter(self, policy: Policy, name: str) -> _Converter:
        """The argument converter implementing `policy` for the function called `name`."""
        if policy in (Policy.LOWER, Policy.RNN):
            return self._map(lambda v: self._to_half(v, name))
        if policy is Policy.FP32:
            return self._map(lambda v: self._to_dtype(v, torch.float32, _HALF_TYPES, name))
        if policy is Policy.PROMOTE:
            return self._promote(name, sequence=False)
        if policy is Policy.SEQUENCE_PROMOTE:
            return self._promote(name, sequence=True)
        if policy is Policy.INPLACE_MATCH_SELF:
            return self._inplace_match_self(name)
        if policy is Policy.INPLACE_FP32_ERROR:
            return self._inplace_fp32(name)
        if policy is Policy.BANNED:
            return self._banned(name)
        raise ValueError(f"ampx: unknown cast policy {policy!r}")

    @staticmethod
    def _map(cast: Callable[[Any], Any]) -> _Converter:
        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            new_args = tuple(cast(a) for a in args)
            changed = any(a is not b for a, b in zip(new_args, args))
            if kwargs:
                new_kwargs = {k: cast(v) for k, v in kwargs.items()}
                if any(new_kwargs[k] is not v for k, v in kwargs.items()):
                    return new_args, new_kwargs
            return (new_args, kwargs) if changed else None

        return convert

    def _promote(self, name: str, *, sequence: bool) -> _Converter:
        def floating_dtypes(values: Any, found: set) -> None:
            for v in values:
                if isinstance(v, _Tensor):
                    if v.is_floating_point():
                        found.add(v.dtype)
                elif type(v) in (list, tuple):
                    floating_dtypes(v, found)

        sources = frozenset({torch.float16, torch.bfloat16, torch.float32})

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            scope = args[0] if sequence and args else args
            found: set = set()
            floating_dtypes(scope, found)
            if not sequence and kwargs:
                floating_dtypes(kwargs.values(), found)
            if len(found) < 2:
                return None
            widest = torch.float64 if torch.float64 in found else torch.float32
            if sequence:
                seq = [self._to_dtype(v, widest, sources, name) for v in args[0]]
                return (seq, *args[1:]), kwargs
            new_args = tuple(self._to_dtype(v, widest, sources, name) for a in [args] for v in a)
            new_kwargs = {k: self._to_dtype(v, widest, sources, name) for k, v in kwargs.items()}
            return new_args, new_kwargs

        return convert

    def _inplace_match_self(self, name: str) -> _Converter:
        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            target = args[0] if args else None
            if not isinstance(target, _Tensor) or not target.is_floating_point():
                return None
            dtype = target.dtype
            sources = frozenset({torch.float16, torch.bfloat16, torch.float32} - {dtype})
            rest = tuple(self._to_dtype(v, dtype, sources, name) for v in args[1:])
            new_kwargs = {k: self._to_dtype(v, dtype, sources, name) for k, v in kwargs.items()}
            return (target, *rest), new_kwargs

        return convert

    def _inplace_fp32(self, name: str) -> _Converter:
        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            target = args[0] if args else None
            if isinstance(target, _Tensor) and target.dtype in _HALF_TYPES:
                raise CastError(
                    f"ampx: cannot call in-place {name} on a {target.dtype} tensor under O1: "
                    f"{name.rstrip('_')} runs in float32, and the result cannot be stored back "
                    f"in half precision. Use the out-of-place form (x = x.{name.rstrip('_')}()) "
                    "or call it inside ampx.disable_casts()."
                )
            rest = tuple(self._to_dtype(v, torch.float32, _HALF_TYPES, name) for v in args[1:])
            return (target, *rest), kwargs

        return convert

    def _banned(self, name: str) -> _Converter:
        to_float = self._map(lambda v: self._to_dtype(v, torch.float32, _HALF_TYPES, name))

        def has_half(values: Any) -> bool:
            for v in values:
                if isinstance(v, _Tensor) and v.dtype in _HALF_TYPES:
                    return True
                if type(v) in (list, tuple) and has_half(v):
                    return True
            return False

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not (has_half(args) or has_half(kwargs.values())):
                return None
            if not self.config.allow_banned:
                raise CastError(_BANNED_MESSAGE.format(name=name))
            return to_float(args, kwargs)

        return convert

    # -- wrappers ----------------------------------------------------------------------------
    def function_wrapper(self, original: Any, policy: Policy, name: str,
                         *, method: bool) -> Callable[..., Any]:
        """A wrapt wrapper `(wrapped, instance, args, kwargs)` applying `policy`.

        For methods, wrapt passes `self` as `instance` (also when called through the class),
        and the unbound `original` is called with the converted self.
        """
        convert = self.converter(policy, name)
        disabled = _CASTS_DISABLED.get

        if method:
            def cast_method(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
                if disabled():
                    return wrapped(*args, **kwargs)
                full = (instance, *args)
                converted = convert(full, kwargs)
                if converted is None:
                    return wrapped(*args, **kwargs)
                return original(*converted[0], **converted[1])

            return cast_method

        def cast_function(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            if disabled():
                return wrapped(*args, **kwargs)
            converted = convert(args, kwargs)
            if converted is None:
                return wrapped(*args, **kwargs)
            return wrapped(*converted[0], **converted[1])

        return cast_function


def _device_predicate(device_types: frozenset[str]) -> Callable[[torch.Tensor], bool]:
    # The common single-device cases use the cheap is_cpu/is_cuda properties.
    if device_types == frozenset({"cpu"}):
        return lambda t: t.is_cpu
    if device_types == frozenset({"cuda"}):
        return lambda t: t.is_cuda
    return lambda t: t.device.type in device_types


class O1Patches:
    """One installation of the O1 patches: the lists plus the user registrations."""

    def __init__(self, config: CastConfig) -> None:
        self.config = config
        self.caster = Caster(config)
        self.patches = PatchSet()

    @property
    def cache(self) -> WeightCastCache:
        """The weight-cast cache of this installation."""
        return self.caster.cache

    def _patch(self, owner: Any, name: str, policy: Policy, label: str) -> None:
        original = self.patches.original(owner, name)
        method = isinstance(owner, type)
        wrapper = self.caster.function_wrapper(original, policy, label, method=method)
        self.patches.apply(owner, name, wrapt.FunctionWrapper(original, wrapper))

    def install(self, entries: list[ListEntry]) -> None:
        """Apply every list entry and user registration; all or nothing."""
        try:
            for entry in entries:
                self._patch(owner_object(entry.owner), entry.name, entry.policy,
                            f"{entry.owner}.{entry.name}")
            for owner, name, policy in _USER_REGISTRY.values():
                self._patch(owner, name, policy, f"{_owner_label(owner)}.{name}")
        except BaseException:
            self.patches.restore()
            raise

    def register(self, owner: Any, name: str, policy: Policy) -> None:
        """Patch one more function now (a registration made after initialize)."""
        self._patch(owner, name, policy, f"{_owner_label(owner)}.{name}")

    def uninstall(self) -> None:
        """Restore every patched attribute and drop the cache."""
        self.caster.cache.clear()
        self.patches.restore()


_ACTIVE: O1Patches | None = None
# (id(owner), name) -> (owner, name, policy); kept across initialize/restore cycles.
_USER_REGISTRY: dict[tuple[int, str], tuple[Any, str, Policy]] = {}


def active() -> O1Patches | None:
    """The installed O1 patches, or None."""
    return _ACTIVE


def activate(config: CastConfig) -> O1Patches:
    """Install the O1 patches for `config`, replacing any previous installation cleanly."""
    global _ACTIVE
    deactivate()
    patches = O1Patches(config)
    patches.install(resolve())
    _ACTIVE = patches
    logger.debug("ampx: installed %d O1 patches (%s)", len(patches.patches), config.dtype)
    return patches


def deactivate() -> None:
    """Remove the O1 patches, if any, restoring torch's original objects."""
    global _ACTIVE
    if _ACTIVE is not None:
        patches, _ACTIVE = _ACTIVE, None
        patches.uninstall()


def clear_cache() -> None:
    """Forget the cast weights (called when an iteration ends)."""
    if _ACTIVE is not None:
        _ACTIVE.cache.clear()


def _owner_label(owner: Any) -> str:
    return getattr(owner, "__name__", type(owner).__name__)


def _register(module: Any, name: str, policy: Policy) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    _USER_REGISTRY[(id(module), name)] = (module, name, policy)
    if _ACTIVE is not None:
        _ACTIVE.register(module, name, policy)


def register_half_function(module: Any, name: str) -> None:
    """Run `module.name` in the session's half dtype under O1.

    Works before or after `initialize` (apex required before), and survives re-initialize.

    Args:
        module: The object holding the function (a module or a class).
        name: The attribute name.

    Raises:
        ValueError: If `module` has no attribute `name`.
    """
    _register(module, name, Policy.LOWER)


def register_float_function(module: Any, name: str) -> None:
    """Run `module.name` in float32 under O1 (see `register_half_function`)."""
    _register(module, name, Policy.FP32)


def register_promote_function(module: Any, name: str) -> None:
    """Cast mixed inputs of `module.name` to the widest type under O1."""
    _register(module, name, Policy.PROMOTE)


def _decorator(policy: Policy) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        label = getattr(fn, "__qualname__", repr(fn))

        def apply_policy(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            patches = _ACTIVE
            if patches is None or _CASTS_DISABLED.get():
                return wrapped(*args, **kwargs)
            converted = patches.caster.converter(policy, label)(args, kwargs)
            if converted is None:
                return wrapped(*args, **kwargs)
            return wrapped(*converted[0], **converted[1])

        return wrapt.FunctionWrapper(fn, apply_policy)  # type: ignore[return-value]

    return decorate


half_function = _decorator(Policy.LOWER)
half_function.__doc__ = "Decorator: run the function in half precision while O1 is active."
float_function = _decorator(Policy.FP32)
float_function.__doc__ = "Decorator: run the function in float32 while O1 is active."
promote_function = _decorator(Policy.PROMOTE)
promote_function.__doc__ = "Decorator: promote mixed inputs to the widest type while O1 is active."
