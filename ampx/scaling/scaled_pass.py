"""One `scale_loss` pass over one or more optimizers, committed all at once or not at all.

`ScaledPass` strings the per-optimizer transitions of `ampx.scaling.protocol` together: `begin`
moves every optimizer to SCALING (or none), `abort` puts every one back, and `end` computes every
optimizer's new gradients, the pass's overflow flag (agreed across ranks) and the scaler's next
state into fresh tensors, then commits all of it through one `Journal`.

`begin` records its changes in the pass's own journal, so `abort` knows what this pass began
even when an interrupt lands between two transitions (or right after `begin` returns): it
aborts exactly those optimizers, and never one that another pass (a nested `scale_loss`
refused) had moved. `abort` is idempotent, so the caller may call it on any exception.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import unscale
from .journal import Journal
from .protocol import OptimizerAmpState
from .scaler import LossScaler

__all__ = ["ScaledPass"]


class ScaledPass:
    """One `scale_loss` pass over one or more optimizers: `begin`, then `end` or `abort`.

    Args:
        optimizers: The optimizers whose parameters get gradients from this backward.
        states: Their ampx states, in the same order.
        scaler: The loss scaler of this pass.
        sync: Agrees on the overflow flag across ranks (in place; a no-op when single).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 states: Sequence[OptimizerAmpState], scaler: LossScaler,
                 sync: Callable[[torch.Tensor], None]) -> None:
        self.pairs = list(zip(optimizers, states))
        self.scaler = scaler
        self.sync = sync
        self._begun = Journal()  # begin's changes: non-empty once any optimizer moved
        self._began_here = False  # False: the optimizers were moved to SCALING elsewhere
        # (apex's _prepare_amp_backward), and `abort` acts on all of them

    def begin(self) -> None:
        """Every optimizer to SCALING, or none (a failure rolls back the ones already moved)."""
        self._began_here = True
        try:  # (not `Journal.atomic`: this runs every step, and a generator costs)
            for opt, state in self.pairs:
                state.begin_backward(opt, self._begun)
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
            clean = unscale.run_clean(cache, state.stash, inv_scale, state.policy.per_tensor,
                                      unit, found)
            if clean is not None:  # the usual pass, in one native call
                work, flag, found = clean
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
