"""How an `AmpOptimizer` update is carried out: with fp32 masters (default) or memory-efficiently.

`MasterStrategy` drives an optimizer initialized by an ampx session through the session's own
scaled-backward transitions (`ampx.scaling.protocol`): every micro-batch is a `delay_unscale` pass,
and the update is finished by one checking pass with no backward of its own.

`MemoryEfficientStrategy` is fairseq's MemoryEfficientFP16Optimizer idea for half-precision
parameters without fp32 masters (O3, or O2 with `master_weights=False`): gradients stay scaled
in half precision, and at `step` each parameter is stepped with float32 math: its gradient is
unscaled into float32 on the fly, the optimizer runs on float32 values and keeps float32 state,
and the result is rounded back into the half parameter. Any `torch.optim` optimizer whose state
is created like its parameters works (SGD, Adam, AdamW, Adagrad, RMSprop, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch

from ... import _ext
from ...frontend import Amp
from ...options.values import HALF_DTYPES
from ...scaling.masters import optimizer_params
from ...scaling.protocol import Stage, amp_state_of
from ...scaling.scaler import LossScaler

__all__ = ["MasterStrategy", "MemoryEfficientStrategy", "Strategy", "make_strategy"]

HALF = HALF_DTYPES
Factor = Union[float, torch.Tensor]


def grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients the optimizer would step."""
    return [p.grad for p in optimizer_params(optimizer) if p.grad is not None]


class MasterStrategy:
    """The default mode: the session's transitions, fp32 masters at O2."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp: Amp, loss_id: int) -> None:
        self.optimizer, self.amp, self.loss_id = optimizer, amp, loss_id
        self.local_norm: torch.Tensor | None = None

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch: a scaled backward whose gradients stay scaled."""
        with self.amp.scale_loss(loss, self.optimizer, loss_id=self.loss_id,
                                 delay_unscale=True) as scaled:
            scaled.backward()

    def finish(self, scaler: LossScaler, last_loss: torch.Tensor | None) -> bool:
        """Unscale, check, agree across ranks and update the scale; False if nothing to do."""
        state = amp_state_of(self.optimizer)
        if state is None or state.stage is not Stage.SCALED or last_loss is None:
            return False  # a session that doesn't scale (O0, O3 with fp16)
        # A pass with no backward of its own unscales what the delayed passes left.
        with self.amp.scale_loss(last_loss, self.optimizer, loss_id=self.loss_id):
            pass
        return True

    def flag(self) -> torch.Tensor | None:
        """The update's overflow flag (None when no checked pass ran)."""
        state = amp_state_of(self.optimizer)
        return state.pending_flag() if state is not None else None

    def skip(self, flag_set: bool) -> None:
        """Consume the update as a skipped step of the optimizer (ampx logs and counts it)."""
        state = amp_state_of(self.optimizer)
        if state is not None and state.pending_flag() is not None:
            if not flag_set:  # finite gradients whose norm overflowed: skip all the same
                state.mark_overflow()
            self.optimizer.step()  # the step pre-hook turns it into a skipped step
        else:
            for param in optimizer_params(self.optimizer):
                param.grad = None

    def step(self, factor: Factor) -> None:
        """Apply the folded factor to the gradients, then the optimizer's step."""
        if not (isinstance(factor, (int, float)) and factor == 1.0):
            with torch.no_grad():
                _ext.mul_(grads_of(self.optimizer), factor)
        self.optimizer.step()

    def load_optimizer_state(self, inner: Mapping[str, Any]) -> None:
        """The wrapped optimizer's `load_state_dict`."""
        self.optimizer.load_state_dict(dict(inner))

    def reset(self) -> None:
        """Forget the finished update (nothing kept here)."""


