"""apex's `LARC` optimizer wrapper (layer-wise adaptive rate control), on today's torch.

``from apex.parallel.LARC import LARC`` resolves here under the alias. The rule is apex's: for
each parameter with a gradient and nonzero weight and gradient norms,
``local_lr = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)``; with
``clip=True`` the gradient is scaled by ``min(local_lr / lr, 1)``, otherwise by ``local_lr``,
after the group's weight decay has been added to it (``g += weight_decay * p``). The wrapped
optimizer then steps with its weight decay set to 0 (and restored afterwards).

Changes: `LARC` is a `torch.optim.Optimizer` that shares the wrapped optimizer's
`param_groups` and `state`, so `ampx.initialize`, LR schedulers and `FP16_Optimizer` accept it
(apex's LARC was a plain object that amp special-cased); norms are computed in float32; the
weight decay is restored even when the wrapped step raises; `step` accepts a closure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LARC"]


class LARC(torch.optim.Optimizer):
    """Wrap `optimizer` with LARC's per-parameter adaptive learning rate.

    Args:
        optimizer: The optimizer to wrap (any `torch.optim.Optimizer`).
        trust_coefficient: LARC's trust coefficient.
        clip: True: clip the local rate to the optimizer's (``min(local_lr, lr)``);
            False: scale it (``local_lr * lr``).
        eps: Added to the denominator of the local rate.

    Example::

        optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02,
                 clip: bool = True, eps: float = 1e-8) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        super().__init__(optimizer.param_groups, dict(optimizer.defaults))
        # Share the wrapped optimizer's groups and state: schedulers and amp see one optimizer.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    def __repr__(self) -> str:
        return f"LARC({self.optim!r})"

    # apex's LARC lived in the module apex/parallel/LARC.py: scripts reach it both as
    # `apex.parallel.LARC` (the module, then `.LARC`) and `from apex.parallel.LARC import LARC`.
    LARC: type[LARC]

    def __getstate__(self) -> dict[str, Any]:
        return {"optim": self.optim, "trust_coefficient": self.trust_coefficient,
                "clip": self.clip, "eps": self.eps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        optim = state["optim"]
        super().__setstate__({"defaults": optim.defaults, "state": optim.state,
                              "param_groups": optim.param_groups})
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (as apex)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer; the shared groups and state follow."""
        self.optim.load_state_dict(state_dict)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's `zero_grad`."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (shared with this one)."""
        if not hasattr(self, "optim"):  # during torch's __init__, before sharing
            super().add_param_group(param_group)
            return
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def _adapt(self, group: dict[str, Any], weight_decay: float) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            w_norm = torch.linalg.vector_norm(p.detach().float())
            g_norm = torch.linalg.vector_norm(p.grad.float())
            rate = self.trust_coefficient * w_norm / (g_norm + w_norm * weight_decay + self.eps)
            if self.clip:
                rate = torch.clamp(rate / group["lr"], max=1.0)
            adapted = (p.grad.float() + weight_decay * p.detach().float()) * rate
            usable = (w_norm != 0) & (g_norm != 0)
            p.grad.copy_(torch.where(usable, adapted, p.grad.float()))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Scale the gradients by the local rates, then step the wrapped optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decays = [group.get("weight_decay", 0) for group in self.param_groups]
        try:
            for group, decay in zip(self.param_groups, decays):
                group["weight_decay"] = 0
                self._adapt(group, decay)
            self.optim.step()
        finally:
            for group, decay in zip(self.param_groups, decays):
                group["weight_decay"] = decay
        return loss


LARC.LARC = LARC
