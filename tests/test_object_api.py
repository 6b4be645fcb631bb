"""The object API: several `ampx.Amp` sessions in one process, and the module functions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampx
from ampx import frontend
from ampx.o1 import patch


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(amp: ampx.Amp, model: nn.Module, opt: torch.optim.Optimizer,
               poison: bool = False) -> None:
    opt.zero_grad()
    loss = model(torch.randn(8, 4)).float().pow(2).mean()
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def test_two_o2_sessions_keep_separate_scale_trajectories() -> None:
    amp_a = ampx.Amp(opt_level="O2", init_scale=2.0**10, growth_interval=2, verbosity=0)
    amp_b = ampx.Amp(opt_level="O2", init_scale=2.0**6, growth_interval=3, verbosity=0)
    model_a, opt_a = amp_a.initialize(*make(0))
    model_b, opt_b = amp_b.initialize(*make(1))
    trajectory_a, trajectory_b = [], []
    for step in range(6):
        train_step(amp_a, model_a, opt_a, poison=step == 1)
        train_step(amp_b, model_b, opt_b, poison=step == 4)
        trajectory_a.append(amp_a.loss_scale())
        trajectory_b.append(amp_b.loss_scale())
    assert trajectory_a == [2.0**10, 2.0**9, 2.0**9, 2.0**10, 2.0**10, 2.0**11]
    assert trajectory_b == [2.0**6, 2.0**6, 2.0**7, 2.0**7, 2.0**6, 2.0**6]
    assert [amp_a.step_was_skipped(opt_a), amp_b.step_was_skipped(opt_b)] == [False, False]
    assert opt_a._ampx.skipped_steps == 1 and opt_b._ampx.skipped_steps == 1
    assert amp_a.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**11
    assert amp_b.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**6
    # each optimizer belongs to its own session
    with pytest.raises(ValueError, match="another Amp session"):
        with amp_a.scale_loss(torch.ones(()), opt_b):
            pass


def test_sessions_load_state_independently() -> None:
    amp_a = ampx.Amp(opt_level="O2", init_scale=8.0, verbosity=0)
    amp_b = ampx.Amp(opt_level="O2", init_scale=8.0, verbosity=0)
    amp_a.initialize(*make(0))
    amp_b.initialize(*make(1))
    amp_a.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 5}})
    assert amp_a.loss_scale() == 2.0 and amp_b.loss_scale() == 8.0


def test_a_second_o1_session_takes_over_the_patches() -> None:
    x = torch.randn(3, 3)
    amp_1 = ampx.Amp(opt_level="O1", verbosity=0)
    amp_1.initialize(*make(0))
    first = patch.active()
    assert torch.mm(x, x).dtype == torch.float16
    amp_2 = ampx.Amp(opt_level="O1", dtype="bf16", verbosity=0)
    amp_2.initialize(*make(1))
    second = patch.active()
    assert second is not None and second is not first
    assert torch.mm(x, x).dtype == torch.bfloat16  # the newer session's casts
    amp_1.restore()  # the older session no longer owns the patches: nothing happens
    assert patch.active() is second and torch.mm(x, x).dtype == torch.bfloat16
    amp_2.restore()
    assert patch.active() is None and torch.mm(x, x).dtype == torch.float32


def test_o2_session_next_to_an_o1_session() -> None:
    amp_1 = ampx.Amp(opt_level="O1", verbosity=0)
    model_1, opt_1 = amp_1.initialize(*make(0))
    amp_2 = ampx.Amp(opt_level="O2", verbosity=0)
    model_2, opt_2 = amp_2.initialize(*make(1))
    train_step(amp_1, model_1, opt_1)
    train_step(amp_2, model_2, opt_2)
    assert next(model_2.parameters()).dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in ampx.master_params(opt_2))
    assert all(p.dtype == torch.float32 for p in model_1.parameters())


def test_module_functions_are_a_default_instance() -> None:
    assert frontend.default_session() is None
    model, opt = ampx.initialize(*make(0), opt_level="O2", verbosity=0, init_scale=4.0)
    session = frontend.default_session()
    assert isinstance(session, ampx.Amp) and opt._ampx.owner is session
    with ampx.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert ampx.state_dict() == session.state_dict()
    # an object session does not replace the default one
    ampx.Amp(opt_level="O2", verbosity=0).initialize(*make(1))
    assert frontend.default_session() is session


def test_initialize_once_per_session() -> None:
    amp = ampx.Amp(opt_level="O2", verbosity=0)
    amp.initialize(*make(0))
    with pytest.raises(RuntimeError, match="already initialized"):
        amp.initialize(*make(1))


def test_module_level_initialize_rebuilds_apex_global_scaler_list() -> None:
    """apex: `loss_id` indexes one global list that every `amp.initialize` rebuilds."""
    model_1, opt_1 = ampx.initialize(*make(0), opt_level="O1", num_losses=2, verbosity=0)
    opt_1.zero_grad()
    loss = model_1(torch.randn(8, 4)).float().pow(2).mean() * float("inf")
    with ampx.scale_loss(loss, opt_1, loss_id=0) as scaled:
        scaled.backward()
    opt_1.step()  # skipped: scaler 0 backs off
    assert ampx.amp._amp_state.loss_scalers[0].loss_scale() == 32768.0
    first_list = ampx.amp._amp_state.loss_scalers
    ampx.initialize(*make(1), opt_level="O1", verbosity=0)
    scalers = ampx.amp._amp_state.loss_scalers
    assert scalers is first_list and len(scalers) == 1  # one list, refilled
    # the FIRST model's optimizer now uses the fresh scaler 0, as with apex
    opt_1.zero_grad()
    loss = model_1(torch.randn(8, 4)).float().pow(2).mean()
    with ampx.scale_loss(loss, opt_1, loss_id=0) as scaled:
        assert scaled.item() == pytest.approx(loss.item() * 65536.0)
        scaled.backward()
    opt_1.step()
    assert not ampx.step_was_skipped(opt_1)
    with pytest.raises(IndexError, match="loss_id=1 but num_losses=1"):
        with ampx.scale_loss(loss, opt_1, loss_id=1):
            pass
    assert ampx.state_dict() == {"loss_scaler0": scalers[0].state_dict()}


def test_disabled_module_level_initialize_keeps_the_scalers() -> None:
    ampx.initialize(*make(0), opt_level="O2", verbosity=0, init_scale=8.0)
    scaler = ampx.amp._amp_state.loss_scalers[0]
    ampx.initialize(*make(1), enabled=False)
    assert ampx.amp._amp_state.loss_scalers == [scaler]


def test_object_sessions_keep_their_own_scalers_beside_module_level_ones() -> None:
    amp = ampx.Amp(opt_level="O2", init_scale=4.0, verbosity=0)
    amp.initialize(*make(0))
    ampx.initialize(*make(1), opt_level="O2", verbosity=0)
    ampx.initialize(*make(2), opt_level="O2", init_scale=2.0, verbosity=0)
    assert amp.loss_scale() == 4.0 and amp.scalers is not ampx.amp._amp_state.loss_scalers
    assert ampx.amp._amp_state.loss_scalers[0].loss_scale() == 2.0


def test_package_names_load_lazily_in_a_fresh_process() -> None:
    import subprocess
    import sys

    code = ("import sys, ampx; assert 'torch' not in sys.modules and 'ampx.frontend' not in "
            "sys.modules; from ampx import amp, Amp; import ampx.frontend as f; "
            "assert Amp is f.Amp and amp.initialize is ampx.initialize; "
            "assert sorted(ampx.__all__) == sorted(ampx._exports()); "
            "assert all(getattr(ampx, n) is not None for n in ampx.__all__); "
            "assert set(ampx.__all__) <= set(dir(ampx))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ampx.nothing  # noqa: B018
