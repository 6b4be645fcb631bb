"""The fairseq-style optimizer wrapper (AmpOptimizer) and the example trainer."""

from __future__ import annotations

import copy
import logging
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.compat.fairseq.optimizer import AmpOptimizer

REPO = pathlib.Path(__file__).resolve().parents[2]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def data(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).sum()


def build(opt_level: str = "O2", optimizer: Callable = torch.optim.SGD, seed: int = 0,
          wrapper_kwargs: dict | None = None, **amp_kwargs: object
          ) -> tuple[ampx.Amp, nn.Module, AmpOptimizer]:
    model = make_model(seed)
    opt = optimizer(model.parameters(), lr=0.1)
    amp_kwargs.setdefault("init_scale", 2.0**8)  # the tiny losses here never overflow at it
    amp = ampx.Amp(opt_level=opt_level, verbosity=0, **amp_kwargs)  # type: ignore[arg-type]
    model, opt = amp.initialize(model, opt)
    return amp, model, AmpOptimizer(opt, amp, **(wrapper_kwargs or {}))


def update(model: nn.Module, wrapper: AmpOptimizer, x: torch.Tensor, y: torch.Tensor,
           update_freq: int = 1, clip: float = 0.0, poison: bool = False) -> torch.Tensor:
    """One fairseq-style update; returns the grad norm (raises like the wrapper)."""
    wrapper.zero_grad()
    for chunk_x, chunk_y in zip(x.chunk(update_freq), y.chunk(update_freq)):
        loss = loss_fn(model, chunk_x, chunk_y)
        wrapper.backward(loss * float("inf") if poison else loss)
    wrapper.multiply_grads(1.0 / len(x))
    norm = wrapper.clip_grad_norm(clip)
    wrapper.step()
    return norm


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.state_dict().values()]


# -- surface -------------------------------------------------------------------------------------

def test_surface() -> None:
    amp, model, wrapper = build("O2")
    assert wrapper.optimizer is amp.optimizers[0]
    assert wrapper.param_groups is wrapper.optimizer.param_groups
    assert all(p.dtype == torch.float32 for p in wrapper.params)  # the masters
    assert wrapper.scaler is amp.scalers[0] and wrapper.loss_scale == 2.0**8
    wrapper.set_lr(0.5)
    assert wrapper.get_lr() == 0.5 and all(g["lr"] == 0.5 for g in wrapper.param_groups)
    assert not wrapper.supports_groups and not wrapper.supports_step_with_scale
    assert "AmpOptimizer(SGD" in repr(wrapper)


def test_construction_errors() -> None:
    model = make_model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="Amp.initialize"):
        AmpOptimizer(plain)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        AmpOptimizer(object())  # type: ignore[arg-type]
    amp, _, wrapper = build("O2")
    with pytest.raises(ValueError, match="another Amp session"):
        AmpOptimizer(wrapper.optimizer, ampx.Amp(opt_level="O2"))
    with pytest.raises(ValueError, match="loss_id"):
        AmpOptimizer(wrapper.optimizer, loss_id=1)
    with pytest.raises(ValueError, match="tolerance"):
        AmpOptimizer(wrapper.optimizer, tolerance=-1)
    with pytest.raises(ValueError, match="closures"):
        wrapper.step(closure=lambda: None)
    with pytest.raises(ValueError, match="groups"):
        wrapper.step(groups={"default"})


