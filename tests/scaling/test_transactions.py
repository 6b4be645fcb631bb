"""Every protocol transition is all-or-nothing (issue: a training loop that never corrupts state).

The fault-injection test makes each kernel call of a training step raise in turn (an error, then
a KeyboardInterrupt), on both kernel backends, and checks that params, masters, gradients,
optimizer state and scaler state are bitwise what they were, and that the next clean step
equals an uninterrupted run bitwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _shared import batch, mlp
from torch import nn

import ampx
from ampx import _ext, _reference

KERNELS = ("unscale_", "unscale_into_", "copy_", "update_scale_", "l2norm")
SCALER_TENSORS = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_overflows_since_report",
                  "_scale_before_overflow")


@pytest.fixture(params=["reference", "native"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel backend in turn (native skips when the extension is not active)."""
    if request.param == "reference":
        monkeypatch.setattr(_ext, "_impl", lambda device: _reference)
    elif _ext._native_module() is None:
        pytest.skip(f"native kernels not active: {_ext.IMPORT_ERROR}")
    return request.param


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(16, seed)


def make(level: str, dtype: torch.dtype, opt_cls: Any = torch.optim.AdamW,
         loss_scale: Any = "dynamic") -> tuple:
    """A session; a static scale of 1 keeps skipping non-finite steps (fp16 O1 would short-
    circuit like apex otherwise: no check at all)."""
    torch.manual_seed(0)
    model = mlp()
    opt = opt_cls(model.parameters(), lr=1e-2)
    skip = None if loss_scale == "dynamic" else True
    amp = ampx.Amp(level, dtype=dtype, loss_scale=loss_scale, verbosity=0, init_scale=2.0**8,
                   skip_non_finite=skip)
    model, opt = amp.initialize(model, opt)
    return amp, model, opt


def backward(amp: ampx.Amp, model: nn.Module, opt: Any, seed: int, **kwargs: Any) -> None:
    x, y = data(seed)
    loss = nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt, **kwargs) as scaled:
        scaled.backward()


