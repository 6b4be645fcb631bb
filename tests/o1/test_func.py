"""torch.func over an O1 model: functional_call, grad, vmap(grad) with eager O1's dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from ampx.o1 import patch


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def _o1(half: torch.dtype) -> None:
    patch.activate(patch.CastConfig(dtype=half, device_types=frozenset({"cpu"})))


def _loss(model: nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(functional_call(model, params, (x,)).float(), y)


def test_functional_call_has_eager_dtypes(half_dtype: torch.dtype) -> None:
    model = _model()
    _o1(half_dtype)
    x = torch.randn(4, 6)
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = functional_call(model, params, (x,))
    assert out.dtype == half_dtype
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_grad_equals_autograd_on_the_o1_model(half_dtype: torch.dtype) -> None:
    model = _model()
    _o1(half_dtype)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    params = {k: v.detach() for k, v in model.named_parameters()}
    grads = grad(lambda p: _loss(model, p, x, y))(params)
    F.mse_loss(model(x).float(), y).backward()
    for name, p in model.named_parameters():
        assert grads[name].dtype == torch.float32
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0)


def test_vmap_grad_gives_per_sample_grads(half_dtype: torch.dtype) -> None:
    model = _model()
    _o1(half_dtype)
    x, y = torch.randn(3, 6), torch.randn(3, 3)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return _loss(model, p, xi[None], yi[None])

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    for i in range(3):
        model.zero_grad()
        F.mse_loss(model(x[i:i + 1]).float(), y[i:i + 1]).backward()
        for name, p in model.named_parameters():
            tol = dict(rtol=5e-2, atol=5e-3)  # batched half matmuls round differently
            torch.testing.assert_close(per_sample[name][i], p.grad, **tol)  # type: ignore[arg-type]


@pytest.mark.parametrize("as_parameters", [False, True])
def test_grad_over_parameters_does_not_touch_the_cache(as_parameters: bool) -> None:
    model = _model()
    _o1(torch.bfloat16)
    cache = patch.active().cache  # type: ignore[union-attr]
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    params = dict(model.named_parameters()) if as_parameters else {
        k: v.detach().requires_grad_() for k, v in model.named_parameters()}
    grad(lambda p: _loss(model, p, x, y))(params)
    assert len(cache) == 0
