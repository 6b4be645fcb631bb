"""ampx under HF Accelerate (CPU, one process): `attach` and Accelerate's own loop.

The loop of Accelerate's docs plus `attach` (docs/accelerate.md's one way) is compared bit for
bit with the earlier `prepare` + `scale_loss` loop (still supported) and with ampx by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _shared import fresh_accelerate_state  # noqa: F401  (autouse)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampx
from ampx import frontend

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from ampx.integrations.accelerate import AmpxAccelerator, attach, prepare  # noqa: E402


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 4, (40,), generator=g))
    return DataLoader(data, batch_size=8, shuffle=False)


def setup(level: str = "O2", dtype: str = "fp16") -> tuple[Any, ...]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    accelerator = accelerate.Accelerator(cpu=True)
    return (accelerator, *prepare(accelerator, model, opt, sched, loader(), opt_level=level,
                                  dtype=dtype))


def setup_attached(level: str = "O2", dtype: str = "fp16") -> tuple[Any, ...]:
    """docs/accelerate.md's way: `attach`, then everything through `accelerator.prepare`."""
    accelerator = attach(accelerate.Accelerator(cpu=True), opt_level=level, dtype=dtype)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, opt, sched, loader()))


def accelerate_loop(accelerator: Any, model: nn.Module, opt: Any, sched: Any, data: Any,
                    overflow_at: int | None = None) -> list[tuple[bool, float, float]]:
    """Accelerate's loop as its docs write it, no ampx call. Per step: (skipped, LR, norm)."""
    out = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        accelerator.backward(loss * float("inf") if i == overflow_at else loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        out.append((accelerator.optimizer_step_was_skipped, sched.get_last_lr()[0], float(norm)))
    return out


def train(accelerator: Any, model: nn.Module, opt: Any, sched: Any, data: Any,
          overflow_at: int | None = None, clip: float | None = None) -> list[tuple[bool, float]]:
    """The earlier `prepare` loop (scale_loss by hand; clips the masters when `clip`).
    Per step: (accelerator.optimizer_step_was_skipped, the scheduler's LR after it)."""
    out = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        if i == overflow_at:
            loss = loss * float("inf")
        with ampx.scale_loss(loss, opt) as scaled:  # the AcceleratedOptimizer itself
            accelerator.backward(scaled)
        if clip is not None:
            accelerator.clip_grad_norm_(ampx.master_params(opt), clip)
        opt.step()
        sched.step()
        out.append((accelerator.optimizer_step_was_skipped, sched.get_last_lr()[0]))
    return out


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def by_hand(level: str, dtype: str, overflow_at: int | None = None
            ) -> tuple[list[torch.Tensor], list[float]]:
    """ampx alone: initialize, scale_loss, clip the masters, hold the scheduler after a skip.
    Returns the final weights and each step's gradient norm."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    norms = []
    for i, (x, y) in enumerate(loader()):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with ampx.scale_loss(loss * float("inf") if i == overflow_at else loss, opt) as scaled:
            scaled.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ampx.master_params(opt), 0.5)))
        opt.step()
        if not ampx.step_was_skipped(opt):
            sched.step()
        model.zero_grad()
    out = weights(model)
    ampx.restore()
    return out, norms


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skipped_step_is_reported_and_does_not_step_the_scheduler(level: str) -> None:
    accelerator, model, opt, sched, data = setup(level)
    assert type(opt).__name__ == "AmpxAcceleratedOptimizer" and opt.optimizer._ampx
    steps = train(accelerator, model, opt, sched, data, overflow_at=2)
    assert [skipped for skipped, _ in steps] == [False, False, True, False, False]
    lrs = [lr for _, lr in steps]
    assert lrs == [0.05, 0.025, 0.025, 0.0125, 0.00625]  # unchanged on the skipped step
    assert ampx.step_was_skipped(opt) is False and opt.optimizer._ampx.skipped_steps == 1


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accelerates_own_loop_with_attach_trains_as_the_prepare_loop(level: str, dtype: str
                                                                     ) -> None:
    accelerator, model, opt, sched, data = setup_attached(level, dtype)
    assert type(accelerator) is AmpxAccelerator and accelerator.mixed_precision == "no"
    assert type(opt).__name__ == "AmpxAcceleratedOptimizer"
    steps = accelerate_loop(accelerator, model, opt, sched, data, overflow_at=2)
    got = weights(model)
    assert [skipped for skipped, _, _ in steps] == [False, False, True, False, False]
    assert [lr for _, lr, _ in steps] == [0.05, 0.025, 0.025, 0.0125, 0.00625]
    assert opt.optimizer._ampx.skipped_steps == 1
    assert (model[0].weight.dtype == torch.float32) == (level == "O1")
    ampx.restore()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    accelerator, model, opt, sched, data = setup(level, dtype)  # the earlier way
    assert type(accelerator) is AmpxAccelerator
    assert train(accelerator, model, opt, sched, data, overflow_at=2, clip=0.5) == [
        (skipped, lr) for skipped, lr, _ in steps]
    assert all(torch.equal(a, b) for a, b in zip(got, weights(model)))
    ampx.restore()

    want, want_norms = by_hand(level, dtype, overflow_at=2)
    norms = [norm for _, _, norm in steps]
    assert norms[:2] == want_norms[:2] and norms[3:] == want_norms[3:]  # step 2: inf/NaN
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("level, dtype", [("O1", "fp16"), ("O2", "fp16"), ("O2", "bf16")])
def test_gradient_accumulation_with_accelerates_accumulate(level: str, dtype: str) -> None:
    accelerator = attach(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2),
                         opt_level=level, dtype=dtype)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched, data = accelerator.prepare(model, opt, sched, loader())
    skipped = []
    for i, (x, y) in enumerate(data):  # 5 batches: steps after 1, 3 (inf at 2: skipped), 4
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x).float(), y)
            accelerator.backward(loss * float("inf") if i == 2 else loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
            skipped.append(accelerator.optimizer_step_was_skipped)
    got, lr = weights(model), sched.get_last_lr()
    assert skipped == [False, False, False, True, False] and lr == [0.025]
    ampx.restore()

    # by hand: each micro-batch's loss halved in its own scale_loss, one step per two
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    for i, (x, y) in enumerate(loader()):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with ampx.scale_loss((loss * float("inf") if i == 2 else loss) / 2, opt) as scaled:
            scaled.backward()
        if i in (1, 3, 4):
            torch.nn.utils.clip_grad_norm_(ampx.master_params(opt), 0.5)
            opt.step()
            if not ampx.step_was_skipped(opt):
                sched.step()
            opt.zero_grad()
    assert sched.get_last_lr() == lr
    assert all(torch.equal(a, b) for a, b in zip(got, weights(model)))


def test_training_matches_the_hand_written_loop() -> None:
    accelerator, model, opt, sched, data = setup("O2", "bf16")
    train(accelerator, model, opt, sched, data)
    got = weights(model)
    ampx.restore()

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = ampx.initialize(model, opt, opt_level="O2", dtype="bf16", verbosity=0)
    for x, y in loader():
        opt.zero_grad()
        with ampx.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
    assert all(torch.equal(a, b) for a, b in zip(got, weights(model)))


def test_accelerated_optimizer_is_accepted_everywhere() -> None:
    accelerator, model, opt, sched, data = setup("O2")
    assert ampx.master_params(opt) == ampx.master_params(opt.optimizer)
    assert all(p.dtype == torch.float32 for p in ampx.master_params(opt))
    train(accelerator, model, opt, sched, data, overflow_at=4)
    assert ampx.step_was_skipped(opt)
    assert ampx.last_overflow(opt) is ampx.last_overflow(opt.optimizer)


def test_save_state_load_state_resume_bit_for_bit_with_the_loss_scale(tmp_path: Path) -> None:
    # 3 steps, a skip at step 0 (fp16: the scale halves), save; then 2 more steps
    accelerator, model, opt, sched, data = setup_attached("O2", "fp16")
    batches = list(data)
    accelerate_loop(accelerator, model, opt, sched, batches[:3], overflow_at=0)
    assert frontend.default_session().loss_scale() == 2.0**15
    accelerator.save_state(tmp_path / "state")
    accelerate_loop(accelerator, model, opt, sched, batches[3:])
    want, want_lr = weights(model), sched.get_last_lr()
    ampx.restore()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    torch.manual_seed(5)
    accelerator, model, opt, sched, data = setup_attached("O2", "fp16")
    assert frontend.default_session().loss_scale() == 2.0**16
    accelerator.load_state(tmp_path / "state")
    assert frontend.default_session().loss_scale() == 2.0**15
    accelerate_loop(accelerator, model, opt, sched, list(data)[3:])
    assert sched.get_last_lr() == want_lr
    assert all(torch.equal(a, b) for a, b in zip(weights(model), want))


def test_save_state_and_load_state_carry_the_loss_scaler(tmp_path: Path) -> None:
    accelerator, model, opt, sched, data = setup("O2")
    train(accelerator, model, opt, sched, data, overflow_at=0)
    scale = frontend.default_session().loss_scale()
    assert scale == 2.0**15  # one skip halved it
    accelerator.save_state(tmp_path / "state")
    want = weights(model)
    ampx.restore()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    torch.manual_seed(5)
    accelerator, model, opt, sched, data = setup("O2")
    assert frontend.default_session().loss_scale() == 2.0**16
    accelerator.load_state(tmp_path / "state")
    assert frontend.default_session().loss_scale() == scale
    assert all(torch.equal(a, b) for a, b in zip(weights(model), want))


def test_the_prepared_optimizers_state_dict_carries_the_loss_scale() -> None:
    accelerator, model, opt, sched, data = setup_attached("O2", "fp16")
    accelerate_loop(accelerator, model, opt, sched, data, overflow_at=0)
    saved = opt.state_dict()
    assert saved["ampx"] == frontend.default_session().state_dict()
    assert saved["ampx"]["loss_scaler0"]["loss_scale"] == 2.0**15
    ampx.restore()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    accelerator, model, opt, sched, data = setup_attached("O2", "fp16")
    session = frontend.default_session()
    bad = dict(saved, state={}, param_groups=[])  # the optimizer's part is refused
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert session.loss_scale() == 2.0**16  # ... and the loss scale put back
    with pytest.raises(ampx.CheckpointError):
        opt.load_state_dict(dict(saved, ampx={"loss_scaler0": {"loss_scale": "x"}}))
    assert session.loss_scale() == 2.0**16
    opt.load_state_dict({k: v for k, v in saved.items() if k != "ampx"})  # a plain optimizer's
    assert session.loss_scale() == 2.0**16
    opt.load_state_dict(saved)
    assert session.loss_scale() == 2.0**15
    assert opt.optimizer.state_dict()["state"].keys() == saved["state"].keys()


@pytest.mark.parametrize("mixed", ["bf16", "fp16"])
def test_accelerates_own_mixed_precision_is_refused(mixed: str) -> None:
    model = mlp()
    before = weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed)
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        prepare(accelerator, model, opt, opt_level="O1", dtype="bf16")
    assert frontend.default_session() is None and not hasattr(opt, "_ampx")
    assert all(torch.equal(a, b) for a, b in zip(weights(model), before))


def drive_like_a_trainer(accelerator: Any, level: str, overflow_at: int | None = None
                         ) -> tuple[nn.Module, list[tuple[bool, float]], list[float]]:
    """The calls the transformers 5 Trainer makes on its Accelerator, and no ampx call."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepared, opt = accelerator.prepare(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    steps, norms = [], []
    for i, (x, y) in enumerate(accelerator.prepare(loader())):
        loss = nn.functional.cross_entropy(prepared(x).float(), y)
        accelerator.backward(loss * float("inf") if i == overflow_at else loss)
        norms.append(float(accelerator.clip_grad_norm_(prepared.parameters(), 0.5)))
        opt.step()
        if not accelerator.optimizer_step_was_skipped:
            sched.step()
        prepared.zero_grad()
        steps.append((accelerator.optimizer_step_was_skipped, sched.get_last_lr()[0]))
    return model, steps, norms


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_attached_accelerator_runs_ampx_in_its_own_calls(level: str) -> None:
    accelerator = attach(accelerate.Accelerator(cpu=True), opt_level=level, dtype="fp16")
    assert type(accelerator) is AmpxAccelerator
    model, steps, norms = drive_like_a_trainer(accelerator, level, overflow_at=2)
    got = weights(model)
    assert [skipped for skipped, _ in steps] == [False, False, True, False, False]
    assert [lr for _, lr in steps] == [0.05, 0.025, 0.025, 0.0125, 0.00625]
    assert frontend.default_session().loss_scale() == 2.0**15
    ampx.restore()

    want, want_norms = by_hand(level, "fp16", overflow_at=2)
    assert norms[:2] == want_norms[:2] and norms[3:] == want_norms[3:]  # step 2: inf/NaN
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_attached_accelerator_prepares_models_alone_and_loaders_as_accelerate() -> None:
    accelerator = attach(accelerate.Accelerator(cpu=True), opt_level="O2", dtype="bf16")
    model = mlp()
    accelerator.prepare(model)  # an evaluation before training: nothing to initialize
    assert model[0].weight.dtype == torch.float32 and frontend.default_session() is None
    loss = nn.functional.cross_entropy(model(torch.randn(2, 8)), torch.tensor([0, 1]))
    accelerator.backward(loss)
    assert model[0].weight.grad is not None  # Accelerate's backward, unscaled
    with pytest.raises(ValueError, match="without its model"):
        accelerator.prepare(torch.optim.SGD(mlp().parameters(), lr=0.1))


def test_attach_refuses_what_it_cannot_take_over() -> None:
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        attach(accelerate.Accelerator(cpu=True, mixed_precision="bf16"), opt_level="O1")
    AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.prepare(mlp())
    with pytest.raises(ValueError, match="before it prepared a model"):
        attach(accelerator, opt_level="O1")
    assert type(accelerator) is accelerate.Accelerator
    AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True)
    with pytest.raises(ampx.OptionError, match="optimization level O4"):
        attach(accelerator, opt_level="O4")  # now, not at the Trainer's first prepare
    assert type(accelerator) is accelerate.Accelerator and frontend.default_session() is None
