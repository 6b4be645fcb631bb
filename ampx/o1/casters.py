"""O1's cast policies: per-policy argument converters for one session.

A `Caster` turns a `CastConfig` into converters (one per policy and function name), each in two
builds: the eager one (weights through the cast cache, C-level device tests) and the compile
one (plain `.to(dtype)` and `t.device.type`, which dynamo traces into the graph; nothing that
touches storage, so fake and functional tensors are safe). `wrappers.py` puts them in closures.
`disable_casts` lives in `regions.py` (re-exported here).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..options.values import HALF_DTYPES
from .casting import WeightCastCache, cacheable, cast_method, map_tensors
from .lists import CastRule
from .regions import LOCAL, casts_disabled, disable_casts

__all__ = ["CastConfig", "CastError", "Caster", "Converter", "LOCAL", "casts_disabled",
           "disable_casts"]

logger = logging.getLogger("ampx")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_PROMOTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32})

Converter = Callable[[tuple, dict], "tuple[tuple, dict] | None"]
TensorCast = Callable[[torch.Tensor], torch.Tensor]


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


@dataclass(frozen=True)
class CastConfig:
    """What O1's casts do: target dtype, which devices, banned handling, cast logging."""

    dtype: torch.dtype
    device_types: frozenset[str]
    allow_banned: bool = False
    verbose: bool = False


# -- converters ------------------------------------------------------------------------------

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
            if v.dtype in HALF_DTYPES and eligible(v):
                return True
        elif isinstance(v, (list, tuple)):
            if _has_half(v, eligible):
                return True
        elif type(v) is dict and _has_half(v.values(), eligible):
            return True
    return False


def map_converter(cast: TensorCast, compiled: bool = False) -> Converter:
    """A converter applying `cast` to every tensor argument (nested ones too).

    The compile build always returns the rebuilt arguments (no identity tests in traced code).
    """

    def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        new_args = map_tensors(args, cast, rebuild=compiled)
        new_kwargs = map_tensors(kwargs, cast, rebuild=compiled) if kwargs else kwargs
        if not compiled and new_args is args and new_kwargs is kwargs:
            return None
        return new_args, new_kwargs

    return convert


def _device_predicate(device_types: frozenset[str], compiled: bool) -> Callable[[_Tensor], bool]:
    if not compiled:
        # Eager: the common single-device cases read is_cpu/is_cuda through a C-level
        # attrgetter (no Python frame per tensor); dynamo cannot trace attrgetter.
        if device_types == frozenset({"cpu"}):
            return operator.attrgetter("is_cpu")
        if device_types == frozenset({"cuda"}):
            return operator.attrgetter("is_cuda")
    types = tuple(sorted(device_types))
    return lambda t: t.device.type in types


