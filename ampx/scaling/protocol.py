"""The scaled-backward protocol: one stage machine per optimizer, one method per transition.

Every optimizer handed to `initialize` is returned as the very same object, of the same class;
its ampx state is one attribute, `optimizer._ampx`, an `OptimizerAmpState`. That state is the
single owner of the protocol, with an explicit `Stage` (as `torch.amp.GradScaler` keeps
`OptState`):

    READY ──begin_backward──▶ SCALING ──end (unscale)──▶ UNSCALED ──step──▶ READY
      ▲                         │  ▲ └──end (delay_unscale)──▶ SCALED ──begin──┘
      └──────── abort / zero_grad ◀──────────────────────────────┘

- `begin_backward` moves existing gradients aside (the stash) so backward writes only its own,
  or, in `scale_loss`, folds the fp32/bf16 ones into `.grad` at this pass's scale (`folded`:
  DDP's all-reduce then includes what accumulated under `no_sync`);
- `abort_backward` (an exception inside `scale_loss`) puts everything back as it was;
- `ScaledPass.end` (`ampx.scaling.scaled_pass`) unscales this pass's gradients into fresh buffers
  (`ampx.scaling.unscale`), flags inf/NaN, computes the next scaler state, then commits it all
  at once;
- `decide_step` / `after_step` run from torch's step hooks (`ampx.scaling.stepping`): the skip
  decision (one host sync, or none for fused optimizers that take the device flag), and the
  master -> model copy;
- `zero_grad` starts a new update (at O2 it also releases the half model gradients).

Transactions: a transition computes into tensors nobody holds yet and then commits with plain
assignments recorded in a `Journal`; on any exception (KeyboardInterrupt included) the journal
undoes them, so state is exactly what it was. `after_step` runs after the optimizer already
changed the parameters, so it rolls forward instead: it completes its idempotent work (on the
reference kernels if the native one failed) and then re-raises.

Per-tensor overflow flags: with `SessionHooks.per_tensor` every
checked pass adds (loss_id, parameters, float32 flags) to `OptimizerAmpState.overflow_flags`,
one flag per parameter that got a new gradient, filled by the same kernel calls (no extra
pass); they live until the step, like the step flag.

This module never imports the session: what it needs from it (skip policy, the cross-rank
flag agreement, overflow reporting, telemetry) arrives as a `SessionHooks` at `attach`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from .. import _ext
from . import masters as _masters
from . import unscale
from .decision import StepDecision, copy_masters, creates_state, version_mark
from .journal import Journal
from .masters import MasterMap, ParamCache, grad_mark, optimizer_params

__all__ = ["OptimizerAmpState", "SessionHooks", "Stage", "amp_state_of", "master_params",
           "unwrap"]

logger = logging.getLogger("ampx")

ATTR = "_ampx"


class Stage(Enum):
    """Where an optimizer is in the scaled-backward protocol."""

    READY = "READY"  # no scaled pass since the last step (or zero_grad)
    SCALING = "SCALING"  # inside scale_loss: earlier gradients stashed, backward running
    SCALED = "SCALED"  # a delay_unscale pass left scaled gradients in .grad
    UNSCALED = "UNSCALED"  # unscaled gradients and their overflow flag wait for step()


def _noop(*args: Any) -> None:
    return None


_FROM_READY = (Stage.READY, None)  # `_entry` of a pass begun from READY


@dataclass(frozen=True)
class SessionHooks:
    """What the session hands an optimizer's state at attach (the state never sees the session).

    Attributes:
        scales: False on apex's short-circuit path (no masters, static 1.0, no inf check).
        skips: Whether steps with non-finite gradients are skipped.
        master_weights: Whether half parameters added later get fp32 masters.
        per_tensor: Compute per-parameter overflow flags in every checked pass (kept in
            `OptimizerAmpState.overflow_flags` until the step).
        on_overflow: Called with the loss ids of a skipped step (logging; may sync), before
            the step's gradients are released; the step is committed even if it raises.
        on_skip: Called with (optimizer, state) on a skipped step, right after `on_overflow`
            (the gradients and `overflow_flags` are still there); may raise likewise.
        on_step: Called with (optimizer, state) after every step (telemetry).
        compensation: "kahan": the half weights carry compensations and step through
            `ampx.scaling.compensated` (decided on the host); None: plain.
    """

    scales: bool = True
    skips: bool = True
    master_weights: bool = False
    per_tensor: bool = False
    on_overflow: Callable[[Sequence[int]], None] = _noop
    on_skip: Callable[[torch.optim.Optimizer, OptimizerAmpState], None] = _noop
    on_step: Callable[[torch.optim.Optimizer, OptimizerAmpState], None] = _noop
    compensation: str | None = None


@dataclass(eq=False)
class OptimizerAmpState:
    """Everything ampx keeps for one optimizer (held as `optimizer._ampx`).

    Attributes:
        owner: The session that attached it (opaque here; the frontend uses it).
        policy: What the session decided for this optimizer.
        masters: The O2 model-parameter -> fp32 master map (empty without master weights).
        stage: Where the optimizer is in the protocol.
        found_inf: Device flag: a non-finite gradient was seen since the last step.
        loss_ids: Loss scalers whose passes fed the next step.
        overflow_flags: With `SessionHooks.per_tensor`, one (loss_id, params, flags) per checked
            pass since the last step: float32 flags, 1.0 where that parameter's new gradient
            had inf/NaN (cleared with the step flag).
        steps: `step()` calls so far.
    """

    owner: object
    policy: SessionHooks = field(default_factory=SessionHooks)
    masters: MasterMap = field(default_factory=MasterMap)
    stage: Stage = Stage.READY
    found_inf: torch.Tensor | None = None
    loss_ids: frozenset[int] = frozenset()
    overflow_flags: tuple[tuple[int, list[torch.Tensor], torch.Tensor], ...] = ()
    last_loss: torch.Tensor | None = None
    steps: int = 0
    stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # earlier gradients now in `.grad` times the pass's scale (for abort: the originals)
    folded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    dropped: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    last_step_end: float = field(default_factory=time.perf_counter)
    _entry: tuple[Stage, dict[int, Any] | None] | None = None
    _before_delay: Stage = Stage.READY
    _decision: StepDecision | None = None
    _skipped: int = 0
    _skipped_device: torch.Tensor | None = None
    _last_skip: bool | torch.Tensor = False
    _groups_seen: int = 0
    _cache: ParamCache | None = None
    # the masters a clean native pass gave a gradient (it appends them itself): their undo
    written: list[torch.Tensor] = field(default_factory=list)
    # the pass in SCALING (`scaled_pass.ScaledPass`: where its block is; None: apex's begin)
    _opening: Any = None

    # -- views -----------------------------------------------------------------------------
    def use_masters(self) -> None:
        """Masters are about to be used: they take what was written into the model since
        initialize (DDP's broadcast, a load on one rank), then stop following it."""
        if self.masters.watching:
            self.masters.follow()

    def cache(self, optimizer: torch.optim.Optimizer) -> ParamCache:
        """The parameter views, after adopting groups added since the last call."""
        groups = optimizer.param_groups
        cache = self._cache
        if cache is not None and len(groups) == self._groups_seen == 1:
            # the usual optimizer (one group, unchanged): `masters.signature`'s test, inline
            params = groups[0]["params"]
            mark = cache.signature[0]
            if (id(params) == mark[0] and len(params) == mark[1] and params
                    and id(params[0]) == mark[2] and id(params[-1]) == mark[3]):
                return cache
        self._groups_seen = _masters.adopt_new_groups(
            optimizer, self.masters, self._groups_seen, self.policy.master_weights)
        self._cache = _masters.build_cache(optimizer, self.masters, self._cache)
        return self._cache

    def model_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The half model parameters behind this optimizer's fp32 masters (O2), in order."""
        return list(self.cache(optimizer).models)

    def master_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The fp32 masters this optimizer steps (O2), in the order of `model_params`."""
        return list(self.cache(optimizer).masters)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent `step()` was skipped.

        .. note:: After a fused optimizer's step (no host sync at step time) this reads the
           device flag: one sync.
        """
        skip = self._last_skip
        return bool(skip.item()) if isinstance(skip, torch.Tensor) else skip

    @property
    def skipped_steps(self) -> int:
        """Skipped `step()` calls so far (one sync when fused steps are counted on device)."""
        extra = self._skipped_device
        return self._skipped + (int(extra.item()) if extra is not None else 0)

    def pending_flag(self) -> torch.Tensor | None:
        """The overflow flag the next `step()` decides on (None when no checked pass ran)."""
        return self.found_inf if self.stage is Stage.UNSCALED else None

    def mark_overflow(self) -> None:
        """UNSCALED: make the next `step()` a skipped one (finite gradients whose norm is not)."""
        if self.stage is Stage.UNSCALED and self.found_inf is not None:
            self.found_inf = torch.ones_like(self.found_inf)

    def detach(self) -> None:
        """Remove the step hooks and the zero_grad handler (initialize failed half-way)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _heal(self, optimizer: torch.optim.Optimizer) -> None:
        """Complete a step whose update ran but whose post hook did not (rolls forward).

        A KeyboardInterrupt inside the optimizer's update, or after it before ampx's post
        hook, leaves `_decision` set, the half model behind its masters and the step
        uncommitted. The next entry (`zero_grad`, `scale_loss`, `step`) finishes it: the
        master -> model copy and the commit, as `after_step` would have. A step that raised
        before changing any parameter stays pending (`step()` again retries it).
        """
        decision = self._decision
        if decision is None or not decision.updated() or decision.running():
            return  # (still running: a zero_grad or scale_loss from inside the step)
        cache = self.cache(optimizer)
        error = copy_masters(cache) if cache.pairs and (not decision.skip or decision.resync) \
            else None
        self._commit_step(cache, decision)
        self.policy.on_step(optimizer, self)  # the step's end, late (telemetry, detector)
        if error is not None:
            raise error

    # -- transitions around backward ---------------------------------------------------------
    def begin_backward(self, optimizer: torch.optim.Optimizer, opening: Any = None,
                       scale: torch.Tensor | None = None) -> None:
        """READY/UNSCALED/SCALED -> SCALING: move earlier gradients aside for this pass.

        All or nothing: the stage is set last, so an exception (or an interrupt) before it
        leaves the optimizer where it was. `opening` is the pass (`scaled_pass.ScaledPass`,
        which knows where its block is): `heal_abandoned` asks it, and the pass aborts exactly
        the optimizers that carry it.

        Parameters the optimizer steps have their gradient stashed (added back to this pass's
        unscaled gradient at the end). Given the pass's `scale` (`scale_loss` gives it; apex's
        `_prepare_amp_backward` does not), dense fp32, fp64 and bf16 gradients are folded
        instead: `.grad` becomes the earlier gradient times the scale, backward adds onto it
        and the pass unscales the sum, which equals the stash's result (exactly at a power-of-
        two scale), but leaves the accumulated gradient where DDP's all-reduce finds it: a
        micro-batch run under `no_sync` before this pass reaches the other ranks. The half
        model parameters behind masters have theirs put aside too and released at the end,
        as apex did: anything there was not produced through this optimizer's `scale_loss` (a
        discriminator's backward reaching the generator), and `zero_grad` only reaches the
        masters. After a `delay_unscale` pass
        nothing moves (gradients accumulate scaled, so DDP's last all-reduce sees all of them);
        the gradients' identities and versions are recorded instead.
        """
        stage = self.stage
        if (stage is Stage.READY and self._decision is None and not self.stash
                and not self.dropped and not self.masters.watching):
            # the usual pass (after zero_grad): nothing to set aside unless a gradient
            # appeared since; three plain assignments, the stage last
            if not _ext.with_grads(self.cache(optimizer).sources):
                self._entry = _FROM_READY
                self._opening = opening
                self.stage = Stage.SCALING
                return
        if stage is Stage.SCALING and not self.heal_abandoned(optimizer):
            raise RuntimeError(
                "ampx.scale_loss: this optimizer is already inside a scale_loss block; nest "
                "no scale_loss blocks over the same optimizer (finish the first one)."
            )
        if self.masters.watching:
            self.masters.follow()
        if self._decision is not None:
            self._heal(optimizer)
        cache = self.cache(optimizer)
        journal = Journal()
        stage = self.stage
        try:
            if stage is Stage.SCALED:
                marks = {id(p): grad_mark(p) for p in cache.sources}
                journal.set(self, "_entry", (Stage.SCALED, marks))
            else:
                journal.set(self, "_entry", (stage, None))
                if self.stash or self.dropped or _ext.with_grads(cache.sources):
                    self._set_aside(journal, cache, scale)
            journal.set(self, "_opening", opening)
            journal.set(self, "stage", Stage.SCALING)
        except BaseException:
            journal.rollback()
            raise

    def _set_aside(self, journal: Journal, cache: ParamCache,
                   scale: torch.Tensor | None) -> None:
        """The gradients of before the pass go into the stash (and `dropped`), out of `.grad`,
        or are folded at `scale` (`begin_backward`)."""
        stash = {id(p): (p, p.grad) for p in _ext.with_grads(cache.others)}
        dropped = {id(p): (p, p.grad) for p in _ext.with_grads(cache.models)}
        folded = unscale.take_foldable(stash) if scale is not None else {}
        journal.set(self, "stash", stash)
        journal.set(self, "dropped", dropped)
        journal.set(self, "folded", folded)
        for param, _ in list(stash.values()) + list(dropped.values()):
            journal.set(param, "grad", None)
        if folded and scale is not None:
            for param, value in unscale.fold(folded, scale, self.found_inf):
                journal.set(param, "grad", value)

    def heal_abandoned(self, optimizer: torch.optim.Optimizer) -> bool:
        """SCALING whose block is gone (interrupted at its exit's entry): abort that pass.

        Returns whether the optimizer left SCALING. A pass whose block is still open (or
        whose begin ran elsewhere: apex's `_prepare_amp_backward`) stays.
        """
        opening = self._opening
        if self.stage is not Stage.SCALING or opening is None or not opening.over():
            return False
        logger.warning("ampx: a scale_loss block was left without its exit (an interrupt at "
                       "its entry); its pass is dropped, as an exception in the block would.")
        self.abort_backward(optimizer)
        return self.stage is not Stage.SCALING

    def abort_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """SCALING -> the stage before: this pass's gradients are dropped, the stash restored.

        After a `delay_unscale` pass the scaled gradients were accumulating in place; if the
        aborted pass wrote into them (an exception after `backward()`), the accumulated update
        is no longer what the completed passes produced, so it is dropped entirely and the
        gradients of before the first delayed pass come back (logged as a warning).
        """
        if self.stage is not Stage.SCALING or self._entry is None:
            return
        before, marks = self._entry
        cache = self.cache(optimizer)
        touched = cache.sources
        if before is Stage.SCALED and marks is not None:
            if not self.written and all(grad_mark(p) == marks.get(id(p)) for p in touched):
                self.stage, self._entry, self._opening = Stage.SCALED, None, None
                return
            logger.warning("ampx.scale_loss: an exception interrupted a backward that added "
                           "into delay_unscale gradients; the partial update is dropped.")
            before = self._before_delay
        journal = Journal()
        try:
            for param in touched:
                journal.set(param, "grad", None)
            for master in self.written:  # a clean pass gave them gradients; they had none
                journal.set(master, "grad", None)
            for param, grad in [*self.stash.values(), *self.dropped.values(),
                                *self.folded.values()]:
                journal.set(param, "grad", grad)
            journal.set(self, "stash", {})
            journal.set(self, "folded", {})
            journal.set(self, "dropped", {})
            journal.set(self, "written", [])
            journal.set(self, "_entry", None)
            journal.set(self, "_opening", None)
            journal.set(self, "stage", before)
        except BaseException:
            journal.rollback()
            raise

    def commit_delayed(self) -> list[Any]:
        """SCALING -> SCALED (a `delay_unscale` pass): the scaled gradients stay in `.grad`.

        Returns the commit as flat (object, name, value) assignments, for `ampx._ext.assign`.
        """
        assert self._entry is not None  # set by begin_backward
        out: list[Any] = []
        if self._entry[0] is not Stage.SCALED:
            out += (self, "_before_delay", self._entry[0])
        out += (self, "_entry", None, self, "_opening", None, self, "stage", Stage.SCALED)
        return out

    def commit_unscale(self, work: unscale.UnscaleWork, flag: torch.Tensor | None,
                       loss_id: int | None, loss: torch.Tensor,
                       per_tensor: torch.Tensor | None = None) -> list[Any]:
        """SCALING -> UNSCALED: the computed gradients, the flag and the bookkeeping.

        Returns the commit as flat (object, name, value) assignments, for `ampx._ext.assign`
        (the pass commits every optimizer's and the scaler's in one call); nothing is set here.
        """
        out: list[Any] = []
        if work.assign or work.clear or self.dropped:  # (none after a clean native pass)
            for (param, _, _), grad in zip(work.assign, work.results):
                if param.grad is not grad:  # a gradient checked in place is already there
                    out += (param, "grad", grad)
            for model_param in work.clear:
                out += (model_param, "grad", None)
            for param, _ in self.dropped.values():
                if param.grad is not None and all(param is not p for p in work.clear):
                    out += (param, "grad", None)
        if self.stash:
            out += (self, "stash", {})
        if self.folded:
            out += (self, "folded", {})
        if self.dropped:
            out += (self, "dropped", {})
        if self.written:  # committed: no undo for them any more
            out += (self, "written", [])
        if flag is not None:
            out += (self, "found_inf", flag)
        if loss_id is not None:
            if loss_id not in self.loss_ids:
                out += (self, "loss_ids", self.loss_ids | {loss_id})
            if per_tensor is not None:
                out += (self, "overflow_flags",
                        (*self.overflow_flags, (loss_id, work.flag_params, per_tensor)))
        out += (self, "last_loss", loss, self, "_entry", None, self, "_opening", None,
                self, "stage", Stage.UNSCALED)
        return out

    def next_flag(self, found: torch.Tensor) -> torch.Tensor:
        """The step flag after folding in one pass's `found` (a tensor nobody writes later).

        `found` is the pass's own flag, written only before this (kernels, the cross-rank
        agreement) and never after, so the first pass's flag is used as it is (no copy).
        """
        if self.found_inf is None:
            return found
        return torch.maximum(self.found_inf, found.to(self.found_inf.device))

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Any stage but SCALING -> READY: the update is abandoned (`optimizer.zero_grad()`).

        Releases the half model gradients behind masters (as apex's O2 zero_grad did), the
        stash, the scaled-gradients mark and the pending overflow flag.
        """
        if (self.stage is Stage.READY and self._decision is None and self.found_inf is None
                and not self.stash and not self.dropped and not self.loss_ids
                and not self.overflow_flags):
            # the usual zero_grad right after a step: nothing to release (at O2, unless
            # half model gradients appeared since)
            if not self.masters or not _ext.with_grads(self.cache(optimizer).models):
                return
        if self.stage is Stage.SCALING and not self.heal_abandoned(optimizer):
            return
        decision = self._decision
        if decision is not None:
            self._heal(optimizer)
            # from inside a running step (SAM's zero_grad, a closure's): the step keeps it
            decision = self._decision if decision.running() else None
        cache = self.cache(optimizer)
        journal = Journal()
        try:
            for model_param in _ext.with_grads(cache.models):
                journal.set(model_param, "grad", None)
            for name, value in (("stash", {}), ("dropped", {}), ("folded", {}),
                                ("found_inf", None),
                                ("loss_ids", frozenset()), ("overflow_flags", ()),
                                ("_decision", decision),
                                ("stage", Stage.READY)):
                journal.set(self, name, value)
        except BaseException:
            journal.rollback()
            raise

    # -- transitions around step -----------------------------------------------------------
    def decide_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> StepDecision:
        """Before the optimizer's step: skip it or not (recorded; committed by `after_step`).

        The step's closure has not run yet: each of the optimizer's calls of it is a pass
        of its own, after which `ampx.scaling.closures` updates this decision.

        .. note:: Reads the device overflow flag with one `.item()`: the only host sync of a
           step, and only when a checked `scale_loss` ran since the last step. Fused torch
           optimizers that take `found_inf` (`_step_supports_amp_scaling`) get the device
           flag instead and skip inside their kernel: no sync.
        """
        stage = self.stage
        if stage is Stage.SCALING:
            self.heal_abandoned(optimizer)
            stage = self.stage
        if stage is Stage.SCALING or stage is Stage.SCALED:
            raise RuntimeError(
                "optimizer.step() was called while gradients are still scaled: the last "
                "scale_loss(..., delay_unscale=True) must be followed by a scale_loss without "
                "delay_unscale before step()." if stage is Stage.SCALED else
                "optimizer.step() was called inside a scale_loss block; step after the block."
            )
        if self.masters.watching:
            self.masters.follow()
        if self._decision is not None:
            self._heal(optimizer)
        cache = self.cache(optimizer)
        skip, flag = False, None
        found = self.found_inf
        if self.stage is Stage.UNSCALED and found is not None and self.policy.skips:
            if getattr(optimizer, "_step_supports_amp_scaling", False) and \
                    not self.policy.compensation and not creates_state(optimizer, cache):
                flag = found
            else:
                skip = bool(found.item())  # the one host sync of a step
        decision = self._decision = StepDecision(skip, flag, version_mark(cache), cache)
        return decision

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer's step: copy masters to the model, then commit the step.

        Rolls forward (the parameters already moved): if the copy kernel fails it is redone
        on the reference path, the step is committed, and the error is re-raised.
        """
        decision = self._decision or StepDecision()
        cache = decision.cache or self.cache(optimizer)
        error: BaseException | None = None
        if cache.pairs and (not decision.skip or decision.resync):
            error = copy_masters(cache)  # (resync: a closure call copied perturbed masters)
        if decision.skip:
            try:
                self.policy.on_overflow(sorted(self.loss_ids))
                self.policy.on_skip(optimizer, self)
            finally:
                self._commit_step(cache, decision)
        else:
            self._commit_step(cache, decision)
        self.policy.on_step(optimizer, self)
        if error is not None:
            raise error

    def _commit_step(self, cache: ParamCache, decision: StepDecision) -> None:
        """The step's bookkeeping, all or nothing (one `ampx._ext.assign`): an interrupt
        before it leaves the step pending (`_decision` set), and the next entry completes it
        again (`_heal`)."""
        if cache.masters:  # as apex: the step consumes them
            _ext.drop_grads(cache.masters)
        out: list[Any] = [self, "steps", self.steps + 1]
        if decision.flag is not None:
            skip = decision.flag.reshape(()) > 0
            out += (self, "_last_skip", skip, self, "_skipped_device",
                    skip.int() if self._skipped_device is None
                    else self._skipped_device + skip.int())
        else:
            if self._last_skip is not decision.skip:
                out += (self, "_last_skip", decision.skip)
            if decision.skip:
                out += (self, "_skipped", self._skipped + 1)
        if self.found_inf is not None:
            out += (self, "found_inf", None)
        if self.loss_ids:
            out += (self, "loss_ids", frozenset())
        if self.overflow_flags:
            out += (self, "overflow_flags", ())
        out += (self, "stage", Stage.READY, self, "_decision", None)  # until here: pending
        _ext.assign(tuple(out))


def unwrap(optimizer: Any) -> Any:
    """The optimizer ampx attached to, behind wrappers exposing it as `.optimizer` (Lightning's
    `LightningOptimizer`, Accelerate's `AcceleratedOptimizer`); anything else unchanged."""
    obj = optimizer
    for _ in range(8):  # a bound on wrapper depth (and on a cycle)
        if ATTR in getattr(obj, "__dict__", {}):
            return obj
        obj = getattr(obj, "optimizer", None)
        if obj is None:
            break
    return optimizer


def amp_state_of(optimizer: Any) -> OptimizerAmpState | None:
    """The ampx state of an optimizer (or of a wrapper's), or None without initialize."""
    return getattr(unwrap(optimizer), ATTR, None)


def master_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters the optimizer steps: the fp32 masters at O2, valid right after initialize.

    Clip gradients over these (not `model.parameters()`): after `scale_loss` they hold the
    unscaled gradients. Half parameters added with `add_param_group` after initialize get
    their masters here at the latest.
    """
    optimizer = unwrap(optimizer)  # a LightningOptimizer / AcceleratedOptimizer
    state = amp_state_of(optimizer)
    if state is not None:
        state.cache(optimizer)
    return list(optimizer_params(optimizer))
