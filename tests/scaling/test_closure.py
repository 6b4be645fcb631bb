"""`optimizer.step(closure)` after initialize, and optimizer wrappers that expose `.optimizer`.

The optimizer's call of the closure is a real pass (forward + scaled backward), then the step is
taken or skipped on its overflow flag: for optimizers that call it first, the same numbers as
the explicit `closure(); optimizer.step()` loop (calls inside step: test_closure_in_step.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx import frontend

LEVELS = ["O0", "O1", "O2", "O3"]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def make(level: str, dtype: torch.dtype, opt_cls: Any = torch.optim.AdamW,
         amp: dict[str, Any] | None = None, **kwargs: Any
         ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = mlp()
    opt = opt_cls(model.parameters(), lr=1e-2, **kwargs)
    return ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0,
                           **({} if level in ("O0", "O3") else {"init_scale": 2.0**10}),
                           **(amp or {}))


def closure_for(model: nn.Module, opt: Any, seed: int, *, nan: bool = False) -> Any:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        x, y = batch(seed)
        loss = nn.functional.mse_loss(model(x).float(), y)
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if nan:
                next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
        return loss
    return closure


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, buffers: bool = True
             ) -> list[torch.Tensor]:
    """Model weights (and buffers: batchnorm's running stats move with every forward) and
    the masters."""
    model_part = model.state_dict().values() if buffers else model.parameters()
    return [t.detach().clone() for t in [*model_part, *ampx.master_params(opt)]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("level", LEVELS)
def test_step_closure_matches_the_explicit_loop(level: str, half_dtype: torch.dtype) -> None:
    sgd = {"opt_cls": torch.optim.SGD, "momentum": 0.9}  # AdamW's eps is 0 in pure fp16 (O3)
    explicit = make(level, half_dtype, **sgd)
    for seed in range(5):
        closure_for(*explicit, seed)()
        explicit[1].step()
    want = snapshot(*explicit)
    ampx.restore()

    model, opt = make(level, half_dtype, **sgd)
    for seed in range(5):
        closure = closure_for(model, opt, seed)
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.requires_grad  # step returns its result
    got = snapshot(model, opt)
    assert all(t.isfinite().all() for t in got) and same(got, want)
    assert opt._ampx.steps == 5


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_overflow_in_closure_skips_the_step(level: str, fused: bool) -> None:
    model, opt = make(level, torch.float16, fused=fused or None)
    opt.step(closure_for(model, opt, 0))
    before = snapshot(model, opt, buffers=False)
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    scale = frontend.default_session().loss_scale()
    loss = opt.step(closure_for(model, opt, 1, nan=True))
    assert isinstance(loss, torch.Tensor)
    assert ampx.step_was_skipped(opt)
    assert same(snapshot(model, opt, buffers=False), before)
    assert all(torch.equal(state[p][n], v) for p, s in opt.state.items() for n, v in s.items())
    assert frontend.default_session().loss_scale() == scale / 2
    opt.step(closure_for(model, opt, 2))  # and training goes on
    assert not ampx.step_was_skipped(opt)
    assert not same(snapshot(model, opt, buffers=False), before)


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_closure_that_raises_leaves_everything_as_it_was(error: type[BaseException]) -> None:
    model, opt = make("O2", torch.float16)
    opt.step(closure_for(model, opt, 0))
    closure_for(model, opt, 1)()  # gradients waiting for a step
    before = snapshot(model, opt, buffers=False)
    grads = [p.grad.clone() for p in ampx.master_params(opt)]
    scale = frontend.default_session().loss_scale()

    def failing() -> torch.Tensor:
        loss = nn.functional.mse_loss(model(batch(2)[0]).float(), batch(2)[1])
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
            raise error("boom")

    with pytest.raises(error):
        opt.step(failing)
    assert same(snapshot(model, opt, buffers=False), before)
    assert all(torch.equal(p.grad, g) for p, g in zip(ampx.master_params(opt), grads))
    assert frontend.default_session().loss_scale() == scale and opt._ampx.steps == 1
    opt.step()  # the pending gradients are still steppable
    assert opt._ampx.steps == 2 and not same(snapshot(model, opt, buffers=False), before)


def test_lbfgs_closure_is_refused_before_anything_runs() -> None:
    model, opt = make("O2", torch.float16, torch.optim.LBFGS)
    ran: list[int] = []
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="LBFGS.*O0"):
        opt.step(lambda: ran.append(1))
    assert not ran and same(snapshot(model, opt), before)


def test_closure_returning_nothing_and_a_positional_closure() -> None:
    model, opt = make("O2", torch.bfloat16, torch.optim.SGD)
    inner = closure_for(model, opt, 0)
    before = snapshot(model, opt)
    assert torch.optim.SGD.step(opt, lambda: (inner(), None)[1]) is None
    assert not same(snapshot(model, opt), before)


class Wrapper(torch.optim.Optimizer):
    """Like Accelerate's AcceleratedOptimizer: a subclass that holds the real one."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_wrapped_optimizers_are_accepted_everywhere(level: str) -> None:
    model, opt = make(level, torch.float16,
                      amp={"detect_overflow": "forward", "on_overflow": "skip"})
    wrapped = Wrapper(Wrapper(opt))
    assert ampx.master_params(wrapped) == ampx.master_params(opt)
    wrapped.step(closure_for(model, wrapped, 0))
    assert not ampx.step_was_skipped(wrapped) and ampx.last_overflow(wrapped) is None
    wrapped.zero_grad()
    x, y = batch(1)
    loss = nn.functional.mse_loss(model(x).float(), y)
    with ampx.scale_loss(loss, wrapped) as scaled:
        scaled.backward()
        next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
    wrapped.step()
    assert ampx.step_was_skipped(wrapped)
    assert ampx.last_overflow(wrapped) is ampx.last_overflow(opt) is not None
    assert frontend.default_session().last_overflow(wrapped) is ampx.last_overflow(opt)


def test_a_wrapper_of_an_uninitialized_optimizer_is_still_refused() -> None:
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="step_was_skipped"):
        ampx.step_was_skipped(Wrapper(opt))
