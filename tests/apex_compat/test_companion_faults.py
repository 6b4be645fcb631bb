"""apex's companions under ampx's reliability rules (issue 22 items 1 and 3).

LARC and the Fused* optimizers, wrapped before or after ``ampx.initialize``, at O1 and O2 in
fp16 and bf16: a skipped step changes nothing (params, masters, optimizer state), and a
checkpoint (model + optimizer + amp) round-trips bitwise, including for half parameters
(FusedAdam's master_param, momentum and moments stay float32 through `load_state_dict`).
FP16_Optimizer's skipped step is a no-op in both dtypes. Fault injection over every kernel
call with these optimizers is in tests/scaling/test_transactions.py.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.compat.apex.fp16_utils import FP16_Optimizer
from ampx.compat.apex.larc import LARC
from ampx.compat.apex.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

Factory = Callable[[Any], torch.optim.Optimizer]

COMPANIONS: dict[str, Factory] = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2),
    "LARC(SGD)": lambda ps: LARC(torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
    "LARC(FusedSGD)": lambda ps: LARC(FusedSGD(ps, lr=1e-2, momentum=0.9)),
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def session(level: str, dtype: torch.dtype, factory: Factory) -> tuple:
    """A static scale of 1 with skipping on: bf16 and fp16 skip non-finite steps alike."""
    model = mlp()
    opt = factory(model.parameters())
    amp = ampx.Amp(level, dtype=dtype, loss_scale=1.0, skip_non_finite=True, verbosity=0)
    model, opt = amp.initialize(model, opt)
    return amp, model, opt


def train(amp: ampx.Amp, model: nn.Module, opt: Any, seed: int, poison: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x).float(), y)
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def state_of(model: nn.Module, opt: Any) -> dict[str, Any]:
    return {"model": [p.detach().clone() for p in model.parameters()],
            "masters": [p.detach().clone() for p in ampx.master_params(opt)],
            "opt": copy.deepcopy(opt.state_dict())}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def finite(state: dict[str, Any]) -> bool:
    tensors = [*state["model"], *state["masters"]]
    tensors += [v for s in state["opt"]["state"].values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("name", list(COMPANIONS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skipped_step_of_a_companion_changes_nothing(level: str, name: str,
                                                       half_dtype: torch.dtype) -> None:
    """Item 1: LARC wrapped before initialize stepped its inner optimizer on skipped steps."""
    amp, model, opt = session(level, half_dtype, COMPANIONS[name])
    train(amp, model, opt, 0)
    before = state_of(model, opt)
    train(amp, model, opt, 1, poison=True)
    assert ampx.step_was_skipped(opt)
    after = state_of(model, opt)
    assert finite(after) and same(after, before)


@pytest.mark.parametrize("name", list(COMPANIONS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_companion_checkpoint_round_trips_bitwise(level: str, name: str,
                                                    half_dtype: torch.dtype) -> None:
    amp, model, opt = session(level, half_dtype, COMPANIONS[name])
    for seed in range(3):
        train(amp, model, opt, seed)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "amp": amp.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    amp2, model2, opt2 = session(level, half_dtype, COMPANIONS[name])
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    amp2.load_state_dict(saved["amp"])
    assert same(state_of(model2, opt2), state_of(model, opt))
    for seed in range(3, 5):
        train(amp, model, opt, seed)
        train(amp2, model2, opt2, seed)
    assert same(state_of(model2, opt2), state_of(model, opt))


HALF_PARAM_OPTIMIZERS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2),
    "FusedAdam-master": lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", list(HALF_PARAM_OPTIMIZERS))
def test_fused_state_of_half_params_stays_float32_through_load(name: str,
                                                               half_dtype: torch.dtype) -> None:
    """Item 3: torch's load_state_dict recast exp_avg/momentum/master_param to the half dtype;
    a resumed FusedAdam went inf after one step and FusedLAMB diverged."""
    factory = HALF_PARAM_OPTIMIZERS[name]
    torch.manual_seed(0)
    params = [torch.randn(6, 5).to(half_dtype).requires_grad_(),
              torch.randn(5).to(half_dtype).requires_grad_()]
    twin = [p.detach().clone().requires_grad_() for p in params]
    opt, opt2 = factory(params), factory(twin)

    def step(o: torch.optim.Optimizer, ps: list[torch.Tensor], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
        o.step()

    for seed in range(2):
        step(opt, params, seed)
    saved = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    with torch.no_grad():
        for p, q in zip(params, twin):
            q.copy_(p)
    loaded = [v for s in opt2.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert loaded and all(v.dtype == torch.float32 for v in loaded)
    for seed in range(2, 4):
        step(opt, params, seed)
        step(opt2, twin, seed)
    for p, q in zip(params, twin):
        assert torch.isfinite(q).all() and torch.equal(p, q)


def test_fp16_optimizer_skipped_step_is_a_no_op(half_dtype: torch.dtype) -> None:
    model = nn.Linear(4, 2).to(half_dtype)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         dynamic_loss_scale=True, verbose=False)
    x = torch.randn(3, 4).to(half_dtype)
    opt.zero_grad()
    opt.backward(model(x).float().pow(2).mean())
    opt.step()
    before = ([p.detach().clone() for p in model.parameters()],
              copy.deepcopy(opt.state_dict()["optimizer_state_dict"]))
    opt.zero_grad()
    opt.backward(model(x).float().sum() * float("inf"))
    assert opt.overflow
    opt.step()
    after = ([p.detach().clone() for p in model.parameters()],
             copy.deepcopy(opt.state_dict()["optimizer_state_dict"]))
    assert same(list(after), list(before))
