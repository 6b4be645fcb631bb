"""The scaled pass: `with amp.scale_loss(...)` over one or more optimizers, committed at once.

`ScaleLossBlock` is the `with` block (the session only creates it); `ScaledPass` strings the
per-optimizer transitions of `ampx.scaling.protocol` together: `begin` moves every optimizer to
SCALING (or none), `abort` puts every one back, and `end` computes every optimizer's new
gradients, the pass's overflow flag (agreed across ranks) and the scaler's next state, then
commits all of it through one `Journal`. The unscale itself is `ampx.scaling.unscale`'s.

The clean pass (the usual one: nothing accumulated, plain dense gradients) is one native call
that checks, unscales and assigns the new gradients (`ampx/csrc/grad_pass.cpp`); it runs under
the GIL, so an interrupt lands before or after it, never inside. Its undo is prepared before it
and costs nothing per parameter: the gradients it replaces are this pass's own (there was
nothing to stash), so an abort drops them, and the masters it gave gradients (listed by the
call itself, in the optimizer state's `written`) go back to None. Anything else takes the
general path, which computes into fresh buffers and commits through the journal; both give
bitwise the same results.

`begin` records its changes in the pass's own journal, so `abort` knows what this pass began
even when an interrupt lands between two transitions (or right after `begin` returns): it
aborts exactly those optimizers, and never one that another pass (a nested `scale_loss`
refused) had moved. `abort` is idempotent, so the caller may call it on any exception.

An interrupt can land where no guard of the block can run: at the entry of `__exit__`, before
its first line (a signal handled at the function's start, a tracer's `call` event). Then the
optimizers stay in SCALING with no exit to come. Each pass therefore records where its block
is (`Opening`: the thread, the frame of the `with` and the offset of its entry); the next
entry of the protocol (`scale_loss`, `zero_grad`, `step`) that finds an optimizer in SCALING
asks `Opening.over`, and aborts the pass if its block is gone (its frame returned or unwound,
or that frame is back at or before the `with`, as the next iteration of a loop is).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .. import _ext
from ..o1 import patch
from . import unscale
from .journal import Journal
from .protocol import OptimizerAmpState, unwrap
from .scaler import LossScaler

__all__ = ["Opening", "ScaleLossBlock", "ScaledPass"]


class Opening:
    """Where a scaled pass's `with` block is: its thread, its frame, the offset of its entry.

    An interrupt at the entry of the block's `__exit__` (before its first line) leaves the
    optimizers in SCALING with no exit to come; the next entry of the protocol asks `over`
    and aborts such a pass (`OptimizerAmpState.heal_abandoned`).
    """

    __slots__ = ("thread", "frame", "offset")

    def __init__(self, thread: int, frame: Any, offset: int) -> None:
        self.thread, self.frame, self.offset = thread, frame, offset

    def over(self) -> bool:
        """Whether the block is gone: its frame left this thread's stack, or is back at (or
        before) the `with` (a loop's next iteration); a live other thread's block is not."""
        if self.thread != threading.get_ident():
            return all(t.ident != self.thread for t in threading.enumerate())
        frame: Any = sys._getframe(1)
        while frame is not None:
            if frame is self.frame:
                return bool(frame.f_lasti <= self.offset)
            frame = frame.f_back
        return True


class ScaledPass:
    """One `scale_loss` pass over one or more optimizers: `begin`, then `end` or `abort`.

    Args:
        optimizers: The optimizers whose parameters get gradients from this backward.
        states: Their ampx states, in the same order.
        scaler: The loss scaler of this pass.
        sync: Agrees on the overflow flag across ranks (in place); None when single.
    """

    __slots__ = ("pairs", "scaler", "sync", "_begun", "_began_here")

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 states: Sequence[OptimizerAmpState], scaler: LossScaler,
                 sync: Callable[[torch.Tensor], None] | None = None) -> None:
        self.pairs = list(zip(optimizers, states))
        self.scaler = scaler
        self.sync = sync
        self._begun = Journal()  # begin's changes: non-empty once any optimizer moved
        self._began_here = False  # False: the optimizers were moved to SCALING elsewhere
        # (apex's _prepare_amp_backward), and `abort` acts on all of them

    def begin(self, opening: Opening | None = None) -> None:
        """Every optimizer to SCALING, or none (a failure rolls back the ones already moved).

        `opening`: where the block is, for a later entry to tell an abandoned pass.
        """
        self._began_here = True
        try:  # (not `Journal.atomic`: this runs every step, and a generator costs)
            for opt, state in self.pairs:
                state.begin_backward(opt, self._begun, opening)
        except BaseException:
            self._begun.rollback()
            raise

    def abort(self) -> None:
        """Every optimizer this pass moved back to where it was before `begin` (idempotent).

        After `end` committed (stage UNSCALED or SCALED) there is nothing to abort: each
        optimizer's `abort_backward` acts in SCALING only. A pass whose `begin` ran elsewhere
        (apex's `_prepare_amp_backward`) aborts every optimizer it holds.
        """
        if self._began_here and not len(self._begun):
            return
        for opt, state in reversed(self.pairs):
            state.abort_backward(opt)
        self._begun.forget()

    def end(self, loss: torch.Tensor, *, loss_id: int, delay_unscale: bool = False,
            check: bool = True) -> None:
        """Finish the pass: unscale and check (or keep scaled), then commit everything at once.

        Args:
            loss: The unscaled loss (kept for telemetry).
            loss_id: The scaler's index, recorded for the step's overflow report.
            delay_unscale: Leave the gradients scaled (stage SCALED).
            check: Update the scale and the step flag (False: apex's delay_overflow_check).

        On any exception the pass is aborted: every optimizer is as before `begin`.
        """
        try:
            self._end(loss, loss_id, delay_unscale, check)
        except BaseException:
            self.abort()
            raise
        self._begun.forget()  # committed: nothing left to abort
        self._began_here = True

    def _end(self, loss: torch.Tensor, loss_id: int, delay_unscale: bool, check: bool) -> None:
        journal = Journal()
        if delay_unscale:
            with journal.atomic():
                for _, state in self.pairs:
                    state.commit_delayed(journal)
            return
        scaler = self.scaler
        found: torch.Tensor | None = None  # made by the first optimizer's kernel call
        inv_scale = scaler.inv_scale()
        unit = scaler.unit_scale()
        works: list[unscale.UnscaleWork] = []
        flags: list[torch.Tensor | None] = []
        for opt, state in self.pairs:
            cache = state.cache(opt)
            out = None if state.stash else _ext.unscale_pass(
                cache.sources, cache.targets, inv_scale, unit, state.policy.per_tensor, found,
                state.written)
            if out is not None:  # the usual pass: checked, unscaled and assigned in one call
                found, flag, _, _, _, flag_params = out
                work = unscale.UnscaleWork([], [], [], flag_params)
            else:
                if found is None:
                    found = torch.zeros(1, dtype=torch.float32, device=scaler.device)
                work = unscale.plan(cache, state.stash)
                flag = unscale.run(work, inv_scale, found, state.policy.per_tensor, unit)
            flags.append(flag)
            works.append(work)
        if found is None:  # no optimizer
            found = torch.zeros(1, dtype=torch.float32, device=scaler.device)
        new_scaler = None
        if check:
            if self.sync is not None:
                self.sync(found)
            new_scaler = scaler.next_state(found)
        try:
            for (_, state), work, per in zip(self.pairs, works, flags):
                flag = state.next_flag(found) if check and state.policy.skips else None
                state.commit_unscale(journal, work, flag, loss_id if check else None, loss,
                                     per)
            if new_scaler is not None:
                scaler.commit(journal, new_scaler)
        except BaseException:
            journal.rollback()
            raise


class _Session(Protocol):
    """What the block reads of its session (`ampx.session.Amp`; never imported here)."""

    scalers: list[LossScaler]

    @property
    def enabled(self) -> bool: ...

    @property
    def scales_gradients(self) -> bool: ...

    def _state_of(self, optimizer: Any) -> OptimizerAmpState: ...

    def synchronize_found_inf(self, found_inf: torch.Tensor) -> None: ...


class ScaleLossBlock:
    """The `with amp.scale_loss(...)` block (a class, not a generator: it runs every step).

    `__enter__` checks the arguments, moves every optimizer to SCALING (or none) and returns
    the scaled loss; `__exit__` ends the pass (unscale, check, commit all at once) or, on an
    exception in the block, aborts it: every optimizer is as before `__enter__`. One guard
    covers begin to end: an interrupt right after `begin` returns, or at `end`'s entry, never
    leaves an optimizer in SCALING (abort is idempotent, and a no-op once `end` committed).
    An interrupt at `__exit__`'s own entry is healed by the next entry (module docstring).
    """

    __slots__ = ("_amp", "_loss", "_optimizers", "_loss_id", "_delay_unscale", "_check",
                 "_pass", "_states", "_mode")

    def __init__(self, amp: _Session, loss: torch.Tensor, optimizers: Any, loss_id: int,
                 delay_unscale: bool, delay_overflow_check: bool) -> None:
        self._amp = amp
        self._loss = loss
        self._optimizers = optimizers
        self._loss_id = loss_id
        self._delay_unscale = delay_unscale
        self._check = not delay_overflow_check
        self._pass: ScaledPass | None = None
        self._states: list[OptimizerAmpState] = []
        self._mode = ""  # "off" (disabled), "short" (apex's short-circuit) or "scaled"

    def __enter__(self) -> torch.Tensor:
        amp, loss, loss_id = self._amp, self._loss, self._loss_id
        if not amp.enabled:
            self._mode = "off"
            return loss
        optimizers = self._optimizers
        opts = [unwrap(opt) for opt in optimizers] if isinstance(optimizers, (list, tuple)) \
            else [] if optimizers is None else [unwrap(optimizers)]  # Lightning's, ...
        states = [amp._state_of(opt) for opt in opts]
        scalers = amp.scalers
        if not 0 <= loss_id < len(scalers):
            raise IndexError(
                f"ampx.scale_loss: loss_id={loss_id} but num_losses={len(scalers)}; pass "
                "num_losses=N to initialize to get N loss scalers."
            )
        scaler = scalers[loss_id]
        if not amp.scales_gradients and scaler.unit_scale():
            # apex's short-circuit (O0, O3 with fp16) while the static scale is 1.0; a scale
            # written since (`_loss_scale = 4.0`, apex's L0 tests) scales and unscales
            self._mode, self._states = "short", states
            return loss.float()
        frame = sys._getframe(1)  # the `with` statement's frame, at its entry
        opening = Opening(threading.get_ident(), frame, frame.f_lasti)
        scaled = self._pass = ScaledPass(opts, states, scaler, amp.synchronize_found_inf)
        self._mode = "scaled"
        try:
            scaled.begin(opening)
            value = scaler.scale_loss_value(loss)
            _drop_weight_casts()
            return value
        except BaseException:
            scaled.abort()
            patch.clear_cache()
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        mode = self._mode
        if mode == "off":
            return
        try:
            if mode == "short":
                if exc_type is None:
                    for state in self._states:
                        state.last_loss = self._loss.detach()
                return
            scaled = self._pass
            assert scaled is not None  # set by __enter__
            if exc_type is not None:
                scaled.abort()
                return
            try:
                scaled.end(self._loss.detach(), loss_id=self._loss_id,
                           delay_unscale=self._delay_unscale, check=self._check)
            except BaseException:
                scaled.abort()
                raise
        finally:
            patch.clear_cache()


def _drop_weight_casts() -> None:
    """`scale_loss` began (the forward is done): the weight-cast cache lets go.

    Backward holds the casts it needs (saved tensors) and frees each as it goes; the cache
    holding them too kept every half weight copy alive through backward and the unscale
    (O1's memory excess over autocast).
    """
    patch.clear_cache()