class MemoryEfficientStrategy:
    """Half parameters stepped with float32 math, gradients kept scaled in half."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp: Amp, loss_id: int) -> None:
        self.optimizer, self.amp, self.loss_id = optimizer, amp, loss_id
        self.local_norm: torch.Tensor | None = None
        self._found: torch.Tensor | None = None
        self.factor_from_scale: torch.Tensor | None = None

    @staticmethod
    def check(amp: Amp, optimizer: torch.optim.Optimizer, state: Any) -> None:
        """Raise ValueError unless this mode suits the session and the parameters."""
        if not amp.enabled:
            raise ValueError("AmpOptimizer(memory_efficient=True) needs an enabled Amp session.")
        if amp.properties.master_weights or (state is not None and len(state.masters)):
            raise ValueError(
                "AmpOptimizer(memory_efficient=True) replaces fp32 master weights; the session "
                f"uses them ({amp.properties.opt_level.value}). Use opt_level='O3' (with "
                "loss_scale='dynamic' for fp16) or O2 with master_weights=False."
            )
        if not any(p.dtype in HALF for p in optimizer_params(optimizer)):
            raise ValueError(
                "AmpOptimizer(memory_efficient=True) is for half-precision parameters (O3, or O2 "
                "with master_weights=False); these are all float32: use the default mode."
            )

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch: backward of the scaled loss, gradients stay scaled in half."""
        self.amp.scalers[self.loss_id].scale_loss_value(loss).backward()

    def finish(self, scaler: LossScaler, last_loss: torch.Tensor | None) -> bool:
        """Norm of the scaled gradients (the overflow check), agree, update the scale."""
        norm = _ext.l2norm(grads_of(self.optimizer))
        assert isinstance(norm, torch.Tensor)
        found = (~torch.isfinite(norm)).float().reshape(1).to(scaler.device)
        self.amp.synchronize_found_inf(found)
        self.factor_from_scale = scaler.inv_scale().reshape(()).to(norm.device)
        scaler.update_(found)
        self._found, self.local_norm = found, norm
        return True

    def flag(self) -> torch.Tensor | None:
        """The update's overflow flag."""
        return self._found

    def skip(self, flag_set: bool) -> None:
        """Drop the update's gradients and report the overflow."""
        for param in optimizer_params(self.optimizer):
            param.grad = None
        self.amp.scalers[self.loss_id].report_overflow()

    def step(self, factor: Factor) -> None:
        """Step half parameters with float32 math and float32 optimizer state."""
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for param in optimizer_params(self.optimizer):
                grad = param.grad
                if grad is None:
                    continue
                f = factor if isinstance(factor, (int, float)) else factor.to(grad.device)
                if param.dtype in HALF:
                    half = param.data
                    grad32 = grad.float().mul_(f)
                    param.grad = None
                    param.data = half.float()
                    param.grad = grad32
                    swapped.append((param, half))
                else:
                    grad.mul_(f)
        try:
            self.optimizer.step()
        finally:
            with torch.no_grad():
                for param, half in swapped:
                    half.copy_(param.data)
                    param.grad = None
                    param.data = half

    def load_optimizer_state(self, inner: Mapping[str, Any]) -> None:
        """`load_state_dict` with the half parameters holding float32 data meanwhile."""
        params = [p for p in optimizer_params(self.optimizer) if p.dtype in HALF]
        halves = [p.data for p in params]
        try:
            for param in params:
                param.data = param.data.float()
            self.optimizer.load_state_dict(dict(inner))
        finally:
            for param, half in zip(params, halves):
                param.data = half

    def reset(self) -> None:
        """Forget the finished update."""
        self._found, self.local_norm, self.factor_from_scale = None, None, None


Strategy = Union[MasterStrategy, MemoryEfficientStrategy]


def make_strategy(optimizer: torch.optim.Optimizer, amp: Amp | None, loss_id: int,
                  memory_efficient: bool) -> Strategy:
    """Check the wrapper's arguments and pick its strategy (`AmpOptimizer.__init__`).

    Raises:
        TypeError: If `optimizer` is not one, or never went through `amp.initialize` (default
            mode).
        ValueError: For an optimizer initialized by another session, a bad `loss_id`, or
            `memory_efficient` with master weights or fp32 parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("AmpOptimizer: expected a torch.optim.Optimizer; got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}.")
    state = amp_state_of(optimizer)
    if amp is None:
        if state is None or not isinstance(state.owner, Amp):
            raise TypeError(
                "AmpOptimizer needs an optimizer passed through ampx.Amp.initialize() (or "
                "amp=... in memory_efficient mode); got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}.")
        amp = state.owner
    if state is not None and state.owner is not amp:
        raise ValueError("AmpOptimizer: this optimizer was initialized by another Amp "
                         "session; pass that session (or amp=None).")
    if not 0 <= loss_id < len(amp.scalers):
        raise ValueError(f"AmpOptimizer: loss_id={loss_id} but the session has "
                         f"{len(amp.scalers)} loss scaler(s) (num_losses).")
    if memory_efficient:
        MemoryEfficientStrategy.check(amp, optimizer, state)
        return MemoryEfficientStrategy(optimizer, amp, loss_id)
    if state is None and amp.enabled:
        raise TypeError("AmpOptimizer needs an optimizer passed through amp.initialize(); got "
                        "one that was not (pass memory_efficient=True for a plain optimizer "
                        "over half parameters).")
    return MasterStrategy(optimizer, amp, loss_id)
