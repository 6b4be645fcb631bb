"""What to do when overflows persist: the ``on_overflow`` policies and the fp32 fallback.

``"skip"`` (the default) skips the step and backs the scale off, as apex did. ``"raise"``
raises :class:`OverflowPersistsError` (a FloatingPointError, as fairseq raises) carrying the
:class:`~ampx.overflow.report.OverflowReport`, once the scale sits at its minimum or after
`patience` consecutive skipped steps. ``"fp32-fallback"`` counts skips per culprit module
(the forward detector's origin when it is on, else the top-ranked module, passing over
modules already in fp32) and, at `patience` skips of one module, runs that module in float32
from then on: at O1 its forward runs with casts disabled on float32 inputs; at O2 it computes with
its parameters' fp32 masters (the model keeps its own half Parameters, so a DDP wrapper made
earlier still reduces their gradients), with inputs cast to float32 and outputs cast back.
The modules in fp32 are part of :meth:`OverflowPolicy.state_dict`, so a resume keeps them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..o1 import patch
from ..o1.casting import cast_tree
from ..options.values import HALF_DTYPES
from ..options.values import ON_OVERFLOW_CHOICES as ON_OVERFLOW
from ..scaling.journal import Journal
from .report import ROOT_MODULE, OverflowReport

__all__ = ["ON_OVERFLOW", "Fp32Fallback", "OverflowPersistsError", "OverflowPolicy",
           "find_module", "float_buffers", "params_with_masters"]

logger = logging.getLogger("ampx")



class OverflowPersistsError(FloatingPointError):
    """Overflows persisted under ``on_overflow="raise"``; `report` says where.

    Args:
        message: The error text.
        report: The report of the skipped step that triggered it.
    """

    def __init__(self, message: str, report: OverflowReport) -> None:
        super().__init__(message)
        self.report = report


class OverflowPolicy:
    """The bookkeeping of one session's ``on_overflow`` choice.

    Args:
        mode: One of :data:`ON_OVERFLOW`.
        patience: Consecutive skips before ``"raise"``; skips attributed to one module
            before ``"fp32-fallback"`` moves it to float32.

    Raises:
        ValueError: For an unknown `mode` or a `patience` below 1 (naming the option).
    """

    def __init__(self, mode: str = "skip", patience: int = 8) -> None:
        if mode not in ON_OVERFLOW:
            raise ValueError(f"ampx.initialize: on_overflow={mode!r} is not one of "
                             f"{', '.join(repr(m) for m in ON_OVERFLOW)}.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"ampx.initialize: overflow_patience must be an int >= 1; "
                             f"got {patience!r}.")
        self.mode = mode
        self.patience = patience
        self.consecutive = 0
        self.attributions: dict[str, int] = {}
        self.fallback: list[str] = []

    def observe_clean(self) -> None:
        """A step that was not skipped."""
        self.consecutive = 0

    def observe_skip(self, report: OverflowReport, at_minimum: bool = False,
                     attribute: bool = True) -> str | None:
        """Count a skipped step; returns a module to move to float32 now, or None.

        `attribute` False: count the skip but blame no module (the numerics monitor did not
        watch it; it watches the next step and names the origin then).

        Raises:
            OverflowPersistsError: Under ``"raise"``, at the minimum scale or after
                `patience` consecutive skips. Nothing is counted when it raises.
        """
        consecutive = self.consecutive + 1
        if self.mode == "raise" and (at_minimum or consecutive >= self.patience):
            why = ("the loss scale is at its minimum" if at_minimum
                   else f"{consecutive} consecutive steps were skipped")
            raise OverflowPersistsError(
                f"{report.summary()}\nampx: on_overflow='raise': {why}. Inspect the modules "
                "above, lower the learning rate, or use bf16.", report)
        self.consecutive = consecutive
        if self.mode != "fp32-fallback" or not attribute:
            return None
        culprit = self.culprit(report)
        if culprit is None:
            return None
        count = self.attributions.get(culprit, 0) + 1
        self.attributions[culprit] = count
        if count < self.patience:
            return None
        self.fallback.append(culprit)
        return culprit

    def culprit(self, report: OverflowReport) -> str | None:
        """The module a skip is attributed to (modules already in fp32 pass it on)."""
        if report.forward_module is not None:
            module = report.forward_module
            while module in self.fallback:  # already fp32 yet still overflowing: its parent
                if module == ROOT_MODULE:
                    return None
                module = module.rpartition(".")[0] or ROOT_MODULE
            return module
        for module, _ in report.modules:
            if module not in self.fallback:
                return module
        return None

    def state_dict(self) -> dict[str, Any]:
        """``{"on_overflow", "patience", "consecutive", "attributions", "fp32_modules"}``."""
        return {"on_overflow": self.mode, "patience": self.patience,
                "consecutive": self.consecutive, "attributions": dict(self.attributions),
                "fp32_modules": list(self.fallback)}

    @staticmethod
    def validate_state(state: Any, key: str = "overflow_policy") -> dict[str, Any]:
        """Check a saved policy state; returns the values to apply.

        Raises:
            ValueError: Naming `key` and the malformed field.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"{key}: expected a dict; got {type(state).__name__}.")
        consecutive = state.get("consecutive", 0)
        attributions = state.get("attributions", {})
        modules = state.get("fp32_modules", [])
        if isinstance(consecutive, bool) or not isinstance(consecutive, int) or consecutive < 0:
            raise ValueError(f"{key}.consecutive must be an int >= 0; got {consecutive!r}.")
        if not (isinstance(attributions, Mapping) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                and v >= 0 for k, v in attributions.items())):
            raise ValueError(f"{key}.attributions must map module names to counts.")
        if not (isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules)):
            raise ValueError(f"{key}.fp32_modules must be a list of module names.")
        return {"consecutive": consecutive, "attributions": dict(attributions),
                "fp32_modules": list(dict.fromkeys(modules))}

    def load_checked(self, checked: Mapping[str, Any]) -> list[str]:
        """Apply :meth:`validate_state` output; returns modules to move to fp32 now."""
        new = [m for m in checked["fp32_modules"] if m not in self.fallback]
        self.consecutive = checked["consecutive"]
        self.attributions = dict(checked["attributions"])
        self.fallback.extend(new)
        return new


