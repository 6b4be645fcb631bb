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
from ampx import _ext

KERNELS = ("unscale_", "unscale_into_", "copy_", "update_scale_", "l2norm", "unscale_pass",
           "next_scale_state")
SCALER_TENSORS = ("_scale", "_growth_tracker", "_hysteresis_tracker", "_overflows_since_report",
                  "_scale_before_overflow")


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


# -- every transition point of a step, not only the kernel calls (issue 22 items 6 and 7) ------

def _fault(monkeypatch: pytest.MonkeyPatch, target: str, when: str,
           exc: type[BaseException]) -> list[int]:
    """Make `target` (a dotted method path) raise `exc` once, before or after its work."""
    module, cls_name, name = target.rsplit(".", 2)
    owner = getattr(__import__(module, fromlist=[cls_name]), cls_name)
    original = getattr(owner, name)
    fired = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if fired[0]:
            return original(*args, **kwargs)
        fired[0] = 1
        if when == "before":
            raise exc(f"injected before {name}")
        original(*args, **kwargs)
        raise exc(f"injected after {name}")

    monkeypatch.setattr(owner, name, wrapped)
    return fired


# (target, when, outcome): "never" = bitwise as before the interrupted call; "done" = the
# interrupted step is completed by the next entry (its update had already run).
PASS_POINTS = [
    ("ampx.scaling.protocol.OptimizerAmpState.begin_backward", "after"),
    ("ampx.scaling.scaled_pass.ScaledPass.begin", "after"),
    ("ampx.scaling.scaled_pass.ScaledPass.end", "before"),
    ("ampx.scaling.scaled_pass.ScaledPass._end", "before"),
    ("ampx.scaling.protocol.OptimizerAmpState.commit_unscale", "after"),
    ("ampx.scaling.scaler.LossScaler.commit", "after"),
]
STEP_POINTS = [
    ("ampx.scaling.protocol.OptimizerAmpState.decide_step", "before", "never"),
    ("ampx.scaling.protocol.OptimizerAmpState.decide_step", "after", "never"),
    ("ampx.scaling.protocol.OptimizerAmpState.after_step", "before", "done"),
]


def _ids(points: list[tuple]) -> list[str]:
    return [f"{p[0].rsplit('.', 1)[-1]}-{p[1]}" for p in points]


def model_equals_masters(model: nn.Module, opt: Any) -> bool:
    """At O2 every half model parameter is the cast of its fp32 master."""
    state = opt._ampx
    cache = state.cache(opt)
    return all(torch.equal(m, p.detach().to(m.dtype)) for p, m in zip(cache.masters, cache.models))


