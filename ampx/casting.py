"""Pure cast helpers over nested values, and the per-iteration weight-cast cache.

Nothing here patches anything: `patch.py` and `model.py` call these helpers.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable

import torch

__all__ = ["WeightCastCache", "cast_tree", "is_namedtuple"]

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
        try:
            return type(value)(items)
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


class WeightCastCache:
    """Casts of parameters to a low-precision dtype, reused within one iteration.

    Entries are keyed by the parameter's identity and the target dtype, and are valid only
    while the parameter's version counter and storage are unchanged, so a weight changed by
    an optimizer step, `load_state_dict` or any in-place update is recast (apex served such
    weights stale, NVIDIA/apex#796). An entry cast with autograd off is not served to a
    forward that needs gradients. `clear()` is called when an iteration ends (`scale_loss`
    exit), which frees the cast copies and their autograd nodes.

    Attributes:
        hits: Casts served from the cache since construction.
        misses: Casts actually performed.
    """

    __slots__ = ("_entries", "hits", "misses")

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, int, torch.Tensor]]
        self._entries = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def cast(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`param.to(dtype)`, served from the cache when still valid."""
        key = (id(param), dtype)
        entry = self._entries.get(key)
        version = param._version
        if entry is not None:
            owner, seen_version, seen_ptr, cast = entry
            if (
                owner is param
                and seen_version == version
                and seen_ptr == param.data_ptr()
                and (cast.requires_grad or not (param.requires_grad and torch.is_grad_enabled()))
            ):
                self.hits += 1
                return cast
        cast = param.to(dtype)
        self._entries[key] = (param, version, param.data_ptr(), cast)
        self.misses += 1
        return cast

    def clear(self) -> None:
        """Drop every entry (the counters are kept)."""
        self._entries.clear()
