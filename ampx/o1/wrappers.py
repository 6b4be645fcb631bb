"""The O1 wrappers: plain closures that apply a policy's converters around the original.

Plain functions (not proxies), so dynamo inlines them and their casts land in the graph. Each
wrapper first reads its session's `live` flag: once the session is gone (restore, a new
initialize), a wrapper that something captured (`from torch.nn.functional import linear`,
torch's own tables) calls the original untouched. Then it branches on
`torch.compiler.is_compiling()`: traced code uses the compile converters and the per-thread
disable depth, eager code the eager converters (weight cache) and the `disable_casts`
ContextVar.

When the extension is built, `patch.py` installs `make_native`'s wrappers instead: a C
callable (ampx/csrc/cast_wrapper.cpp, with its argument side in cast_rules.cpp) that applies
the same rules to eager calls without a Python frame, and hands every call it cannot handle
exactly (while compiling, under a TorchFunctionMode, odd argument types, errors) to the
closure, which stays the reference.
Its Python `__call__` (the closure again) is what dynamo inlines, so compiled code is traced
through the closure and sees its casts.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Protocol, SupportsIndex

import torch

from ..options.values import HALF_DTYPES
from .casters import Caster, Converter, TensorCast
from .casting import map_tensors
from .interop import fx_record, fx_state, mark_scriptable, name_as_installed, reduce_like
from .lists import CastRule
from .regions import (
    _CASTS_DISABLED,
    LOCAL,
    StepScope,
    eager_depth_when_compiling,
    in_compiled_region,
)
from .registry import PATCHES

__all__ = ["Live", "decorator_wrapper", "make_native", "make_wrapper", "native_class"]

_Tensor = torch.Tensor


# Torch's own Python code that runs only while compiling (decompositions, meta functions,
# refs): a patched function it calls must not cast, or the compiled graph would get casts
# that eager O1 (which runs the C++ kernels) never makes, e.g. inside sdpa's math path.
_COMPILER_INTERNALS = ("torch._decomp", "torch._refs", "torch._prims", "torch._meta_registrations",
                       "torch._inductor", "torch._subclasses", "torch._functorch",
                       "torch._higher_order_ops")


def _applies_when_compiling() -> bool:
    """In a compile: whether the calling wrapper's policy applies.

    Inlined by dynamo (the user's code): unless in a `disable_casts()` (a depth dynamo
    tracks and guards). Run opaquely (a Tensor method during fake propagation or AOT
    tracing): unless in a `disable_casts()` of the compiled code (in graph order) or around
    the compiled call (guarded), or called by compiler-internal code.
    """
    if torch.compiler.is_dynamo_compiling():
        return not LOCAL.depth
    if in_compiled_region() or eager_depth_when_compiling():
        return False
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return not caller.startswith(_COMPILER_INTERNALS)


class Live(Protocol):
    """What a wrapper reads from its session (a plain attribute, which dynamo guards)."""

    live: bool


def make_wrapper(original: Callable[..., Any], policy: CastRule, name: str, caster: Caster,
                 session: Live) -> Callable[..., Any]:
    """A closure applying `policy` around `original` (called with self first, for methods)."""
    compiled = caster.converter(policy, name, compiled=True)
    if policy in (CastRule.LOWER, CastRule.RNN, CastRule.FP32):
        if policy is CastRule.FP32:
            cast = caster.dtype_cast(torch.float32, HALF_DTYPES, name)
        else:
            cast = caster.half_cast(name)
        wrapper = _map_wrapper(original, session, cast, compiled, name)
    else:
        wrapper = _convert_wrapper(original, session, caster.converter(policy, name), compiled,
                                   name)
    wrapper.__ampx_policy__ = policy  # type: ignore[attr-defined]
    name_as_installed(wrapper, name)
    mark_scriptable(wrapper, original)
    return wrapper


def _wraps(original: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    # functools.wraps copies __name__/__doc__/__module__ and sets __wrapped__; builtins lack
    # some of these attributes, which functools.wraps skips.
    return functools.wraps(original)


def _map_wrapper(original: Callable[..., Any], session: Live, cast: TensorCast,
                 compiled: Converter, label: str) -> Callable[..., Any]:
    """The hot path (F.linear, matmul, softmax...): no tuple is rebuilt when nothing changes.

    A call with an explicit `out=` tensor runs as written (as under torch.autocast); under
    `torch.fx.symbolic_trace` a call on Proxies is recorded as the patched name (interop.py).
    """
    disabled = _CASTS_DISABLED.get
    compiling = torch.compiler.is_compiling
    eager = _eager_map(cast)

    @_wraps(original)
    def ampx_cast(*args: Any, **kwargs: Any) -> Any:
        if session.live and not (kwargs and kwargs.get("out") is not None):
            if compiling():
                if _applies_when_compiling():
                    converted = compiled(args, kwargs)
                    if converted is not None:
                        return original(*converted[0], **converted[1])
            elif not disabled():
                if fx_state._is_fx_tracing_flag:
                    traced = fx_record(label, args, kwargs)
                    if traced is not None:
                        return traced
                converted = eager(args, kwargs)
                if converted is not None:
                    return original(*converted[0], **converted[1])
        return original(*args, **kwargs)

    return ampx_cast


def _eager_map(cast: TensorCast) -> Converter:
    """`map_converter` with the all-positional top level inlined (F.linear(x, w, b))."""

    def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        new: list | None = None
        i = 0
        for a in args:
            if isinstance(a, _Tensor):
                c = cast(a)
            elif isinstance(a, (list, tuple, dict)):
                c = map_tensors(a, cast)
            else:
                i += 1
                continue
            if c is not a:
                if new is None:
                    new = list(args)
                new[i] = c
            i += 1
        if kwargs:
            new_kwargs = map_tensors(kwargs, cast)
            if new_kwargs is not kwargs:
                return (args if new is None else tuple(new)), new_kwargs
        return None if new is None else (tuple(new), kwargs)

    return convert


def _convert_wrapper(original: Callable[..., Any], session: Live, eager: Converter,
                     compiled: Converter, label: str) -> Callable[..., Any]:
    """The other rules; `out=` and fx as in `_map_wrapper`."""
    disabled = _CASTS_DISABLED.get
    compiling = torch.compiler.is_compiling

    @_wraps(original)
    def ampx_cast(*args: Any, **kwargs: Any) -> Any:
        if session.live and not (kwargs and kwargs.get("out") is not None):
            if compiling():
                converted = (compiled(args, kwargs) if _applies_when_compiling() else None)
            elif disabled():
                converted = None
            else:
                if fx_state._is_fx_tracing_flag:
                    traced = fx_record(label, args, kwargs)
                    if traced is not None:
                        return traced
                converted = eager(args, kwargs)
            if converted is not None:
                return original(*converted[0], **converted[1])
        return original(*args, **kwargs)

    return ampx_cast


# CastRule -> the rule code of ampx/csrc/cast_wrapper.h.
_RULE_CODES = {rule: code for code, rule in enumerate((
    CastRule.LOWER, CastRule.FP32, CastRule.PROMOTE, CastRule.SEQUENCE_PROMOTE,
    CastRule.BANNED, CastRule.INPLACE_MATCH_SELF, CastRule.INPLACE_FP32_ERROR, CastRule.RNN,
    CastRule.RNN_CHECK))}


def native_class() -> type | None:
    """The native wrapper type, or None when the extension (or its CastWrapper) is absent."""
    if not PATCHES.native_class:
        PATCHES.native_class.append(_build_native_class())
    return PATCHES.native_class[0]


def _build_native_class() -> type | None:
    from .. import _ext

    module = _ext._native_module()
    base = getattr(module, "CastWrapper", None)
    if module is None or base is None:
        return None
    # fx Proxies go to the closure, which records them (interop.fx_record). A step's
    # StepScope is read natively where its cached frame answers (StepScope.running).
    module._cast_wrapper_setup(torch.Tensor, torch.nn.Parameter, torch.Size, torch.device,
                               torch.layout, torch.memory_format, vars(torch.compiler),
                               _CASTS_DISABLED, StepScope, (torch.fx.Proxy,))

    class NativeCastWrapper(base):  # type: ignore[misc, valid-type]
        """O1's native cast wrapper. Eager calls run the C call slot; dynamo inlines this
        `__call__`, the reference closure, so compiled graphs hold the closure's casts."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self._ampx_python(*args, **kwargs)

        # A function to pickle and copy: by reference, and itself (interop.py).
        def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
            return reduce_like(self._ampx_original, self, int(protocol))

        def __copy__(self) -> Any:
            return self

        def __deepcopy__(self, memo: dict) -> Any:
            return self

    module._seal_cast_wrapper(NativeCastWrapper)
    return NativeCastWrapper


