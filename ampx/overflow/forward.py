"""Opt-in forward provenance: the first module whose output became non-finite in a step.

:class:`ForwardDetector` puts one forward hook on every module of the models. Each hook
records, on the device, the largest magnitude of the module's floating outputs
(``abs().max()``: inf for an inf, NaN for a NaN, finite otherwise) into a per-step list,
in hook order, which is execution order with children before their parent. Nothing is read
on the host until a step is skipped; then :meth:`ForwardDetector.first_nonfinite` copies the
list once and returns the first module whose output was not finite, which is where the
activations overflowed (every later module just propagates it).

Only forwards with autograd enabled are recorded (evaluation under ``torch.no_grad()`` costs a
flag check). At most `capacity` outputs are kept per step; after that each module folds its
outputs into one running maximum, so a loop that never steps cannot grow memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .report import ROOT_MODULE

__all__ = ["ForwardDetector"]


def _outputs(output: Any) -> list[torch.Tensor]:
    """The non-empty floating tensors of a module output (one level into tuples and dicts)."""
    if isinstance(output, torch.Tensor):
        items: Sequence[Any] = (output,)
    elif isinstance(output, (tuple, list)):
        items = output
    elif isinstance(output, dict):
        items = list(output.values())
    else:
        return []
    return [t for t in items
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


class _Hook:
    """The forward hook of one module: records its output magnitude (no host sync)."""

    __slots__ = ("detector", "index")

    def __init__(self, detector: ForwardDetector, index: int) -> None:
        self.detector = detector
        self.index = index

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        det = self.detector
        for t in _outputs(output):
            value = t.detach().abs().max()
            if len(det._values) < det.capacity:
                det._values.append(value)
                det._modules.append(self.index)
            else:
                det._fold(self.index, value)


class ForwardDetector:
    """Forward hooks that find the first module whose output was non-finite.

    Args:
        models: The models to watch (all their modules, the models themselves included).
        capacity: Outputs recorded in order per step before folding per module.

    Example::

        detector = ForwardDetector([model])
        loss = model(x).sum()
        ...  # backward; the step was skipped
        detector.first_nonfinite()   # ("encoder.layers.3.self_attn", "inf")
        detector.clear()             # after every step
    """

    def __init__(self, models: Sequence[nn.Module], capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"ForwardDetector: capacity must be >= 1; got {capacity}")
        self.capacity = capacity
        self.names: list[str] = []
        self._values: list[torch.Tensor] = []
        self._modules: list[int] = []
        self._late: dict[int, torch.Tensor] = {}
        self._late_order: list[int] = []
        self._handles: list[Any] = []
        try:
            for i, model in enumerate(models):
                prefix = f"model{i}." if len(models) > 1 else ""
                for name, module in model.named_modules():
                    self.names.append(prefix + name if name else prefix + ROOT_MODULE)
                    hook = _Hook(self, len(self.names) - 1)
                    self._handles.append(module.register_forward_hook(hook))
        except BaseException:
            self.remove()
            raise

    def _fold(self, index: int, value: torch.Tensor) -> None:
        value = value.float()
        old = self._late.get(index)
        if old is None:
            self._late[index] = value
            self._late_order.append(index)
        else:  # torch.maximum propagates NaN
            self._late[index] = torch.maximum(old, value.to(old.device))

    @property
    def recorded(self) -> int:
        """Outputs recorded since the last :meth:`clear`."""
        return len(self._values) + len(self._late)

    def clear(self) -> None:
        """Forget this step's records (after every step; no host sync)."""
        self._values.clear()
        self._modules.clear()
        self._late.clear()
        self._late_order.clear()

    def first_nonfinite(self) -> tuple[str, str] | None:
        """``(module name, "inf" | "nan")`` of the first non-finite output, or None.

        .. note:: Copies this step's records to the host (one sync); call it on skipped
           steps only.
        """
        entries = list(zip(self._modules, self._values))
        entries += [(i, self._late[i]) for i in self._late_order]
        if not entries:
            return None
        device = entries[0][1].device
        host = torch.stack([v.float().to(device) for _, v in entries]).tolist()
        for (index, _), value in zip(entries, host):
            if not math.isfinite(value):
                return self.names[index], "nan" if math.isnan(value) else "inf"
        return None

    def remove(self) -> None:
        """Remove every hook (``restore``, or a failed ``initialize``)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()
