"""Convergence: a small model on a fixed synthetic task ends within 2% of the fp32 final loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampx

STEPS = 120


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed teacher-student regression with label noise (the noise floor is ~0.1)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    y = torch.tanh(x @ teacher) + 0.3 * torch.randn(512, 4, generator=g)
    return x, y


def _final_loss(level: str | None, dtype: torch.dtype) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64),
                          nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if level is not None:
        model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    x, y = _data()
    for i in range(STEPS):
        idx = slice((i % 4) * 128, (i % 4 + 1) * 128)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[idx]).float(), y[idx])
        if level is None:
            loss.backward()
        else:
            with ampx.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x).float(), y).item()
    ampx.restore()
    return final


@pytest.fixture(scope="module")
def fp32_loss() -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (module fixtures run before the per-test thread fixture)
    try:
        return _final_loss(None, torch.float32)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_reaches_fp32_loss_within_2_percent(level, half_dtype, fp32_loss):
    loss = _final_loss(level, half_dtype)
    assert abs(loss - fp32_loss) <= 0.02 * fp32_loss, (loss, fp32_loss)