def make_native(python: Callable[..., Any], original: Callable[..., Any], policy: CastRule,
                caster: Caster, session: Live) -> Callable[..., Any] | None:
    """The native wrapper for `original` around the closure `python` (None: not available).

    Not for verbose sessions (the cast log is the closure's).
    """
    cls = native_class()
    config = caster.config
    if cls is None or config.verbose:
        return None
    table = cached = aliases = None
    if policy in (CastRule.LOWER, CastRule.RNN):
        cached = caster.half_cache_cast()
        table = caster.cache.table(config.dtype)
        aliases = caster.cache.aliases()
    native = cls(original, python, session, _RULE_CODES[policy], config.dtype,
                 frozenset(config.device_types), config.allow_banned, caster.cache.counters(),
                 table, cached, aliases)
    functools.update_wrapper(native, original)
    native.__module__, native.__qualname__ = python.__module__, python.__qualname__
    native._ampx_python = python
    native.__ampx_policy__ = policy
    return native


def decorator_wrapper(fn: Callable[..., Any], policy: CastRule,
                      current: Callable[[], Caster | None]) -> Callable[..., Any]:
    """`@half_function` and friends: apply `policy` with whichever session is active.

    `current()` returns the active session's caster (None outside O1).
    """
    label = getattr(fn, "__qualname__", repr(fn))
    disabled = _CASTS_DISABLED.get
    compiling = torch.compiler.is_compiling

    @_wraps(fn)
    def ampx_cast(*args: Any, **kwargs: Any) -> Any:
        caster = current()
        if caster is not None:
            if compiling():
                converted = (caster.compiled_converters[policy](args, kwargs)
                             if _applies_when_compiling() else None)
            else:
                converted = None if disabled() else caster.converter(policy, label)(args, kwargs)
            if converted is not None:
                return fn(*converted[0], **converted[1])
        return fn(*args, **kwargs)

    return ampx_cast
