"""`apex.optimizers` for legacy scripts: FusedAdam, FusedSGD, FusedLAMB, FusedNovoGrad.

ampx implementations of apex's fused optimizers, written from apex's documented signatures and
its kernels' update rules (multi_tensor_adam, multi_tensor_sgd, multi_tensor_lamb,
multi_tensor_novograd), in plain torch, so they run on every device. They are ordinary
`torch.optim.Optimizer` subclasses: `ampx.initialize` accepts them, LR schedulers drive them,
and `state_dict()` round-trips.

As in apex's kernels, the arithmetic runs in float32 (float64 for float64 parameters) whatever
the parameter dtype, and the result is rounded once into the parameter. Changes from apex:
optimizer state is always kept in float32 (apex kept FusedSGD/LAMB/NovoGrad state in the
parameter's dtype); bfloat16 parameters are accepted by all four (apex: FusedAdam only); the
step counter of a group advances only on steps where the group has gradients (a step that
ampx skips after an overflow sets the gradients to None, so it leaves the optimizer untouched,
as apex's skipped steps did); FusedLAMB leaves `.grad` unchanged (apex overwrote it with the
update); FusedNovoGrad keeps its per-tensor norm in each parameter's state (`exp_avg_sq`, a
0-d tensor) instead of one tensor per group. Options that only steered CUDA kernels
(`capturable`, `materialize_master_grads`) are accepted and change nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import required

from ...options.values import HALF_DTYPES
from . import missing_name
from ._layerwise import FusedLAMB, FusedNovoGrad
from ._optim_base import Closure, Params, _adam_checks, _FusedBase, _grad, _math, _zeros

__all__ = ["FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]

_MISSING = {
    "FusedAdagrad": "torch.optim.Adagrad(..., foreach=True)",
    "FusedLARS": "ampx.compat.apex.parallel.LARC around torch.optim.SGD",
    "FusedMixedPrecisionLamb": "FusedLAMB on the fp32 master weights (ampx O2)",
    "DistributedFusedAdam": "torch.distributed.fsdp (fully_shard) with torch.optim.AdamW",
    "DistributedFusedLAMB": "torch.distributed.fsdp (fully_shard) with FusedLAMB",
    "FP16_Optimizer": "apex.fp16_utils.FP16_Optimizer or ampx.initialize(..., opt_level='O2')",
}


def __getattr__(name: str) -> Any:
    missing_name("apex.optimizers", name, _MISSING)


class FusedAdam(_FusedBase):
    """Adam / AdamW with apex's `FusedAdam` signature and update rule.

    Per element, in float32: with ``adam_w_mode=False`` (L2) ``g += weight_decay * p`` first;
    then ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
    ``update = (m/bc1) / (sqrt(v/bc2) + eps)``, plus ``weight_decay * p`` in AdamW mode, and
    ``p -= lr * update``, where ``bc1 = 1 - b1**step`` and ``bc2 = 1 - b2**step`` (both 1 with
    ``bias_correction=False``).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        bias_correction: Apply Adam's bias correction.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Added to the denominator.
        adam_w_mode: True: decoupled weight decay (AdamW); False: L2 regularization (Adam).
        weight_decay: Weight decay.
        amsgrad: Not supported (raises RuntimeError, as in apex).
        set_grad_none: `zero_grad()` sets gradients to None.
        capturable: Accepted (a CUDA-graph option in apex); no effect.
        master_weights: Keep a float32 copy of each float16/bfloat16 parameter in the
            optimizer state (``state["master_param"]``), update it and round it into the
            parameter, as apex's `master_weights=True`.
    """

    _kind = "FusedAdam"
    _options = ("adam_w_mode", "set_grad_none", "capturable", "master_weights")

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        _adam_checks(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights

    @torch.no_grad()
    def step(self, closure: Closure = None, grads: Any = None, output_params: Any = None,
             scale: Any = None, grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        """One Adam step over the parameters that have gradients; returns the closure's loss."""
        if any(x is not None for x in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError("FusedAdam has been updated.  Simply initialize it identically "
                               "to torch.optim.Adam, and call step() with no arguments.")
        loss = self._run_closure(closure)
        self._check_grads()
        for group in self.param_groups:
            params = self._with_grads(group)
            if not params:
                continue
            bc1, bc2 = self._corrections(group, self._advance(group))
            for p in params:
                self._update(p, group, bc1, bc2)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], bc1: float, bc2: float) -> None:
        beta1, beta2 = group["betas"]
        decay, lr, eps = group["weight_decay"], group["lr"], group["eps"]
        state = self.state[p]
        if not state:
            state["exp_avg"], state["exp_avg_sq"] = _zeros(p), _zeros(p)
            if self.master_weights and p.dtype in HALF_DTYPES:
                state["master_param"] = p.detach().float()
        weight = state.get("master_param", p)
        w = _math(weight)
        g = _grad(p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if not self.adam_w_mode and decay != 0:
            g = g + decay * w
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        update = (m / bc1) / ((v / bc2).sqrt_().add_(eps))
        if self.adam_w_mode and decay != 0:
            update.add_(w, alpha=decay)
        new = w - lr * update
        weight.copy_(new)
        if weight is not p:
            p.copy_(new)


class FusedSGD(_FusedBase):
    """SGD with momentum, apex's `FusedSGD` signature and update rule.

    Per element, in float32: ``g += weight_decay * p`` (unless `wd_after_momentum`); with
    momentum, ``buf = g`` on the first step and ``buf = momentum*buf + (1-dampening)*g`` after,
    then ``g = g + momentum*buf`` (Nesterov) or ``g = buf``; ``g += weight_decay * p`` here
    when `wd_after_momentum`; ``p -= lr * g``. Without `wd_after_momentum` this is
    `torch.optim.SGD`'s rule.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (required).
        momentum: Momentum factor.
        dampening: Dampening for momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and zero dampening).
        wd_after_momentum: Add the weight decay after the momentum update.
        materialize_master_grads: Accepted (steered apex amp's O2 gradient copies); no effect.
        set_grad_none: `zero_grad()` sets gradients to None.
    """

    _kind = "FusedSGD"
    _options = ("wd_after_momentum", "materialize_master_grads", "set_grad_none")

    def __init__(self, params: Params, lr: Any = required, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False) -> None:
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Closure = None) -> Any:
        """One SGD step over the parameters that have gradients; returns the closure's loss."""
        loss = self._run_closure(closure)
        self._check_grads()
        for group in self.param_groups:
            for p in self._with_grads(group):
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        decay, momentum = group["weight_decay"], group["momentum"]
        w = _math(p)
        g = _grad(p)
        if decay != 0 and not self.wd_after_momentum:
            g = g + decay * w
        if momentum != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.clone()
            else:
                buf.mul_(momentum).add_(g, alpha=1.0 - group["dampening"])
            g = g + momentum * buf if group["nesterov"] else buf
        if decay != 0 and self.wd_after_momentum:
            g = g + decay * w
        p.copy_(w - group["lr"] * g)
