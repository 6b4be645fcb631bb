"""O1 and threads: patches are process-wide, the optimizer step's casts-off flag is per thread.

The step runs with casts off in the stepping thread only (`ampx.o1.regions.start_step`, the
flag `disable_casts()` sets); other threads keep casting, nothing about the patch set changes
during a step, and a step that raises anywhere (KeyboardInterrupt included) leaves O1 fully
active.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampx
from ampx.o1 import patch, regions

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _wrappers() -> dict[tuple[int, str], Any]:
    """Every attribute O1 patched, as it is stored on its owner now."""
    o1 = patch.active()
    assert o1 is not None
    return {key: vars(owner).get(name) for key, (owner, name, _, _) in
            o1.patches._records.items()}


def _cast_dtype() -> torch.dtype:
    """The dtype an fp32 F.linear gives in this thread now (half when O1 casts)."""
    return F.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype


class _Probe(torch.optim.SGD):
    """SGD whose step records what F.linear gives inside it and can wait on a barrier."""

    def __init__(self, params: Any, barrier: threading.Barrier | None = None,
                 fail: BaseException | None = None) -> None:
        super().__init__(params, lr=0.1)
        self.barrier = barrier
        self.fail = fail
        self.seen: list[torch.dtype] = []
        self.wrappers_seen: list[dict[tuple[int, str], Any]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append(_cast_dtype())
        if self.barrier is not None:
            self.barrier.wait(timeout=30)
            self.wrappers_seen.append(_wrappers())
            self.barrier.wait(timeout=30)
        if self.fail is not None:
            raise self.fail
        return super().step(closure)


def _backward(amp: ampx.Amp, model: nn.Module, opt: Any, loss_id: int = 0) -> None:
    loss = model(torch.ones(2, 4)).float().mean()
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()


def _o1_fully_active(dtype: torch.dtype, before: dict[tuple[int, str], Any]) -> None:
    assert _wrappers() == before
    assert not regions.casts_disabled()
    assert _cast_dtype() == dtype


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_step_runs_with_casts_off_in_its_thread_only(dtype: str) -> None:
    model = nn.Linear(4, 4)
    amp = ampx.Amp("O1", dtype=dtype, verbosity=0)
    model, opt = amp.initialize(model, _Probe(model.parameters()))
    try:
        before = _wrappers()
        _backward(amp, model, opt)
        opt.step()
        assert opt.seen == [torch.float32]
        _o1_fully_active(DTYPES[dtype], before)
    finally:
        amp.restore()


def test_forward_in_another_thread_while_one_steps_is_cast() -> None:
    barrier = threading.Barrier(2)
    model = nn.Linear(4, 4)
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0)
    model, opt = amp.initialize(model, _Probe(model.parameters(), barrier))
    seen: list[torch.dtype] = []

    def other() -> None:
        barrier.wait(timeout=30)  # the step is running now
        seen.append(_cast_dtype())
        seen.append(model(torch.ones(2, 4)).dtype)
        barrier.wait(timeout=30)

    try:
        _backward(amp, model, opt)
        thread = threading.Thread(target=other)
        thread.start()
        opt.step()
        thread.join(timeout=30)
        assert opt.seen == [torch.float32]
        assert seen == [torch.bfloat16, torch.bfloat16]
    finally:
        amp.restore()


def test_concurrent_steps_leave_every_wrapper_in_place() -> None:
    barrier = threading.Barrier(2)
    models = [nn.Linear(4, 4), nn.Linear(4, 4)]
    amp = ampx.Amp("O1", dtype="fp16", verbosity=0, num_losses=2)
    models, opts = amp.initialize(models, [_Probe(m.parameters(), barrier) for m in models])
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            for _ in range(5):
                opts[i].zero_grad()
                _backward(amp, models[i], opts[i], loss_id=i)
                opts[i].step()  # both threads are inside a step at the barriers
                assert _cast_dtype() == torch.float16
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    try:
        before = _wrappers()
        threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        for opt in opts:
            assert opt.seen == [torch.float32] * 5
            assert opt.wrappers_seen == [before] * 5  # during the steps too
        _o1_fully_active(torch.float16, before)
    finally:
        amp.restore()


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32),
                         nn.Linear(32, 4))


def _train(amp: ampx.Amp, model: nn.Module, opt: Any, seed: int, loss_id: int,
           barrier: threading.Barrier | None = None) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(6):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            scaled.backward()
        if barrier is not None:
            barrier.wait(timeout=30)  # the other thread's forward/backward/step interleave
        opt.step()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_two_models_in_two_threads_train_bitwise_as_each_alone(dtype: str) -> None:
    alone = []
    for seed in (0, 1):
        amp = ampx.Amp("O1", dtype=dtype, verbosity=0)
        model = _mlp(seed)
        model, opt = amp.initialize(model, _adamw(model))
        try:
            _train(amp, model, opt, seed, 0)
        finally:
            amp.restore()
        alone.append([p.detach().clone() for p in model.parameters()])

    models = [_mlp(0), _mlp(1)]
    amp = ampx.Amp("O1", dtype=dtype, verbosity=0, num_losses=2)
    models, opts = amp.initialize(models, [_adamw(m) for m in models])
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            _train(amp, models[i], opts[i], i, i, barrier)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
    finally:
        amp.restore()
    for model, want in zip(models, alone):
        for got, ref in zip(model.parameters(), want):
            assert torch.equal(got, ref)


# -- faults at any point of a step ------------------------------------------------------------

# ampx's step hooks and protocol, and AdamW's own loop (torch/optim/optimizer.py is left out: a
# fault between its set_grad_enabled(False) and its try leaves grad mode off, torch's matter).
_TRACED = ("ampx/scaling/", "ampx/o1/regions.py", "torch/optim/adamw.py")


def _traced(frame: Any) -> bool:
    return any(t in frame.f_code.co_filename.replace("\\", "/") for t in _TRACED)


def _lines_of_a_step(run: Callable[[], None]) -> int:
    """How many traced lines `run` runs."""
    count = [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and _traced(frame):
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(None)
    return count[0]


def _raise_at_line(at: int, exc: type[BaseException], run: Callable[[], None]) -> bool:
    """Run `run` with `exc` raised at traced line number `at`; whether it was raised."""
    count = [0]
    fired = [False]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and _traced(frame):
            count[0] += 1
            if count[0] == at:
                fired[0] = True
                raise exc("injected")  # settrace is unset after a raising trace function
        return trace

    sys.settrace(trace)
    try:
        run()
    except exc as caught:
        assert fired[0] and "injected" in str(caught)
    finally:
        sys.settrace(None)
    return fired[0]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_fault_anywhere_in_a_step_leaves_o1_fully_active(exc: type[BaseException]) -> None:
    model = nn.Linear(4, 4)
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0)
    model, opt = amp.initialize(model, _adamw(model))
    try:
        before = _wrappers()
        _backward(amp, model, opt)
        lines = _lines_of_a_step(opt.step)
        assert lines > 50  # the hooks, the protocol and AdamW's loop are traced
        for at in range(1, lines + 1):
            opt.zero_grad()
            _backward(amp, model, opt)
            assert _raise_at_line(at, exc, opt.step)
            _o1_fully_active(torch.bfloat16, before)
    finally:
        amp.restore()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["step", "pre-hook", "post-hook before", "post-hook after"])
def test_a_raising_step_or_user_hook_leaves_o1_fully_active(where: str,
                                                           exc: type[BaseException]) -> None:
    def hook(*args: Any) -> None:
        raise exc("injected")

    model = nn.Linear(4, 4)
    opt = _Probe(model.parameters(), fail=exc("injected") if where == "step" else None)
    if where == "post-hook before":  # runs before ampx's post-hook
        opt.register_step_post_hook(hook)
    amp = ampx.Amp("O1", dtype="fp16", verbosity=0)
    model, opt = amp.initialize(model, opt)
    if where == "pre-hook":  # runs after ampx's pre-hook set the flag
        opt.register_step_pre_hook(hook)
    if where == "post-hook after":
        opt.register_step_post_hook(hook)
    try:
        before = _wrappers()
        _backward(amp, model, opt)
        with pytest.raises(exc, match="injected"):
            opt.step()
        _o1_fully_active(torch.float16, before)  # in this thread, before any other ampx call
    finally:
        amp.restore()


def test_reentrant_steps_keep_casts_off_until_the_outer_step_ends() -> None:
    inner_model = nn.Linear(4, 4)
    outer_model = nn.Linear(4, 4)
    seen: list[object] = []
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0, num_losses=2)

    class Outer(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            seen.append(_cast_dtype())
            try:
                inner.step()  # raises: its post-hook never runs
            except RuntimeError:
                seen.append("inner raised")
            seen.append(_cast_dtype())  # still inside the outer step: casts stay off
            return super().step(closure)

    models, (outer, inner) = amp.initialize(
        [outer_model, inner_model],
        [Outer(outer_model.parameters(), lr=0.1),
         _Probe(inner_model.parameters(), fail=RuntimeError("injected"))])
    try:
        before = _wrappers()
        _backward(amp, models[0], outer, 0)
        _backward(amp, models[1], inner, 1)
        outer.step()
        assert seen == [torch.float32, "inner raised", torch.float32]
        assert inner.seen == [torch.float32]
        _o1_fully_active(torch.bfloat16, before)
    finally:
        amp.restore()


def test_disable_casts_around_a_step_stays_on_after_it() -> None:
    model = nn.Linear(4, 4)
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0)
    model, opt = amp.initialize(model, _Probe(model.parameters(), fail=RuntimeError("injected")))
    try:
        _backward(amp, model, opt)
        with ampx.disable_casts():
            with pytest.raises(RuntimeError):
                opt.step()
            assert _cast_dtype() == torch.float32  # the region of before the step
        assert _cast_dtype() == torch.bfloat16
    finally:
        amp.restore()
