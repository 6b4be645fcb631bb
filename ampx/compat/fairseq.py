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
parameters without fp32 masters (O3, or O2 with `master_weights=False`): gradients stay scaled
in half precision, and at `step` each parameter is stepped with float32 math: its gradient is
unscaled into float32 on the fly, the optimizer runs on float32 values and keeps float32 state,
and the result is rounded back into the half parameter. Any `torch.optim` optimizer whose state
is created like its parameters works (SGD, Adam, AdamW, Adagrad, RMSprop, ...).

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
from typing import Any, Union

import torch

from .. import _ext
from ..frontend import Amp
from ..optimizer import amp_state_of, optimizer_params
from ..scaler import LossScaler

__all__ = ["AmpOptimizer"]

_HALF = (torch.float16, torch.bfloat16)
_STATE_KEY = "ampx"  # our entry in state_dict(); "loss_scale" is fairseq's own key
_STATE_VERSION = 1
_UNDERFLOW_SCALE = 2.0**-24  # below this every scaled fp16 gradient is zero

Factor = Union[float, torch.Tensor]

_DTensor: Any
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - torch without distributed
    _DTensor = None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


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
            at or below this (default: the scaler's `min_loss_scale`; without one, 2**-24).
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
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "AmpOptimizer: expected a torch.optim.Optimizer; got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}."
            )
        state = amp_state_of(optimizer)
        if amp is None:
            if state is None:
                raise TypeError(
                    "AmpOptimizer needs an optimizer passed through ampx.Amp.initialize() (or "
                    "amp=... in memory_efficient mode); got "
                    f"{type(optimizer).__module__}.{type(optimizer).__name__}."
                )
            amp = state.session
        if state is not None and state.session is not amp:
            raise ValueError(
                "AmpOptimizer: this optimizer was initialized by another Amp session; pass that "
                "session (or amp=None)."
            )
        if not 0 <= loss_id < len(amp.scalers):
            raise ValueError(
                f"AmpOptimizer: loss_id={loss_id} but the session has {len(amp.scalers)} loss "
                "scaler(s) (num_losses)."
            )
        if isinstance(tolerance, bool) or not (isinstance(tolerance, (int, float))
                                                and tolerance >= 0):
            raise ValueError(f"AmpOptimizer: tolerance={tolerance!r} must be a number >= 0.")
        self._optimizer = optimizer
        self.amp = amp
        self.loss_id = loss_id
        self.tolerance = float(tolerance)
        self.min_loss_scale = min_loss_scale
        self.memory_efficient = bool(memory_efficient)
        if self.memory_efficient:
            self._check_memory_efficient(state)
        elif state is None and amp.enabled:
            raise TypeError(
                "AmpOptimizer needs an optimizer passed through amp.initialize(); got one "
                "that was not (pass memory_efficient=True for a plain optimizer over half "
                "parameters)."
            )
        # per-update state
        self._factor: Factor = 1.0
        self._needs_sync = False
        self._decided = False
        self._last_loss: torch.Tensor | None = None
        self._scale_before: torch.Tensor | None = None
        self._found: torch.Tensor | None = None  # memory-efficient mode's overflow flag
        self._local_norm: torch.Tensor | None = None  # memory-efficient mode, scaled grads
        # counters, saved in state_dict (fairseq's DynamicLossScaler bookkeeping)
        self.steps = 0
        self.skipped_steps = 0
        self._iter = 0
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0

    def _check_memory_efficient(self, state: Any) -> None:
        amp = self.amp
        if not amp.enabled:
            raise ValueError("AmpOptimizer(memory_efficient=True) needs an enabled Amp session.")
        if amp.properties.master_weights or (state is not None and len(state.masters)):
            raise ValueError(
                "AmpOptimizer(memory_efficient=True) replaces fp32 master weights; the session "
                f"uses them ({amp.properties.opt_level.value}). Use opt_level='O3' (with "
                "loss_scale='dynamic' for fp16) or O2 with master_weights=False."
            )
        if not any(p.dtype in _HALF for p in optimizer_params(self._optimizer)):
            raise ValueError(
                "AmpOptimizer(memory_efficient=True) is for half-precision parameters (O3, or O2 "
                "with master_weights=False); these are all float32: use the default mode."
            )

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
        if self.memory_efficient:
            self.scaler.scale_loss_value(loss).backward()
        else:
            with self.amp.scale_loss(loss, self._optimizer, loss_id=self.loss_id,
                                     delay_unscale=True) as scaled:
                scaled.backward()
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
        norm = self._local_norm if self._local_norm is not None else _total_norm(self._grads())
        if aggregate_norm_fn is not None:
            norm = aggregate_norm_fn(norm)
        else:
            norm = _aggregate_dtensor_norm(norm, self._grads())
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
            if self.memory_efficient:
                self._step_fp32()
            else:
                self._apply_factor()
                self._optimizer.step()
            self.steps += 1
        finally:
            self._reset()

    def zero_grad(self) -> None:
        """Drop every gradient of the update (model and master copies) and its overflow flag."""
        self._optimizer.zero_grad(set_to_none=True)
        state = amp_state_of(self._optimizer)
        if state is not None:
            for model_param, _ in state.masters.pairs():
                model_param.grad = None
            state.scaled_grads_pending = False
            if state.pending and state.found_inf is not None:
                state.found_inf.zero_()
            state.pending = False
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
        if self.memory_efficient:
            with _as_float32(list(self.params)):  # keep the optimizer state float32
                self._optimizer.load_state_dict(inner)
        else:
            self._optimizer.load_state_dict(inner)
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
        self._found = None
        self._local_norm = None

    def _sync(self) -> None:
        """Finish the update's backward passes: unscale, flag, agree across ranks, update scale."""
        if not self._needs_sync:
            return
        self._needs_sync = False
        scaler = self.scaler
        if self.memory_efficient:
            norm = _total_norm(self._grads())  # of the scaled half gradients, in float32
            found = (~torch.isfinite(norm)).float().reshape(1).to(scaler.device)
            self.amp.synchronize_found_inf(found)
            self._scale_before = scaler.scale.clone()
            self._factor = self._factor * scaler.inv_scale().reshape(()).to(norm.device)
            scaler.update_(found)
            self._found, self._local_norm = found, norm
            return
        state = amp_state_of(self._optimizer)
        if state is None or not state.scaled_grads_pending:
            return  # a session that doesn't scale (O0, O3 with fp16): nothing to finish
        self._scale_before = scaler.scale.clone()
        # A scale_loss pass with no backward of its own unscales what the delayed passes left
        # (apex's delay_unscale protocol), checks it, syncs the flag and updates the scale.
        assert self._last_loss is not None  # set by every backward
        with self.amp.scale_loss(self._last_loss, self._optimizer, loss_id=self.loss_id):
            pass

    def _flag(self) -> torch.Tensor | None:
        if self.memory_efficient:
            return self._found
        state = amp_state_of(self._optimizer)
        if state is not None and state.pending and state.found_inf is not None:
            return state.found_inf
        return None

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
            parts[1] = (~torch.isfinite(_local(norm))).float().reshape(1).to(device)
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
            floor = self.min_loss_scale if self.min_loss_scale is not None \
                else self.scaler.min_loss_scale
            raise FloatingPointError(
                f"Minimum loss scale reached ({floor}). Your loss is probably exploding. Try "
                "lowering the learning rate, using gradient clipping or increasing the batch "
                "size."
            )
        new_scale = self.loss_scale
        self._reset()
        raise OverflowError(f"setting loss scale to: {new_scale}")

    def _skip(self, flag_set: bool) -> None:
        """Consume this update as a skipped step (ampx logs and counts it)."""
        self.steps += 1
        self.skipped_steps += 1
        if self.memory_efficient:
            for param in self.params:
                param.grad = None
            self.scaler.report_overflow()
            return
        state = amp_state_of(self._optimizer)
        if state is not None and state.pending and state.found_inf is not None:
            if not flag_set:  # finite gradients whose norm overflowed: skip all the same
                state.found_inf.fill_(1.0)
            self._optimizer.step()  # ampx's step pre-hook turns it into a skipped step
        else:
            for param in self.params:
                param.grad = None

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
        floor = self.min_loss_scale if self.min_loss_scale is not None else scaler.min_loss_scale
        scale = scaler.loss_scale()
        if floor is None:
            return scale < _UNDERFLOW_SCALE
        return scale <= floor

    def _apply_factor(self) -> None:
        factor = self._factor
        if isinstance(factor, (int, float)) and factor == 1.0:
            return
        grads = [_local(g) for g in self._grads()]
        with torch.no_grad():
            for group in _by_device_dtype(grads):
                f = factor if isinstance(factor, (int, float)) else factor.to(group[0].device)
                torch._foreach_mul_(group, f)

    def _step_fp32(self) -> None:
        """Step half parameters with float32 math and float32 optimizer state."""
        factor = self._factor
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for param in self.params:
                grad = param.grad
                if grad is None:
                    continue
                f = factor if isinstance(factor, (int, float)) else factor.to(grad.device)
                if param.dtype in _HALF:
                    half = param.data
                    grad32 = grad.float().mul_(f)
                    param.grad = None
                    param.data = half.float()
                    param.grad = grad32
                    swapped.append((param, half))
                else:
                    grad.mul_(f)
        try:
            self._optimizer.step()
        finally:
            with torch.no_grad():
                for param, half in swapped:
                    half.copy_(param.data)
                    param.grad = None
                    param.data = half


