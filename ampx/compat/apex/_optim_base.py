"""What ampx's apex-style fused optimizers share: float32 math helpers and `_FusedBase`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

Params = Iterable[Any]
Closure = Callable[[], Any] | None


def _check_range(name: str, value: float, low: float, high: float = math.inf) -> None:
    if not low <= value < high:
        raise ValueError(f"Invalid {name} value: {value} (expected {low} <= {name} < {high})")


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _math(t: torch.Tensor) -> torch.Tensor:
    """`t` in the math dtype (the tensor itself when it already is)."""
    return t if t.dtype == _math_dtype(t) else t.to(_math_dtype(t))


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of `p` (one the step selected for having one) in the math dtype."""
    grad = p.grad
    if grad is None:
        raise RuntimeError("internal: a parameter without a gradient reached the update")
    return _math(grad)


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=_math_dtype(p), memory_format=torch.preserve_format)


class _FusedBase(torch.optim.Optimizer):
    """What the four share: `set_grad_none`, input checks, the per-group step counter."""

    set_grad_none: bool
    _kind = "Fused"
    _options: tuple[str, ...] = ("set_grad_none",)  # attributes beyond torch's pickled state

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._options})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's `load_state_dict`, keeping floating state in the math dtype.

        torch casts floating state to each parameter's dtype; these optimizers keep theirs
        (exp_avg, exp_avg_sq, momentum, FusedAdam's `master_param`) in float32 for half
        parameters, so a resumed run would otherwise continue from rounded state.
        """
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for param_id, param in zip(ids, params):
            for key, value in saved.get(param_id, {}).items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[param][key] = value.to(dtype=_math_dtype(param),
                                                      device=param.device)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: to None when `set_to_none` (default: the `set_grad_none` option)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _with_grads(self, group: dict[str, Any]) -> list[torch.Tensor]:
        return [p for p in group["params"] if p.grad is not None]

    def _check_grads(self) -> None:
        """Refuse sparse or non-floating gradients before anything is changed."""
        for group in self.param_groups:
            for p in self._with_grads(group):
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(
                        f"{self._kind} does not support sparse gradients, please consider "
                        "SparseAdam instead"
                    )
                if not p.is_floating_point():
                    raise RuntimeError(f"{self._kind} only supports floating parameters, got "
                                       f"{p.dtype}")

    @staticmethod
    def _advance(group: dict[str, Any]) -> int:
        group["step"] = group.get("step", 0) + 1
        return int(group["step"])

    @staticmethod
    def _corrections(group: dict[str, Any], step: int, sqrt_second: bool = False
                     ) -> tuple[float, float]:
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        second = 1.0 - beta2**step
        return 1.0 - beta1**step, math.sqrt(second) if sqrt_second else second

    def _run_closure(self, closure: Closure) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def _adam_checks(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    _check_range("lr", lr, 0.0)
    _check_range("eps", eps, 0.0)
    _check_range("betas[0]", betas[0], 0.0, 1.0)
    _check_range("betas[1]", betas[1], 0.0, 1.0)
    _check_range("weight_decay", weight_decay, 0.0)