class Caster:
    """Builds the tensor casts and argument converters of each policy for one `CastConfig`.

    A converter takes the full positional arguments (self first, for methods) and kwargs, and
    returns converted ones, or None when nothing needs casting (the common fast path: no
    tuple is rebuilt). Float64 tensors are never cast. Everything is built once per session
    and reused.
    """

    def __init__(self, config: CastConfig) -> None:
        self.config = config
        self.cache = WeightCastCache()
        self._eligible = {c: _device_predicate(config.device_types, c) for c in (False, True)}
        self._converters: dict[tuple[CastRule, str, bool], Converter] = {}
        self._casts: dict[tuple, TensorCast] = {}
        self._half_cached: TensorCast | None = None
        # What `@half_function` and friends use in traced code (no dict filled while tracing).
        self.compiled_converters = {policy: self.converter(policy, "", compiled=True)
                                    for policy in (CastRule.LOWER, CastRule.FP32, CastRule.PROMOTE)}

    def _name(self, name: str) -> str:
        # The name only shows in cast logs: share the casts otherwise.
        return name if self.config.verbose else ""

    def half_cast(self, name: str = "", *, compiled: bool = False) -> TensorCast:
        """`tensor -> tensor in the session's half dtype` for `name` (eager: cached weights)."""
        key = ("half", self._name(name), compiled)
        cast = self._casts.get(key)
        if cast is None:
            cast = self._casts[key] = self._make_half_cast(name, compiled)
        return cast

    def _make_half_cast(self, name: str, compiled: bool) -> TensorCast:
        half = self.config.dtype
        lower_from = (torch.float32, *(set(HALF_DTYPES) - {half}))
        eligible = self._eligible[compiled]
        if compiled:
            def to_half_compiled(t: torch.Tensor) -> torch.Tensor:
                if t.dtype in lower_from and eligible(t):
                    return t.to(half)
                return t

            return to_half_compiled
        cached = self.cache.bind(half, lambda t: t.dtype in lower_from and eligible(t))
        self._half_cached = cached
        plain = cast_method(half)
        if self.config.verbose:
            def to_half_logged(t: torch.Tensor) -> torch.Tensor:
                if t.dtype not in lower_from or not eligible(t):
                    return t
                logger.info("%s->%s (%s)", t.dtype, half, name)
                return cached(t) if cacheable(t) else plain(t)

            return to_half_logged
        transforms_active = torch._C._are_functorch_transforms_active
        tracing = torch._C._get_tracing_state

        def to_half(t: torch.Tensor) -> torch.Tensor:
            # Weights first: a cached cast is served before any dtype or device test (the
            # cache checks those on a miss). Outside torch.func and torch.jit.trace, as
            # `cacheable` requires.
            if type(t) is _Parameter and not transforms_active() and tracing() is None:
                return cached(t)
            if t.dtype not in lower_from or not eligible(t):
                return t
            return cached(t) if cacheable(t) else plain(t)

        return to_half

    def half_cache_cast(self) -> TensorCast:
        """The weight cache's cast that the eager half cast calls (a miss casts and stores)."""
        self.half_cast()
        assert self._half_cached is not None
        return self._half_cached

    def dtype_cast(self, dtype: torch.dtype, sources: Collection[torch.dtype], name: str = "", *,
                   compiled: bool = False) -> TensorCast:
        """`tensor -> tensor.to(dtype)` for eligible tensors whose dtype is in `sources`."""
        key = (dtype, sources, self._name(name), compiled)
        cast = self._casts.get(key)
        if cast is not None:
            return cast
        froms = tuple(s for s in sources if s != dtype)
        eligible = self._eligible[compiled]
        convert = cast_method(dtype)
        verbose = self.config.verbose and not compiled

        def to_dtype(t: torch.Tensor) -> torch.Tensor:
            if t.dtype not in froms or not eligible(t):
                return t
            if verbose:
                logger.info("%s->%s (%s)", t.dtype, dtype, name)
            return t.to(dtype) if compiled else convert(t)

        self._casts[key] = to_dtype
        return to_dtype

    def converter(self, policy: CastRule, name: str, *, compiled: bool = False) -> Converter:
        """The argument converter implementing `policy` for the function called `name`."""
        named = self.config.verbose or policy in (CastRule.INPLACE_FP32_ERROR, CastRule.BANNED)
        key = (policy, name if named else "", compiled)
        convert = self._converters.get(key)
        if convert is None:
            convert = self._converters[key] = self._build(policy, name, compiled)
        return convert

    def _build(self, policy: CastRule, name: str, compiled: bool) -> Converter:
        if policy in (CastRule.LOWER, CastRule.RNN):
            return map_converter(self.half_cast(name, compiled=compiled), compiled)
        if policy is CastRule.FP32:
            return map_converter(self.dtype_cast(torch.float32, HALF_DTYPES, name,
                                                 compiled=compiled), compiled)
        if policy in (CastRule.PROMOTE, CastRule.SEQUENCE_PROMOTE):
            return self._promote(name, compiled, sequence=policy is CastRule.SEQUENCE_PROMOTE)
        if policy is CastRule.INPLACE_MATCH_SELF:
            return self._inplace_match_self(name, compiled)
        if policy is CastRule.INPLACE_FP32_ERROR:
            return self._inplace_fp32(name, compiled)
        if policy is CastRule.BANNED:
            return self._banned(name, compiled)
        if policy is CastRule.RNN_CHECK:
            return self._rnn_check(compiled)
        raise ValueError(f"ampx: unknown cast policy {policy!r}")

    def _promote(self, name: str, compiled: bool, *, sequence: bool) -> Converter:
        eligible = self._eligible[compiled]
        casts = {dtype: self.dtype_cast(dtype, _PROMOTABLE, name, compiled=compiled)
                 for dtype in (torch.float32, torch.float64)}

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
                    elif isinstance(v, (list, tuple, dict)):
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
                return (map_tensors(args[0], cast, rebuild=compiled), *args[1:]), kwargs
            return (map_tensors(args, cast, rebuild=compiled),
                    map_tensors(kwargs, cast, rebuild=compiled) if kwargs else kwargs)

        return convert

    def _inplace_match_self(self, name: str, compiled: bool) -> Converter:
        eligible = self._eligible[compiled]
        casts = {dtype: self.dtype_cast(dtype, _PROMOTABLE, name, compiled=compiled)
                 for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}

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
                elif isinstance(v, (list, tuple, dict)):
                    break
            else:
                if not kwargs:
                    return None
            return map_converter(cast, compiled)(args, kwargs)

        return convert

    def _inplace_fp32(self, name: str, compiled: bool) -> Converter:
        eligible = self._eligible[compiled]
        to_float = map_converter(self.dtype_cast(torch.float32, HALF_DTYPES, name,
                                                 compiled=compiled), compiled)
        plain = name.rsplit(".", 1)[-1].strip("_").replace("ipow", "pow").rstrip("_")

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            target = args[0] if args else None
            if isinstance(target, _Tensor) and target.dtype in HALF_DTYPES and eligible(target):
                raise CastError(
                    f"ampx: cannot call in-place {name} on a {target.dtype} tensor under O1: "
                    f"{plain} runs in float32 under O1, and the float32 result cannot be stored "
                    f"back in place. Use the out-of-place {plain} (x = x.{plain}(...)), or call "
                    "it inside ampx.disable_casts()."
                )
            return to_float(args, kwargs)

        return convert

    def _banned(self, name: str, compiled: bool) -> Converter:
        eligible = self._eligible[compiled]
        to_float = map_converter(self.dtype_cast(torch.float32, HALF_DTYPES, name,
                                                 compiled=compiled), compiled)
        allow = self.config.allow_banned

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not (_has_half(args, eligible) or (kwargs and _has_half(kwargs.values(), eligible))):
                return None
            if not allow:
                raise CastError(_BANNED_MESSAGE.format(name=name))
            return to_float(args, kwargs)

        return convert

    def _rnn_check(self, compiled: bool) -> Converter:
        # RNNBase.check_input(self, input, batch_sizes) rejects an input whose dtype differs
        # from the fp32 weights unless torch.autocast is on; under O1 the _VF entry points
        # cast both, so the check sees a stand-in of the weights' dtype (no data).
        eligible = self._eligible[compiled]

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if len(args) < 2:
                return None
            module, data = args[0], args[1]
            weights = getattr(module, "_flat_weights", None)
            if not isinstance(data, _Tensor) or not weights:
                return None
            wdtype = weights[0].dtype
            if (data.dtype is wdtype or data.dtype not in _PROMOTABLE
                    or wdtype not in _PROMOTABLE or not eligible(data)):
                return None
            stand_in = torch.empty(data.shape, dtype=wdtype, device="meta")
            return (module, stand_in, *args[2:]), kwargs

        return convert
