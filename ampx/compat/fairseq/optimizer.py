"""A fairseq-style optimizer wrapper over an ampx session: `AmpOptimizer`.

fairseq's trainer drives its optimizer through a small surface (`backward`, `multiply_grads`,
`clip_grad_norm`, `step`, `zero_grad`, `get_lr`/`set_lr`, `state_dict`) and an exception
protocol: `OverflowError` means "this update was skipped, zero the gradients and carry on",
`FloatingPointError` means "training diverged, save a crash checkpoint". `AmpOptimizer` gives
an optimizer that went through `Amp.initialize` that surface, with ampx doing the precision work.

How an update flows (the default mode):

- `backward(loss)` runs `amp.scale_loss(loss, optimizer, delay_unscale=True)`: gradients of
  the update's micro-batches (fairseq's `--update-freq`) accumulate scaled, as in fairseq, so
  DDP's `no_sync` accumulation all-reduces the whole sum on the last micro-batch.
- The first of `clip_grad_norm`/`step` finishes the update: ampx unscales every gradient once
  (into the fp32 masters at O2), flags inf/NaN, agrees on the flag across ranks, and updates
  the loss scale, once per update (so `--scale-window` counts updates, as in fairseq).
- `multiply_grads(c)` and clipping are folded into one factor applied right before the step.
- On an overflow the optimizer's step is consumed as a skipped step (ampx logs it and counts
  it) and `OverflowError` is raised; when the scale has reached its minimum,
  `FloatingPointError` is raised instead.

`memory_efficient=True` is fairseq's MemoryEfficientFP16Optimizer idea for half-precision
parameters without fp32 masters (O3, or O2 with `master_weights=False`); both modes are
strategies in `ampx.compat.fairseq.strategies`. The wrapper never touches the optimizer's ampx state
itself: it uses the session's scaled-backward transitions (`ampx.scaling.protocol`).

Example::

    amp = ampx.Amp(opt_level="O2", dtype="fp16")
    model, optimizer = amp.initialize(model, torch.optim.AdamW(model.parameters()))
    optimizer = AmpOptimizer(optimizer, amp)
    for samples in batches:                     # one update = several micro-batches
        optimizer.zero_grad()
        for sample in samples:
            optimizer.backward(criterion(model, sample))
        try:
            optimizer.multiply_grads(1.0 / len(samples))
            grad_norm = optimizer.clip_grad_norm(1.0)
            optimizer.step()
        except OverflowError:
            optimizer.zero_grad()               # skipped; the scale was reduced
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ... import _ext
from ...distributed import aggregate_dtensor_norm, local
from ...frontend import Amp
from ...overflow.watch import with_report
from ...scaling.masters import optimizer_params
from ...scaling.scaler import LossScaler
from .strategies import Factor, MemoryEfficientStrategy, Strategy, make_strategy

__all__ = ["AmpOptimizer"]

_STATE_KEY = "ampx"  # our entry in state_dict(); "loss_scale" is fairseq's own key
_STATE_VERSION = 1


class AmpOptimizer:
    """fairseq's optimizer surface over an optimizer initialized by an `ampx.Amp` session.

    Args:
        optimizer: The optimizer returned by `amp.initialize` (in `memory_efficient` mode it
            may also be a plain optimizer over the half model's parameters).
        amp: Its session (default: the session that initialized `optimizer`).
        loss_id: The loss scaler to use.
        tolerance: fairseq's `--fp16-scale-tolerance`: on an overflow the scale backs off only
            when at least this fraction of the updates since the last rescale overflowed.
            With 0 every overflow backs off (ampx's rule; see also `hysteresis`).
        min_loss_scale: `FloatingPointError` is raised when an overflow leaves the dynamic scale
            at or below this (default: the scaler's floor: `min_loss_scale`, or 1.0).
        memory_efficient: Step half parameters with float32 math instead of fp32 masters.

    Raises:
        TypeError: If `optimizer` never went through `amp.initialize` (default mode).
        ValueError: For an optimizer initialized by another session, a bad `loss_id` or
            `tolerance`, or `memory_efficient` with master weights or fp32 parameters.

    Example::

        amp = ampx.Amp(opt_level="O3", dtype="fp16", loss_scale="dynamic")
        model = amp.initialize(model)
        optimizer = AmpOptimizer(torch.optim.Adam(model.parameters()), amp,
                                 memory_efficient=True)
    """

    supports_flat_params = False
    supports_groups = False
    supports_step_with_scale = False
    supports_memory_efficient_fp16 = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        amp: Amp | None = None,
        *,
        loss_id: int = 0,
        tolerance: float = 0.0,
        min_loss_scale: float | None = None,
        memory_efficient: bool = False,
    ) -> None:
        if isinstance(tolerance, bool) or not (isinstance(tolerance, (int, float))
                                                and tolerance >= 0):
            raise ValueError(f"AmpOptimizer: tolerance={tolerance!r} must be a number >= 0.")
        self._strategy: Strategy = make_strategy(optimizer, amp, loss_id, memory_efficient)
        self._optimizer = optimizer
        self.amp = self._strategy.amp
        self.loss_id = loss_id
        self.tolerance = float(tolerance)
        self.min_loss_scale = min_loss_scale
        self.memory_efficient = bool(memory_efficient)
        # per-update state
        self._factor: Factor = 1.0
        self._needs_sync = False
        self._decided = False
        self._last_loss: torch.Tensor | None = None
        self._scale_before: torch.Tensor | None = None
        # counters, saved in state_dict (fairseq's DynamicLossScaler bookkeeping)
        self.steps = 0
        self.skipped_steps = 0
        self._iter = 0
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0

    # -- views -------------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (at O2 it holds the fp32 master weights)."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def params(self) -> Iterator[torch.Tensor]:
        """The parameters the optimizer steps (the fp32 masters at O2)."""
        return optimizer_params(self._optimizer)

    @property
    def scaler(self) -> LossScaler:
        """The session's loss scaler used by this wrapper."""
        return self.amp.scalers[self.loss_id]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (fairseq logs it as `loss_scale`).

        .. note:: Synchronises with the device once.
        """
        return self.scaler.loss_scale() if self.amp.enabled else 1.0

    def get_lr(self) -> float:
        """The learning rate of the first parameter group."""
        return float(self.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group."""
        for group in self.param_groups:
            group["lr"] = lr

    def __repr__(self) -> str:
        mode = ", memory_efficient=True" if self.memory_efficient else ""
        return (f"AmpOptimizer({type(self._optimizer).__name__}, opt_level="
                f"{self.amp.properties.opt_level.value}{mode})")

    # -- one update ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, scaled; gradients accumulate until `step`.

        Raises:
            RuntimeError: After `clip_grad_norm`/`step` decided this update; call `step()` or
                `zero_grad()` first.
        """
        if self._decided:
            raise RuntimeError(
                "AmpOptimizer.backward: this update was already checked by clip_grad_norm(); "
                "call step() (or zero_grad()) before the next backward."
            )
        self._strategy.backward(loss)
        self._last_loss = loss.detach()
        self._needs_sync = True

    def all_reduce_grads(self, module: torch.nn.Module) -> None:
        """fairseq's hook for wrappers that reduce gradients by hand (`module.all_reduce_grads`).

        Gradients are still scaled here, so the reduction happens before the overflow check.
        """
        reduce = getattr(module, "all_reduce_grads", None)
        if callable(reduce):
            reduce()

    def multiply_grads(self, c: float | torch.Tensor) -> None:
        """Multiply the gradients by `c` (lazily: folded into the factor applied at `step`)."""
        self._factor = self._factor * c

    def clip_grad_norm(
        self,
        max_norm: float,
        aggregate_norm_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Total L2 norm of the (unscaled, multiplied) gradients; clip to `max_norm` if > 0.

        The norm is one fused pass over the gradients the optimizer steps (the fp32 masters at
        O2) and equals `torch.nn.utils.clip_grad_norm_`'s; clipping scales by
        `max_norm / (norm + 1e-6)` when that is below 1, as torch and fairseq do. Gradients
        that are DTensor shards (FSDP2) are reduced over their mesh unless `aggregate_norm_fn`
        is given.

        Args:
            max_norm: Clip threshold; 0 only computes the norm.
            aggregate_norm_fn: Combines this rank's norm into the global one (fairseq passes it
                for model-parallel and sharded runs).

        Returns:
            The norm before clipping, a float32 0-dim tensor.

        Raises:
            OverflowError: When the gradients are not finite; the step is skipped and the loss
                scale reduced (fairseq's trainer then zeroes the gradients and carries on).
            FloatingPointError: When that overflow leaves the loss scale at its minimum, or the
                gradients are not finite in a session that does not skip steps.

        .. note:: Reads the overflow flag and the norm with one host sync per update.
        """
        self._sync()
        norm = self._strategy.local_norm
        if norm is None:
            total = _ext.l2norm(self._grads()) if self._grads() else torch.zeros(())
            norm = total if isinstance(total, torch.Tensor) else total[0]
        if aggregate_norm_fn is not None:
            norm = aggregate_norm_fn(norm)
        else:
            norm = aggregate_dtensor_norm(norm, self._grads())
        norm = norm * self._factor
        self._decide(norm)
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            self._factor = self._factor * coef
        return norm

    def step(self, closure: Any = None, scale: float = 1.0, groups: Any = None) -> None:
        """Apply the update (fairseq's signature); raises on overflow like `clip_grad_norm`.

        Args:
            closure: Not supported with loss scaling (must be None).
            scale: Divide the gradients by this first (fairseq's `step(scale=...)`).
            groups: Not supported (`supports_groups` is False).

        Raises:
            OverflowError: See `clip_grad_norm`.
            FloatingPointError: See `clip_grad_norm`.
            ValueError: For a closure or groups.
        """
        if closure is not None:
            raise ValueError(
                "AmpOptimizer.step: closures cannot be combined with loss scaling; run the "
                "closure's loss through backward() and call step() without one."
            )
        if groups is not None:
            raise ValueError("AmpOptimizer.step: groups are not supported (supports_groups).")
        self._sync()
        if scale != 1.0:
            self.multiply_grads(1.0 / scale)
        self._decide(None)
        try:
            self._strategy.step(self._factor)
            self.steps += 1
        finally:
            self._reset()

    def zero_grad(self) -> None:
        """Drop every gradient of the update (model and master copies) and its overflow flag."""
        self._optimizer.zero_grad(set_to_none=True)  # ampx's handler also ends the update
        self._reset()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict plus fairseq's `loss_scale` and ampx's scaler state.

        The session's `amp.state_dict()` (every loss scaler) and this wrapper's counters are
        kept under the `"ampx"` key, so one optimizer checkpoint resumes the scale trajectory.

        .. note:: Synchronises with the device (reads the scaler state).
        """
        out = dict(self._optimizer.state_dict())
        out["loss_scale"] = self.loss_scale
        out[_STATE_KEY] = {
            "version": _STATE_VERSION,
            "amp": self.amp.state_dict(),
            "loss_id": self.loss_id,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "iter": self._iter,
            "last_rescale_iter": self._last_rescale_iter,
            "overflows_since_rescale": self._overflows_since_rescale,
        }
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any],
                        optimizer_overrides: Mapping[str, Any] | None = None) -> None:
        """Load `state_dict()` output (or a plain optimizer state dict).

        Args:
            state_dict: What `state_dict()` returned.
            optimizer_overrides: Values written into every parameter group afterwards
                (fairseq's `--optimizer-overrides`, e.g. a new learning rate).

        Raises:
            ampx.CheckpointError: For a malformed scaler entry (nothing of it is applied).
            ValueError: For a wrapper state newer than this ampx.
        """
        inner = dict(state_dict)
        inner.pop("loss_scale", None)
        extra = inner.pop(_STATE_KEY, None)
        if extra is not None and int(extra.get("version", 0)) > _STATE_VERSION:
            raise ValueError(
                f"AmpOptimizer.load_state_dict: state version {extra['version']} is newer than "
                f"this ampx understands ({_STATE_VERSION}); upgrade ampx."
            )
        if extra is not None and self.amp.enabled and extra.get("amp"):
            self.amp.load_state_dict(extra["amp"])
        self._strategy.load_optimizer_state(inner)
        if optimizer_overrides:
            for group in self.param_groups:
                group.update(optimizer_overrides)
        if extra is not None:
            self.steps = int(extra.get("steps", 0))
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            self._iter = int(extra.get("iter", 0))
            self._last_rescale_iter = int(extra.get("last_rescale_iter", -1))
            self._overflows_since_rescale = int(extra.get("overflows_since_rescale", 0))
        self._reset()

    # -- internals -------------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _reset(self) -> None:
        self._factor = 1.0
        self._needs_sync = False
        self._decided = False
        self._scale_before = None
        self._strategy.reset()

    def _sync(self) -> None:
        """Finish the update's backward passes: unscale, flag, agree across ranks, update scale."""
        if not self._needs_sync:
            return
        self._needs_sync = False
        scaler = self.scaler
        before = scaler.scale.clone()
        if self._strategy.finish(scaler, self._last_loss):
            self._scale_before = before
        if isinstance(self._strategy, MemoryEfficientStrategy):
            scale = self._strategy.factor_from_scale
            if scale is not None:
                self._factor = self._factor * scale

    def _flag(self) -> torch.Tensor | None:
        return self._strategy.flag()

    def _decide(self, norm: torch.Tensor | None) -> None:
        """Once per update: read the flags (one host sync) and raise fairseq's exceptions."""
        if self._decided:
            return
        self._decided = True
        device = self.scaler.device
        parts = [torch.zeros(1, device=device) for _ in range(3)]
        flag = self._flag()
        if flag is not None:
            parts[0] = flag.reshape(1).float().to(device)
        if norm is not None:
            parts[1] = (~torch.isfinite(local(norm))).float().reshape(1).to(device)
        tracking = self.tolerance > 0 and self._scale_before is not None and self.scaler.dynamic
        if tracking:
            assert self._scale_before is not None
            parts[2] = (self.scaler.scale > self._scale_before).float().reshape(1)
        flag_value, bad_norm, grew = torch.cat(parts).tolist()
        if not (flag_value or bad_norm):
            if grew:
                self._last_rescale_iter = self._iter
            self._iter += 1
            return
        if not (self.amp.enabled and self.amp.skips_non_finite):
            self._reset()
            raise FloatingPointError(
                "gradients are Nan/Inf (this ampx session does not skip steps with non-finite "
                "gradients)"
            )
        self._skip(flag_set=bool(flag_value))
        if self.tolerance > 0 and self.scaler.dynamic:
            self._apply_tolerance()
        self._iter += 1
        scale_before = self._scale_before
        if self._at_minimum():
            if scale_before is not None:
                self.scaler.scale.copy_(scale_before)  # as fairseq: keep the last usable scale
            self._reset()
            raise with_report(FloatingPointError(
                f"Minimum loss scale reached ({self._floor()}). Your loss is probably exploding. "
                "Try lowering the learning rate, using gradient clipping or increasing the "
                "batch size."
            ), self._optimizer)
        new_scale = self.loss_scale
        self._reset()
        raise with_report(OverflowError(f"setting loss scale to: {new_scale}"), self._optimizer)

    def _skip(self, flag_set: bool) -> None:
        """Consume this update as a skipped step (ampx logs and counts it)."""
        self.steps += 1
        self.skipped_steps += 1
        self._strategy.skip(flag_set)

    def _apply_tolerance(self) -> None:
        """fairseq's tolerance: undo this update's backoff unless enough updates overflowed."""
        self._overflows_since_rescale += 1
        since = max(1, self._iter - self._last_rescale_iter)
        if self._overflows_since_rescale / since >= self.tolerance:
            self._last_rescale_iter = self._iter
            self._overflows_since_rescale = 0
        elif self._scale_before is not None:
            self.scaler.scale.copy_(self._scale_before)

    def _at_minimum(self) -> bool:
        scaler = self.scaler
        if not scaler.dynamic:
            return False
        return scaler.loss_scale() <= self._floor()

    def _floor(self) -> float:
        """The scale at which an overflow raises FloatingPointError (default: the scaler's
        floor, below which it backs off no further)."""
        return self.scaler.floor if self.min_loss_scale is None else self.min_loss_scale
