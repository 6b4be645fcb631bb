"""Overflow provenance results: which parameters and modules a skipped step's inf/NaN came from.

This module holds the data side of provenance: :class:`ParamNames` maps parameters (the
models' own and the O2 fp32 masters behind them) to their ``named_parameters()`` names and
owning modules, :class:`OverflowReport` is the result object of one skipped step, and
:func:`overflow_message` / :class:`RateLimiter` make the log line. Collecting the flags lives
in :mod:`ampx.overflow.flags`, the forward detector in :mod:`ampx.overflow.forward`, and the
``on_overflow`` policies in :mod:`ampx.overflow.policy`.

Ranking: in backward an overflow spreads from where it started towards the input, so every
module that runs *before* the culprit gets non-finite gradients too. Flagged parameters and
modules are therefore ranked closest-to-the-loss first (latest registered first): the first
entry is the most likely origin. The forward detector, when on, names the origin directly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["OverflowReport", "ParamNames", "RateLimiter", "overflow_message"]

ROOT_MODULE = "(root)"


class ParamNames:
    """Parameter -> ``named_parameters()`` name, owning module, and registration order.

    Built from the models given to ``initialize``. With several models the names get a
    ``model<i>.`` prefix. O2 fp32 masters are added with :meth:`add_alias` and resolve to the
    name of the half model parameter they stand behind.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> names = ParamNames.from_models([model])
        >>> names.name_of(model[0].bias), names.module_of(model[0].bias)
        ('0.bias', '0')
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, str, int]] = {}
        self._names: list[str] = []

    @classmethod
    def from_models(cls, models: Sequence[nn.Module],
                    masters: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> ParamNames:
        """Names for every parameter of `models`, plus (model param, master) aliases."""
        names = cls()
        for i, model in enumerate(models):
            prefix = f"model{i}." if len(models) > 1 else ""
            for name, param in model.named_parameters():
                names.add(param, prefix + name)
        for model_param, master in masters:
            names.add_alias(master, model_param)
        return names

    def add(self, param: torch.Tensor, name: str) -> None:
        """Record `param` under `name` (the first name wins, as for tied weights)."""
        if self._known(param) is None:
            self._by_id[id(param)] = (param, name, len(self._names))
            self._names.append(name)

    def add_alias(self, alias: torch.Tensor, param: torch.Tensor) -> None:
        """Make `alias` (an O2 master) resolve to `param`'s name and order."""
        entry = self._known(param)
        if entry is not None:
            self._by_id[id(alias)] = (alias, entry[1], entry[2])

    def _known(self, param: torch.Tensor) -> tuple[torch.Tensor, str, int] | None:
        entry = self._by_id.get(id(param))
        return entry if entry is not None and entry[0] is param else None

    def name_of(self, param: torch.Tensor) -> str | None:
        """The parameter's name, or None for a parameter of no named model."""
        entry = self._known(param)
        return entry[1] if entry is not None else None

    def order_of(self, param: torch.Tensor) -> int:
        """Registration index (0 = first parameter of the first model); -1 when unknown."""
        entry = self._known(param)
        return entry[2] if entry is not None else -1

    def name_at(self, order: int) -> str:
        """The name of the parameter with registration index `order`."""
        return self._names[order]

    def module_of(self, param: torch.Tensor) -> str | None:
        """The qualified name of the module that owns the parameter (``"(root)"`` for the top)."""
        name = self.name_of(param)
        return None if name is None else module_of_name(name)

    def __len__(self) -> int:
        return len(self._names)


def module_of_name(param_name: str) -> str:
    """``"enc.fc1.weight"`` -> ``"enc.fc1"``; a top-level parameter -> ``"(root)"``.

    >>> module_of_name("enc.fc1.weight"), module_of_name("scale")
    ('enc.fc1', '(root)')
    """
    head, _, _ = param_name.rpartition(".")
    return head or ROOT_MODULE


def rank_modules(params: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """Owning modules of flagged ``(name, order)`` params, closest to the loss first, with counts.

    >>> rank_modules([("a.w", 0), ("b.w", 2), ("b.b", 3)])
    (('b', 2), ('a', 1))
    """
    latest: dict[str, int] = {}
    counts: dict[str, int] = {}
    for name, order in params:
        module = module_of_name(name)
        latest[module] = max(latest.get(module, -1), order)
        counts[module] = counts.get(module, 0) + 1
    ranked = sorted(latest, key=lambda m: (-latest[m], m))
    return tuple((m, counts[m]) for m in ranked)


@dataclass(frozen=True)
class OverflowReport:
    """Where the inf/NaN of one skipped step came from (``ampx.last_overflow(optimizer)``).

    Attributes:
        step: Index of the skipped ``optimizer.step()`` (0 = the first step).
        loss_ids: The losses whose backward passes fed this step, overflowing or not.
        scales: ``loss_id -> (scale before, scale after)`` for every overflowing loss.
        inf_params: Parameters whose gradient held +-inf, closest to the loss first.
        nan_params: Parameters whose gradient held NaN (a gradient with both is in both).
        unknown_params: Flagged by the unscale kernel, but the gradient was gone (or no
            longer non-finite) when it was classified.
        params_by_loss: ``loss_id -> flagged parameters`` of that loss's backward passes.
        modules: ``(module, number of flagged parameters)``, closest to the loss first.
        forward_module: The first module (in execution order) whose output was non-finite,
            when the forward detector is on and saw one; else None.
        forward_kind: ``"inf"`` or ``"nan"`` for `forward_module`.
        rank: This process's rank, or None when not distributed.
        param_ranks: ``parameter -> ranks whose own unscale flagged it`` (distributed only).
            After DDP's all-reduce an inf from one rank reaches every rank's gradients, so
            this names the origin rank only for values that arose after the reduction.
    """

    step: int
    loss_ids: tuple[int, ...]
    scales: dict[int, tuple[float, float]]
    inf_params: tuple[str, ...] = ()
    nan_params: tuple[str, ...] = ()
    unknown_params: tuple[str, ...] = ()
    params_by_loss: dict[int, tuple[str, ...]] = field(default_factory=dict)
    modules: tuple[tuple[str, int], ...] = ()
    forward_module: str | None = None
    forward_kind: str | None = None
    rank: int | None = None
    param_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def loss_id(self) -> int:
        """The first loss whose gradients overflowed (the first of `loss_ids` if none did)."""
        if self.scales:
            return min(self.scales)
        return self.loss_ids[0] if self.loss_ids else 0

    @property
    def scale_before(self) -> float:
        """The scale of `loss_id` before the overflow (nan when unknown)."""
        return self.scales.get(self.loss_id, (math.nan, math.nan))[0]

    @property
    def scale_after(self) -> float:
        """The scale of `loss_id` after the overflow's backoff (nan when unknown)."""
        return self.scales.get(self.loss_id, (math.nan, math.nan))[1]

    @property
    def params(self) -> tuple[str, ...]:
        """Every flagged parameter once, closest to the loss first."""
        order = {name: i for i, name in enumerate(self._ranked_params())}
        return tuple(sorted(order, key=order.__getitem__))

    def _ranked_params(self) -> list[str]:
        seen: dict[str, None] = {}
        for loss_params in self.params_by_loss.values():
            for name in loss_params:
                seen.setdefault(name, None)
        for name in (*self.inf_params, *self.nan_params, *self.unknown_params,
                     *self.param_ranks):
            seen.setdefault(name, None)
        return list(seen)

    @property
    def culprit(self) -> str | None:
        """The module most likely at fault: the forward origin, else the top-ranked module."""
        if self.forward_module is not None:
            return self.forward_module
        return self.modules[0][0] if self.modules else None

    def where(self) -> str:
        """The provenance part of the log line, e.g. ``"in fc2.weight (+3 more)"``."""
        params = self.params
        parts = []
        if params:
            more = f" (+{len(params) - 1} more)" if len(params) > 1 else ""
            parts.append(f"in {params[0]}{more}")
        if self.forward_module is not None:
            parts.append(f"activations first {self.forward_kind or 'non-finite'} in "
                         f"{self.forward_module}")
        if self.rank is not None and self.param_ranks and params:
            ranks = self.param_ranks.get(params[0], ())
            parts.append(f"on rank{'s' if len(ranks) != 1 else ''} "
                         + ",".join(str(r) for r in ranks))
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able form (telemetry records, ``ampx sweep``)."""
        return {
            "step": self.step,
            "loss_ids": list(self.loss_ids),
            "scales": {str(k): list(v) for k, v in self.scales.items()},
            "inf_params": list(self.inf_params),
            "nan_params": list(self.nan_params),
            "unknown_params": list(self.unknown_params),
            "params_by_loss": {str(k): list(v) for k, v in self.params_by_loss.items()},
            "modules": [list(m) for m in self.modules],
            "forward_module": self.forward_module,
            "forward_kind": self.forward_kind,
            "rank": self.rank,
            "param_ranks": {k: list(v) for k, v in self.param_ranks.items()},
        }

    def summary(self) -> str:
        """A multi-line description (the text of the ``raise`` policy's FloatingPointError)."""
        lines = [f"ampx: step {self.step} skipped: non-finite gradients"
                 + (f" on rank {self.rank}" if self.rank is not None else "")]
        for loss_id, (before, after) in sorted(self.scales.items()):
            lines.append(f"  loss {loss_id}: scale {_num(before)} -> {_num(after)}")
        if self.forward_module is not None:
            lines.append(f"  activations first {self.forward_kind} in: {self.forward_module}")
        for label, names in (("inf", self.inf_params), ("NaN", self.nan_params),
                             ("unclassified", self.unknown_params)):
            if names:
                lines.append(f"  {label} gradients ({len(names)}): " + ", ".join(_head(names)))
        if self.modules:
            lines.append("  modules (closest to the loss first): "
                         + ", ".join(f"{m} ({n})" for m, n in _head(self.modules)))
        return "\n".join(lines)


def _head(items: Sequence[Any], n: int = 8) -> list[Any]:
    out = list(items[:n])
    if len(items) > n:
        out.append(f"... {len(items) - n} more")
    return out


def _num(value: float) -> str:
    """A scale as the log line shows it: ``32768`` rather than ``32768.0``."""
    if math.isfinite(value) and value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def overflow_message(*, loss_id: int, old_scale: float, new_scale: float, dynamic: bool,
                     where: str = "", hysteresis: int = 1, suppressed: int = 0) -> str:
    """The INFO line of a skipped step.

    >>> print(overflow_message(loss_id=0, old_scale=65536.0, new_scale=32768.0, dynamic=True,
    ...                        where="in fc2.w"))
    Gradient overflow in fc2.w. Skipping step, loss scaler 0 reducing loss scale to 32768
    """
    head = ("Gradient overflow" if dynamic else "Non-finite gradients") + (
        f" {where}" if where else "")
    extra = f" ({suppressed} similar messages suppressed)" if suppressed else ""
    if not dynamic:
        return (f"{head}. Skipping step, loss scaler {loss_id} keeps its static loss scale "
                f"{_num(new_scale)}{extra}")
    if new_scale < old_scale:
        return (f"{head}. Skipping step, loss scaler {loss_id} reducing loss scale to "
                f"{_num(new_scale)}{extra}")
    return (f"{head}. Skipping step, loss scaler {loss_id} keeps loss scale {_num(new_scale)} "
            f"(hysteresis={hysteresis}: more overflows are tolerated before backing off){extra}")


class RateLimiter:
    """Let the first `first` events through, then at most one per `interval_s` seconds.

    Args:
        first: Events always allowed.
        interval_s: Minimum spacing of later events.
        clock: Time source (tests pass a fake one).
    """

    def __init__(self, first: int = 3, interval_s: float = 30.0,
                 clock: Any = time.monotonic) -> None:
        self.first = first
        self.interval_s = interval_s
        self._clock = clock
        self._seen = 0
        self._last = -math.inf
        self.suppressed = 0

    def allow(self) -> tuple[bool, int]:
        """Returns ``(allowed, number suppressed since the last allowed event)``."""
        self._seen += 1
        now = self._clock()
        if self._seen <= self.first or now - self._last >= self.interval_s:
            suppressed, self.suppressed, self._last = self.suppressed, 0, now
            return True, suppressed
        self.suppressed += 1
        return False, 0
