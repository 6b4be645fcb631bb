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


def test_the_step_copy_invalidates_graphs_that_saved_the_half_weights(
        backend: str, half_dtype: torch.dtype) -> None:
    """The master -> model copy writes the model's Parameters as an in-place op does: a graph
    that saved them before `step` refuses to backward after it, as plain torch's (issue 39
    item 3: the native copy wrote through raw pointers and left the version counters be, so
    such a backward mixed the new weights with the old activations)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    _step(model, opt)
    held = model(torch.randn(3, 4)).float().pow(2).sum()  # saves the half weights
    before = [p._version for p in model.parameters()]
    _step(model, opt, seed=2)
    assert all(p._version > v for p, v in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        held.backward()


class _GraphWatch(torch.overrides.TorchFunctionMode):
    """The torch calls that left a tensor with an autograd node among their arguments or
    results (in-place calls leave it on their arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        stack = [args, kwargs or {}, out]
        while stack:
            value = stack.pop()
            if isinstance(value, torch.Tensor):
                if value.grad_fn is not None:
                    self.recorded.append(getattr(func, "__name__", repr(func)))
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, dict):
                stack.extend(value.values())
        return out


def test_the_step_records_no_autograd_graph(backend: str, half_dtype: torch.dtype) -> None:
    """torch runs step hooks outside the optimizer's `no_grad`, and the masters require grad:
    ampx's part of `step` records nothing (issue 39 item 4: the reference copy recorded one
    node per tensor, each saving the whole list, so 10k parameters took GBs and seconds;
    `benchmarks/bench_many_params.py` measures it)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0,
                                 loss_scale=128.0)  # the step runs (is not skipped)
    with ampx.scale_loss(model(torch.randn(2, 3)).float().sum(), opt) as scaled:
        scaled.backward()
    masters = [p for group in opt.param_groups for p in group["params"]]
    with _GraphWatch() as watch:
        opt.step()
    assert watch.recorded == []
    for master, param in zip(masters, model.parameters()):
        assert param.is_leaf and torch.equal(param, master.detach().to(half_dtype))
