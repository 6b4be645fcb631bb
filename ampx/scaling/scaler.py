"""LossScaler: dynamic or static loss scaling with device-side state.

The scale, growth tracker and hysteresis tracker live on the gradients' device and are updated
there by the kernel contract's `update_scale_`, so scaling never waits for the host. Updates
are transactional: `next_state` computes the new state into fresh tensors and `commit` lists
the assignments that install it (the scaled pass applies them together with the gradients').

Host synchronisation, all of it:

- none while scaling, unscaling and updating (`scale_loss_value`, `inv_scale`, `update_`);
- one `.item()` per optimizer step, in the optimizer's step pre-hook (`ampx.scaling.protocol`
  `decide_step`), to decide whether the step is skipped; on clean steps that is the only one;
  none for fused torch optimizers, which take the device flag;
- on skipped steps only, `report_overflow` reads the flag and the old and new scale to log;
- reading a value as a Python number (`loss_scale()`, `clean_steps`, `state_dict()`)
  synchronises once per call.

apex's private members (`_loss_scale`, `update_scale`, ...) are added by `ampx.compat.apex`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from .. import _ext
from ..options.levels import DEFAULTS, LossScale
from . import checkpoint

__all__ = ["LossScaler", "STATE_VERSION"]

logger = logging.getLogger("ampx")

STATE_VERSION = checkpoint.STATE_VERSION
_STATIC_INTERVAL = 2**31 - 1  # a static scaler never grows; it only counts clean steps
_STATIC_RULE = (1.0, 1.0, _STATIC_INTERVAL, 1, 0.0, math.inf)
_LOG_INTERVAL_S = 30.0  # overflow messages after the first few are rate-limited to this
_LOG_FIRST = 3  # overflow messages always logged before rate limiting starts
# Without a min_loss_scale the scale backs off no lower than 1.0 (DeepSpeed's floor). apex's
# halving ran into 0; a floor like 2**-126 is no better: every fp16 gradient underflows to 0
# there, steps look clean, and growing back takes ~250k steps. At 1.0 gradients are plain fp16
# values, training goes on, and the scale grows back by growth_factor per growth_interval.
_DEFAULT_FLOOR = 1.0
_float, _mul, _reshape = torch._C.TensorBase.float, torch._C.TensorBase.mul, \
    torch._C.TensorBase.reshape
_TENSORS = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_overflows_since_report",
            "_scale_before_overflow")


class LossScaler:
    """The scale of one loss (`loss_id`), dynamic or static.

    Dynamic scaling (apex's rule): start at `min(init_scale, max_loss_scale)`, multiply by
    `backoff_factor` on an overflow (after `hysteresis` consecutive overflows), multiply by
    `growth_factor` after `growth_interval` clean steps, and stay within
    [`min_loss_scale`, `max_loss_scale`]. A static scaler keeps its scale and counts clean
    steps as apex did; with `skip_non_finite` (the bf16 default) its steps are still skipped
    on inf/NaN gradients, without changing the scale.

    State lives on `device` (moved to the gradients' device at initialize); see the module
    docstring for the one host sync per step.

    Args:
        loss_scale: "dynamic" or a static positive float.
        init_scale: Initial dynamic scale.
        growth_factor: Growth multiplier.
        backoff_factor: Backoff multiplier.
        growth_interval: Clean steps between growths (apex's scale window).
        hysteresis: Overflows tolerated before backing off (DeepSpeed's meaning).
        min_loss_scale: Floor (None: 1.0, or the start scale when that is lower).
        max_loss_scale: Ceiling.
        loss_id: The index of this scaler, for messages.
        device: Where the state lives; moved to the gradients' device on first use.
        log_level: The level of the skipped-step lines (`initialize`'s ``verbosity=0``, like
            apex's, silences them: DEBUG). The floor warning is a WARNING at any level.

    Example::

        scaler = LossScaler("dynamic", init_scale=2.0**10)
        found_inf = torch.zeros(1)
        scaler.update_(found_inf)          # a clean step
        scaler.loss_scale()                # 1024.0 (one host sync)
    """

    def __init__(
        self,
        loss_scale: LossScale = "dynamic",
        *,
        init_scale: float = DEFAULTS.init_scale,
        growth_factor: float = DEFAULTS.growth_factor,
        backoff_factor: float = DEFAULTS.backoff_factor,
        growth_interval: int = DEFAULTS.growth_interval,
        hysteresis: int = DEFAULTS.hysteresis,
        min_loss_scale: float | None = DEFAULTS.min_loss_scale,
        max_loss_scale: float = DEFAULTS.max_loss_scale,
        loss_id: int = 0,
        device: torch.device | str = "cpu",
        log_level: int = logging.INFO,
    ) -> None:
        self.dynamic = loss_scale == "dynamic"
        start = min(max_loss_scale, init_scale) if self.dynamic else float(loss_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = float(max_loss_scale)
        self.loss_id = loss_id
        self.log_level = log_level
        self._start = float(start)
        device = torch.device(device)
        # torch.tensor, not full/clone: their kernels' code pages are resident memory that a
        # training loop never maps otherwise (benchmarks/bench_memory.py)
        self._scale = torch.tensor([start], dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.tensor([self.hysteresis], dtype=torch.int32,
                                                device=device)
        self._overflows_since_report = torch.zeros(1, dtype=torch.float32, device=device)
        self._scale_before_overflow = torch.tensor([start], dtype=torch.float32, device=device)
        self._last_log = -math.inf
        self._suppressed = 0
        self._floor_warned = False
        self.overflow_count = 0  # overflows observed by the host (at step time)
        # (scale tensor, its version) while a static scale is known on the host to be 1.0
        self._unit_mark: tuple[torch.Tensor, int] | None = None
        self._inv_cache: tuple[torch.Tensor, int, torch.Tensor] | None = None  # inv_scale
        self._scale_view: tuple[torch.Tensor, torch.Tensor] | None = None  # (scale, 0-d view)
        # the state a pass replaced (the five, 1/scale, the view): the native update writes
        # the state after next there when nothing else holds it (`_ext.next_scale_state`)
        self._spare: tuple[torch.Tensor, ...] | None = None
        self._mark_unit(not self.dynamic and start == 1.0)

    # -- device placement -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device holding the scaler's state."""
        return self._scale.device

    def to_(self, device: torch.device) -> None:
        """Move the state to `device` (done once, on first use with the gradients' device)."""
        if device != self._scale.device:
            unit = self.unit_scale()
            for name in _TENSORS:
                setattr(self, name, getattr(self, name).to(device))
            self._spare = None
            self._mark_unit(unit)

    # -- host knowledge of a unit scale (no sync) ------------------------------------------
    def _mark_unit(self, unit: bool) -> None:
        self._unit_mark = (self._scale, self._scale._version) if unit else None

    def unit_scale(self) -> bool:
        """True when the scale is known, without a sync, to be exactly 1.0 (a static scaler).

        Then unscaling multiplies by exactly 1, which changes no value: gradients can be
        checked in place instead of copied (`ampx.scaling.unscale`). Known from the constructor and
        `set_scale`; anything else that writes the scale tensor (or replaces
        it) voids the knowledge, through the tensor's identity and version counter.
        """
        mark = self._unit_mark
        return mark is not None and mark[0] is self._scale and mark[1] == self._scale._version

    # -- the hot path (no host sync) ------------------------------------------------------
    @property
    def scale(self) -> torch.Tensor:
        """The current scale as a float32 tensor of shape [1] (no sync)."""
        return self._scale

    def scale_loss_value(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss.float() * scale`, computed on the device (no sync).

        At a scale known to be exactly 1 (a static scale of 1: bf16's default) that is
        `loss.float()` itself: the product would equal it value for value and gradient for
        gradient, at the cost of one more op per step.
        """
        # torch's own tensor methods (`TensorBase`): under O1 `Tensor.__mul__` and `.float`
        # are cast wrappers, and a float32 loss times a float32 scale needs no cast decision
        loss = _float(loss)
        if self.unit_scale():
            return loss
        scale, view = self._scale, self._scale_view
        if view is None or view[0] is not scale:  # a view: in-place writes show through
            view = self._scale_view = (scale, _reshape(scale, ()))
        if loss.get_device() != scale.get_device():  # (ints: no device objects)
            return _mul(loss, view[1].to(loss.device))
        return _mul(loss, view[1])

    def inv_scale(self) -> torch.Tensor:
        """1 / scale as a float32 tensor of shape [1] (no sync); treat it as read-only.

        Computed once per scale tensor and version (a static scale: once for good), so a
        pass whose scale did not change since the last one launches no kernel for it.
        """
        scale = self._scale
        cached = self._inv_cache
        if cached is not None and cached[0] is scale and cached[1] == scale._version:
            return cached[2]
        # 1 / scale by the division kernel the optimizers run anyway (bitwise reciprocal's
        # result): reciprocal's own code would be pages every process maps for one number
        inv = torch.ones_like(scale).div_(scale)
        self._inv_cache = (scale, scale._version, inv)
        return inv

    def update_(self, found_inf: torch.Tensor) -> None:
        """Update the scale after one backward pass; `found_inf` is a float32 [1] flag."""
        _ext.assign(tuple(self.commit(self.next_state(found_inf))))

    @property
    def floor(self) -> float:
        """The lowest scale a backoff reaches: `min_loss_scale`, or 1.0 (or the start scale
        when that is below 1) without one."""
        if self.min_loss_scale is not None:
            return float(self.min_loss_scale)
        return min(_DEFAULT_FLOOR, self._start)

    def next_state(self, found_inf: torch.Tensor) -> dict[str, Any]:
        """The state after one backward pass with flag `found_inf`.

        Nothing of the scaler changes; `commit` installs the result (the transactional half
        of `update_`, used by the scaled-backward protocol). The tensors are fresh, or (the
        native CPU update) the spare set, the state the last commit replaced, written in
        place when nothing but the scaler holds any of it: a kept `scale`, a graph that
        saved the scaled loss's factor, keep theirs (`_ext.next_scale_state`).
        """
        found = found_inf if found_inf.get_device() == self._scale.get_device() \
            else found_inf.to(self.device)  # (`get_device`: an int, no device object)
        rule = self.rule
        fused = _ext.next_scale_state(self.tensors(), found, rule, self._spare)
        if fused is not None:  # the same five ops as below, in one native call (and 1/scale)
            fresh: dict[str, Any] = dict(zip(_TENSORS, fused))
            fresh["_inv_cache"] = (fused[0], fused[0]._version, fused[5])
            fresh["_scale_view"] = (fused[0], fused[6])
            fresh["_spare"] = self._current_set()
            return fresh
        # the three the kernel updates in place are cloned; the other two are computed anew
        new = {name: getattr(self, name).clone() for name in _TENSORS[:3]}
        # remember the scale in force before the first overflow not yet reported (for the log)
        new["_scale_before_overflow"] = torch.where(
            self._overflows_since_report > 0, self._scale_before_overflow, self._scale)
        new["_overflows_since_report"] = torch.maximum(self._overflows_since_report, found)
        _ext.update_scale_(new["_scale"], new["_growth_tracker"], new["_hysteresis_tracker"],
                           found, *rule)
        return new

    def _current_set(self) -> tuple[torch.Tensor, ...] | None:
        """The seven tensors of the state in force (the five, 1/scale, the 0-d view), which
        become the spare once a new state is committed; None while 1/scale or the view is
        not of the current scale."""
        scale, inv, view = self._scale, self._inv_cache, self._scale_view
        if inv is None or view is None or inv[0] is not scale or view[0] is not scale:
            return None
        return (scale, self._growth_tracker, self._hysteresis_tracker,
                self._overflows_since_report, self._scale_before_overflow, inv[2], view[1])

    @property
    def rule(self) -> tuple[float, float, int, int, float, float]:
        """(growth, backoff, interval, hysteresis, floor, ceiling) of the update rule; a
        static scaler's never changes the scale."""
        if self.dynamic:
            return (float(self.growth_factor), float(self.backoff_factor),
                    int(self.growth_interval), int(self.hysteresis), float(self.floor),
                    float(self.max_loss_scale))
        return _STATIC_RULE

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The five state tensors, in `next_state`'s order (read-only)."""
        return (self._scale, self._growth_tracker, self._hysteresis_tracker,
                self._overflows_since_report, self._scale_before_overflow)

    def commit(self, new: Mapping[str, Any]) -> list[Any]:
        """The assignments that install a state made by `next_state` (or a checkpoint load):
        flat (object, name, value) triples for `ampx._ext.assign`; nothing is set here.

        A static scale keeps its value through both (a checkpoint of another static scale is
        refused), so a known unit scale stays known.
        """
        out: list[Any] = []
        for name, value in new.items():  # (`next_state`'s or a checkpoint's names only)
            out += (self, name, value)
        if self.unit_scale():
            scale = new.get("_scale", self._scale)
            out += (self, "_unit_mark", (scale, scale._version))
        return out

    # -- host-side reporting (syncs; called only on the overflow path) ------------------------
    def report_overflow(self, where: str = "") -> tuple[float, float] | None:
        """Log an overflow seen at step time, rate-limited, and warn at the floor.

        The first few overflows are logged (logger "ampx", INFO) with the loss id, the old and
        the new scale; later ones at most once per 30 s, with a count of the suppressed ones.
        A WARNING is logged once each time a dynamic scale reaches its floor.

        Args:
            where: Inserted after "Gradient overflow" (e.g. " in fc2.weight").

        Returns:
            (old scale, new scale) when this scaler had an overflow to report, else None.

        .. note:: Reads the flag and the scales: host syncs, only on steps that overflowed.
        """
        if not bool(self._overflows_since_report.item()):
            return None
        self._overflows_since_report.zero_()
        self.overflow_count += 1
        old_scale = float(self._scale_before_overflow.item())
        new_scale = self.loss_scale()
        now = time.monotonic()
        if self.overflow_count <= _LOG_FIRST or now - self._last_log >= _LOG_INTERVAL_S:
            self._log_overflow(old_scale, new_scale, where)
            self._last_log, self._suppressed = now, 0
        else:
            self._suppressed += 1
        self._warn_at_floor(new_scale)
        return old_scale, new_scale

    def _log_overflow(self, old_scale: float, new_scale: float, where: str) -> None:
        extra = f" ({self._suppressed} similar messages suppressed)" if self._suppressed else ""
        level = self.log_level
        if not self.dynamic:
            logger.log(level, "Non-finite gradients%s.  Skipping step, loss scaler %d keeps its "
                       "static loss scale %s%s", where, self.loss_id, new_scale, extra)
        elif new_scale < old_scale:
            logger.log(level, "Gradient overflow%s.  Skipping step, loss scaler %d reducing loss "
                       "scale to %s (was %s)%s", where, self.loss_id, new_scale, old_scale,
                       extra)
        else:
            logger.log(level, "Gradient overflow%s.  Skipping step, loss scaler %d keeps loss "
                       "scale %s (hysteresis=%d: more overflows are tolerated before backing "
                       "off)%s", where, self.loss_id, new_scale, self.hysteresis, extra)

    def _warn_at_floor(self, new_scale: float) -> None:
        at_floor = new_scale <= self.floor
        if self.dynamic and at_floor and not self._floor_warned:
            self._floor_warned = True
            logger.warning(
                "ampx: loss scaler %d reached its minimum scale %s after an overflow; it backs "
                "off no further. Steps with inf/NaN gradients are still skipped, and the scale "
                "grows again after %d clean steps. If steps keep being skipped at this scale, "
                "look for a layer producing inf/NaN, lower the learning rate, or use bf16.",
                self.loss_id, new_scale, self.growth_interval,
            )
        elif not at_floor:
            self._floor_warned = False

    def at_minimum(self) -> bool:
        """True when a dynamic scale sits at `min_loss_scale` (one host sync)."""
        return (self.dynamic and self.min_loss_scale is not None
                and self.loss_scale() <= self.min_loss_scale)

    def loss_scale(self) -> float:
        """The current scale as a Python float.

        .. note:: Synchronises with the device once.
        """
        return float(self._scale.item())

    # -- host-side access (syncs) -------------------------------------------------------------
    def set_scale(self, value: float) -> None:
        """Write the scale from the host (a static 1.0 written here is known without a sync)."""
        self._scale.fill_(float(value))
        self._mark_unit(not self.dynamic and float(value) == 1.0)

    @property
    def clean_steps(self) -> int:
        """Clean steps since the last growth or overflow (the growth tracker; syncs once)."""
        return int(self._growth_tracker.item())

    @clean_steps.setter
    def clean_steps(self, value: int) -> None:
        self._growth_tracker.fill_(int(value))

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """apex's two keys (`loss_scale`, `unskipped`) plus ampx's full state.

        .. note:: Synchronises with the device once.
        """
        return {
            "loss_scale": self.loss_scale(),
            "unskipped": self.clean_steps,
            "version": STATE_VERSION,
            "dynamic": self.dynamic,
            "hysteresis_tracker": int(self._hysteresis_tracker.item()),
            "hysteresis": self.hysteresis,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
        }

    def load_state_dict(self, state: Mapping[str, Any], key: str = "loss_scaler") -> None:
        """Load an entry made by `state_dict()` or by apex (`loss_scale`, `unskipped` only).

        The scaling policy (dynamic flag, factors, bounds) stays the one this session was
        configured with; the checkpoint restores the trajectory (scale and counters). See
        `ampx.scaling.checkpoint` for what is checked.

        Raises:
            ampx.CheckpointError: Naming the key, for a malformed or mismatched entry;
                nothing is changed then.
        """
        checkpoint.load([self], {"loss_scaler0": state}, names=[key])
