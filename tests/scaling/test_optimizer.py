"""The optimizer stays itself: identity, class, state dicts, LR schedulers, fused/foreach, O2."""

from __future__ import annotations

import copy
import os
import sys

import _shared
import pytest
import torch
from torch import nn

import ampx


def mlp() -> nn.Module:
    return _shared.mlp(bn=True)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return _shared.batch(32, seed)


def step(model, opt, *, seed=1, overflow=False, set_to_none=True):
    x, y = batch(seed)
    opt.zero_grad(set_to_none=set_to_none)
    loss = nn.functional.mse_loss(model(x).float(), y)
    with ampx.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if overflow:
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
    opt.step()
    return loss.item()


def test_same_object_same_class_step_not_replaced(half_dtype):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn = type(opt).step
    model2, opt2 = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    assert opt2 is opt and model2 is model
    assert type(opt) is torch.optim.AdamW and isinstance(opt, torch.optim.AdamW)
    assert "step" not in vars(opt)
    assert type(opt).step is step_fn
    # zero_grad: the class's method is untouched; a small instance-level handler runs it and
    # then releases what ampx keeps for the update (the O2 half gradients)
    assert type(opt).zero_grad is torch.optim.Optimizer.zero_grad


def test_master_params_valid_right_after_initialize(half_dtype):
    model = mlp()
    originals = list(model.parameters())
    before = [o.detach().clone() for o in originals]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    masters = list(ampx.master_params(opt))
    split = [o.dtype == half_dtype for o in originals]
    # new fp32 masters for the half parameters (apex's way); fp32 batchnorm is stepped itself
    assert all((m is not o) == s for m, o, s in zip(masters, originals, split))
    assert all(m.dtype == torch.float32 for m in masters)
    # the model keeps the user's Parameter objects
    assert [id(p) for p in model.parameters()] == [id(o) for o in originals]
    assert all(torch.equal(m, b) for m, b in zip(masters, before))  # not rounded
    halves = [p for p in model.parameters() if p.dtype == half_dtype]
    assert len(halves) == 4  # the two Linear layers; batchnorm stays fp32
    assert isinstance(model[1].weight, nn.Parameter) and model[1].weight.dtype == torch.float32


def test_o2_many_steps_masters_fp32_model_half(half_dtype):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    for i in range(30):
        step(model, opt, seed=i)
    masters = list(ampx.master_params(opt))
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    pairs = opt._ampx.masters.pairs()
    assert len(pairs) == 4
    for half, master in pairs:
        assert half.dtype == half_dtype
        assert torch.equal(half, master.to(half_dtype))  # copied after every step
        assert half.grad is None
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for k, v in sd.items() if v.is_floating_point())
    for (name, _), master in zip(model.named_parameters(), masters):
        assert torch.equal(sd[name], master)  # lossless: the masters themselves


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_optimizer_state_dict_round_trip(level, half_dtype):
    def make():
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return ampx.Amp(level, dtype=half_dtype, verbosity=0).initialize(model, opt)

    model_a, opt_a = make()
    for i in range(3):
        step(model_a, opt_a, seed=i)
    model_b, opt_b = make()
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    model_b.load_state_dict(model_a.state_dict())
    assert opt_b.state_dict()["param_groups"] == opt_a.state_dict()["param_groups"]
    step(model_a, opt_a, seed=9)
    step(model_b, opt_b, seed=9)
    for p, q in zip(ampx.master_params(opt_a), ampx.master_params(opt_b)):
        assert torch.equal(p, q)


def test_state_and_scheduler_created_before_initialize_keep_driving_it(half_dtype):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x, y = batch()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # state created before initialize (fp32, keyed by the fp32 params)
    sched.step()
    model, opt2 = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0,
                                  init_scale=2.0**8)
    assert opt2 is opt
    for i in range(5):
        step(model, opt, seed=i, overflow=(i == 1))
        sched.step()
    assert sched.last_epoch == 6 and opt.param_groups[0]["lr"] == pytest.approx(0.00125)
    assert all(int(s["step"]) == 5 for s in opt.state.values())  # 6 steps, one skipped
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_scheduler_after_initialize_no_warning_even_if_first_step_skipped(level):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=torch.bfloat16,
                                 verbosity=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1))
    stepped = 0
    for i in range(4):  # filterwarnings=error turns any scheduler warning into a failure
        step(model, opt, seed=i, overflow=(i == 0))
        if not ampx.step_was_skipped(opt):  # gate the schedule on real steps
            sched.step()
            stepped += 1
    assert stepped == 3 and sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 4)
    assert opt._ampx.steps == 4 and opt._ampx.skipped_steps == 1


