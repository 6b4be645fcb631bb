"""Converting an initialized model's dtype (issue 33, item 2).

``model.float()``, ``.half()``, ``.bfloat16()`` or ``.to(dtype)`` after an O2/O3
``initialize`` is followed: the model's inputs are cast to its new dtype, parameters with fp32
masters take their masters' values in it (``model.float()`` computes with the masters
exactly), and ``model.state_dict()`` saves the masters whatever the model's dtype, before and
after the first step. float64 is refused at the next forward, with nothing changed.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ampx

CONVERSIONS = {
    "float": lambda m: m.float(),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to-float32": lambda m: m.to(torch.float32),
    "to-other-half": None,  # .to() the half dtype the session does not use
    "double": lambda m: m.double(),
}
OTHER_HALF = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}


def _convert(model: nn.Module, how: str, half_dtype: torch.dtype) -> torch.dtype:
    """Convert `model`; returns the dtype its cast parameters now have."""
    if how == "to-other-half":
        model.to(OTHER_HALF[half_dtype])
    else:
        CONVERSIONS[how](model)
    return model[0].weight.dtype


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 8, generator=gen)).float().pow(2).mean()
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def _masters_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    masters = opt._ampx.masters  # type: ignore[attr-defined]
    out = {}
    for name, param in model.named_parameters():
        master = masters.master_of(param)
        if master is not None:
            out[name] = master
    return out


def _assert_state_dict_is_the_masters(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    masters = _masters_by_name(model, opt)
    assert set(masters) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    state = model.state_dict()
    for name, master in masters.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], master), name
    for name, param in model.named_parameters():  # the others (kept batchnorm) as they are
        if name not in masters:
            assert torch.equal(state[name], param.detach().float()), name


@pytest.mark.parametrize("when", ["before-first-step", "after-first-step"])
@pytest.mark.parametrize("how", list(CONVERSIONS))
def test_o2_state_dict_is_the_masters_after_a_conversion(how: str, when: str,
                                                         half_dtype: torch.dtype,
                                                         backend: str) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0,
                                 init_scale=2.0**8)
    if when == "after-first-step":
        _train(model, opt, 2)
    new = _convert(model, how, half_dtype)
    _assert_state_dict_is_the_masters(model, opt)  # right after the conversion
    if new == torch.float64:
        masters = {k: v.clone() for k, v in _masters_by_name(model, opt).items()}
        with pytest.raises(TypeError, match="converted to torch.float64"):
            model(torch.randn(2, 8))
        with pytest.raises(TypeError, match="converted to torch.float64"):  # every time
            model(torch.randn(2, 8))
        assert all(torch.equal(m, masters[k]) for k, m in _masters_by_name(model, opt).items())
        _assert_state_dict_is_the_masters(model, opt)
        return
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 8))  # inputs follow the model's dtype
    assert out.dtype == torch.float32  # O2's output cast
    for name, master in _masters_by_name(model, opt).items():  # computes with its masters
        assert torch.equal(model.get_parameter(name), master.to(new)), name
    assert model[1].weight.dtype == torch.float32  # kept batchnorm is float32 again
    model.train()
    _train(model, opt, 2, seed=2)  # trains in its new dtype
    assert model[0].weight.dtype == new and model[0].weight.grad is None
    for name, master in _masters_by_name(model, opt).items():
        assert torch.equal(model.get_parameter(name), master.to(new)), name
    _assert_state_dict_is_the_masters(model, opt)


def test_float_for_evaluation_then_half_again_changes_nothing(half_dtype: torch.dtype,
                                                             backend: str) -> None:
    """The legacy loop: evaluate in float32 with ``model.float()``, then ``model.half()``
    (or ``.to(dtype)``) back; training goes on bitwise as without the round trip."""
    runs = []
    for round_trip in (False, True):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype,
                                     keep_batchnorm_fp32=False, verbosity=0, init_scale=2.0**8)
        _train(model, opt, 2)
        if round_trip:
            model.float()
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 8))
        if round_trip:
            model.to(half_dtype)
        model.train()
        _train(model, opt, 2, seed=2)
        runs.append((list(model.parameters()), ampx.master_params(opt), model.state_dict()))
        ampx.restore()
    (params_a, masters_a, state_a), (params_b, masters_b, state_b) = runs
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(params_a, params_b))
    assert all(torch.equal(a, b) for a, b in zip(masters_a, masters_b))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_half_conversion_puts_kept_batchnorm_back_to_float32(half_dtype: torch.dtype,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    model.float()
    model(torch.randn(2, 8))
    model.to(half_dtype)
    assert model[1].weight.dtype == half_dtype  # torch's conversion
    with caplog.at_level(logging.WARNING, logger="ampx"):
        model(torch.randn(2, 8))
    assert model[1].weight.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    assert any("rounded" in r.getMessage() and "(1)" in r.getMessage() for r in caplog.records)
    _train(model, opt, 1)
    _assert_state_dict_is_the_masters(model, opt)


@pytest.mark.parametrize("how", ["float", "to-other-half"])
def test_o3_follows_a_conversion(how: str, half_dtype: torch.dtype, backend: str) -> None:
    """O3 has no masters: the model's own parameters, in their new dtype, are what it saves."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O3", dtype=half_dtype, verbosity=0,
                                 init_scale=2.0**8)
    _train(model, opt, 1)
    new = _convert(model, how, half_dtype)
    _train(model, opt, 2, seed=2)
    assert all(p.dtype == new for p in model.parameters())
    state = model.state_dict()
    for name, param in model.named_parameters():
        assert torch.equal(state[name], param.detach().float()), name
