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
is (the thread, the frame of the `with` and the offset of its entry); the next entry of the
protocol (`scale_loss`, `zero_grad`, `step`) that finds an optimizer in SCALING asks the pass
(`ScaledPass.over`), and aborts it if its block is gone (its frame returned or unwound, or
that frame is back at or before the `with`, as the next iteration of a loop is).
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
from .protocol import ATTR, OptimizerAmpState, unwrap
from .scaler import LossScaler

__all__ = ["ScaleLossBlock", "ScaledPass"]


class ScaledPass:
    """One `scale_loss` pass over one or more optimizers: `begin`, then `end` or `abort`.

    Args:
        optimizers: The optimizers whose parameters get gradients from this backward.
        states: Their ampx states, in the same order.
        scaler: The loss scaler of this pass.
        sync: Agrees on the overflow flag across ranks (in place); None when single.
        frame: The frame of the pass's `with` statement, at its entry. Each optimizer `begin`
            moves carries the pass as its opening (`OptimizerAmpState._opening`): `abort`
            acts on exactly those, and a later entry asks `over` whether the block is gone.
            None: the optimizers were moved to SCALING elsewhere (apex's
            `_prepare_amp_backward`), and `abort` acts on all of them.
    """

    __slots__ = ("pairs", "scaler", "sync", "thread", "frame", "offset")

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 states: Sequence[OptimizerAmpState], scaler: LossScaler,
                 sync: Callable[[torch.Tensor], None] | None = None,
                 frame: Any = None) -> None:
        self._open(list(zip(optimizers, states)), scaler, sync, frame)

    def _open(self, pairs: Sequence[tuple[torch.optim.Optimizer, OptimizerAmpState]],
              scaler: LossScaler, sync: Callable[[torch.Tensor], None] | None,
              frame: Any) -> None:
        self.pairs = pairs
        self.scaler = scaler
        self.sync = sync
        self.frame = frame  # where the block is: its thread, its frame, its entry offset
        if frame is not None:
            self.thread, self.offset = threading.get_ident(), frame.f_lasti

    @property
    def opening(self) -> ScaledPass | None:
        """What the optimizers this pass moves carry (the pass; None: begun elsewhere)."""
        return None if self.frame is None else self

    def over(self) -> bool:
        """Whether the block is gone: its frame left this thread's stack, or is back at (or
        before) the `with` (a loop's next iteration); a live other thread's block is not.

        An interrupt at the entry of the block's `__exit__` (before its first line) leaves the
        optimizers in SCALING with no exit to come; the next entry of the protocol asks this
        and aborts such a pass (`OptimizerAmpState.heal_abandoned`).
        """
        if self.thread != threading.get_ident():
            return all(t.ident != self.thread for t in threading.enumerate())
        frame: Any = sys._getframe(1)
        while frame is not None:
            if frame is self.frame:
                return bool(frame.f_lasti <= self.offset)
            frame = frame.f_back
        return True

    def begin(self) -> None:
        """Every optimizer to SCALING, or none (a failure aborts the ones already moved)."""
        opening = None if self.frame is None else self  # (`opening`, inline: every step)
        try:  # (not `Journal.atomic`: this runs every step, and a generator costs)
            scale = self.scaler.scale  # (earlier fp32/bf16 gradients fold at it)
            for opt, state in self.pairs:
                state.begin_backward(opt, opening, scale)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Every optimizer this pass moved back to where it was before `begin` (idempotent).

        Only optimizers still in SCALING with this pass's opening are touched: after `end`
        committed (stage UNSCALED or SCALED) there is nothing to abort, and an optimizer that
        another pass moved (a nested `scale_loss`, refused) is left alone.
        """
        opening = self.opening
        for opt, state in reversed(self.pairs):
            if opening is None or state._opening is opening:
                state.abort_backward(opt)

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
            _ext.assign(self._end(loss, loss_id, delay_unscale, check))
        except BaseException:
            self.abort()
            raise

    def _end(self, loss: torch.Tensor, loss_id: int, delay_unscale: bool,
                check: bool) -> tuple[Any, ...]:
        """Compute the pass; return its commit (flat assignments for `ampx._ext.assign`).

        The clean native pass has assigned its gradients already (its undo: `abort`)."""
        out: list[Any] = []
        if delay_unscale:
            for _, state in self.pairs:
                out += state.commit_delayed()
            return tuple(out)
        scaler = self.scaler
        found: torch.Tensor | None = None  # made by the first optimizer's kernel call
        inv_scale = scaler.inv_scale()
        unit = scaler.unit_scale()
        works: list[unscale.UnscaleWork] = []
        flags: list[torch.Tensor | None] = []
        for opt, state in self.pairs:
            cache = state.cache(opt)
            out_ = None if state.stash else _ext.unscale_pass(
                cache.sources, cache.targets, inv_scale, unit, state.policy.per_tensor, found,
                state.written)
            if out_ is not None:  # the usual pass: checked, unscaled and assigned in one call
                found, flag, _, _, _, flag_params = out_
                work = unscale.UnscaleWork(_NONE, _NONE, _NONE, flag_params)
            else:
                if found is None:
                    found = torch.zeros(1, dtype=torch.float32, device=scaler.device)
                work = unscale.plan(cache, state.stash)
                flag = unscale.run(work, inv_scale, found, state.policy.per_tensor, unit)
            flags.append(flag)
            works.append(work)
        if found is None:  # no optimizer
            found = torch.zeros(1, dtype=torch.float32, device=scaler.device)
        if check:
            if self.sync is not None:
                self.sync(found)
            out += scaler.commit(scaler.next_state(found))
        for (_, state), work, per in zip(self.pairs, works, flags):
            flag = state.next_flag(found) if check and state.policy.skips else None
            out += state.commit_unscale(work, flag, loss_id if check else None, loss, per)
        return tuple(out)


_NONE: list[Any] = []  # (read-only) the empty lists of a clean pass's work


class _Session(Protocol):
    """What the block reads of its session (`ampx.session.Amp`; never imported here)."""

    scalers: list[LossScaler]

    @property
    def enabled(self) -> bool: ...

    @property
    def scales_gradients(self) -> bool: ...

    def _state_of(self, optimizer: Any) -> OptimizerAmpState: ...

    def synchronize_found_inf(self, found_inf: torch.Tensor) -> None: ...


class ScaleLossBlock(ScaledPass):
    """The `with amp.scale_loss(...)` block, which is its own pass (a class, not a generator:
    it runs every step).

    `__enter__` checks the arguments, moves every optimizer to SCALING (or none) and returns
    the scaled loss; `__exit__` ends the pass (unscale, check, commit all at once) or, on an
    exception in the block, aborts it: every optimizer is as before `__enter__`. One guard
    covers begin to end: an interrupt right after `begin` returns, or at `end`'s entry, never
    leaves an optimizer in SCALING (abort is idempotent, and a no-op once `end` committed).
    An interrupt at `__exit__`'s own entry is healed by the next entry (module docstring).
    """

    __slots__ = ("_amp", "_loss", "_optimizers", "_loss_id", "_delay_unscale", "_check",
                 "_mode")

    def __init__(self, amp: _Session, loss: torch.Tensor, optimizers: Any, loss_id: int,
                 delay_unscale: bool, delay_overflow_check: bool) -> None:
        # (the pass's own fields are set by `__enter__`, which knows them)
        self._amp = amp
        self._loss = loss
        self._optimizers = optimizers
        self._loss_id = loss_id
        self._delay_unscale = delay_unscale
        self._check = not delay_overflow_check
        self._mode = ""  # "off" (disabled), "short" (apex's short-circuit) or "scaled"

    def __enter__(self) -> torch.Tensor:
        amp = self._amp
        if not amp.enabled:
            self._mode = "off"
            return self._loss
        optimizers = self._optimizers
        state = vars(optimizers).get(ATTR) if isinstance(optimizers, torch.optim.Optimizer) \
            else None
        if state is not None and state.owner is amp:  # the usual call: one optimizer
            pairs: Sequence[tuple[Any, OptimizerAmpState]] = ((optimizers, state),)
            scales = state.policy.scales
        else:
            opts = [unwrap(opt) for opt in optimizers] if isinstance(
                optimizers, (list, tuple)) else [] if optimizers is None \
                else [unwrap(optimizers)]  # Lightning's, ...
            pairs = [(opt, amp._state_of(opt)) for opt in opts]
            scales = pairs[0][1].policy.scales if len(pairs) == 1 else amp.scales_gradients
        loss_id = self._loss_id
        scalers = amp.scalers
        if not 0 <= loss_id < len(scalers):
            raise IndexError(
                f"ampx.scale_loss: loss_id={loss_id} but num_losses={len(scalers)}; pass "
                "num_losses=N to initialize to get N loss scalers."
            )
        scaler = scalers[loss_id]
        if not scales and scaler.unit_scale():
            # apex's short-circuit (O0, O3 with fp16) while the static scale is 1.0; a scale
            # written since (`_loss_scale = 4.0`, apex's L0 tests) scales and unscales
            self._mode, self.pairs = "short", pairs
            return self._loss.float()
        # with the `with` statement's frame, at its entry
        self._open(pairs, scaler, amp.synchronize_found_inf, sys._getframe(1))
        self._mode = "scaled"
        try:
            self.begin()
            value = scaler.scale_loss_value(self._loss)
            _drop_weight_casts()
            return value
        except BaseException:
            self.abort()
            patch.clear_cache()
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        mode = self._mode
        if mode == "off":
            return
        try:
            if mode == "short":
                if exc_type is None:
                    for _, state in self.pairs:
                        state.last_loss = self._loss.detach()
                return
            if exc_type is not None:
                self.abort()
                return
            try:  # (`end` aborts on its own failures; this also covers its entry)
                self.end(self._loss.detach(), loss_id=self._loss_id,
                         delay_unscale=self._delay_unscale, check=self._check)
            except BaseException:
                self.abort()
                raise
        finally:
            patch.clear_cache()


def _drop_weight_casts() -> None:
    """`scale_loss` began (the forward is done): the weight-cast cache lets go (as autocast's
    does at its exit).

    Backward holds the casts it needs (saved tensors) and frees each as it goes; the cache
    holding them too kept every half weight copy alive through backward and the unscale
    (O1's memory excess over autocast).
    """
    patch.clear_cache()
