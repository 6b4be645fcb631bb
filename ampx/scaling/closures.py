"""`optimizer.step(closure)`: the closure the optimizer's own step receives.

Each call the optimizer makes runs the user's closure for real, as `step` would without
ampx: a forward at the parameters as they are at that moment, then the closure's own
`scale_loss` backward, a complete checked pass (unscale, inf/NaN check, scaler update). So
an optimizer that calls its closure after changing the weights (SAM: perturb, `zero_grad`,
closure, restore, update) gets the gradient of the perturbed point, and one that calls it
first (every torch optimizer but LBFGS) gets exactly `closure(); step()`.

- Casts: the closure runs with O1's casts as they were before the step
  (`regions.call_outside_step`); only the optimizer's own math runs with them off.
- O2: the optimizer steps the fp32 masters, while the closure's forward reads the half
  model; before each call the masters are copied into the model (SAM's perturbation
  reaches the forward), and the post-hook copies them again even on a skipped step.
- The skip decision: the pre-hook decides on the passes before the step (their overflow
  skips the whole step: the optimizer runs on a stand-in, and the closure still runs so
  that `step` returns its result). After each call the flag of the passes since then is
  read: on inf/NaN the step becomes a skipped one from that point on, and the optimizer
  sees no gradients (every parameter it steps has `.grad = None`, which torch's optimizers
  skip). What the optimizer did to the weights before that call stays (SAM undoes its own
  perturbation); LBFGS, which moves the weights between evaluations of one step, is
  therefore refused under loss scaling (`check`). A fused optimizer decided on the device
  flag gets the new flag instead (no host sync).

An exception in the closure leaves its pass aborted by its own `scale_loss` and the step
pending, as any step that raised before changing a parameter (`step()` again retries it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..o1 import regions
from .decision import StepDecision, copy_masters, version_mark
from .protocol import OptimizerAmpState, Stage

__all__ = ["LiveClosure", "check"]


def check(optimizer: torch.optim.Optimizer, state: OptimizerAmpState) -> None:
    """Refuse what cannot be checked (before anything runs): LBFGS under loss scaling."""
    if state.policy.scales and isinstance(optimizer, torch.optim.LBFGS):
        raise RuntimeError(
            "optimizer.step(closure): LBFGS evaluates its closure several times inside "
            "step() and moves the weights between evaluations, so an inf/NaN gradient at a "
            "later evaluation cannot skip the step; train LBFGS at opt_level='O0' or "
            "without loss scaling (loss_scale=1.0; torch.amp's GradScaler refuses closures "
            "too).")


class LiveClosure:
    """What the optimizer's own step calls as its closure (module docstring).

    Args:
        closure: The user's closure.
        optimizer: The real optimizer (its stepped parameters lose their gradients when the
            step becomes a skipped one).
        state: Its ampx state.
        decision: The step's decision (the pre-hook's), updated after each call.
        checked: Whether the session scales and checks gradients (False on the short-circuit
            path: only the casts matter).
    """

    __slots__ = ("closure", "optimizer", "state", "decision", "checked", "entry_skip")

    def __init__(self, closure: Any, optimizer: torch.optim.Optimizer,
                 state: OptimizerAmpState, decision: StepDecision, checked: bool) -> None:
        self.closure = closure
        self.optimizer = optimizer
        self.state = state
        self.decision = decision
        self.checked = checked
        self.entry_skip = decision.skip  # the optimizer runs on a stand-in

    def __call__(self) -> Any:
        decision = self.decision
        if not self.entry_skip:
            cache = decision.cache
            if cache is not None and cache.pairs:  # the forward reads the half model
                decision.resync = True
                copy_masters(cache)  # (a failed native copy is redone in plain torch)
        result = regions.call_outside_step(self._run)
        if self.checked and not self.entry_skip:
            self._decide()
        return result

    def _run(self) -> Any:
        with torch.enable_grad():
            return self.closure()

    def _decide(self) -> None:
        """After a call: the flag of the passes since the step began (or since a zero_grad)
        decides; a skip withholds every gradient from the rest of the step."""
        state, decision = self.state, self.decision
        cache = decision.cache
        if decision.mark is None and cache is not None:  # no gradient before the step
            decision.mark = version_mark(cache)  # (what tells an interrupted update ran)
        found = state.found_inf
        if not decision.skip and state.stage is Stage.UNSCALED and found is not None \
                and state.policy.skips:
            if decision.flag is not None:  # fused, decided on the device: the new flag
                decision.flag = flag = found.reshape(())
                self.optimizer.found_inf = flag  # type: ignore[attr-defined]
                return
            decision.skip = bool(found.item())
        if decision.skip:
            for param in cache.targets if cache is not None else ():
                param.grad = None
