"""Model handling: O0's fp32 cast and input/output casts by hooks, deepcopy, undo on failure."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampx
from ampx.model import cast_model


def test_o0_casts_model_inputs_and_outputs_to_fp32_with_hooks() -> None:
    model = nn.Linear(3, 2).double()
    ampx.initialize(model, opt_level="O0", verbosity=0)
    assert "forward" not in vars(model)  # apex reassigned model.forward; ampx uses hooks
    assert model.weight.dtype == torch.float32
    out = model(torch.rand(4, 3, dtype=torch.float64))
    assert out.dtype == torch.float32
    out = model(input=torch.rand(4, 3, dtype=torch.float16))
    assert out.dtype == torch.float32


def test_o2_casts_half_keeps_batchnorm_and_outputs_fp32(half_dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    assert model[0].weight.dtype == half_dtype and model[1].weight.dtype == torch.float32
    assert model(torch.rand(8, 8)).dtype == torch.float32
    assert all(v.dtype != half_dtype for v in model.state_dict().values())


def test_cast_model_outputs_at_o1() -> None:
    model = nn.Linear(64, 64)
    ampx.initialize(model, opt_level="O1", dtype="bf16", cast_model_outputs=torch.float32,
                    verbosity=0)
    assert model.weight.dtype == torch.float32
    assert model(torch.rand(8, 64)).dtype == torch.float32


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_deepcopy_after_initialize_is_independent(level: str) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype="bf16", verbosity=0)
    ema = copy.deepcopy(model)
    assert all(a is not b for a, b in zip(model.parameters(), ema.parameters()))
    x = torch.rand(8, 64)
    torch.testing.assert_close(ema(x), model(x))
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    assert torch.count_nonzero(ema(x)) == 0  # computes with its own weights
    assert torch.count_nonzero(model(x)) > 0  # and the original is untouched
    assert ema(x).dtype == model(x).dtype
    sd = ema.state_dict()
    assert all(torch.count_nonzero(v) == 0 for v in sd.values())


def test_cast_model_undo_restores_everything() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.LSTM(3, 3))
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    record = cast_model(model, torch.float16, keep_batchnorm_fp32=False,
                        split_params={id(model[0].weight)}, cast_outputs=torch.float32)
    assert model[0].weight is not params["0.weight"][0]
    record.undo()
    for name, p in model.named_parameters():
        assert p is params[name][0] and p.dtype == torch.float32
        assert torch.equal(p, params[name][1])
    assert all(b is buffers[n] for n, b in model.named_buffers())
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(a is b for a, b in zip(model[2]._flat_weights, model[2].parameters()))
