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
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import wrapt

from .casting import WeightCastCache, cast_method
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
_TensorCast = Callable[[torch.Tensor], torch.Tensor]
_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_PROMOTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32})


def _cast_tree(value: Any, cast: _TensorCast) -> Any:
    """Apply a tensor cast inside lists, tuples, namedtuples and dicts; `value` if unchanged."""
    if isinstance(value, _Tensor):
        return cast(value)
    cls = type(value)
    if cls is list or cls is tuple or (isinstance(value, tuple) and hasattr(cls, "_fields")):
        items = [_cast_tree(v, cast) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return cls(*items) if cls is not list and cls is not tuple else cls(items)
    if cls is dict:
        mapped = {k: _cast_tree(v, cast) for k, v in value.items()}
        return value if all(mapped[k] is v for k, v in value.items()) else mapped
    return value


def _is_container(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict))


def _floating_dtypes(values: Any, eligible: Callable[[torch.Tensor], bool], found: set) -> None:
    for v in values:
        if isinstance(v, _Tensor):
            if v.dtype in _FLOATING and eligible(v):
                found.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            _floating_dtypes(v, eligible, found)
        elif type(v) is dict:
            _floating_dtypes(v.values(), eligible, found)


def _has_half(values: Any, eligible: Callable[[torch.Tensor], bool]) -> bool:
    for v in values:
        if isinstance(v, _Tensor):
            if v.dtype in _HALF_TYPES and eligible(v):
                return True
        elif isinstance(v, (list, tuple)):
            if _has_half(v, eligible):
                return True
        elif type(v) is dict and _has_half(v.values(), eligible):
            return True
    return False