def _uninterrupted_accumulating(level: str, dtype: torch.dtype, opt_cls: Any,
                                zero_grad: bool = False) -> dict[str, Any]:
    amp, model, opt = make(level, dtype, opt_cls)
    head(amp, model, opt)
    first_pass(amp, model, opt, False)
    scenario(amp, model, opt)
    if zero_grad:
        opt.zero_grad()
    backward(amp, model, opt, 3)
    opt.step()
    return snapshot(amp, model, opt)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize(("target", "when"), PASS_POINTS, ids=_ids(PASS_POINTS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_interrupt_at_each_point_of_a_pass_changes_nothing(
        backend: str, level: str, target: str, when: str, exc: type[BaseException],
        half_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: right after `begin` (or one optimizer's begin), at `end`'s entry, in the middle
    of the commit: the optimizer is never left in SCALING and nothing changed."""
    expected = _uninterrupted_accumulating(level, half_dtype, torch.optim.AdamW)
    amp, model, opt = make(level, half_dtype)
    head(amp, model, opt)
    first_pass(amp, model, opt, False)
    before = snapshot(amp, model, opt)
    with monkeypatch.context() as m:
        fired = _fault(m, target, when, exc)
        with pytest.raises(exc, match="injected"):
            scenario(amp, model, opt)
        assert fired[0]
    assert same(snapshot(amp, model, opt), before)
    assert opt._ampx.stage.value == "UNSCALED"
    scenario(amp, model, opt)  # nothing is stuck: the same pass and step, clean
    backward(amp, model, opt, 3)
    opt.step()
    assert same(snapshot(amp, model, opt), expected)
    assert level == "O1" or model_equals_masters(model, opt)


class InterruptAfterUpdate(torch.optim.AdamW):
    """An optimizer whose step is interrupted once after its update (before ampx's hook)."""

    armed = False
    exc: type[BaseException] = KeyboardInterrupt

    def step(self, closure: Any = None) -> Any:
        # AdamW's own step, without torch's hook wrapper (which would run the hooks twice)
        update = torch.optim.AdamW.step
        with torch.no_grad():
            out = getattr(update, "__wrapped__", update)(self, closure)
        if self.armed:
            self.armed = False
            raise self.exc("injected after the update")
        return out


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("point", [*STEP_POINTS, ("update", "after", "done"),
                                   ("post-hook", "after", "done")],
                         ids=[*_ids(STEP_POINTS), "update-after", "user-post-hook"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_interrupt_at_each_point_of_a_step_never_leaves_a_stale_model(
        backend: str, level: str, point: tuple, exc: type[BaseException],
        half_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 7: between the optimizer's update and the master -> model copy (the update
    interrupted after it ran, ampx's post hook interrupted at its entry, a user's post hook
    registered before initialize that raises): the step is completed, never half-done (by
    ampx's hook, which runs first, or by the next `zero_grad`/`scale_loss`/`step` when the
    update ran but the hook did not); the model equals its masters and the next step is
    bitwise that of an uninterrupted run. A fault before the update leaves the step pending
    (bitwise as before; `step()` retries it)."""
    target, when, outcome = point
    expected = _uninterrupted_accumulating(level, half_dtype, InterruptAfterUpdate, True)
    torch.manual_seed(0)
    raw, raw_opt = mlp(), None
    raw_opt = InterruptAfterUpdate(raw.parameters(), lr=1e-2)
    hook_armed = [False]
    if target == "post-hook":
        def user_hook(*args: Any) -> None:
            if hook_armed[0]:
                hook_armed[0] = False
                raise exc("injected in a user post hook")
        raw_opt.register_step_post_hook(user_hook)
    amp = ampx.Amp(level, dtype=half_dtype, loss_scale="dynamic", verbosity=0, init_scale=2.0**8)
    model, opt = amp.initialize(raw, raw_opt)
    head(amp, model, opt)
    first_pass(amp, model, opt, False)
    backward(amp, model, opt, 2)
    before = snapshot(amp, model, opt)
    with monkeypatch.context() as m:
        if target == "update":
            opt.armed, opt.exc = True, exc
        elif target == "post-hook":
            hook_armed[0] = True
        else:
            _fault(m, target, when, exc)
        with pytest.raises(exc, match="injected"):
            opt.step()
    if outcome == "never":
        assert same(snapshot(amp, model, opt), before)
        opt.step()  # retried
    if target == "post-hook":  # ampx's hook ran first: completed at once
        assert opt._ampx.steps == 2 and (level == "O1" or model_equals_masters(model, opt))
    opt.zero_grad()  # the next entry completes an interrupted update
    assert level == "O1" or model_equals_masters(model, opt)
    backward(amp, model, opt, 3)
    opt.step()
    assert same(snapshot(amp, model, opt), expected)
    assert level == "O1" or model_equals_masters(model, opt)


# -- apex's companion optimizers are first-class in the fault tests (issue 22) ----------------

def _companions() -> dict[str, Callable[..., torch.optim.Optimizer]]:
    from ampx.compat.apex.larc import LARC
    from ampx.compat.apex.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

    return {
        "FusedAdam": FusedAdam,
        "FusedSGD": lambda ps, lr: FusedSGD(ps, lr=lr, momentum=0.9),
        "FusedLAMB": FusedLAMB,
        "FusedNovoGrad": FusedNovoGrad,
        "LARC(SGD)": lambda ps, lr: LARC(torch.optim.SGD(ps, lr=lr, momentum=0.9)),
    }


COMPANIONS = list(_companions())


@pytest.mark.parametrize("name", COMPANIONS)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fault_in_every_kernel_call_with_an_apex_companion(
        backend: str, level: str, exc: type[BaseException], name: str,
        half_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """LARC and the Fused* optimizers under the kernel-call fault injection: a failed pass
    changes nothing, a failed master copy rolls forward, the model equals its masters and
    the next clean step is bitwise that of an uninterrupted run."""
    factory = _companions()[name]

    def prepare() -> tuple:
        amp, model, opt = make(level, half_dtype, lambda ps, lr: factory(ps, lr=lr))
        head(amp, model, opt)
        first_pass(amp, model, opt, False)
        return amp, model, opt

    amp, model, opt = prepare()
    scenario(amp, model, opt)
    backward(amp, model, opt, 3)
    opt.step()
    expected = snapshot(amp, model, opt)
    total = kernel_calls(monkeypatch, prepare, scenario)
    assert total >= 2
    for at in range(total):
        amp, model, opt = prepare()
        before = snapshot(amp, model, opt)
        fail_at(monkeypatch, at, exc, scenario, amp, model, opt)
        if opt._ampx.steps == 1:  # the fault was in the pass
            assert same(snapshot(amp, model, opt), before), at
            scenario(amp, model, opt)
        assert level == "O1" or model_equals_masters(model, opt)
        backward(amp, model, opt, 3)
        opt.step()
        assert same(snapshot(amp, model, opt), expected), f"fault at kernel call {at}"