def find_module(models: Sequence[nn.Module], name: str) -> nn.Module:
    """The module called `name` in a report (``model<i>.`` prefix with several models).

    Raises:
        KeyError: When no model has it.
    """
    index, rest = 0, name
    if len(models) > 1:
        head, _, rest = name.partition(".")
        if not (head.startswith("model") and head[5:].isdigit()):
            raise KeyError(f"ampx: no module {name!r} (expected a model<i>. prefix)")
        index = int(head[5:])
    if rest == ROOT_MODULE:
        return models[index]
    try:
        return models[index].get_submodule(rest)
    except (AttributeError, IndexError) as exc:
        raise KeyError(f"ampx: no module {name!r} in the initialized models") from exc


class Fp32Fallback:
    """Run one module in float32 from now on (hooks; :meth:`remove` undoes them).

    Args:
        module: The module.
        disable_casts: O1: run its forward with ``ampx.disable_casts()``.
        cast_back: O2: cast its outputs back to the dtype its inputs came in.
        master_of: O2: a half parameter's fp32 master (None for a parameter without one).
            For the length of each forward, every such parameter of the module is replaced
            by a tensor whose value is its master and whose gradient flows into the half
            parameter: the module computes with the fp32 masters while the model keeps its
            own Parameters, so a DistributedDataParallel wrapper made earlier still reduces
            their gradients, and the optimizer still steps the masters.
    """

    def __init__(self, module: nn.Module, *, disable_casts: bool, cast_back: bool,
                 master_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None
                 ) -> None:
        self.module = module
        self.disable_casts = disable_casts
        self.cast_back = cast_back
        self.master_of = master_of
        # one (incoming dtype, journal) per forward in flight: the journal re-enables casts
        self._calls: list[tuple[torch.dtype | None, Journal]] = []
        self._handles: list[Any] = []
        with Journal().atomic() as journal:
            journal.record(self._remove_handles)
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        incoming = _first_float_dtype((args, kwargs))
        journal = Journal()
        if self.disable_casts:
            casts_off = patch.disable_casts()
            casts_off.__enter__()
            journal.record(functools.partial(casts_off.__exit__, None, None, None))
        self._calls.append((incoming, journal))
        if self.master_of is not None:
            _compute_with_masters(self.module, self.master_of, journal)
        return (cast_tree(args, torch.float32, _is_half),
                cast_tree(kwargs, torch.float32, _is_half))

    def _post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._calls:
            return None
        incoming, journal = self._calls.pop()
        journal.rollback()
        if self.cast_back and incoming in HALF_DTYPES and output is not None:
            return cast_tree(output, incoming, _always)
        return None

    def unwind(self) -> None:
        """Re-enable casts left disabled by a forward interrupted by a BaseException.

        torch runs ``always_call`` hooks on ``Exception`` only; the step boundary calls this.
        """
        while self._calls:
            self._calls.pop()[1].rollback()

    def _remove_handles(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def remove(self) -> None:
        """Remove the hooks."""
        self.unwind()
        self._remove_handles()


def _compute_with_masters(module: nn.Module,
                          master_of: Callable[[torch.Tensor], torch.Tensor | None],
                          journal: Journal) -> None:
    """For one forward: each half parameter with a master becomes ``master + (p - p)``.

    Its value is the master's, bit for bit; its gradient goes to the half parameter ``p``
    (cast to p's dtype), where DDP's hooks and the O2 unscale expect it. The journal puts
    the Parameters back when the forward ends.
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            master = master_of(param) if param is not None else None
            if param is None or master is None:
                continue
            view = master.detach() + (param - param.detach()).to(master.dtype)
            journal.setitem(sub._parameters, name, view)


def float_buffers(module: nn.Module, journal: Journal) -> int:
    """O2 fallback: `module`'s half floating buffers become float32 (recorded in `journal`)."""
    count = 0
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.dtype in HALF_DTYPES:
                journal.setitem(sub._buffers, name, buf.float())
                count += 1
    return count


def params_with_masters(module: nn.Module,
                        master_of: Callable[[torch.Tensor], torch.Tensor | None]) -> int:
    """How many of `module`'s parameters have an fp32 master (for the log line)."""
    return sum(1 for p in module.parameters() if master_of(p) is not None)


def _first_float_dtype(value: Any) -> torch.dtype | None:
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(items, (tuple, list)) or isinstance(value, Mapping):
        for item in items:
            found = _first_float_dtype(item)
            if found is not None:
                return found
    return None


def _is_half(tensor: torch.Tensor) -> bool:
    return tensor.dtype in HALF_DTYPES


def _always(tensor: torch.Tensor) -> bool:
    return True
