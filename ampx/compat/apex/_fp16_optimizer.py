"""apex's `FP16_Optimizer` and its loss scalers, on today's torch.

`FP16_Optimizer` wraps an optimizer whose parameters are (partly) half precision: it gives the
wrapped optimizer float32 master copies of the half parameters, owns the backward pass
(``optimizer.backward(loss)`` scales the loss, copies the half gradients into the masters and
unscales them), skips the step after an overflow when the scale is dynamic, and copies the
updated masters back into the half parameters. The names, arguments, defaults, the dynamic
scaling rule (start 2**32, halve on overflow but not below 1, double after `scale_window`
clean iterations) and the state dict keys are apex's. Changes: "half" means float16 or
bfloat16, on any device; messages go to the `logging` logger "ampx" instead of `print`; the
overflow check reads one flag for all gradients (apex synced once per tensor); the state dict
stores the loss scaler as a plain dict (loadable with ``torch.load(weights_only=True)``), and
`load_state_dict` also accepts apex's pickled scaler objects; it validates the checkpoint
before changing anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...options.values import HALF_DTYPES
from ._fp16util import master_params_to_model_params, model_grads_to_master_grads

__all__ = ["DynamicLossScaler", "FP16_Optimizer", "LossScaler"]

logger = logging.getLogger("ampx")

_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def _any_non_finite(grads: list[torch.Tensor]) -> bool:
    """Whether any gradient holds an inf or NaN (one host sync for all of them)."""
    if not grads:
        return False
    device = grads[0].device
    flags = [(~torch.isfinite(g)).any().to(device) for g in grads]
    return bool(torch.stack(flags).any().item())


class LossScaler:
    """A static loss scale (apex's `LossScaler`): never overflows, never changes.

    Args:
        scale: The loss scale.
    """

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Always False: a static scale does not check."""
        return False

    def update_scale(self, overflow: bool) -> None:
        """No-op."""

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: Any) -> tuple:
        """Multiply gradients by the scale (apex's backward-hook helper)."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``."""
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """apex's dynamic loss scaler for `FP16_Optimizer`.

    Args:
        init_scale: The first scale tried.
        scale_factor: Divide by it after an overflow (not below 1), multiply by it after
            `scale_window` iterations without one.
        scale_window: Clean iterations before the scale grows.
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0,
                 scale_window: int = 1000) -> None:
        if init_scale <= 0 or scale_factor <= 1 or scale_window < 1:
            raise ValueError("DynamicLossScaler: init_scale must be > 0, scale_factor > 1 and "
                             f"scale_window >= 1 (got {init_scale}, {scale_factor}, "
                             f"{scale_window})")
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any parameter's gradient holds an inf or NaN."""
        return _any_non_finite([p.grad for p in params if p.grad is not None])

    def update_scale(self, overflow: bool) -> None:
        """apex's rule: back off on overflow, grow every `scale_window` clean iterations."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _scaler_state(scaler: LossScaler) -> dict[str, Any]:
    return {k: getattr(scaler, k) for k in _SCALER_FIELDS if hasattr(scaler, k)}


def _scaler_from(saved: Any, dynamic: bool) -> LossScaler:
    """A scaler rebuilt from a saved dict (ampx) or a pickled scaler object (apex)."""
    fields = saved if isinstance(saved, dict) else getattr(saved, "__dict__", None)
    if not isinstance(fields, dict) or "cur_scale" not in fields:
        raise ValueError("FP16_Optimizer.load_state_dict: 'loss_scaler' holds no cur_scale")
    if not dynamic:
        return LossScaler(fields["cur_scale"])
    missing = [k for k in _SCALER_FIELDS if k not in fields]
    if missing:
        raise ValueError(f"FP16_Optimizer.load_state_dict: 'loss_scaler' lacks {missing}")
    scaler = DynamicLossScaler(fields["cur_scale"], fields["scale_factor"],
                               fields["scale_window"])
    scaler.cur_iter, scaler.last_overflow_iter = fields["cur_iter"], fields["last_overflow_iter"]
    return scaler


class FP16_Optimizer:
    """Master weights and loss scaling around an optimizer (apex.fp16_utils.FP16_Optimizer).

    Args:
        init_optimizer: The optimizer to wrap; its half parameters are replaced, in its
            param groups, by float32 masters (their state moves along).
        static_loss_scale: The loss scale when not dynamic.
        dynamic_loss_scale: Use a `DynamicLossScaler` (overrides `static_loss_scale`).
        dynamic_loss_args: Keyword arguments for `DynamicLossScaler`.
        verbose: Log each parameter ingested (logger "ampx", INFO).

    Example::

        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   dynamic_loss_scale=True)
        optimizer.zero_grad()
        optimizer.backward(loss)        # replaces loss.backward()
        optimizer.clip_master_grads(1.0)
        optimizer.step()
    """

    def __init__(self, init_optimizer: Any, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False,
                 dynamic_loss_args: dict[str, Any] | None = None, verbose: bool = True) -> None:
        self.verbose = verbose
        if dynamic_loss_scale:
            scaler: LossScaler = DynamicLossScaler(**(dynamic_loss_args or {}))
        else:
            scaler = LossScaler(static_loss_scale)
        self._check_params(init_optimizer)
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for i, group in enumerate(init_optimizer.param_groups):
            self._ingest(i, group)
        # Recast pre-existing per-parameter state (e.g. momentum) to the masters' dtype.
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.loss_scaler = scaler
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_

    @staticmethod
    def _check_params(optimizer: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.dtype not in (*HALF_DTYPES, torch.float32):
                    raise TypeError("Wrapped parameters must be either float32 or half "
                                    f"(float16/bfloat16) tensors. Received {p.type()}")

    def _ingest(self, index: int, group: dict[str, Any]) -> None:
        self.maybe_print(f"FP16_Optimizer processing param group {index}:")
        halves, fp32s, masters = [], [], []
        for i, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            self.maybe_print(f"FP16_Optimizer received {p.type()} with {tuple(p.size())}")
            if p.dtype in HALF_DTYPES:
                master = p.detach().clone().float().requires_grad_(True)
                group["params"][i] = master
                if p in self.optimizer.state:
                    self.optimizer.state[master] = self.optimizer.state.pop(p)
                halves.append(p)
                masters.append(master)
            else:
                fp32s.append(p)
        self.fp16_groups.append(halves)
        self.fp32_from_fp16_groups.append(masters)
        self.fp32_from_fp32_groups.append(fp32s)

    def maybe_print(self, msg: str) -> None:
        """Log `msg` (logger "ampx", INFO) when verbose."""
        if self.verbose:
            logger.info("%s", msg)

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # apex's name
        """Zero (or set to None) the masters' and the half model parameters' gradients."""
        groups = [g["params"] for g in self.optimizer.param_groups] + self.fp16_groups
        for params in groups:
            for p in params:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def _model_grads(self) -> list[torch.Tensor]:
        return [p for group in self.fp16_groups + self.fp32_from_fp32_groups for p in group]

    def _check_overflow(self) -> None:
        self.overflow = self.loss_scaler.has_overflow(self._model_grads())

    def _update_scale(self, has_overflow: bool = False) -> None:
        self.loss_scaler.update_scale(has_overflow)

    def _master_params_to_model_params(self) -> None:
        for halves, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups):
            master_params_to_model_params(halves, masters)

    def _model_params_to_master_params(self) -> None:
        for halves, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups):
            master_params_to_model_params(masters, halves)

    def _model_grads_to_master_grads(self) -> None:
        for halves, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups):
            model_grads_to_master_grads(halves, masters)

    def _downscale_master(self) -> None:
        if self.loss_scale != 1.0:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / self.loss_scale)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> Any:
        """Clip the float32 master gradients; returns their total norm, or -1 after overflow."""
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        """apex's keys: loss_scaler, dynamic_loss_scale, overflow, first_closure_call_this_step,
        optimizer_state_dict and fp32_from_fp16 (the masters)."""
        return {
            "loss_scaler": _scaler_state(self.loss_scaler),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()` (ampx's or apex's); checked fully before anything changes.

        Raises:
            ValueError: For a missing key, a malformed loss scaler or masters of another shape.
        """
        keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                "optimizer_state_dict", "fp32_from_fp16")
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(f"FP16_Optimizer.load_state_dict: missing key(s) {missing}")
        scaler = _scaler_from(state_dict["loss_scaler"], bool(state_dict["dynamic_loss_scale"]))
        saved = state_dict["fp32_from_fp16"]
        shapes = [[tuple(p.shape) for p in g] for g in self.fp32_from_fp16_groups]
        if [[tuple(p.shape) for p in g] for g in saved] != shapes:
            raise ValueError("FP16_Optimizer.load_state_dict: fp32_from_fp16 does not match "
                             "this optimizer's half parameters (another model?)")
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler = scaler
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])
        with torch.no_grad():
            for current, loaded in zip(self.fp32_from_fp16_groups, saved):
                for p, value in zip(current, loaded):
                    p.copy_(value)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the scale; unless the gradients overflowed, step the masters and copy them
        into the half parameters. Returns the closure's loss (None on a skipped step)."""
        if closure is not None and isinstance(self.loss_scaler, DynamicLossScaler):
            raise TypeError("Using step with a closure is currently not compatible with "
                            "dynamic loss scaling.")
        scale = self.loss_scaler.loss_scale
        self._update_scale(self.overflow)
        if self.overflow:
            logger.info("OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s",
                        scale, self.loss_scale)
            return None
        if closure is not None:
            retval = self._step_with_closure(closure)
        else:
            retval = self.optimizer.step()
        with torch.no_grad():
            self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                with torch.no_grad():
                    self._master_params_to_model_params()
            return closure()

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``, then (by default) `update_master_grads`."""
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Check for overflow (dynamic scale), copy the half gradients into the masters and
        unscale the masters' gradients."""
        if self.dynamic_loss_scale:
            self._check_overflow()
            if self.overflow:
                return
        with torch.no_grad():
            self._model_grads_to_master_grads()
            self._downscale_master()

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """The masters' gradients per param group (None while in an overflow state)."""
        if self.overflow:
            logger.warning("FP16_Optimizer.inspect_master_grad_data called in an overflow "
                           "state: gradients are invalid; returning None.")
            return None
        return [[p.grad for p in g["params"]] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (settable)."""
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:
        """The wrapped optimizer's param groups (e.g. to set the learning rate)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value
