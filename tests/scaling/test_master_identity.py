"""O2's identity model: the model keeps its Parameters; fp32 masters follow it until first used.

apex kept the model's Parameter objects and made the masters lazily, from the model, at the
first backward. ampx makes them at initialize (full float32, no rounding) and, until they are
first used, lets them follow any write into the model (DDP's broadcast, a copy on one rank);
loads reach the masters directly (issue 22 items 4-5, issue 23 item 1).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampx


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 1) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    with ampx.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()


def test_hooks_registered_before_initialize_keep_firing(half_dtype: torch.dtype) -> None:
    model = _net()
    weight = model[0].weight
    seen: list[torch.dtype] = []
    accumulated: list[torch.dtype] = []
    weight.register_hook(lambda g: seen.append(g.dtype))
    weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    assert model[0].weight is weight and weight.dtype == half_dtype  # same object, cast
    for seed in range(2):
        _step(model, opt, seed)
    assert seen == accumulated == [half_dtype, half_dtype]


def test_untouched_masters_keep_full_precision(half_dtype: torch.dtype) -> None:
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    _step(model, opt)
    assert all(torch.equal(m, b) for m, b in zip(ampx.master_params(opt), before))


@pytest.mark.parametrize("how", ["copy_", "data"])
def test_masters_follow_writes_into_the_model_until_first_used(
        half_dtype: torch.dtype, how: str) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    rank0 = _net(seed=5)  # what DDP's broadcast would write
    written = model[0].weight
    with torch.no_grad():
        value = rank0[0].weight.to(half_dtype)
        written.copy_(value) if how == "copy_" else written.data.copy_(value)
    untouched = [m.detach().clone() for m in ampx.master_params(opt)][1:]
    _step(model, opt)  # the first backward fixes the masters
    masters = list(ampx.master_params(opt))
    assert torch.equal(masters[0], value.float())
    assert all(torch.equal(m, u) for m, u in zip(masters[1:], untouched))
    with torch.no_grad():  # after first use the model no longer leads
        written.add_(1.0)
    _step(model, opt)
    assert torch.equal(masters[0], value.float())


def test_load_between_initialize_and_first_step_reaches_the_masters(
        half_dtype: torch.dtype) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    checkpoint = _net(seed=9).state_dict()
    model.load_state_dict(checkpoint)
    _step(model, opt)
    masters = list(ampx.master_params(opt))
    assert all(torch.equal(m, checkpoint[k]) for m, k in
               zip(masters, ["0.weight", "0.bias", "2.weight", "2.bias"]))  # not rounded


def test_masters_copied_after_apex_lazy_init_survive_a_later_broadcast(
        half_dtype: torch.dtype) -> None:
    """NVIDIA's BERT resume: lazy init, copy saved masters in, then wrap in DDP."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    saved = [p.detach().clone() for p in _net(seed=3).parameters()]
    opt._lazy_init_maybe_master_weights()
    opt._amp_stash.lazy_init_called = True
    for master, value in zip(ampx.master_params(opt), saved):
        master.data.copy_(value)
    with torch.no_grad():  # DDP's broadcast (rank 0's half weights)
        for param, value in zip(model.parameters(), saved):
            param.copy_(value)
    _step(model, opt)
    assert all(torch.equal(m, s) for m, s in zip(ampx.master_params(opt), saved))


def test_optimizer_state_loaded_before_initialize_moves_to_the_masters(
        half_dtype: torch.dtype) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _net(seed=2)  # unrelated
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    masters = list(ampx.master_params(opt))
    assert all(p not in opt.state for p in model.parameters())
    assert all(torch.equal(opt.state[m]["momentum_buffer"], b) for m, b in zip(masters, buffers))


def test_submodule_attached_after_initialize_saves_and_loads_its_master(
        half_dtype: torch.dtype) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    torch.manual_seed(4)
    head = nn.Linear(2, 2)
    full = {k: v.clone() for k, v in head.state_dict().items()}
    model.add_module("head", head.to(half_dtype))  # already half, as a script would make it
    opt.add_param_group({"params": head.parameters()})
    _step(model, opt)
    state = model.state_dict()
    master = ampx.master_params(opt)[-2]
    assert state["head.weight"].dtype == torch.float32 and torch.equal(state["head.weight"],
                                                                        master)
    checkpoint = dict(state, **{f"head.{k}": v for k, v in full.items()})
    model.load_state_dict(checkpoint)
    assert torch.equal(ampx.master_params(opt)[-2], full["weight"])  # the master, unrounded
    assert torch.equal(model.state_dict()["head.weight"], full["weight"])


def test_state_dict_before_first_use_does_not_stop_the_follow(half_dtype: torch.dtype) -> None:
    """A rank-0-only `model.state_dict()` between initialize and DDP's wrap must not freeze
    rank 0's masters (the other ranks would still follow the broadcast)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    before = model.state_dict()["0.weight"].clone()
    assert torch.equal(before, ampx.master_params(opt)[0])  # full precision
    value = _net(seed=5)[0].weight.detach().to(half_dtype)
    with torch.no_grad():
        model[0].weight.copy_(value)  # the broadcast, after that state dict
    assert torch.equal(model.state_dict()["0.weight"], value.float())
    _step(model, opt)
    assert torch.equal(ampx.master_params(opt)[0], value.float())