class _as_float32:
    """Context manager: half parameters temporarily hold float32 data (for load_state_dict)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = [p for p in params if p.dtype in _HALF]
        self._halves: list[torch.Tensor] = []

    def __enter__(self) -> None:
        for param in self._params:
            self._halves.append(param.data)
            param.data = param.data.float()

    def __exit__(self, *exc: Any) -> None:
        for param, half in zip(self._params, self._halves):
            param.data = half


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Float32 L2 norm of this rank's part of `grads`, one fused pass per device."""
    local = [_local(g) for g in grads]
    if not local:
        return torch.zeros(())
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in local:
        by_device.setdefault(t.device, []).append(t)
    norms: list[torch.Tensor] = [_ext.l2norm(group) for group in by_device.values()]  # type: ignore[misc]
    if len(norms) == 1:
        return norms[0]
    first = norms[0].device
    return torch.stack([n.to(first) for n in norms]).norm()


def _aggregate_dtensor_norm(norm: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum squared norms over the mesh when the gradients are DTensor shards (FSDP2)."""
    sharded = [g for g in grads if _is_dtensor(g)
               and any(p.is_shard() for p in g.placements)]  # type: ignore[attr-defined]
    meshes = {id(g.device_mesh): g.device_mesh for g in sharded}  # type: ignore[attr-defined]
    if not meshes:
        return norm
    if len(meshes) > 1 or next(iter(meshes.values())).ndim != 1:
        raise ValueError(
            "AmpOptimizer.clip_grad_norm: gradients are sharded over several or multi-"
            "dimensional device meshes; pass aggregate_norm_fn to combine the norms."
        )
    import torch.distributed as dist

    mesh = next(iter(meshes.values()))
    squared = (norm.float() ** 2).reshape(1)
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return squared.sqrt().reshape(())