@pytest.mark.parametrize("kind", ["foreach", "fused", "single"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_and_foreach_optimizers(kind, level, half_dtype):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=kind == "foreach",
                            fused=True if kind == "fused" else None)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=half_dtype,
                                 loss_scale="dynamic", verbosity=0)
    losses = [step(model, opt, seed=0) for _ in range(5)]
    assert losses[-1] < losses[0]
    before = [p.detach().clone() for p in ampx.master_params(opt)]
    state = copy.deepcopy(opt.state_dict()["state"])
    step(model, opt, overflow=True)
    assert ampx.step_was_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, ampx.master_params(opt)))
    after = opt.state_dict()["state"]
    assert all(torch.equal(state[k][n], after[k][n]) for k in state for n in state[k])


def test_custom_optimizer_subclass_skips_too():
    class SignSGD(torch.optim.Optimizer):
        def __init__(self, params, lr=0.01):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-group["lr"])

    model = mlp()
    opt = SignSGD(model.parameters())
    model, opt = ampx.initialize(model, opt, opt_level="O2", verbosity=0)
    step(model, opt)
    before = [p.detach().clone() for p in ampx.master_params(opt)]
    step(model, opt, overflow=True)
    assert ampx.step_was_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, ampx.master_params(opt)))


def test_closure_runs_before_the_step_when_scaling():
    # (was: closures raised under loss scaling; tests/scaling/test_closure.py covers them in full)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", verbosity=0)
    ran = []
    assert opt.step(lambda: ran.append(1) or torch.tensor(0.0)).item() == 0.0
    assert ran == [1]


def test_closure_works_on_the_short_circuit_path():
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    model, opt = ampx.initialize(model, opt, opt_level="O0", verbosity=0)
    x, y = batch()

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    first = closure().item()
    opt.step(closure)
    assert closure().item() < first


def test_add_param_group_with_half_params(half_dtype):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD([model[0].weight, model[0].bias], lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=half_dtype, verbosity=0)
    assert model[3].weight.dtype == half_dtype  # cast, but without a master yet
    opt.add_param_group({"params": list(model[3].parameters()), "lr": 0.05})
    masters = list(ampx.master_params(opt))
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
    assert torch.equal(masters[2], model[3].weight.float())
    w = model[3].weight.detach().clone()
    step(model, opt)
    assert not torch.equal(w, model[3].weight)
    assert torch.equal(model[3].weight, masters[2].to(half_dtype))
    assert opt.param_groups[1]["lr"] == 0.05


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_zero_grad_with_and_without_set_to_none(level, half_dtype):
    """Each step sees only its own batch's gradient, whichever zero_grad is used."""
    def run(mode: str) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = ampx.Amp(level, dtype=half_dtype, verbosity=0,
                              init_scale=2.0**10).initialize(model, opt)
        seen: list[list[torch.Tensor]] = []
        opt.register_step_pre_hook(
            lambda o, a, k: seen.append([p.grad.clone() for p in ampx.master_params(o)]))
        for i in range(3):
            x, y = batch(i)
            if mode != "none":
                opt.zero_grad(set_to_none=mode == "to_none")
            with ampx.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
        return seen

    to_none, to_zero, never = run("to_none"), run("to_zero"), run("none")
    for a, b in zip(to_none, to_zero):
        assert all(torch.equal(g, h) for g, h in zip(a, b))
    assert all(torch.equal(g, h) for g, h in zip(to_none[0], never[0]))  # same first batch
    # without zero_grad the gradients accumulate: the check above can tell them apart
    assert not all(torch.equal(g, h) for g, h in zip(to_none[2], never[2]))


# -- skipped steps are a no-op for every optimizer (issue 9 item 4) ------------------------------