def test_backward_after_the_check_is_an_error() -> None:
    _, model, wrapper = build("O2")
    x, y = data()
    wrapper.backward(loss_fn(model, x, y))
    wrapper.clip_grad_norm(0.0)
    with pytest.raises(RuntimeError, match="call step"):
        wrapper.backward(loss_fn(model, x, y))
    wrapper.zero_grad()
    wrapper.backward(loss_fn(model, x, y))  # fine again


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_clip_grad_norm_equals_torch(opt_level: str) -> None:
    """The norm and the clipped gradients equal torch.nn.utils.clip_grad_norm_'s."""
    def run(clip: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        _, model, wrapper = build(opt_level)
        seen: list[torch.Tensor] = []
        wrapper.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: seen.extend(_grad(p).clone() for p in wrapper.params))
        x, y = data()
        norm = update(model, wrapper, x, y, update_freq=2, clip=clip)
        return norm, seen

    norm_free, grads = run(0.0)
    max_norm = float(norm_free) / 3
    norm, clipped = run(max_norm)
    ref = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(ref, grads):
        param.grad = grad.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    torch.testing.assert_close(norm, ref_norm)
    torch.testing.assert_close(norm_free, ref_norm)
    for got, param in zip(clipped, ref):
        torch.testing.assert_close(got, param.grad)


def test_clip_grad_norm_aggregate_fn() -> None:
    _, model, wrapper = build("O2")
    x, y = data()
    wrapper.backward(loss_fn(model, x, y))
    local = wrapper.clip_grad_norm(0.0)
    wrapper.zero_grad()
    wrapper.backward(loss_fn(model, x, y))
    total = wrapper.clip_grad_norm(0.0, aggregate_norm_fn=lambda n: n * 2)
    torch.testing.assert_close(total, local * 2)


# -- exceptions -----------------------------------------------------------------------------------

def test_overflow_error_skips_the_update() -> None:
    amp, model, wrapper = build("O2", init_scale=2.0**10)
    x, y = data()
    update(model, wrapper, x, y)
    before = params_of(model)
    masters = [p.detach().clone() for p in wrapper.params]
    with pytest.raises(OverflowError, match="setting loss scale to: 512.0"):
        update(model, wrapper, x, y, update_freq=2, poison=True)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model)))
    assert all(torch.equal(a, b) for a, b in zip(masters, wrapper.params))
    assert all(p.grad is None for p in wrapper.params)
    assert amp.step_was_skipped(wrapper.optimizer) and wrapper.skipped_steps == 1
    wrapper.zero_grad()  # fairseq's trainer does this, then carries on
    update(model, wrapper, x, y)
    assert not amp.step_was_skipped(wrapper.optimizer)
    assert not all(torch.equal(a, b) for a, b in zip(before, params_of(model)))
    assert wrapper.steps == 3 and wrapper.loss_scale == 512.0


def test_overflow_error_from_step_without_clipping() -> None:
    _, model, wrapper = build("O1", init_scale=8.0)
    x, y = data()
    wrapper.backward(loss_fn(model, x, y) * float("nan"))
    with pytest.raises(OverflowError):
        wrapper.step()
    assert wrapper.loss_scale == 4.0 and wrapper.skipped_steps == 1


def test_overflow_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    _, model, wrapper = build("O2", init_scale=8.0)
    x, y = data()
    with caplog.at_level(logging.DEBUG, logger="ampx"):  # verbosity=0: the skip line is DEBUG
        with pytest.raises(OverflowError):
            update(model, wrapper, x, y, poison=True)
    assert any("Gradient overflow" in r.getMessage() for r in caplog.records)


def test_floating_point_error_at_the_minimum_scale() -> None:
    _, model, wrapper = build("O2", init_scale=4.0, min_loss_scale=1.0)
    x, y = data()
    with pytest.raises(OverflowError, match="2.0"):
        update(model, wrapper, x, y, poison=True)
    with pytest.raises(FloatingPointError, match=r"Minimum loss scale reached \(1.0\)"):
        update(model, wrapper, x, y, poison=True)
    assert wrapper.loss_scale == 2.0  # as fairseq: the last usable scale is kept
    assert wrapper.skipped_steps == 2


def test_threshold_holds_the_scale_without_raising() -> None:
    """fairseq's --threshold-loss-scale above --min-loss-scale: keep skipping at the floor."""
    _, model, wrapper = build("O2", init_scale=4.0, min_loss_scale=2.0,
                              wrapper_kwargs={"min_loss_scale": 1.0})
    x, y = data()
    for _ in range(3):
        with pytest.raises(OverflowError, match="2.0"):
            update(model, wrapper, x, y, poison=True)