def _grad(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.grad is None else t.grad.clone()


def snapshot(amp: ampx.Amp, model: nn.Module, opt: Any) -> dict[str, Any]:
    """Everything a transition may touch, cloned."""
    masters = list(ampx.master_params(opt))
    state = opt._ampx
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [_grad(p) for p in model.parameters()],
        "masters": [m.detach().clone() for m in masters],
        "master_grads": [_grad(m) for m in masters],
        "opt": copy.deepcopy(opt.state_dict()),
        "scaler": [getattr(s, n).clone() for s in amp.scalers for n in SCALER_TENSORS],
        "stage": getattr(state, "stage", None),
        "flag": None if state.found_inf is None else state.found_inf.clone(),
        "stash": {k: g.clone() for k, (_, g) in state.stash.items()},
    }


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested snapshots (None, tensors, dicts, lists, plain values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


class Faults:
    """Counts the kernel calls through `ampx._ext` and raises at call number `at`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int = -1,
                 exc: type[BaseException] = RuntimeError) -> None:
        self.calls = 0
        self.at, self.exc = at, exc
        for name in KERNELS:
            monkeypatch.setattr(_ext, name, self._wrap(getattr(_ext, name), name))

    def _wrap(self, fn: Callable, name: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls - 1 == self.at:
                raise self.exc(f"injected fault in {name}")
            return fn(*args, **kwargs)
        return call


def kernel_calls(monkeypatch: pytest.MonkeyPatch, prepare: Callable[[], tuple],
                 run: Callable[..., None]) -> int:
    """How many kernel calls `run(*prepare())` makes (the calls a fault can be injected in)."""
    with monkeypatch.context() as m:
        state = prepare()
        counter = Faults(m)
        run(*state)
        return counter.calls


def fail_at(monkeypatch: pytest.MonkeyPatch, at: int, exc: type[BaseException],
            run: Callable[..., None], *state: Any) -> None:
    """Run `run(*state)` with kernel call number `at` raising `exc`; it must propagate."""
    with monkeypatch.context() as m:
        Faults(m, at, exc)
        with pytest.raises(exc, match="injected"):
            run(*state)


def scenario(amp: ampx.Amp, model: nn.Module, opt: Any) -> None:
    """The interrupted part: a pass (accumulating onto the previous one), then the step."""
    backward(amp, model, opt, 2)
    opt.step()


def head(amp: ampx.Amp, model: nn.Module, opt: Any) -> None:
    backward(amp, model, opt, 0)
    opt.step()
    opt.zero_grad()


def first_pass(amp: ampx.Amp, model: nn.Module, opt: Any, delayed: bool) -> None:
    backward(amp, model, opt, 1, delay_unscale=delayed)


def uninterrupted(level: str, dtype: torch.dtype, delayed: bool,
                  loss_scale: Any = "dynamic") -> dict[str, Any]:
    amp, model, opt = make(level, dtype, loss_scale=loss_scale)
    head(amp, model, opt)
    first_pass(amp, model, opt, delayed)
    scenario(amp, model, opt)
    backward(amp, model, opt, 3)
    opt.step()
    return snapshot(amp, model, opt)


@pytest.mark.parametrize("loss_scale", ["dynamic", 1.0], ids=["dynamic", "unit"])
@pytest.mark.parametrize("delayed", [False, True], ids=["accumulate", "after-delay"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fault_in_every_kernel_call_leaves_state_bitwise_unchanged(
        backend: str, level: str, exc: type[BaseException], delayed: bool, loss_scale: Any,
        half_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed pass leaves everything as before it; a failed master copy rolls forward.

    After delay_unscale passes, gradients accumulate in place (DDP's last all-reduce must see
    them), so a pass that fails after its backward ran drops the whole update instead: the
    state is bitwise that of before the first delayed pass.
    """
    expected = uninterrupted(level, half_dtype, delayed, loss_scale)

    def prepare() -> tuple:
        amp, model, opt = make(level, half_dtype, loss_scale=loss_scale)
        head(amp, model, opt)
        first_pass(amp, model, opt, delayed)
        return amp, model, opt

    total = kernel_calls(monkeypatch, prepare, scenario)
    assert total >= 2  # unscale, scale update (and the O2 master copy)
    for at in range(total):
        amp, model, opt = make(level, half_dtype, loss_scale=loss_scale)
        head(amp, model, opt)
        start = snapshot(amp, model, opt)
        first_pass(amp, model, opt, delayed)
        before = snapshot(amp, model, opt)
        fail_at(monkeypatch, at, exc, scenario, amp, model, opt)
        if opt._ampx.steps == 1:  # the fault was in the pass
            assert same(snapshot(amp, model, opt), start if delayed else before), at
            if delayed:
                first_pass(amp, model, opt, delayed)
            scenario(amp, model, opt)
        # else: the fault was in the step's master copy, which rolled forward
        backward(amp, model, opt, 3)
        opt.step()
        assert same(snapshot(amp, model, opt), expected), f"fault at kernel call {at}"


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fault_in_a_pass_checked_in_place_leaves_state_unchanged(
        backend: str, level: str, exc: type[BaseException], half_dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At a static scale of 1 a fresh pass checks its gradients in place (no copy); a fault
    in any kernel call of that pass or its step still leaves everything as before it."""
    def fresh_pass_and_step(amp: ampx.Amp, model: nn.Module, opt: Any) -> None:
        backward(amp, model, opt, 5)
        opt.step()

    amp, model, opt = make(level, half_dtype, loss_scale=1.0)
    head(amp, model, opt)
    fresh_pass_and_step(amp, model, opt)
    expected = snapshot(amp, model, opt)
    def prepare() -> tuple:
        amp, model, opt = make(level, half_dtype, loss_scale=1.0)
        head(amp, model, opt)
        return amp, model, opt

    total = kernel_calls(monkeypatch, prepare, fresh_pass_and_step)
    assert total >= 2
    for at in range(total):
        amp, model, opt = make(level, half_dtype, loss_scale=1.0)
        head(amp, model, opt)
        before = snapshot(amp, model, opt)
        fail_at(monkeypatch, at, exc, fresh_pass_and_step, amp, model, opt)
        if opt._ampx.steps == 1:  # the fault was in the pass
            assert same(snapshot(amp, model, opt), before), at
            fresh_pass_and_step(amp, model, opt)
        assert same(snapshot(amp, model, opt), expected), f"fault at kernel call {at}"


@pytest.mark.parametrize("earlier", [False, True], ids=["fresh", "accumulating"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_error_after_backward_leaves_no_scaled_gradients(level: str, earlier: bool,
                                                          half_dtype: torch.dtype) -> None:
    """Issue item 2: an exception after backward() inside scale_loss drops that pass."""
    def run(fail: bool) -> dict[str, Any]:
        amp, model, opt = make(level, half_dtype)
        head(amp, model, opt)
        if earlier:
            first_pass(amp, model, opt, False)
        before = snapshot(amp, model, opt)
        if fail:
            x, y = data(9)
            with pytest.raises(ValueError, match="user error"):
                with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
                    scaled.backward()
                    raise ValueError("user error")
            assert same(snapshot(amp, model, opt), before)
        scenario(amp, model, opt)
        return snapshot(amp, model, opt)

    assert same(run(True), run(False))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_error_in_a_later_delayed_pass_drops_the_update(level: str, half_dtype: torch.dtype,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Issue item 2: an abandoned delay_unscale pass never leaks into the next update."""
    amp, model, opt = make(level, half_dtype)
    backward(amp, model, opt, 0)
    opt.step()
    reference = snapshot(amp, model, opt)
    backward(amp, model, opt, 1, delay_unscale=True)
    x, y = data(2)
    with pytest.raises(ValueError):
        with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt,
                            delay_unscale=True) as scaled:
            scaled.backward()
            raise ValueError("user error")
    assert "dropped" in caplog.text
    after = snapshot(amp, model, opt)
    assert same(after["grads"], reference["grads"]) and same(after["params"], reference["params"])
    assert same(after["master_grads"], reference["master_grads"])
    assert opt._ampx.stage.value == "READY"


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_zero_grad_after_delay_unscale_starts_a_clean_update(level: str,
                                                            half_dtype: torch.dtype) -> None:
    """Issue item 3: optimizer.zero_grad() after a delay_unscale pass releases its gradients."""
    def run(abandon: bool) -> dict[str, Any]:
        amp, model, opt = make(level, half_dtype)
        if abandon:
            backward(amp, model, opt, 1, delay_unscale=True)
            opt.zero_grad()
        backward(amp, model, opt, 2)
        opt.step()
        return snapshot(amp, model, opt)

    assert same(run(True), run(False))


def test_nested_scale_loss_over_the_same_optimizer_raises(half_dtype: torch.dtype) -> None:
    amp, model, opt = make("O2", half_dtype)
    x, y = data(0)
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as outer:
        with pytest.raises(RuntimeError, match="already inside a scale_loss"):
            with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt):
                pass  # pragma: no cover - never entered
        outer.backward()
    opt.step()
    assert opt._ampx.steps == 1 and not ampx.step_was_skipped(opt)


