"""apex's private `LossScaler` members, added to `ampx.scaling.scaler.LossScaler` by `install`.

Scripts written for apex read and write `amp._amp_state.loss_scalers[i]._loss_scale`,
`_unskipped` and `_scale_seq_len`, and some drive a scaler by hand as apex's FP16_Optimizer
did (`clear_overflow_state`, `unscale`, `unscale_with_stashed`, `_has_overflow`,
`update_scale`). The engine's scaler has none of these names: `install()` (run by
`ampx.compat.apex.shell.install`) sets the members of `ApexScalerMembers` on the class, so
every scaler, the sessions' and those built by hand, has them once the apex shell is in place.
Each member is written on the engine's public methods (`loss_scale`, `set_scale`,
`clean_steps`, `inv_scale`, `update_`).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _ext
from ...scaling.scaler import LossScaler

__all__ = ["ApexScalerMembers", "install"]


class ApexScalerMembers(LossScaler):
    """apex's private `LossScaler` members (a subclass only so that they type-check as members).

    `install` copies them onto `LossScaler`; this class is never instantiated.
    """

    # -- apex's private attributes, read and written by real scripts --------------------------
    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self.set_scale(value)

    @property
    def _unskipped(self) -> int:
        return self.clean_steps

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self.clean_steps = value

    @property
    def _scale_seq_len(self) -> int:
        return self.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        self.growth_interval = int(value)

    @property
    def _min_loss_scale(self) -> float | None:
        return self.min_loss_scale

    @property
    def _max_loss_scale(self) -> float:
        return self.max_loss_scale

    # -- apex's methods for scripts that drive the scaler by hand ---------------------------
    @property
    def _has_overflow(self) -> bool:
        """Whether a hand-driven `unscale` since `clear_overflow_state` saw inf/NaN (syncs)."""
        return bool(self._manual_found().item() > 0)

    def _manual_found(self) -> torch.Tensor:
        found = getattr(self, "_apex_found", None)
        if found is None or found.device != self.device:
            found = self._apex_found = torch.zeros(1, dtype=torch.float32, device=self.device)
        return found

    def clear_overflow_state(self) -> None:
        """apex: forget the overflow seen by earlier hand-driven `unscale` calls."""
        self._manual_found().zero_()

    def unscale(self, model_grads: list[torch.Tensor], master_grads: list[torch.Tensor],
                unused_scale: Any = None, models_are_masters: bool = False,
                scale_override: float | None = None) -> None:
        """apex: ``master = model / scale`` (in place when they are the same), flag inf/NaN.

        Args:
            model_grads: The scaled gradients.
            master_grads: Where the unscaled gradients go (float32 in apex's O2).
            unused_scale: Ignored (apex's signature).
            models_are_masters: The lists are the same tensors (unscale in place).
            scale_override: Divide by this instead of the current scale.
        """
        inv = self._inverse(scale_override)
        found = self._manual_found()
        pairs = [(m, d) for m, d in zip(model_grads, master_grads) if m is not None]
        same = [m for m, d in pairs if models_are_masters or m is d]
        apart = [(m, d) for m, d in pairs if not (models_are_masters or m is d)]
        _ext.unscale_(same, inv, found)
        _ext.unscale_into_([m for m, _ in apart], [d for _, d in apart], inv, found)

    def unscale_with_stashed(self, model_grads: list[torch.Tensor],
                             stashed_master_grads: list[torch.Tensor],
                             master_grads: list[torch.Tensor],
                             scale_override: Any = None) -> None:
        """apex: ``master = model / scale + stashed``; only the new gradients are checked."""
        grads_scale = scale_override[0] if isinstance(scale_override, tuple) else None
        inv = self._inverse(grads_scale)
        found = self._manual_found()
        for model, stashed, out in zip(model_grads, stashed_master_grads, master_grads):
            if out is not stashed:
                out.copy_(stashed)
            _ext.unscale_into_([model], [out], inv, found, accumulate=True)

    def update_scale(self) -> bool:
        """apex: update the scale from the hand-driven overflow flag; True: skip this step.

        A static scaler never skips (apex) and counts the step as clean.

        .. note:: Synchronises with the device once.
        """
        found = self._manual_found()
        overflow = bool(found.item() > 0)
        self.update_(found.clone() if self.dynamic else torch.zeros_like(found))
        return overflow and self.dynamic

    def _inverse(self, scale: float | None) -> torch.Tensor:
        if scale is None:
            return self.inv_scale()
        return torch.full((1,), 1.0 / float(scale), dtype=torch.float32, device=self.device)


def install() -> None:
    """Set apex's members on `LossScaler` (idempotent)."""
    for name, member in vars(ApexScalerMembers).items():
        if not name.startswith("__"):
            setattr(LossScaler, name, member)
