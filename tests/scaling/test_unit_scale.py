"""A static loss scale of exactly 1 (bf16's default): gradients are checked where they are.

Multiplying by 1 changes no value, so a pass at a known unit scale checks its fresh gradients
in place instead of copying them into new buffers (`ampx.scaling.unscale`). These tests pin when
that happens, that the result is bitwise what a plain backward gives, and when the scaler knows the
scale is 1 without reading it (`LossScaler.unit_scale`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampx
from ampx.scaling.scaler import LossScaler


def _setup(level: str = "O1", dtype: torch.dtype = torch.bfloat16, **options: object) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = ampx.Amp(level, dtype=dtype, verbosity=0, **options)
    model, opt = amp.initialize(model, opt)
    return amp, model, opt


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def test_a_unit_scale_pass_keeps_autograds_gradients_bitwise() -> None:
    amp, model, opt = _setup()
    assert amp.scalers[0].unit_scale()
    x = torch.randn(4, 8)
    _loss(model, x).backward()  # the plain backward, under the same O1 patches
    plain = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    with amp.scale_loss(_loss(model, x), opt) as scaled:
        scaled.backward()
        produced = [p.grad for p in model.parameters()]
    after = [p.grad for p in model.parameters()]
    assert all(a is b for a, b in zip(after, produced))  # checked in place, not copied
    assert all(torch.equal(a, b) for a, b in zip(after, plain))
    opt.step()
    assert not ampx.step_was_skipped(opt)
    amp.restore()


def test_a_dynamic_scale_pass_unscales_its_own_gradients_in_place() -> None:
    """As GradScaler: this pass's gradients (nothing was there before it) are unscaled where
    they are (a failure drops them anyway); gradients of earlier passes get new buffers."""
    amp, model, opt = _setup(dtype=torch.float16, loss_scale="dynamic")
    assert not amp.scalers[0].unit_scale()
    x = torch.randn(4, 8)
    _loss(model, x).backward()  # the plain backward, under the same O1 patches
    plain = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    with amp.scale_loss(_loss(model, x), opt) as scaled:
        scaled.backward()
        produced = [p.grad for p in model.parameters()]
    in_place = ampx._ext._native_module() is not None  # (the reference copies)
    assert all((p.grad is g) is in_place for p, g in zip(model.parameters(), produced))
    # the plain gradients, up to fp16 rounding (the scaled backward rounds elsewhere)
    assert all(torch.allclose(p.grad, g, rtol=1e-2, atol=1e-4)
               for p, g in zip(model.parameters(), plain))
    earlier = [p.grad for p in model.parameters()]
    with amp.scale_loss(_loss(model, x), opt) as scaled:  # accumulates onto `earlier`
        scaled.backward()
    assert all(p.grad is not g for p, g in zip(model.parameters(), earlier))
    assert all(torch.allclose(p.grad, 2 * g, rtol=1e-2, atol=1e-4)
               for p, g in zip(model.parameters(), plain))
    amp.restore()


def test_one_gradient_tensor_on_two_parameters_is_unscaled_once() -> None:
    """A hook that gives two parameters the same gradient tensor: unscaling it in place for
    each would divide it by the scale twice; each parameter gets its own buffer instead."""
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = ampx.Amp("O1", dtype=torch.float16, loss_scale=8.0, verbosity=0)
    model, opt = amp.initialize(model, opt)
    a, b = model
    with amp.scale_loss((a * b).sum(), opt) as scaled:
        scaled.backward()
        b.grad = a.grad  # one tensor, two parameters (8 * b each)
    expected = b.detach().clone()
    assert torch.equal(a.grad, expected) and torch.equal(b.grad, expected)
    amp.restore()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_gradients_that_need_autograd_or_a_cast_are_not_checked_in_place() -> None:
    amp, model, opt = _setup()
    with amp.scale_loss(_loss(model, torch.randn(4, 8)), opt) as scaled:
        scaled.backward(create_graph=True)
        produced = [p.grad for p in model.parameters()]
    assert all(g.requires_grad for g in produced)
    assert all(p.grad is not g for p, g in zip(model.parameters(), produced))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), produced))
    for p in model.parameters():
        p.grad = None  # break the create_graph reference cycle
    amp.restore()
    amp, model, opt = _setup("O2")  # bf16 model gradients go into fp32 masters
    with amp.scale_loss(_loss(model, torch.randn(4, 8).bfloat16()), opt) as scaled:
        scaled.backward()
    assert all(m.grad.dtype == torch.float32 for m in ampx.master_params(opt))
    amp.restore()


def test_a_non_finite_gradient_at_unit_scale_skips_the_step() -> None:
    amp, model, opt = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8)
    x[0, 0] = float("inf")
    with amp.scale_loss(_loss(model, x), opt) as scaled:
        scaled.backward()
    opt.step()
    assert ampx.step_was_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    amp.restore()


def test_the_scaler_knows_a_unit_scale_without_reading_it() -> None:
    assert LossScaler(1.0).unit_scale()
    assert not LossScaler(2.0).unit_scale()
    assert not LossScaler("dynamic", init_scale=1.0).unit_scale()  # it may grow
    scaler = LossScaler(2.0)
    scaler.set_scale(1.0)  # written from the host (apex's `_loss_scale` setter calls it)
    assert scaler.unit_scale()
    scaler.set_scale(4.0)
    assert not scaler.unit_scale()
    scaler = LossScaler(1.0)
    scaler.scale.mul_(2)  # written behind the scaler's back: the version counter tells
    assert not scaler.unit_scale()
    scaler = LossScaler(1.0)
    scaler._scale = torch.full((1,), 3.0)  # replaced: the identity tells
    assert not scaler.unit_scale()


def test_a_unit_scale_stays_known_through_steps_and_checkpoints() -> None:
    amp, model, opt = _setup()
    for _ in range(3):
        with amp.scale_loss(_loss(model, torch.randn(4, 8)), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert amp.scalers[0].unit_scale()
    amp.load_state_dict(amp.state_dict())
    assert amp.scalers[0].unit_scale()
    assert amp.scalers[0].loss_scale() == 1.0
    amp.restore()