def test_floating_point_error_without_a_floor() -> None:
    """Without min_loss_scale the scaler backs off no lower than 1.0: raised there."""
    _, model, wrapper = build("O2", init_scale=4.0)
    x, y = data()
    with pytest.raises(OverflowError):
        update(model, wrapper, x, y, poison=True)  # 2.0
    with pytest.raises(FloatingPointError, match=r"\(1\.0\)"):
        update(model, wrapper, x, y, poison=True)  # 1.0: the default floor


def test_floating_point_error_when_steps_are_not_skipped() -> None:
    _, model, wrapper = build("O0")
    x, y = data()
    with pytest.raises(FloatingPointError, match="Nan/Inf"):
        update(model, wrapper, x, y, poison=True)


def test_static_scale_skips_non_finite_steps() -> None:
    _, model, wrapper = build("O2", dtype="bf16")
    x, y = data()
    with pytest.raises(OverflowError, match="1.0"):
        update(model, wrapper, x, y, poison=True)
    update(model, wrapper, x, y)


class FairseqScaler:
    """fairseq.optim.dynamic_loss_scaler.DynamicLossScaler's rules (the reference)."""

    def __init__(self, scale: float, window: int, tolerance: float) -> None:
        self.loss_scale, self.window, self.tolerance = scale, window, tolerance
        self._iter, self._last_overflow_iter, self._last_rescale_iter = 0, -1, -1
        self._overflows_since_rescale = 0

    def update(self) -> None:
        if (self._iter - self._last_overflow_iter) % self.window == 0:
            self.loss_scale *= 2.0
            self._last_rescale_iter = self._iter
        self._iter += 1

    def overflow(self) -> None:
        since = self._iter - self._last_rescale_iter
        self._last_overflow_iter = self._iter
        self._overflows_since_rescale += 1
        if self._overflows_since_rescale / float(since) >= self.tolerance:
            self.loss_scale /= 2.0
            self._last_rescale_iter = self._iter
            self._overflows_since_rescale = 0
        self._iter += 1


def test_tolerance_follows_fairseq() -> None:
    pattern = [0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    _, model, wrapper = build("O2", init_scale=2.0**10, growth_interval=3,
                              wrapper_kwargs={"tolerance": 0.4})
    ref = FairseqScaler(2.0**10, 3, 0.4)
    x, y = data()
    for poison in pattern:
        if poison:
            with pytest.raises(OverflowError):
                update(model, wrapper, x, y, poison=True)
            ref.overflow()
        else:
            update(model, wrapper, x, y)
            ref.update()
        assert wrapper.loss_scale == ref.loss_scale


# -- accumulation, state --------------------------------------------------------------------------

@pytest.mark.parametrize("opt_level,dtype,tol", [("O0", "fp16", 1e-6), ("O1", "bf16", 2e-2),
                                                 ("O2", "fp16", 2e-3), ("O2", "bf16", 2e-2)])
def test_update_freq_equals_one_big_batch(opt_level: str, dtype: str, tol: float) -> None:
    _, model_a, wrapper_a = build(opt_level, dtype=dtype)
    _, model_b, wrapper_b = build(opt_level, dtype=dtype)
    for step in range(3):
        x, y = data(16, seed=step)
        update(model_a, wrapper_a, x, y, update_freq=1, clip=1.0)
        update(model_b, wrapper_b, x, y, update_freq=4, clip=1.0)
    for a, b in zip(wrapper_a.params, wrapper_b.params):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_scale_updates_once_per_update() -> None:
    """--scale-window counts updates, not micro-batches (fairseq's meaning)."""
    _, model, wrapper = build("O2", init_scale=2.0**4, growth_interval=2)
    x, y = data()
    update(model, wrapper, x, y, update_freq=4)
    assert wrapper.loss_scale == 2.0**4
    update(model, wrapper, x, y, update_freq=4)
    assert wrapper.loss_scale == 2.0**5


def test_zero_grad_discards_pending_gradients() -> None:
    _, model, wrapper = build("O2")
    x, y = data()
    wrapper.backward(loss_fn(model, x, y))
    wrapper.zero_grad()
    before = params_of(model)
    wrapper.step()  # nothing to apply
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model)))
    assert all(p.grad is None for p in model.parameters())


