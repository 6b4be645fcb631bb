"""KeyboardInterrupt anywhere in a step never corrupts training (issue 33, item 4 and its fuzz).

A line tracer over ampx's own code delivers KeyboardInterrupt at one traced event (a
function's `call`, a `line`, a `return`) of a step, as a signal handled there would. After
catching it, the script goes on as a real one would: `zero_grad()` and the step again (unless
the interrupted step had already updated the parameters: then it was completed, rolled
forward). The next clean step must be bitwise that of an uninterrupted run, and at O2 the
model must equal its masters.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from _shared import batch, mlp
from torch import nn

import ampx

AMPX_DIR = str(Path(ampx.__file__).resolve().parent)
SCALER_TENSORS = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_overflows_since_report",
                  "_scale_before_overflow")


class Interrupt:
    """A tracer raising KeyboardInterrupt at traced event number `at` of ampx's code.

    `where` limits the events counted to one code object (None: every function in ampx).
    With `at` = -1 it only counts (`self.events`).
    """

    def __init__(self, at: int = -1, where: Any = None) -> None:
        self.at, self.where = at, where
        self.events = 0
        self.fired = ""

    def __enter__(self) -> Interrupt:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if self.where is not None:
            if code is not self.where:
                return None
        elif not code.co_filename.startswith(AMPX_DIR) or _in_update(frame):
            return None
        return self._event(frame, event, arg)

    def _event(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event in ("call", "line", "return") and not self.fired:
            if self.events == self.at:
                self.fired = f"{frame.f_code.co_qualname}:{frame.f_lineno} ({event})"
                raise KeyboardInterrupt(f"injected at {self.fired}")
            self.events += 1
        return self._event


def _in_update(frame: FrameType | None) -> bool:
    """Whether the optimizer's own update is running (O1's wrappers called by AdamW): torch's
    optimizer is not interruptible half-way by anyone, so no point is placed there."""
    while frame is not None:
        name = frame.f_code.co_filename
        if OPTIM_DIR in name and not name.endswith("optimizer.py"):  # not the hooks' wrapper
            return True
        frame = frame.f_back
    return False


OPTIM_DIR = str(Path(torch.optim.__file__).parent)


def make(level: str, dtype: torch.dtype) -> tuple[ampx.Amp, nn.Module, Any]:
    torch.manual_seed(0)
    model = mlp()
    amp = ampx.Amp(level, dtype=dtype, verbosity=0, init_scale=2.0**8)
    model, opt = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return amp, model, opt


def train_step(amp: ampx.Amp, model: nn.Module, opt: Any, seed: int) -> None:
    opt.zero_grad()
    x, y = batch(16, seed)
    loss = nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def state_of(amp: ampx.Amp, model: nn.Module, opt: Any) -> list[Any]:
    """Everything a step changes (after a step: parameters, masters, optimizer, scaler)."""
    masters = list(ampx.master_params(opt))
    out: list[Any] = [p.detach().clone() for p in model.parameters()]
    out += [m.detach().clone() for m in masters]
    for value in opt.state_dict()["state"].values():
        out += [v.clone() if isinstance(v, torch.Tensor) else v for v in value.values()]
    out += [getattr(s, n).clone() for s in amp.scalers for n in SCALER_TENSORS]
    out += [opt._ampx.stage.value, opt._ampx.steps, ampx.step_was_skipped(opt)]
    return out


def equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b))


def model_equals_masters(opt: Any) -> bool:
    cache = opt._ampx.cache(opt)
    return all(torch.equal(m, p.detach().to(m.dtype)) for p, m in zip(cache.masters, cache.models))


def recover(amp: ampx.Amp, model: nn.Module, opt: Any, seed: int, steps: int) -> None:
    """Go on from where the interrupt left the step (the protocol's state says where)."""
    state = opt._ampx
    decision = state._decision
    if state.steps > steps:
        pass  # the step was committed (the interrupt came after it)
    elif decision is not None and decision.updated():
        opt.zero_grad()  # the update ran: the next entry completes the step
    elif state.stage.value == "UNSCALED":
        opt.step()  # the pass had committed (the interrupt came after it): step on it
    else:
        opt.zero_grad()  # nothing of the step is left (an abandoned pass is dropped)
        train_step(amp, model, opt, seed)


# -- issue 33 item 4: the exit's entry -------------------------------------------------------

def _exit_code(amp: ampx.Amp, model: nn.Module, opt: Any) -> Any:
    x, _ = batch(16, 0)
    block = amp.scale_loss(model(x).float().sum(), opt)
    return type(block).__exit__.__code__


@pytest.mark.parametrize("where", ["function", "loop"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_interrupt_at_the_entry_of_the_exit_leaves_no_optimizer_in_scaling(
        backend: str, level: str, where: str, half_dtype: torch.dtype) -> None:
    """A KeyboardInterrupt at the `call` event of the block's `__exit__` (before any line of
    it runs): the pass is dropped by the next entry, and the next clean step equals an
    uninterrupted run, whether the `with` was in a function that unwound or in the same
    frame's loop."""
    amp, model, opt = make(level, half_dtype)
    train_step(amp, model, opt, 0)
    train_step(amp, model, opt, 1)
    expected = state_of(amp, model, opt)

    amp, model, opt = make(level, half_dtype)
    train_step(amp, model, opt, 0)
    code = _exit_code(amp, model, opt)
    if where == "function":
        with Interrupt(0, code) as hit:
            with pytest.raises(KeyboardInterrupt, match="injected"):
                train_step(amp, model, opt, 1)
        assert hit.fired and opt._ampx.stage.value == "SCALING"
        recover(amp, model, opt, 1, 1)
    else:
        done = False
        for attempt in range(2):  # the same `with` statement, run again in this frame
            opt.zero_grad()
            x, y = batch(16, 1)
            loss = nn.functional.mse_loss(model(x).float(), y)
            try:
                with Interrupt(0 if attempt == 0 else -1, code):
                    with amp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
            except KeyboardInterrupt:
                assert attempt == 0 and opt._ampx.stage.value == "SCALING"
                continue
            opt.step()
            done = True
        assert done
    assert equal(state_of(amp, model, opt), expected)
    assert level == "O1" or model_equals_masters(opt)


def test_a_block_still_open_is_not_taken_for_an_abandoned_one(half_dtype: torch.dtype) -> None:
    """Inside the block, `step()` and a nested `scale_loss` still refuse (the pass is live)."""
    amp, model, opt = make("O2", half_dtype)
    x, y = batch(16, 0)
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
        with pytest.raises(RuntimeError, match="inside a scale_loss block"):
            opt.step()
        with pytest.raises(RuntimeError, match="already inside a scale_loss block"):
            with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt):
                pass  # pragma: no cover - never entered
        opt.zero_grad()  # a no-op for the live pass
        assert opt._ampx.stage.value == "SCALING"
        scaled.backward()
    opt.step()
    assert opt._ampx.steps == 1 and model_equals_masters(opt)


# -- the fuzz (issue 33, "done when" item 2) --------------------------------------------------

POINTS_PER_CONFIG = 75  # x 4 (O1/O2, fp16/bf16): 300 injection points per backend


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_interrupt_at_random_traced_lines_of_many_steps(
        backend: str, level: str, half_dtype: torch.dtype) -> None:
    """KeyboardInterrupt at a random traced event of each of many steps (fixed seed)."""
    rng = random.Random(f"{backend}-{level}-{half_dtype}")
    steps = POINTS_PER_CONFIG + 1
    amp, model, opt = make(level, half_dtype)
    expected = []
    for i in range(steps):
        train_step(amp, model, opt, i)
        expected.append(state_of(amp, model, opt))

    amp, model, opt = make(level, half_dtype)
    train_step(amp, model, opt, 0)
    with Interrupt() as counter:
        train_step(amp, model, opt, 1)
    assert equal(state_of(amp, model, opt), expected[1])
    events = counter.events
    assert events > 50  # the step runs through ampx: the points cover all of it
    fired = []
    for i in range(2, steps):
        steps_before = opt._ampx.steps
        with Interrupt(rng.randrange(events)) as hit:
            try:
                train_step(amp, model, opt, i)
            except KeyboardInterrupt:
                pass
        if hit.fired:
            fired.append(hit.fired)
            recover(amp, model, opt, i, steps_before)
        assert equal(state_of(amp, model, opt), expected[i]), (i, hit.fired)
        assert level == "O1" or model_equals_masters(opt), (i, hit.fired)
    assert len(fired) >= (steps - 2) // 2, fired  # most steps were interrupted


def test_an_interrupt_anywhere_in_the_master_copy_leaves_grad_mode_on(
        half_dtype: torch.dtype) -> None:
    """Every traced event of the O2 master -> model copy (which runs under `no_grad`): grad
    mode is back on afterwards (a `try:` opening a `with` body escaped the `with`'s cleanup
    on CPython 3.11), and the interrupted step is still completed by the next entry."""
    from ampx.scaling import decision

    code = decision.copy_masters.__code__
    amp, model, opt = make("O2", half_dtype)
    train_step(amp, model, opt, 0)
    with Interrupt(-1, code) as counter:
        train_step(amp, model, opt, 1)
    assert counter.events >= 3
    for at in range(counter.events):
        with Interrupt(at, code) as hit:
            with pytest.raises(KeyboardInterrupt, match="injected"):
                train_step(amp, model, opt, 2 + at)
        assert hit.fired and torch.is_grad_enabled(), hit.fired
        opt.zero_grad()  # completes the interrupted step (its update ran)
        assert model_equals_masters(opt)
