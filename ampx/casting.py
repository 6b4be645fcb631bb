"""Pure cast helpers over nested values, and the per-iteration weight-cast cache.

Nothing here patches anything: `patch.py` and `model.py` call these helpers.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable

import torch

__all__ = ["WeightCastCache", "cast_method", "cast_tree", "is_namedtuple"]

_Tensor = torch.Tensor


def is_namedtuple(value: Any) -> bool:
    """True for instances of `collections.namedtuple` / `typing.NamedTuple` classes."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def cast_tree(value: Any, dtype: torch.dtype, should_cast: Callable[[torch.Tensor], bool]) -> Any:
    """Cast every floating tensor in a nested value for which `should_cast` holds.

    Recurses into lists, tuples, namedtuples (rebuilt field by field, unlike apex) and
    mappings (rebuilt with their own type when it takes a dict). Objects that are not tensors
    but have a `.to` method (custom batch types, the protocol apex documented) get
    `.to(dtype)`. Strings, bytes, numpy arrays and everything else pass through.

    >>> out = cast_tree({"x": torch.ones(2), "n": 3}, torch.float16, lambda t: True)
    >>> out["x"].dtype, out["n"]
    (torch.float16, 3)
    """
    if isinstance(value, _Tensor):
        if value.is_floating_point() and value.dtype != dtype and should_cast(value):
            return value.to(dtype)
        return value
    if isinstance(value, (str, bytes)) or value is None:
        return value
    if isinstance(value, collections.abc.Mapping):
        items = {k: cast_tree(v, dtype, should_cast) for k, v in value.items()}
        mapping_type: Any = type(value)
        try:
            return mapping_type(items)
        except TypeError:
            return items
    if isinstance(value, tuple):
        cast = [cast_tree(v, dtype, should_cast) for v in value]
        return type(value)(*cast) if is_namedtuple(value) else type(value)(cast)
    if isinstance(value, list):
        return [cast_tree(v, dtype, should_cast) for v in value]
    if isinstance(value, torch.nn.Module):
        return value
    to = getattr(value, "to", None)
    if callable(to) and type(value).__module__.split(".")[0] != "numpy":
        return to(dtype)
    return value


_CAST_METHODS: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {
    # The dtype-specific methods parse their arguments faster than `Tensor.to(dtype)`.
    torch.float16: torch._C.TensorBase.half,
    torch.bfloat16: torch._C.TensorBase.bfloat16,
    torch.float32: torch._C.TensorBase.float,
    torch.float64: torch._C.TensorBase.double,
}


def cast_method(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fastest `tensor -> tensor.to(dtype)` callable for `dtype` (autograd-aware).

    >>> cast_method(torch.bfloat16)(torch.ones(1)).dtype
    torch.bfloat16
    """
    method = _CAST_METHODS.get(dtype)
    if method is not None:
        return method
    return lambda t: t.to(dtype)


class WeightCastCache:
    """Casts of parameters to a low-precision dtype, reused within one iteration.

    Entries are keyed by the parameter's identity (one table per target dtype), and are valid
    only while the parameter's version counter and storage are unchanged, so a weight changed
    by an optimizer step, `load_state_dict` or any in-place update is recast (apex served such
    weights stale, NVIDIA/apex#796). An entry cast with autograd off is not served to a
    forward that needs gradients, and an entry made under `torch.inference_mode` is not
    served outside it. `clear()` is called when an iteration ends (`scale_loss` exit), which
    frees the cast copies and their autograd nodes.

    The hot path is `bind(dtype)`, a specialised closure the O1 wrappers call per tensor.

    Attributes:
        hits: Casts served from the cache since construction.
        misses: Casts actually performed.
    """

    __slots__ = ("_tables", "hits", "misses")

    def __init__(self) -> None:
        # dtype -> id(param) -> (param, version, data_ptr, cast)
        self._tables: dict[torch.dtype, dict[int, tuple[torch.Tensor, int, int, torch.Tensor]]]
        self._tables = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def bind(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """A fast `param -> cached param.to(dtype)` for one dtype (what `cast` calls)."""
        table = self._tables.setdefault(dtype, {})
        convert = cast_method(dtype)
        grad_enabled = torch.is_grad_enabled
        inference = torch.is_inference_mode_enabled
        cache = self

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
                    cache.hits += 1
                    return cast
            cast = convert(param)
            table[id(param)] = (param, param._version, param.data_ptr(), cast)
            cache.misses += 1
            return cast

        return cached_cast

    def cast(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`param.to(dtype)`, served from the cache when still valid."""
        return self.bind(dtype)(param)

    def clear(self) -> None:
        """Drop every entry (the counters are kept)."""
        for table in self._tables.values():
            table.clear()