def test_step_inside_scale_loss_raises(half_dtype: torch.dtype) -> None:
    amp, model, opt = make("O1", half_dtype)
    x, y = data(0)
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
        with pytest.raises(RuntimeError, match="inside a scale_loss block"):
            opt.step()
    assert opt._ampx.steps == 0


class FailOnce(torch.optim.SGD):
    failed = False

    def step(self, closure: Any = None) -> Any:
        if not self.failed:
            self.failed = True
            raise RuntimeError("optimizer failed once")
        return super().step(closure)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_real_step_that_raises_keeps_the_update_pending(level: str,
                                                         half_dtype: torch.dtype) -> None:
    def run(fail: bool) -> dict[str, Any]:
        amp, model, opt = make(level, half_dtype, FailOnce)
        opt.failed = not fail
        backward(amp, model, opt, 0)
        if fail:
            with pytest.raises(RuntimeError, match="failed once"):
                opt.step()
            assert opt._ampx.stage.value == "UNSCALED" and opt._ampx.steps == 0
        opt.step()  # decided again, and applied
        return snapshot(amp, model, opt)

    assert same(run(True), run(False))


def test_step_after_delay_unscale_raises(half_dtype: torch.dtype) -> None:
    amp, model, opt = make("O2", half_dtype)
    backward(amp, model, opt, 0, delay_unscale=True)
    before = snapshot(amp, model, opt)
    with pytest.raises(RuntimeError, match="still scaled"):
        opt.step()
    assert same(snapshot(amp, model, opt), before)
