"""The step's decision and what the step transitions use around it.

`StepDecision` is what the step pre-hook decided (`OptimizerAmpState.decide_step`: skip or
not, or the device flag a fused optimizer skips on) and what tells, later, that the
optimizer's update ran (`version_mark`: one stepped parameter's version counter), so an
interrupted step is completed exactly once. `creates_state` says when a fused step must be
decided on the host; `copy_masters` is the O2 master -> model copy of a completed step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .. import _ext
from .masters import ParamCache

__all__ = ["StepDecision", "copy_masters", "creates_state", "version_mark"]


class StepDecision:
    """The pre-hook's decision, committed by the post-hook (discarded if step raised).

    Attributes:
        skip: Whether the step is skipped (decided on the host).
        flag: Fused path: the device flag handed to the optimizer.
        mark: (a stepped parameter, its version before the step): a changed version means
            the optimizer's update ran, even if the step was interrupted before the post hook.
        frame: The frame running the step's hooks (torch's step wrapper), set by the pre-hook:
            while it is on the stack, the step runs (`running`).
        resync: O2: a closure call copied the masters into the model during the step, so
            the post-hook copies them even when the step is skipped.
    """

    __slots__ = ("skip", "flag", "mark", "cache", "frame", "resync")

    def __init__(self, skip: bool = False, flag: torch.Tensor | None = None,
                 mark: tuple[torch.Tensor, int] | None = None,
                 cache: ParamCache | None = None) -> None:
        self.skip, self.flag, self.mark = skip, flag, mark
        self.cache = cache  # the parameter views the step ran over (the post hook's too)
        self.frame: Any = None
        self.resync = False

    def running(self) -> bool:
        """Whether the step is still running on this thread (its hooks' frame is on the
        stack): a `zero_grad` or `scale_loss` from inside it (an optimizer's closure, SAM's
        own `zero_grad`) must not complete it, and a nested step (`super().step()` of a
        hooked base class) is part of it."""
        target = self.frame
        if target is None:
            return False
        frame: Any = sys._getframe(1)
        while frame is not None:
            if frame is target:
                return True
            frame = frame.f_back
        return False

    def updated(self) -> bool:
        """Whether the optimizer changed its parameters since the decision (no sync)."""
        return self.mark is not None and self.mark[0]._version != self.mark[1]


def version_mark(cache: ParamCache) -> tuple[torch.Tensor, int] | None:
    """(first stepped parameter with a gradient, its version): what `updated` compares."""
    for param in cache.targets:  # (masters, then others: usually the first one has one)
        if param.grad is not None:
            return param, param._version
    return None


def creates_state(optimizer: torch.optim.Optimizer, cache: ParamCache) -> bool:
    """Whether this fused step would create torch SGD momentum buffers (a first step).

    Such a step is decided on the host, not in the fused kernel: torch's fused SGD allocates
    its momentum buffers with `empty_like` and its kernel returns early on `found_inf`, so a
    skipped first step would leave garbage momentum behind. (Fused Adam/AdamW make zeros and
    take their step counts back; Adagrad makes its state at construction.)
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    state = optimizer.state
    if len(state) >= len(cache.params):  # the usual case: every parameter has its buffer
        return False
    return any(group.get("momentum", 0) != 0 and p.grad is not None
               and "momentum_buffer" not in state.get(p, {})
               for group in optimizer.param_groups for p in group["params"])


def copy_masters(cache: ParamCache) -> BaseException | None:
    """Copy the masters into the half model params; on failure redo it with plain torch.

    No `with torch.no_grad()`: an interrupt can land between a `with` body's last line and
    the call of its `__exit__` (or at `__exit__`'s entry), which would leave grad mode off
    for the rest of the script. The kernels write the parameters without autograd, and the
    fallback writes through detached aliases (same storage and version counter).
    """
    try:
        _ext.copy_(cache.masters, cache.models)
        return None
    except BaseException as exc:
        for master, model in zip(cache.masters, cache.models):
            model.detach().copy_(master)
        return exc
