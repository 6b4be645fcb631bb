"""Hostile cases of issue 22 ("never corrupt training, round two") outside the fault tests.

Item 2: torch's fused SGD with momentum whose first step is skipped; items 10 and 11: option
and checkpoint-key input that used to be misread; the "also verify": fp16 sparse gradients
are checked after coalescing. Each runs on both kernel backends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.options.levels import OptionError
from ampx.scaling.checkpoint import CheckpointError
from ampx.scaling.protocol import amp_state_of


@pytest.fixture(autouse=True)
def _each_backend(backend: str) -> str:
    """Every test here runs on both kernel backends (tests/conftest.py's `backend`)."""
    return backend


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(amp: ampx.Amp, model: nn.Module, opt: Any, seed: int, poison: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss * float("inf") if poison else loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_sgd_momentum_with_a_skipped_first_step_equals_a_fresh_run(
        level: str, half_dtype: torch.dtype) -> None:
    """Item 2: the fused kernel returns early on found_inf after torch made the momentum
    buffers with empty_like: garbage momentum (O1 diverged, O2 went non-finite)."""
    def run(skip_first: bool) -> list[torch.Tensor]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
        amp = ampx.Amp(level, dtype=half_dtype, loss_scale=1.0, skip_non_finite=True,
                       verbosity=0)
        model, opt = amp.initialize(model, opt)
        if skip_first:
            train(amp, model, opt, 0, poison=True)
            assert ampx.step_was_skipped(opt)
            assert not any("momentum_buffer" in s for s in opt.state.values())
        for seed in (1, 2, 3):
            train(amp, model, opt, seed)
        return [p.detach().clone() for p in [*model.parameters(), *ampx.master_params(opt)]]

    skipped, fresh = run(True), run(False)
    assert all(torch.isfinite(p).all() for p in skipped)
    assert all(torch.equal(a, b) for a, b in zip(skipped, fresh))


def test_fused_sgd_later_skips_stay_on_the_device(half_dtype: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the momentum buffers exist the fused kernel decides again (no host sync)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    amp = ampx.Amp("O2", dtype=half_dtype, loss_scale=1.0, skip_non_finite=True, verbosity=0)
    model, opt = amp.initialize(model, opt)
    train(amp, model, opt, 0)
    items: list[int] = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: items.append(1) or original(t))
    train(amp, model, opt, 1, poison=True)
    monkeypatch.undo()
    assert items == [] and ampx.step_was_skipped(opt)


@pytest.mark.parametrize("value", ["no", "yes", "0", 2, 0.0])
def test_sync_overflow_refuses_what_is_not_a_bool(value: Any) -> None:
    """Item 10: sync_overflow="no" read as True."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OptionError, match="sync_overflow"):
        ampx.initialize(model, opt, opt_level="O1", sync_overflow=value, verbosity=0)
    assert amp_state_of(opt) is None and model.weight.dtype == torch.float32


@pytest.mark.parametrize(("value", "expected"), [(False, False), ("False", False),
                                                 (True, True), ("True", True), (None, True)])
def test_sync_overflow_accepts_bools_and_apex_strings(value: Any, expected: bool) -> None:
    assert ampx.Amp("O1", sync_overflow=value, verbosity=0).sync_overflow is expected


@pytest.mark.parametrize("key", ["loss_scaler\u0661", "loss_scaler\uff11", "loss_scaler\u00b2",
                                 "loss_scaler\u0660", "loss_scaler 1", "loss_scaler+1"])
def test_scaler_keys_take_ascii_digits_only(key: str) -> None:
    """Item 11: an Arabic-Indic or full-width digit was read as index 1; "²" raised a bare
    ValueError."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = ampx.Amp("O1", num_losses=2, verbosity=0)
    amp.initialize(model, opt)
    before = [s.state_dict() for s in amp.scalers]
    with pytest.raises(CheckpointError, match="Unexpected key"):
        amp.load_state_dict({key: {"loss_scale": 8.0, "unskipped": 0}})
    assert [s.state_dict() for s in amp.scalers] == before


@pytest.mark.parametrize(("level", "options"), [("O2", {"master_weights": False}), ("O3", {})],
                         ids=["O2-no-masters", "O3"])
def test_fp16_sparse_gradients_are_coalesced_before_the_check(level: str,
                                                              options: dict) -> None:
    """Also-verify: two finite fp16 values at one index overflow once summed (torch's
    GradScaler coalesces first); the step must be skipped, not taken into inf."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    amp = ampx.Amp(level, dtype=torch.float16, loss_scale=1.0, skip_non_finite=True,
                   verbosity=0, **options)
    emb, opt = amp.initialize(emb, opt)
    before = emb.weight.detach().clone()
    idx = torch.tensor([0, 0, 3])
    with amp.scale_loss((emb(idx).float() * 40000.0).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert ampx.step_was_skipped(opt)
    assert torch.equal(emb.weight.detach(), before)


def test_bf16_and_fp32_master_sparse_gradients_are_not_coalesced_needlessly() -> None:
    """An fp16 sparse gradient unscaled into an fp32 master sums in fp32: no overflow, the
    step is taken and finite."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=1e-6)
    amp = ampx.Amp("O2", dtype=torch.float16, loss_scale=1.0, skip_non_finite=True,
                   verbosity=0)
    emb, opt = amp.initialize(emb, opt)
    with amp.scale_loss((emb(torch.tensor([0, 0])).float() * 40000.0).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not ampx.step_was_skipped(opt)
    assert all(torch.isfinite(p).all() for p in ampx.master_params(opt))
