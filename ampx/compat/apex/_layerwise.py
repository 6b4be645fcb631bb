"""apex's layer-wise adaptive optimizers, FusedLAMB and FusedNovoGrad, in plain torch.

Neither has a torch twin; both follow apex's kernels (multi_tensor_lamb.cu,
multi_tensor_novograd.cu) operation by operation, in float32. Importable from
`ampx.compat.apex.optimizers` (and, under the alias, `apex.optimizers`).
"""

from __future__ import annotations

from typing import Any

import torch

from ._optim_base import Closure, Params, _adam_checks, _FusedBase, _grad, _math, _zeros

__all__ = ["FusedLAMB", "FusedNovoGrad"]


class FusedLAMB(_FusedBase):
    """LAMB with apex's `FusedLAMB` signature and update rule.

    First the global gradient norm ``G`` over every parameter of every group; with
    ``G > max_grad_norm`` each gradient is divided by ``G / max_grad_norm``. Then per tensor,
    in float32, with ``beta3 = 1 - b1`` (`grad_averaging`) or 1: in L2 mode
    (``adam_w_mode=False``) ``g += weight_decay * p``; ``m = b1*m + beta3*g``,
    ``v = b2*v + (1-b2)*g*g``, ``u = (m/bc1) / (sqrt(v/bc2) + eps)`` (+ ``weight_decay * p``
    in AdamW mode). The trust ratio ``||p|| / ||u||`` (1 where either norm is 0) multiplies
    the learning rate when ``weight_decay != 0`` or `use_nvlamb`; ``p -= lr * ratio * u``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        bias_correction: Apply Adam's bias correction.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Added to the denominator.
        weight_decay: Weight decay (apex's default 0.01).
        amsgrad: Not supported (raises RuntimeError, as in apex).
        adam_w_mode: True: decoupled weight decay; False: L2 regularization.
        grad_averaging: Scale the gradient by ``1 - b1`` in the first moment.
        set_grad_none: `zero_grad()` sets gradients to None.
        max_grad_norm: Clip the global gradient norm to this value (from the constructor's
            value, as in apex). 0 or None: no clipping (apex divided by zero).
        use_nvlamb: Apply the trust ratio to parameters without weight decay too.
    """

    _kind = "FusedLAMB"
    _options = ("adam_w_mode", "set_grad_none", "use_nvlamb")

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float | None = 1.0, use_nvlamb: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        _adam_checks(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and max_grad_norm < 0:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm} (expected >= 0)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def _clip_divisor(self) -> torch.Tensor | None:
        """``G / max_grad_norm`` where the global norm G exceeds it, else 1 (device tensor)."""
        grads = [_grad(p).float() for g in self.param_groups for p in self._with_grads(g)]
        max_norm = self.defaults["max_grad_norm"]
        if not grads or not max_norm:
            return None
        norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        total = torch.linalg.vector_norm(norms)
        return torch.where(total > max_norm, total / max_norm, torch.ones_like(total))

    @torch.no_grad()
    def step(self, closure: Closure = None) -> Any:
        """One LAMB step over the parameters that have gradients; returns the closure's loss."""
        loss = self._run_closure(closure)
        self._check_grads()
        divisor = self._clip_divisor()
        for group in self.param_groups:
            params = self._with_grads(group)
            if not params:
                continue
            bc1, bc2 = self._corrections(group, self._advance(group))
            for p in params:
                self._update(p, group, bc1, bc2, divisor)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], bc1: float, bc2: float,
                divisor: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        decay, eps = group["weight_decay"], group["eps"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        state = self.state[p]
        if not state:
            state["exp_avg"], state["exp_avg_sq"] = _zeros(p), _zeros(p)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        w = _math(p)
        g = _grad(p)
        if divisor is not None:
            g = g / divisor.to(g.dtype)
        if not self.adam_w_mode and decay != 0:
            g = g + decay * w
        m.mul_(beta1).add_(g, alpha=beta3)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        update = (m / bc1) / ((v / bc2).sqrt_().add_(eps))
        if self.adam_w_mode and decay != 0:
            update.add_(w, alpha=decay)
        lr: Any = group["lr"]
        if self.use_nvlamb or decay != 0:
            w_norm = torch.linalg.vector_norm(w)
            u_norm = torch.linalg.vector_norm(update)
            usable = (w_norm != 0) & (u_norm != 0)
            lr = lr * torch.where(usable, w_norm / u_norm, torch.ones_like(w_norm))
        p.copy_(w - lr * update)


class FusedNovoGrad(_FusedBase):
    """NovoGrad with apex's `FusedNovoGrad` signature and update rule.

    Per tensor, the gradient norm ``n`` (L2, or max-abs with ``norm_type=0``) is blended into
    the running norm ``v``: ``v = sqrt(b2*v**2 + (1-b2)*n**2)`` (L2) or
    ``v = b2*v + (1-b2)*n`` (inf). ``v`` starts at 0 (`init_zero`) or at the first step's
    ``n``. With ``bc2 = sqrt(1 - b2**step)``, ``beta3 = 1 - b1`` (`grad_averaging`) or 1 and
    ``d = v/bc2 + eps``: by default ``m = b1*m + beta3*g`` and
    ``p -= lr * ((m/bc1)/d + weight_decay*p)``; with `reg_inside_moment`
    ``m = b1*m + beta3*(g/d + weight_decay*p)`` and ``p -= lr * m/bc1``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        bias_correction: Apply the bias corrections.
        betas: Coefficients of the running averages of the gradient and its norm.
        eps: Added to the denominator.
        weight_decay: Weight decay.
        amsgrad: Not supported (raises RuntimeError, as in apex).
        reg_inside_moment: Apply the normalization and weight decay inside the momentum.
        grad_averaging: Scale the gradient by ``1 - b1`` in the momentum.
        norm_type: 2 (L2) or 0 (infinity norm).
        init_zero: Start the running norm at 0 instead of the first step's norm.
        set_grad_none: `zero_grad()` sets gradients to None.
    """

    _kind = "FusedNovoGrad"
    _options = ("moment_mode", "set_grad_none")

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        _adam_checks(lr, betas, eps, weight_decay)
        if norm_type not in (0, 2):
            raise ValueError(f"Invalid norm_type value: {norm_type!r}; FusedNovoGrad supports "
                             "2 (L2 norm) and 0 (infinity norm)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults)
        self.moment_mode = 0 if reg_inside_moment else 1
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Closure = None) -> Any:
        """One NovoGrad step over the parameters that have gradients; returns the loss."""
        loss = self._run_closure(closure)
        self._check_grads()
        for group in self.param_groups:
            params = self._with_grads(group)
            if not params:
                continue
            bc1, bc2 = self._corrections(group, self._advance(group), sqrt_second=True)
            for p in params:
                self._update(p, group, bc1, bc2)
        return loss

    @staticmethod
    def _blend(group: dict[str, Any], state: dict[str, Any], g: torch.Tensor) -> torch.Tensor:
        """Blend this step's gradient norm into ``state["exp_avg_sq"]`` and return it."""
        beta2 = group["betas"][1]
        inf_norm = group["norm_type"] == 0
        norm = g.abs().max() if inf_norm else torch.linalg.vector_norm(g)
        norm = norm.float() if norm.dtype != torch.float64 else norm
        if "exp_avg_sq" not in state:
            state["exp_avg_sq"] = torch.zeros_like(norm) if group["init_zero"] else norm.clone()
        v = state["exp_avg_sq"]
        if inf_norm:
            v.mul_(beta2).add_(norm, alpha=1.0 - beta2)
        else:
            v.copy_(torch.sqrt(beta2 * v * v + (1.0 - beta2) * norm * norm))
        return v

    def _update(self, p: torch.Tensor, group: dict[str, Any], bc1: float, bc2: float) -> None:
        beta1 = group["betas"][0]
        decay, lr, eps = group["weight_decay"], group["lr"], group["eps"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = _zeros(p)
        m = state["exp_avg"]
        w = _math(p)
        g = _grad(p)
        denom = self._blend(group, state, g) / bc2 + eps
        if self.moment_mode == 0:
            g = g / denom + decay * w
            m.mul_(beta1).add_(g, alpha=beta3)
            p.copy_(w - lr * (m / bc1))
        else:
            m.mul_(beta1).add_(g, alpha=beta3)
            update = (m / bc1) / denom + decay * w
            p.copy_(w - lr * update)