def test_step_scale_argument() -> None:
    def run(**kwargs: float) -> list[torch.Tensor]:
        _, model, wrapper = build("O2")
        x, y = data()
        wrapper.backward(loss_fn(model, x, y))
        if "c" in kwargs:
            wrapper.multiply_grads(kwargs["c"])
            wrapper.step()
        else:
            wrapper.step(scale=kwargs["scale"])
        return [p.detach().clone() for p in wrapper.params]

    for a, b in zip(run(c=0.25), run(scale=4.0)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_state_dict_resumes_exactly(opt_level: str) -> None:
    steps = [(s, s == 2) for s in range(6)]

    def run(amp_model_wrapper: tuple, chunk: list) -> None:
        _, model, wrapper = amp_model_wrapper
        for step, poison in chunk:
            x, y = data(8, seed=step)
            try:
                update(model, wrapper, x, y, update_freq=2, clip=0.5, poison=poison)
            except OverflowError:
                wrapper.zero_grad()

    kwargs: dict[str, Any] = dict(optimizer=torch.optim.Adam, init_scale=2.0**8,
                                  growth_interval=2)
    full = build(opt_level, **kwargs)
    run(full, steps)
    first = build(opt_level, **kwargs)
    run(first, steps[:3])
    saved = copy.deepcopy({"model": first[1].state_dict(), "opt": first[2].state_dict()})
    assert saved["opt"]["loss_scale"] == first[2].loss_scale
    assert saved["opt"]["ampx"]["skipped_steps"] == 1
    resumed = build(opt_level, seed=7, **kwargs)  # other initial weights: all come from the file
    resumed[1].load_state_dict(saved["model"])
    resumed[2].load_state_dict(saved["opt"])
    assert resumed[2].loss_scale == first[2].loss_scale and resumed[2].steps == 3
    run(resumed, steps[3:])
    for a, b in zip(params_of(full[1]), params_of(resumed[1])):
        assert torch.equal(a, b)
    assert full[2].state_dict()["ampx"] == resumed[2].state_dict()["ampx"]


def test_load_state_dict_overrides_and_plain_dicts() -> None:
    _, model, wrapper = build("O2", optimizer=torch.optim.Adam)
    x, y = data()
    update(model, wrapper, x, y)
    state = wrapper.state_dict()
    wrapper.load_state_dict(state, optimizer_overrides={"lr": 0.01})
    assert wrapper.get_lr() == 0.01
    wrapper.load_state_dict(wrapper.optimizer.state_dict())  # a plain optimizer state dict
    bad = dict(state, ampx=dict(state["ampx"], version=99))
    with pytest.raises(ValueError, match="newer"):
        wrapper.load_state_dict(bad)


# -- memory-efficient mode ------------------------------------------------------------------------

def build_memory_efficient(optimizer: Callable = torch.optim.Adam, dtype: str = "fp16",
                           seed: int = 0) -> tuple[ampx.Amp, nn.Module, AmpOptimizer]:
    model = make_model(seed)
    amp = ampx.Amp(opt_level="O3", dtype=dtype, loss_scale="dynamic", init_scale=2.0**8,
                   verbosity=0)
    model = amp.initialize(model)
    opt = optimizer(model.parameters(), lr=0.01)
    return amp, model, AmpOptimizer(opt, amp, memory_efficient=True)


def test_memory_efficient_steps_half_params_with_fp32_math() -> None:
    amp, model, wrapper = build_memory_efficient()
    params = list(model.parameters())
    assert all(p.dtype == torch.float16 for p in params)
    x, y = data()
    # reference: the same half gradients, unscaled in fp32, stepped by fp32 Adam, rounded
    twin = copy.deepcopy(model)
    (loss_fn(twin, x, y) * 2.0**8).backward()
    ref_params = [nn.Parameter(p.detach().float()) for p in twin.parameters()]
    for ref, p in zip(ref_params, twin.parameters()):
        ref.grad = _grad(p).float() * 2.0**-8 / len(x)
    ref_opt = torch.optim.Adam(ref_params, lr=0.01)
    ref_opt.step()

    update(model, wrapper, x, y)
    assert list(model.parameters()) == params  # same Parameter objects, still half
    assert all(p.dtype == torch.float16 for p in model.parameters())
    for got, ref in zip(model.parameters(), ref_params):
        assert torch.equal(got.detach(), ref.detach().half())
    states = list(wrapper.optimizer.state.values())
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in states)


