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
    assert model[0].weight is params["0.weight"][0]  # the model keeps its Parameter objects
    assert record.masters.master_of(model[0].weight).dtype == torch.float32
    record.undo()
    assert len(record.masters) == 0
    for name, p in model.named_parameters():
        assert p is params[name][0] and p.dtype == torch.float32
        assert torch.equal(p, params[name][1])
    assert all(b is buffers[n] for n, b in model.named_buffers())
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(a is b for a, b in zip(model[2]._flat_weights, model[2].parameters()))


# -- issue 9, item 5: O2 on a model that is already half ---------------------------------------

def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 8)).float().pow(2).mean()
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def test_o2_on_an_already_half_model_gets_fp32_masters(half_dtype: torch.dtype) -> None:
    half_model = _net().to(half_dtype)
    # the reference: the same (half-rounded) weights handed in as float32
    reference = _net().to(half_dtype).float()
    runs = []
    for model in (half_model, reference):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
        assert all(p.dtype == torch.float32 for p in ampx.master_params(opt))
        assert model[0].weight.dtype == half_dtype and model[1].weight.dtype == torch.float32
        assert model[1].running_mean.dtype == torch.float32  # kept batchnorm is fp32 again
        _train(model, opt)
        runs.append((model, opt))
    (model_a, opt_a), (model_b, opt_b) = runs
    for a, b in zip(ampx.master_params(opt_a), ampx.master_params(opt_b)):
        assert torch.equal(a, b)
    for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()):
        assert torch.equal(a, b)


def test_o2_half_model_rollback_restores_half_params(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _net().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    monkeypatch.setattr("ampx.initializer.attach", _raise)
    with pytest.raises(RuntimeError, match="injected"):
        ampx.initialize(model, opt, opt_level="O2", verbosity=0)
    for name, p in model.named_parameters():
        assert p is before[name][0] and p.dtype == torch.float16
        assert torch.equal(p, before[name][1])


def _raise(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected")


# -- issue 9, item 6: pickling, add_param_group, assign=True ----------------------------------

@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_initialized_model_can_be_pickled(level: str, half_dtype: torch.dtype) -> None:
    import io

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=half_dtype, verbosity=0)
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    x = torch.randn(4, 8)
    assert torch.equal(loaded(x), model(x)) and loaded(x).dtype == torch.float32
    # the copy has no masters of its own: its state dict is its own (fp32) weights
    assert all(v.dtype != half_dtype for v in loaded.state_dict().values())
    torch.testing.assert_close(loaded.state_dict()["0.weight"], model[0].weight.float())


def test_add_param_group_half_params_are_checkpointed_as_masters(half_dtype: torch.dtype) -> None:
    model = _net()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    assert model[3].weight.dtype == half_dtype  # not in the optimizer: cast, no master
    opt.add_param_group({"params": list(model[3].parameters())})
    _train(model, opt, steps=2)
    master = opt.param_groups[1]["params"][0]
    assert master.dtype == torch.float32 and not torch.equal(master, model[3].weight.float())
    state = model.state_dict()
    assert torch.equal(state["3.weight"], master)  # the master, not the rounded half copy
    new = torch.randn_like(master)
    state["3.weight"] = new
    model.load_state_dict(state)
    assert torch.equal(master, new)  # loading reaches the new group's master
    assert torch.equal(model[3].weight, new.to(half_dtype))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_load_state_dict_assign_keeps_the_cast_model_working(level: str,
                                                              half_dtype: torch.dtype) -> None:
    runs = []
    for assign in (False, True):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = ampx.initialize(model, opt, opt_level=level, dtype=half_dtype, verbosity=0)
        checkpoint = {k: torch.randn_like(v) if v.is_floating_point() else v
                      for k, v in _net(seed=5).state_dict().items()}
        params = list(model.parameters())
        model.load_state_dict(checkpoint, assign=assign)
        assert list(model.parameters()) == params  # the optimizer still steps these
        bn_dtype = torch.float32 if level == "O2" else half_dtype
        assert model[0].weight.dtype == half_dtype and model[1].weight.dtype == bn_dtype
        assert model[1].running_var.dtype == bn_dtype
        if level == "O2":
            assert torch.equal(next(iter(ampx.master_params(opt))), checkpoint["0.weight"])
        _train(model, opt, steps=2)
        runs.append(model.state_dict())
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_master_map_discard() -> None:
    from ampx.scaling.masters import MasterMap

    half, master = nn.Parameter(torch.zeros(2).half()), nn.Parameter(torch.zeros(2))
    masters = MasterMap()
    masters.add(half, master)
    assert masters.master_of(half) is master and len(masters) == 1
    masters.discard(half)
    masters.discard(half)  # a second discard is harmless
    assert masters.master_of(half) is None and len(masters) == 0
