"""Pure cast helpers: the one nested-value walker, dtype casts, and the weight-cast cache.

Nothing here patches anything: `policies.py`, `patch.py` and `model.py` call these helpers.
"""

from __future__ import annotations

import array
import collections.abc
import operator
import weakref
from typing import Any, Callable

import torch

__all__ = ["WeightCastCache", "cacheable", "cast_method", "cast_tree", "is_namedtuple",
           "map_tensors"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_TensorCast = Callable[[torch.Tensor], torch.Tensor]


def is_namedtuple(value: Any) -> bool:
    """True for instances of `collections.namedtuple` / `typing.NamedTuple` classes."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def map_tensors(value: Any, fn: _TensorCast, leaf: Callable[[Any], Any] | None = None,
                rebuild: bool = False) -> Any:
    """Apply `fn` to every tensor in lists, tuples, namedtuples and dicts; `value` if unchanged.

    This is the one walker over nested values (O1's argument casts and O2's input/output
    casts both use it). A container whose items all come back as the same objects is
    returned itself, so an uncast call rebuilds nothing. Namedtuples are rebuilt field by
    field, other tuple types with their own type, lists as lists. Dicts are always walked;
    other mappings only when `leaf` is given (then rebuilt with their own type when it takes
    a dict). Any other value goes to `leaf` (or is returned as it is).

    Plain Python, so dynamo traces it; traced code passes `rebuild=True`, which skips the
    identity tests (dynamo cannot trace `is` between containers) and always rebuilds.

    >>> map_tensors([torch.ones(1), (2, torch.ones(1))], torch.Tensor.half)[1][1].dtype
    torch.float16
    """
    if isinstance(value, _Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [map_tensors(v, fn, leaf, rebuild) for v in value]
        if not rebuild and all(map(operator.is_, items, value)):  # (no generator frame)
            return value
        if not isinstance(value, tuple):
            return items
        return type(value)(*items) if is_namedtuple(value) else type(value)(items)
    if isinstance(value, dict) or (leaf is not None and isinstance(value, collections.abc.Mapping)):
        mapped = {k: map_tensors(v, fn, leaf, rebuild) for k, v in value.items()}
        if not rebuild and all(mapped[k] is v for k, v in value.items()):
            return value
        if type(value) is dict:
            return mapped
        mapping_type: Any = type(value)
        try:
            return mapping_type(mapped)
        except TypeError:
            return mapped
    return value if leaf is None else leaf(value)


def cast_tree(value: Any, dtype: torch.dtype, should_cast: Callable[[torch.Tensor], bool]) -> Any:
    """Cast every floating tensor in a nested value for which `should_cast` holds.

    `map_tensors` with a dtype cast. Objects that are not tensors but have a `.to` method
    (custom batch types, the protocol apex documented) get `.to(dtype)`. Strings, bytes,
    modules, numpy arrays and everything else pass through.

    >>> out = cast_tree({"x": torch.ones(2), "n": 3}, torch.float16, lambda t: True)
    >>> out["x"].dtype, out["n"]
    (torch.float16, 3)
    """

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype and should_cast(t):
            return t.to(dtype)
        return t

    def other(v: Any) -> Any:
        if v is None or isinstance(v, (str, bytes, torch.nn.Module)):
            return v
        to = getattr(v, "to", None)
        if callable(to) and type(v).__module__.split(".")[0] != "numpy":
            return to(dtype)
        return v

    return map_tensors(value, cast, other)


_CAST_METHODS: dict[torch.dtype, _TensorCast] = {
    # The dtype-specific methods parse their arguments faster than `Tensor.to(dtype)`.
    torch.float16: torch._C.TensorBase.half,
    torch.bfloat16: torch._C.TensorBase.bfloat16,
    torch.float32: torch._C.TensorBase.float,
    torch.float64: torch._C.TensorBase.double,
}


def cast_method(dtype: torch.dtype) -> _TensorCast:
    """The fastest `tensor -> tensor.to(dtype)` callable for `dtype` (autograd-aware).

    >>> cast_method(torch.bfloat16)(torch.ones(1)).dtype
    torch.bfloat16
    """
    method = _CAST_METHODS.get(dtype)
    if method is not None:
        return method
    return lambda t: t.to(dtype)


def cacheable(t: torch.Tensor) -> bool:
    """Whether the weight cache may hold a cast of `t` (eager code only).

    Only exact `Parameter`s and exact-`Tensor` leaves that require grad, and only while no
    torch.func transform is active: the exact-type test refuses FakeTensor, FunctionalTensor
    and every other subclass (their storage must not be touched), and functorch's wrappers
    (which report `torch.Tensor`) are refused by the transforms check. Nor while
    `torch.jit.trace` records: a cast made outside the trace would enter it as a constant
    that requires grad, which the tracer refuses (autocast's `cache_enabled=False`).
    """
    cls = type(t)
    if cls is _Parameter or (cls is _Tensor and t.requires_grad and t.is_leaf):
        return (not torch._C._are_functorch_transforms_active()
                and torch._C._get_tracing_state() is None)
    return False


class WeightCastCache:
    """Casts of parameters to a low-precision dtype, reused within one forward (and backward).

    Entries are keyed by the parameter's identity (one table per target dtype), and are valid
    only while the parameter's version counter and storage are unchanged, so a weight changed
    by an optimizer step, `load_state_dict` or any in-place update is recast (apex served such
    weights stale, NVIDIA/apex#796). A `.data` alias has a version counter of its own, so
    writes through it are invisible to that check: `note_data_access` (called by O1's
    `Tensor.data` property) drops the parameter's entries and keeps it out of the cache for
    as long as an alias taken during the session lives. An entry cast with autograd off is not
    served to a forward that needs gradients, and an entry made under `torch.inference_mode`
    is not served outside it. `clear()` is called when a forward of an initialized model
    starts, when one without autograd ends (`o1.patch.forward_starts`/`forward_ends`), and by
    `scale_loss`: writes the version counter cannot see are never served to a later forward.

    The hot path is `bind(dtype)`, a specialised closure the O1 wrappers call per tensor; it
    is only ever given tensors for which `cacheable` holds.

    Attributes:
        hits: Casts served from the cache since construction.
        misses: Casts actually performed.
    """

    __slots__ = ("_aliased", "_counts", "_refs", "_tables", "__weakref__")

    def __init__(self) -> None:
        # dtype -> id(param) -> (param, version, data_ptr, cast)
        self._tables: dict[torch.dtype, dict[int, tuple[torch.Tensor, int, int, torch.Tensor]]]
        self._tables = {}
        self._aliased: dict[int, int] = {}  # id(param) -> live `.data` aliases
        # id(ref) -> ref (keeps each alias's weakref and its callback alive; a set would
        # compare two live refs to one tensor with the tensor's `==`)
        self._refs: dict[int, weakref.ref] = {}
        # [hits, misses] as int64s: the native O1 wrapper counts its hits in place.
        self._counts = array.array("q", [0, 0])

    @property
    def hits(self) -> int:
        """Casts served from the cache since construction."""
        return self._counts[0]

    @property
    def misses(self) -> int:
        """Casts actually performed."""
        return self._counts[1]

    def counters(self) -> array.array:
        """The live `[hits, misses]` int64 array (what the native wrapper increments)."""
        return self._counts

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def bind(self, dtype: torch.dtype,
             accepts: Callable[[torch.Tensor], bool] | None = None) -> _TensorCast:
        """A fast `param -> cached param.to(dtype)` for one dtype (what `cast` calls).

        With `accepts`, a miss casts only a tensor it accepts and returns any other as it is
        (so O1 can hand every `Parameter` straight to the cache: a hit is served before any
        dtype or device test).
        """
        table = self._tables.setdefault(dtype, {})
        convert = cast_method(dtype)
        grad_enabled = torch.is_grad_enabled
        inference = torch.is_inference_mode_enabled
        aliased = self._aliased
        counts = self._counts

        def cached_cast(param: torch.Tensor) -> torch.Tensor:
            entry = table.get(id(param))
            if entry is not None:
                owner, version, ptr, cast = entry
                if (
                    owner is param
                    and version == param._version
                    and ptr == param.data_ptr()
                    and (
                        cast.requires_grad
                        or (
                            not (param.requires_grad and grad_enabled())
                            and not (cast.is_inference() and not inference())
                        )
                    )
                ):
                    counts[0] += 1
                    return cast
            if accepts is not None and not accepts(param):
                return param
            cast = convert(param)
            counts[1] += 1
            if id(param) not in aliased:
                table[id(param)] = (param, param._version, param.data_ptr(), cast)
            return cast

        return cached_cast

    def table(self, dtype: torch.dtype) -> dict:
        """The live entry table of `dtype` (id(param) -> (param, version, data_ptr, cast)).

        The native O1 wrapper serves hits from it (the same test as `bind`'s closure).
        """
        return self._tables.setdefault(dtype, {})

    def aliases(self) -> dict[int, int]:
        """The live id(param) -> `.data` alias count (a miss of the native O1 wrapper keeps
        those parameters out of the table, as `bind`'s closure does)."""
        return self._aliased

    def note_data_access(self, param: torch.Tensor, alias: torch.Tensor | None) -> None:
        """`param.data` was read (giving `alias`) or assigned (the tensor given): forget its
        casts.

        While `alias` lives (or, for a view such as `flat[:16].view(4, 4)`, the tensor it
        views), writes through it are invisible to the version check, so `param` is not
        cached again until it is gone.
        """
        key = id(param)
        for table in self._tables.values():
            table.pop(key, None)
        if alias is None or not cacheable(param):
            return
        self._track(key, alias)
        if alias._base is not None:
            self._track(key, alias._base)

    def _track(self, key: int, alias: torch.Tensor) -> None:
        self._aliased[key] = self._aliased.get(key, 0) + 1
        cache_ref = weakref.ref(self)

        def gone(ref: weakref.ref) -> None:
            cache = cache_ref()
            if cache is not None:
                cache._refs.pop(id(ref), None)
                left = cache._aliased.get(key, 1) - 1
                if left > 0:
                    cache._aliased[key] = left
                else:
                    cache._aliased.pop(key, None)

        ref = weakref.ref(alias, gone)
        self._refs[id(ref)] = ref

    def clear(self) -> None:
        """Drop every entry (the counters and the alias bookkeeping are kept)."""
        for table in self._tables.values():
            table.clear()