class Caster:
    """Builds the argument converters and wrappers of each policy for one `CastConfig`.

    A converter takes the full positional arguments (self first, for methods) and kwargs, and
    returns converted ones, or None when nothing needs casting (the common fast path: no
    tuple is rebuilt). Tensor casts are specialised closures built once per session: the
    half cast goes through the weight cache for leaf tensors that require grad and for
    parameters, and float64 tensors are never cast.
    """

    def __init__(self, config: CastConfig) -> None:
        self.config = config
        self.cache = WeightCastCache()
        self._eligible = _device_predicate(config.device_types)
        self._converters: dict[tuple[Policy, str], _Converter] = {}
        self._half_casts: dict[str, _TensorCast] = {}
        self._dtype_casts: dict[tuple, _TensorCast] = {}
        self._wrappers: dict[Policy, Callable[..., Any]] = {}

    # -- tensor casts ------------------------------------------------------------------------
    def half_cast(self, name: str = "") -> _TensorCast:
        """`tensor -> tensor in the session's half dtype` (cached for weights), for `name`."""
        cast = self._half_casts.get(name if self.config.verbose else "")
        if cast is not None:
            return cast
        half = self.config.dtype
        lower_from = frozenset({torch.float32} | (_HALF_TYPES - {half}))
        eligible = self._eligible
        cached = self.cache.bind(half)
        plain = cast_method(half)
        verbose = self.config.verbose
        parameter = _Parameter

        def to_half(t: torch.Tensor) -> torch.Tensor:
            if t.dtype not in lower_from or not eligible(t):
                return t
            if verbose:
                logger.info("%s->%s (%s)", t.dtype, half, name)
            if t.requires_grad:
                return cached(t) if t.is_leaf else plain(t)
            return cached(t) if isinstance(t, parameter) else plain(t)

        self._half_casts[name if verbose else ""] = to_half
        return to_half

    def dtype_cast(self, dtype: torch.dtype, sources: frozenset, name: str = "") -> _TensorCast:
        """`tensor -> tensor.to(dtype)` for eligible tensors whose dtype is in `sources`."""
        key = (dtype, sources, name if self.config.verbose else "")
        cached = self._dtype_casts.get(key)
        if cached is None:
            cached = self._dtype_casts[key] = self._make_dtype_cast(dtype, sources, name)
        return cached

    def _make_dtype_cast(self, dtype: torch.dtype, sources: frozenset, name: str) -> _TensorCast:
        sources = sources - {dtype}
        eligible = self._eligible
        convert = cast_method(dtype)
        verbose = self.config.verbose

        def to_dtype(t: torch.Tensor) -> torch.Tensor:
            if t.dtype not in sources or not eligible(t):
                return t
            if verbose:
                logger.info("%s->%s (%s)", t.dtype, dtype, name)
            return convert(t)

        return to_dtype

    # -- converters ------------------------------------------------------------------------
    def converter(self, policy: Policy, name: str) -> _Converter:
        """The argument converter implementing `policy` for the function called `name`.

        Converters are built once per (policy, name) and reused.
        """
        # The name only shows in error messages and cast logs: share the rest.
        named = self.config.verbose or policy in (Policy.INPLACE_FP32_ERROR, Policy.BANNED)
        key = (policy, name if named else "")
        convert = self._converters.get(key)
        if convert is None:
            convert = self._build(policy, name)
            self._converters[key] = convert
        return convert

    def _build(self, policy: Policy, name: str) -> _Converter:
        if policy in (Policy.LOWER, Policy.RNN):
            return _map(self.half_cast(name))
        if policy is Policy.FP32:
            return _map(self.dtype_cast(torch.float32, _HALF_TYPES, name))
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
        if policy is Policy.RNN_CHECK:
            return self._rnn_check()
        raise ValueError(f"ampx: unknown cast policy {policy!r}")

    def _promote(self, name: str, *, sequence: bool) -> _Converter:
        eligible = self._eligible
        casts = {
            dtype: self.dtype_cast(dtype, _PROMOTABLE, name)
            for dtype in (torch.float32, torch.float64)
        }

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if sequence:
                if not args or not isinstance(args[0], (list, tuple)):
                    return None
                scope: Any = args[0]
            else:
                # Fast path: the common all-same-dtype call touches no set.
                first = None
                for v in args:
                    if isinstance(v, _Tensor):
                        dtype = v.dtype
                        if dtype in _FLOATING:
                            if first is None:
                                first = dtype
                            elif dtype is not first:
                                break
                    elif _is_container(v):
                        break
                else:
                    if not kwargs:
                        return None
                scope = args
            found: set = set()
            _floating_dtypes(scope, eligible, found)
            if not sequence and kwargs:
                _floating_dtypes(kwargs.values(), eligible, found)
            if len(found) < 2:
                return None
            cast = casts[torch.float64 if torch.float64 in found else torch.float32]
            if sequence:
                seq = _cast_tree(args[0], cast)
                return (seq, *args[1:]), kwargs
            new_args = tuple(_cast_tree(v, cast) for v in args)
            new_kwargs = {k: _cast_tree(v, cast) for k, v in kwargs.items()} if kwargs else kwargs
            return new_args, new_kwargs

        return convert

    def _inplace_match_self(self, name: str) -> _Converter:
        eligible = self._eligible
        casts = {
            dtype: self.dtype_cast(dtype, _PROMOTABLE, name)
            for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        }

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            target = args[0] if args else None
            if not isinstance(target, _Tensor):
                return None
            dtype = target.dtype
            cast = casts.get(dtype)
            if cast is None or not eligible(target):
                return None
            for v in args[1:]:  # fast path: nothing of another floating type
                if isinstance(v, _Tensor):
                    if v.dtype is not dtype and v.dtype in _PROMOTABLE:
                        break
                elif _is_container(v):
                    break
            else:
                if not kwargs:
                    return None
            return _map(cast)(args, kwargs)

        return convert

    def _inplace_fp32(self, name: str) -> _Converter:
        eligible = self._eligible
        to_float = _map(self.dtype_cast(torch.float32, _HALF_TYPES, name))
        plain = name.rsplit(".", 1)[-1].strip("_").replace("ipow", "pow").rstrip("_")

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            target = args[0] if args else None
            if isinstance(target, _Tensor) and target.dtype in _HALF_TYPES and eligible(target):
                raise CastError(
                    f"ampx: cannot call in-place {name} on a {target.dtype} tensor under O1: "
                    f"{plain} runs in float32 under O1, and the float32 result cannot be stored "
                    f"back in place. Use the out-of-place {plain} (x = x.{plain}(...)), or call "
                    "it inside ampx.disable_casts()."
                )
            return to_float(args, kwargs)

        return convert

    def _banned(self, name: str) -> _Converter:
        eligible = self._eligible
        to_float = _map(self.dtype_cast(torch.float32, _HALF_TYPES, name))
        allow = self.config.allow_banned

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not (_has_half(args, eligible) or (kwargs and _has_half(kwargs.values(), eligible))):
                return None
            if not allow:
                raise CastError(_BANNED_MESSAGE.format(name=name))
            return to_float(args, kwargs)

        return convert

    def _rnn_check(self) -> _Converter:
        # RNNBase.check_input(self, input, batch_sizes) rejects an input whose dtype differs
        # from the fp32 weights unless torch.autocast is on; under O1 the _VF entry points
        # cast both, so the check sees a stand-in of the weights' dtype (no data).
        eligible = self._eligible
        convertible = _PROMOTABLE

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if len(args) < 2:
                return None
            module, data = args[0], args[1]
            weights = getattr(module, "_flat_weights", None)
            if not isinstance(data, _Tensor) or not weights:
                return None
            wdtype = weights[0].dtype
            if (data.dtype is wdtype or data.dtype not in convertible
                    or wdtype not in convertible or not eligible(data)):
                return None
            stand_in = torch.empty(data.shape, dtype=wdtype, device="meta")
            return (module, stand_in, *args[2:]), kwargs

        return convert

    # -- wrappers ----------------------------------------------------------------------------
    def function_wrapper(self, original: Any, policy: Policy, name: str,
                         *, method: bool) -> Callable[..., Any]:
        """A wrapt wrapper `(wrapped, instance, args, kwargs)` applying `policy`.

        For methods, wrapt passes `self` as `instance` (also when called through the class),
        and the unbound `original` is called with the converted self.
        """
        if not method and not self.config.verbose and policy not in (
                Policy.INPLACE_FP32_ERROR, Policy.BANNED):
            # Function wrappers don't depend on the function: share one per policy (fewer
            # objects per initialize, so less garbage-collector work).
            shared = self._wrappers.get(policy)
            if shared is None:
                shared = self._wrappers[policy] = self._function_wrapper(
                    original, policy, name, method=False)
            return shared
        return self._function_wrapper(original, policy, name, method=method)

    def _function_wrapper(self, original: Any, policy: Policy, name: str,
                          *, method: bool) -> Callable[..., Any]:
        disabled = _CASTS_DISABLED.get
        if policy in (Policy.LOWER, Policy.RNN, Policy.FP32):
            # The hot path (F.linear, matmul, softmax...): one specialised closure, no tuple
            # rebuilt when nothing changes.
            if policy is Policy.FP32:
                cast = self.dtype_cast(torch.float32, _HALF_TYPES, name)
            else:
                cast = self.half_cast(name)
            if method:
                return _map_method_wrapper(original, cast, disabled)
            return _map_function_wrapper(cast, disabled)

        convert = self.converter(policy, name)
        if method:
            def cast_method(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
                if disabled():
                    return wrapped(*args, **kwargs)
                converted = convert((instance, *args), kwargs)
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


def _map(cast: _TensorCast) -> _Converter:
    """A converter applying `cast` to every floating tensor (nested ones too)."""

    def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        new: list | None = None
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                c = cast(a)
            elif _is_container(a):
                c = _cast_tree(a, cast)
            else:
                continue
            if c is not a:
                if new is None:
                    new = list(args)
                new[i] = c
        if kwargs:
            new_kwargs = None
            for k, v in kwargs.items():
                c = _cast_tree(v, cast)
                if c is not v:
                    if new_kwargs is None:
                        new_kwargs = dict(kwargs)
                    new_kwargs[k] = c
            if new_kwargs is not None:
                return (args if new is None else tuple(new)), new_kwargs
        return None if new is None else (tuple(new), kwargs)

    return convert


def _map_function_wrapper(cast: _TensorCast, disabled: Callable[[], bool]) -> Callable[..., Any]:
    convert = _map(cast)

    def cast_function(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if disabled():
            return wrapped(*args, **kwargs)
        if kwargs:
            converted = convert(args, kwargs)
            if converted is None:
                return wrapped(*args, **kwargs)
            return wrapped(*converted[0], **converted[1])
        # Inlined _map for the common all-positional call (F.linear(x, w, b)).
        new: list | None = None
        i = 0
        for a in args:
            if isinstance(a, _Tensor):
                c = cast(a)
            elif isinstance(a, (list, tuple, dict)):
                c = _cast_tree(a, cast)
            else:
                i += 1
                continue
            if c is not a:
                if new is None:
                    new = list(args)
                new[i] = c
            i += 1
        return wrapped(*args) if new is None else wrapped(*new)

    return cast_function


def _map_method_wrapper(original: Any, cast: _TensorCast,
                        disabled: Callable[[], bool]) -> Callable[..., Any]:
    convert = _map(cast)

    def cast_method(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if disabled():
            return wrapped(*args, **kwargs)
        this = cast(instance) if isinstance(instance, _Tensor) else instance
        converted = convert(args, kwargs) if (args or kwargs) else None
        if converted is None:
            if this is instance:
                return wrapped(*args, **kwargs)
            return original(this, *args, **kwargs)
        return original(this, *converted[0], **converted[1])

    return cast_method


def _device_predicate(device_types: frozenset[str]) -> Callable[[torch.Tensor], bool]:
    # The common single-device cases read the cheap is_cpu/is_cuda properties through a
    # C-level attrgetter (no Python frame per tensor).
    if device_types == frozenset({"cpu"}):
        return operator.attrgetter("is_cpu")
    if device_types == frozenset({"cuda"}):
        return operator.attrgetter("is_cuda")
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
        static = method and isinstance(_class_attribute(owner, name), staticmethod)
        wrapper = self.caster.function_wrapper(original, policy, label,
                                               method=method and not static)
        replacement: Any = wrapt.FunctionWrapper(original, wrapper)
        if static:
            replacement = staticmethod(replacement)
        self.patches.apply(owner, name, replacement)

    def install(self, entries: list[ListEntry]) -> None:
        """Apply every list entry, then every user registration; all or nothing.

        A registration of a name that a list already patched replaces that patch (it
        wraps the original, never the list's wrapper).
        """
        try:
            for entry in entries:
                self._patch(owner_object(entry.owner), entry.name, entry.policy,
                            f"{entry.owner}.{entry.name}")
            for owner, name, policy in list(_USER_REGISTRY.values()):
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
    """Install the O1 patches for `config`, replacing any previous installation cleanly.

    All or nothing: if installing fails, the previous installation (if any) is put back and
    torch's namespaces are as they were before the call.
    """
    global _ACTIVE
    previous = _ACTIVE
    deactivate()
    patches = O1Patches(config)
    try:
        patches.install(resolve())
    except BaseException:
        patches.uninstall()  # whatever was applied before the failure
        if previous is not None:
            previous.install(resolve())
            _ACTIVE = previous
        raise
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


def _class_attribute(cls: type, name: str) -> Any:
    """The raw attribute (descriptor) `cls.name` resolves to, or None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _register(module: Any, name: str, policy: Policy) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    _USER_REGISTRY[(id(module), name)] = (module, name, policy)
    if _ACTIVE is not None:
        _ACTIVE.register(module, name, policy)


def register_half_function(module: Any, name: str) -> None:
    """Run `module.name` in the session's half dtype under O1.

    Works before or after `initialize` (apex required before), survives re-initialize, and
    replaces a built-in list entry of the same name (no double wrapping).

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
        # (caster, converter) of the session that last called it: built once per session.
        memo: list[Any] = [None, None]

        def apply_policy(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            patches = _ACTIVE
            if patches is None or _CASTS_DISABLED.get():
                return wrapped(*args, **kwargs)
            caster = patches.caster
            if memo[0] is not caster:
                memo[0], memo[1] = caster, caster.converter(policy, label)
            converted = memo[1](args, kwargs)
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
