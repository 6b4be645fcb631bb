"""A `scale_loss` after earlier passes folds their fp32 gradients into `.grad` at its own scale
(issue 39, item 10): the accumulated gradient stays where DDP's all-reduce finds it, with the
numbers apex's stash gave (the two-rank test: tests/test_distributed_accumulation.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampx
from ampx import frontend
from ampx.scaling import unscale


def setup(dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O1", dtype=dtype, verbosity=0,
                                 init_scale=2.0**10)
    return model, opt, torch.randn(12, 8, generator=torch.Generator().manual_seed(1))


def passes(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int = 3,
           poison: int = -1) -> None:
    for i in range(n):
        with ampx.scale_loss(model(x[4 * i:4 * i + 4]).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            if i == poison:
                model[0].weight.grad.fill_(float("inf"))


def test_folded_accumulation_equals_the_stash(half_dtype: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, x = setup(half_dtype)
    passes(model, opt, x)
    folded = [p.grad for p in model.parameters()]
    ampx.restore()
    monkeypatch.setattr(unscale, "foldable", lambda grad: False)  # apex's stash rule
    model, opt, x = setup(half_dtype)
    passes(model, opt, x)
    stashed = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(folded, stashed))  # bitwise (2**10)
    assert opt._ampx.folded == {} and opt._ampx.stash == {}


def test_an_earlier_overflow_is_not_flagged_again() -> None:
    model, opt, x = setup(torch.float16)
    passes(model, opt, x, poison=0)
    # as apex's stash: each pass checks its own gradients, so the scale halved once
    assert frontend.default_session().loss_scale() == 2.0**9
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert ampx.step_was_skipped(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_a_failing_later_pass_puts_the_earlier_gradients_back(error: type) -> None:
    model, opt, x = setup(torch.bfloat16)
    passes(model, opt, x, n=1)
    grads = [p.grad for p in model.parameters()]
    copies = [g.clone() for g in grads]
    with pytest.raises(error):
        with ampx.scale_loss(model(x[4:8]).float().pow(2).mean(), opt) as scaled:
            assert opt._ampx.folded  # folded at the pass's scale while it runs
            scaled.backward()
            raise error("boom")
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # the same tensors
    assert all(torch.equal(g, c) for g, c in zip(grads, copies))
    assert opt._ampx.folded == {}