class NoGradCheckSGD(torch.optim.Optimizer):
    """Applies weight decay first, never checks `p.grad is None`, counts its calls."""

    def __init__(self, params, lr=0.01, wd=0.1):
        super().__init__(params, {"lr": lr, "wd": wd})
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 - group["lr"] * group["wd"])  # decoupled weight decay, unconditionally
                p.add_(p.grad, alpha=-group["lr"])  # crashes on grad=None
                self.state[p]["n"] = self.state[p].get("n", 0) + 1


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_skipped_step_is_a_noop_for_any_optimizer(level, half_dtype):
    torch.manual_seed(0)
    model = mlp()
    opt = NoGradCheckSGD(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # before initialize
    model, opt2 = ampx.initialize(model, opt, opt_level=level, dtype=half_dtype, verbosity=0,
                                  loss_scale="dynamic")
    assert opt2 is opt and type(opt) is NoGradCheckSGD
    step(model, opt)
    sched.step()
    before = [p.detach().clone() for p in ampx.master_params(opt)]
    model_before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    step(model, opt, overflow=True)
    sched.step()
    assert ampx.step_was_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, ampx.master_params(opt)))
    assert all(torch.equal(a, b) for a, b in zip(model_before, model.parameters()))
    after = opt.state_dict()
    assert after["state"] == state["state"] and opt.calls == 1
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.0025)
    step(model, opt)  # and the next step is a real one
    assert not ampx.step_was_skipped(opt) and opt.calls == 2


class RaisingSGD(torch.optim.SGD):
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(1.0)  # changes the params, then fails
        raise RuntimeError("optimizer failed")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_skipped_step_whose_optimizer_raises_changes_nothing(level, half_dtype):
    model = mlp()
    opt = RaisingSGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=half_dtype, verbosity=0,
                                 loss_scale="dynamic")
    x, y = batch()
    with ampx.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
        next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
    before = [p.detach().clone() for p in ampx.master_params(opt)]
    grads = [p.grad for p in ampx.master_params(opt)]
    with pytest.raises(RuntimeError, match="optimizer failed"):
        opt.step()  # skipped: runs on a stand-in, whose failure reaches nothing
    assert all(torch.equal(a, b) for a, b in zip(before, ampx.master_params(opt)))
    assert all(g is p.grad for g, p in zip(grads, ampx.master_params(opt)))
    assert opt._ampx.stage.value == "UNSCALED" and opt._ampx.steps == 0


# -- host syncs per step (issue 10: fused optimizers take the device flag) -----------------------

# ampx's own source directory: not any path containing "/ampx/" (a clone named ampx holds
# the venv, and so torch, under such a path too)
_AMPX_DIR = os.path.dirname(os.path.abspath(ampx.__file__)) + os.sep


def _count_syncs(monkeypatch, run):
    """(all host reads of a tensor's value, those made by ampx's own code) during `run`."""
    count = [0, 0]
    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, **kwargs):
            count[0] += 1
            count[1] += sys._getframe(1).f_code.co_filename.startswith(_AMPX_DIR)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    run()
    monkeypatch.undo()
    return tuple(count)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_host_syncs_per_step(level, fused, monkeypatch):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None,
                            foreach=None if fused else False)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=torch.float16, verbosity=0,
                                 loss_scale="dynamic", init_scale=2.0**8)
    x, y = batch()

    def one_step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    one_step()  # warm up (optimizer state creation)
    total, by_ampx = _count_syncs(monkeypatch, lambda: [one_step() for _ in range(3)])
    if fused:
        assert total == 0  # none at all: skip and unscale decided inside the fused kernel
    else:
        assert by_ampx == 3  # one per step (torch's own single-tensor AdamW reads `step`)
    step(model, opt, overflow=True)  # the fused kernel skips on the device flag
    assert ampx.step_was_skipped(opt) and opt._ampx.skipped_steps == 1


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad])
def test_other_fused_optimizers_skip_without_a_sync(cls, monkeypatch):
    model = mlp()
    opt = cls(model.parameters(), lr=1e-2, fused=True)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0,
                                 loss_scale="dynamic", init_scale=2.0**8)
    step(model, opt)
    before = [p.detach().clone() for p in ampx.master_params(opt)]
    state = copy.deepcopy(opt.state_dict()["state"])
    x, y = batch()

    def poisoned_step():
        opt.zero_grad()
        with ampx.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
        opt.step()

    total, _ = _count_syncs(monkeypatch, poisoned_step)
    assert total == 0
    assert all(torch.equal(a, b) for a, b in zip(before, ampx.master_params(opt)))
    after = opt.state_dict()["state"]
    assert all(torch.equal(torch.as_tensor(state[k][n]), torch.as_tensor(after[k][n]))
               for k in state for n in state[k])
    assert ampx.step_was_skipped(opt)