def test_memory_efficient_overflow_and_resume() -> None:
    amp, model, wrapper = build_memory_efficient(optimizer=torch.optim.AdamW)
    x, y = data()
    update(model, wrapper, x, y)
    before = params_of(model)
    with pytest.raises(OverflowError, match="128.0"):
        update(model, wrapper, x, y, update_freq=2, poison=True)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model)))
    update(model, wrapper, x, y, update_freq=2, clip=0.1)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": wrapper.state_dict()})
    update(model, wrapper, x, y)
    expected = params_of(model)

    _, model_2, wrapper_2 = build_memory_efficient(optimizer=torch.optim.AdamW, seed=3)
    model_2.load_state_dict(saved["model"])
    wrapper_2.load_state_dict(saved["opt"])
    states = list(wrapper_2.optimizer.state.values())
    assert all(s["exp_avg"].dtype == torch.float32 for s in states)  # not cast to half
    assert wrapper_2.loss_scale == 128.0
    update(model_2, wrapper_2, x, y)
    for a, b in zip(expected, params_of(model_2)):
        assert torch.equal(a, b)


def test_memory_efficient_needs_half_params_without_masters() -> None:
    amp, _, wrapper = build("O2")
    with pytest.raises(ValueError, match="master weights"):
        AmpOptimizer(wrapper.optimizer, amp, memory_efficient=True)
    model = make_model()
    amp_1 = ampx.Amp(opt_level="O1", verbosity=0)
    model, opt = amp_1.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="float32"):
        AmpOptimizer(opt, memory_efficient=True)


# -- the example trainer -------------------------------------------------------------------------

@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(REPO))
    from examples.fairseq_style import train

    return train


def run_example(train, argv: list[str]) -> dict:  # type: ignore[no-untyped-def]
    args = train.parse_args_and_arch(argv)
    trainer = train.main(args)
    return trainer.state_dict()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_example_resume_equals_uninterrupted(example, tmp_path: pathlib.Path,  # type: ignore[no-untyped-def]
                                             level: str) -> None:
    common = ["--arch", "convnet" if level == "O2" else "mlp", "--optimizer", "adam",
              "--opt-level", level, "--update-freq", "2", "--clip-norm", "1.0",
              "--init-scale", "1e9", "--scale-window", "3", "--log-interval", "0"]
    full = run_example(example, common + ["--max-update", "8", "--save-dir",
                                          str(tmp_path / "full")])
    run_example(example, common + ["--max-update", "4", "--save-dir", str(tmp_path / "split")])
    resumed = run_example(example, common + ["--max-update", "8", "--save-dir",
                                             str(tmp_path / "split")])
    assert full["num_updates"] == resumed["num_updates"] == 8
    assert full["overflows"] == resumed["overflows"] > 0  # the scale came down from 2**24
    assert full["optimizer"]["loss_scale"] == resumed["optimizer"]["loss_scale"]
    assert full["optimizer"]["ampx"] == resumed["optimizer"]["ampx"]
    for key, value in full["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    saved = torch.load(tmp_path / "split" / "checkpoint_last.pt", weights_only=False)
    assert saved["num_updates"] == 8
