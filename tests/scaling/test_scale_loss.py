"""scale_loss end to end: skipped steps, accumulation, several losses/models/optimizers."""

from __future__ import annotations

import copy

import _shared
import pytest
import torch
from _shared import batch
from torch import nn

import ampx

LEVELS = ["O0", "O1", "O2", "O3"]


def mlp(bn: bool = True) -> nn.Module:
    return _shared.mlp(bn)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def poison(model: nn.Module) -> None:
    """Put an inf into the first gradient found (the forced overflow)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.view(-1)[0] = float("inf")
            return
    raise AssertionError("no gradient to poison")


def train_step(model, opt, x, y, *, overflow=False, loss_id=0):
    opt.zero_grad()
    loss = loss_of(model, x, y)
    with ampx.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
        if overflow:
            poison(model)
    opt.step()
    return loss


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": [p.detach().clone() for p in model.parameters()],
        "masters": [p.detach().clone() for p in ampx.master_params(opt)],
        "buffers": [b.clone() for b in model.buffers()],
        "state": copy.deepcopy(opt.state_dict()["state"]),
    }


def assert_bitwise_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_bitwise_equal(u, v)
    else:
        assert a == b


def setup(level, dtype, *, bn=True, opt_cls=torch.optim.AdamW, lr=1e-3, **kw):
    model = mlp(bn)
    opt = opt_cls(model.parameters(), lr=lr)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0, **kw)
    return model, opt


# -- skipped steps ---------------------------------------------------------------------------

def _skip_kwargs(level: str, dtype: torch.dtype) -> dict:
    # fp16 at O0/O3 takes apex's short-circuit by default (no check): ask for a dynamic scale.
    return {"loss_scale": "dynamic"} if dtype == torch.float16 else {}


def _cases(levels: list[str], exclude: tuple[str, torch.dtype]) -> list:
    """(level, half dtype) parameters, without the combination the test cannot exercise."""
    return [pytest.param(level, dtype, id=f"{level}-{name}")
            for level in levels
            for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
            if (level, dtype) != exclude]


# O0 with bf16 is fp32 with a static scale 1.0 (apex's short-circuit): nothing to skip.
@pytest.mark.parametrize(("level", "half_dtype"), _cases(LEVELS, ("O0", torch.bfloat16)))
def test_forced_overflow_skips_exactly_that_step(level, half_dtype):
    model, opt = setup(level, half_dtype, opt_cls=torch.optim.SGD, lr=0.1,
                       **_skip_kwargs(level, half_dtype))
    if level != "O0":
        opt.param_groups[0]["momentum"] = 0.9  # optimizer state that must not move either
    x, y = batch()
    amp = ampx.frontend.default_session()
    assert amp is not None
    for _ in range(2):
        train_step(model, opt, x, y)
        assert not ampx.step_was_skipped(opt)
    scale = amp.loss_scale()
    before = snapshot(model, opt)
    train_step(model, opt, x, y, overflow=True)
    assert ampx.step_was_skipped(opt)
    after = snapshot(model, opt)
    # BN running stats move in forward; everything the optimizer owns must not
    assert_bitwise_equal(before["model"], after["model"])
    assert_bitwise_equal(before["masters"], after["masters"])
    assert_bitwise_equal(before["state"], after["state"])
    expected = scale / 2 if amp.properties.dynamic else scale
    assert amp.loss_scale() == expected
    train_step(model, opt, x, y)
    assert not ampx.step_was_skipped(opt)
    assert not all(torch.equal(a, b) for a, b in zip(after["model"], model.parameters()))
    state = opt._ampx
    assert state.steps == 4 and state.skipped_steps == 1


def test_forced_overflow_with_adam_state(half_dtype):
    model, opt = setup("O2", half_dtype, loss_scale="dynamic")
    x, y = batch()
    train_step(model, opt, x, y)
    before = snapshot(model, opt)
    train_step(model, opt, x, y, overflow=True)
    assert ampx.step_was_skipped(opt)
    assert_bitwise_equal(before, {**snapshot(model, opt), "buffers": before["buffers"]})
    assert all(int(s["step"]) == 1 for s in opt.state.values())


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_short_circuit_path_as_apex(level):
    """fp16 O0/O3 with the default static 1.0: loss.float() yielded, nothing checked."""
    model, opt = setup(level, torch.float16, opt_cls=torch.optim.SGD)
    amp = ampx.frontend.default_session()
    assert amp is not None and not amp.scales_gradients
    x, y = batch()
    loss = loss_of(model, x, y)
    with ampx.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32 and torch.equal(scaled, loss.float())
        scaled.backward()
        poison(model)
    opt.step()
    assert not ampx.step_was_skipped(opt)  # apex: a static scale never skips


def test_bf16_default_static_one_still_skips():
    model, opt = setup("O2", torch.bfloat16)
    amp = ampx.frontend.default_session()
    assert amp is not None and not amp.properties.dynamic and amp.loss_scale() == 1.0
    x, y = batch()
    train_step(model, opt, x, y, overflow=True)
    assert ampx.step_was_skipped(opt) and amp.loss_scale() == 1.0


def test_delay_overflow_check_never_skips():
    model, opt = setup("O1", torch.float16)
    x, y = batch()
    loss = loss_of(model, x, y)
    with ampx.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
        scaled.backward()
        poison(model)
    opt.step()
    assert not ampx.step_was_skipped(opt)
    assert ampx.frontend.default_session().loss_scale() == 2.0**16  # type: ignore[union-attr]


def test_one_host_sync_per_step(monkeypatch: pytest.MonkeyPatch):
    # SGD: torch's (non-capturable) Adam reads its step counters with .item() itself
    model, opt = setup("O2", torch.float16, opt_cls=torch.optim.SGD)
    x, y = batch()
    train_step(model, opt, x, y)  # warm up (lazy optimizer state)
    calls = []
    original = torch.Tensor.item

    def counting_item(self):
        calls.append(1)
        return original(self)

    def forbidden(self, *args):
        raise AssertionError("unexpected host sync")

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    for name in ("__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x).float(), y)
    with ampx.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    monkeypatch.undo()
    assert len(calls) == 1


def test_static_fp16_scale_has_no_host_sync(monkeypatch: pytest.MonkeyPatch):
    model, opt = setup("O2", torch.float16, loss_scale=128.0, opt_cls=torch.optim.SGD)
    x, y = batch()

    def forbidden(self, *args):
        raise AssertionError("unexpected host sync")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    train_step(model, opt, x, y)
    train_step(model, opt, x, y)


# -- gradient values ---------------------------------------------------------------------------

def reference_grads(model: nn.Module, losses) -> list[torch.Tensor]:
    """fp32 gradients of the sum of `losses(model)` for an fp32 copy of `model`'s weights."""
    ref = copy.deepcopy(model).float()
    for m in ref.modules():
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    ref.zero_grad()
    sum(fn(ref) for fn in losses).backward()
    return [p.grad for p in ref.parameters()]


def grads_at_step(opt) -> list[torch.Tensor]:
    """The gradients the optimizer sees (masters at O2), captured by a step pre-hook."""
    seen: list[torch.Tensor] = []

    def hook(optimizer, args, kwargs):
        seen.extend(p.grad.clone() for p in ampx.master_params(optimizer))

    handle = opt.register_step_pre_hook(hook)
    opt.step()
    handle.remove()
    return seen


def close(a: list[torch.Tensor], b: list[torch.Tensor], dtype: torch.dtype) -> None:
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for u, v in zip(a, b):
        u, v = u.float(), v.float()
        assert (u - v).norm() <= tol * v.norm() + 1e-5, (u - v).norm() / v.norm()


def unscaled_grads(opt) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in ampx.master_params(opt)]


# O3 with fp16 has pure fp16 gradients: covered by the short-circuit tests.
@pytest.mark.parametrize(("level", "half_dtype"), _cases(["O1", "O2", "O3"], ("O3", torch.float16)))
@pytest.mark.parametrize("loss_scale", [None, 1.0, 128.0, "dynamic"])
def test_two_losses_accumulate(level, loss_scale, half_dtype):
    """Two backward passes before one step give the gradient of the summed loss, at every
    scale; includes apex's O2 static-1.0 bug (fp32 batchnorm params kept only the last pass's
    gradient)."""
    model, opt = setup(level, half_dtype, num_losses=2, loss_scale=loss_scale)
    amp = ampx.frontend.default_session()
    if amp.properties.dynamic:  # type: ignore[union-attr]
        amp.scalers[1].set_scale(8.0)  # type: ignore[union-attr]  # different scales
    x1, y1 = batch(seed=1)
    x2, y2 = batch(seed=2)
    opt.zero_grad()
    with ampx.scale_loss(loss_of(model, x1, y1) + loss_of(model, x2, y2), opt) as scaled:
        scaled.backward()
    expected = unscaled_grads(opt)
    opt.zero_grad()
    for i, (x, y) in enumerate([(x1, y1), (x2, y2)]):
        with ampx.scale_loss(loss_of(model, x, y), opt, loss_id=i) as scaled:
            scaled.backward()
    close(grads_at_step(opt), expected, half_dtype)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("delay_unscale", [False, True])
def test_gradient_accumulation_equals_large_batch(level, delay_unscale, half_dtype):
    model, opt = setup(level, half_dtype, bn=False)
    x, y = batch(64)
    expected = reference_grads(model, [lambda m: loss_of(m, x, y)])
    opt.zero_grad()
    chunks = list(zip(x.chunk(4), y.chunk(4)))
    for i, (xc, yc) in enumerate(chunks):
        last = i == len(chunks) - 1
        with ampx.scale_loss(loss_of(model, xc, yc) / 4, opt,
                             delay_unscale=delay_unscale and not last) as scaled:
            scaled.backward()
    close(grads_at_step(opt), expected, half_dtype)


def test_step_while_gradients_scaled_raises():
    model, opt = setup("O2", torch.float16)
    x, y = batch()
    with ampx.scale_loss(loss_of(model, x, y), opt, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="delay_unscale"):
        opt.step()


def test_master_grads_are_consumed_by_step_at_o2():
    """As in apex, O2 master gradients are released after the step (and half grads at exit)."""
    model, opt = setup("O2", torch.float16, opt_cls=torch.optim.SGD)
    x, y = batch()
    opt.zero_grad()
    with ampx.scale_loss(loss_of(model, x, y), opt) as scaled:
        scaled.backward()
    masters = opt._ampx.masters.pairs()
    assert masters and all(half.grad is None and master.grad is not None
                           for half, master in masters)
    opt.step()
    assert all(master.grad is None for _, master in masters)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_grad_norm_over_master_params_clips_true_gradient(level, half_dtype):
    model, opt = setup(level, half_dtype, loss_scale="dynamic")
    x, y = batch()
    expected = reference_grads(model, [lambda m: loss_of(m, x, y)])
    true_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected]))
    opt.zero_grad()
    with ampx.scale_loss(loss_of(model, x, y), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(ampx.master_params(opt), max_norm=0.01)
    tol = 2e-2 if half_dtype == torch.bfloat16 else 4e-3
    assert abs(norm.item() - true_norm.item()) <= tol * true_norm.item()
    clipped = torch.linalg.vector_norm(
        torch.stack([p.grad.float().norm() for p in ampx.master_params(opt)]))
    assert clipped.item() == pytest.approx(0.01, rel=1e-3)
    opt.step()


def test_exception_inside_block_restores_gradients():
    model, opt = setup("O1", torch.float16, opt_cls=torch.optim.SGD)
    x, y = batch()
    opt.zero_grad()
    with ampx.scale_loss(loss_of(model, x, y), opt) as scaled:
        scaled.backward()
    kept = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(KeyError):
        with ampx.scale_loss(loss_of(model, x, y), opt):
            raise KeyError("boom")
    assert all(torch.equal(a, p.grad) for a, p in zip(kept, model.parameters()))


def test_errors():
    model, opt = setup("O1", torch.float16)
    x, y = batch()
    with pytest.raises(IndexError, match="num_losses"):
        with ampx.scale_loss(loss_of(model, x, y), opt, loss_id=3):
            pass
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="ampx.initialize"):
        with ampx.scale_loss(loss_of(model, x, y), other):
            pass


# -- several models, optimizers and losses (apex's DCGAN pattern) -------------------------------

@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gan_loop(level, half_dtype):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    (gen, disc), (opt_g, opt_d) = ampx.initialize(
        [gen, disc], [opt_g, opt_d], opt_level=level, dtype=half_dtype, num_losses=3,
        verbosity=0)
    bce = nn.functional.binary_cross_entropy_with_logits
    g = torch.Generator().manual_seed(3)
    for it in range(6):
        real = torch.randn(16, 8, generator=g)
        noise = torch.randn(16, 4, generator=g)
        # discriminator: two losses, each with its own scaler
        opt_d.zero_grad()
        fake = gen(noise)
        out_real = disc(real).float()
        with ampx.scale_loss(bce(out_real, torch.ones_like(out_real)), opt_d, loss_id=0) as s:
            s.backward()
        d_before = [p.grad.clone() for p in ampx.master_params(opt_d)]
        out_fake = disc(fake.detach()).float()
        with ampx.scale_loss(bce(out_fake, torch.zeros_like(out_fake)), opt_d, loss_id=1) as s:
            s.backward()
            if it == 3:
                poison(disc)
        assert all(b.data_ptr() == p.grad.data_ptr() or not torch.equal(b, p.grad)
                   for b, p in zip(d_before, ampx.master_params(opt_d)))
        opt_d.step()
        assert ampx.step_was_skipped(opt_d) == (it == 3)
        # generator: its backward also reaches the discriminator's params, which it must not
        # disturb; and stepping the discriminator must not eat the generator's gradients.
        opt_g.zero_grad()
        out = disc(fake).float()
        with ampx.scale_loss(bce(out, torch.ones_like(out)), opt_g, loss_id=2) as s:
            s.backward()
        g_params = [p.detach().clone() for p in ampx.master_params(opt_g)]
        opt_g.step()
        assert not ampx.step_was_skipped(opt_g)
        assert all(not torch.equal(a, b) for a, b in zip(g_params, ampx.master_params(opt_g)))
    amp = ampx.frontend.default_session()
    scales = [amp.loss_scale(i) for i in range(3)]  # type: ignore[union-attr]
    if half_dtype == torch.float16:
        assert scales == [2.0**16, 2.0**15, 2.0**16]
    else:
        assert scales == [1.0, 1.0, 1.0]


def test_stale_half_grads_from_another_backward_are_dropped():
    """A discriminator backward that reaches the generator's half params (not detached) leaves
    scaled gradients there; the generator's scale_loss must not add them to its masters."""
    torch.manual_seed(0)
    gen = nn.Linear(4, 8)
    disc = nn.Linear(8, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    (gen, disc), (opt_g, opt_d) = ampx.initialize(
        [gen, disc], [opt_g, opt_d], opt_level="O2", verbosity=0, init_scale=2.0**10)
    noise = torch.randn(4, 4)
    with ampx.scale_loss(disc(gen(noise)).float().mean(), opt_g) as s:
        s.backward()
    expected = unscaled_grads(opt_g)
    opt_g.zero_grad()
    opt_d.zero_grad()
    with ampx.scale_loss(disc(gen(noise)).float().mean(), opt_d) as s:
        s.backward()  # also writes scaled grads into gen's half params
    assert gen.weight.grad is not None
    disc_weight = disc.weight.detach().clone()
    opt_d.step()
    assert not ampx.step_was_skipped(opt_d) and not torch.equal(disc_weight, disc.weight)
    opt_d.param_groups[0]["lr"] = 0.0  # (the comparison below needs the same disc weights)
    with torch.no_grad():
        disc.weight.copy_(disc_weight)
        next(iter(ampx.master_params(opt_d))).copy_(disc_weight)
    opt_g.zero_grad()
    with ampx.scale_loss(disc(gen(noise)).float().mean(), opt_g) as s:
        s.backward()
    assert_bitwise_equal(grads_at_step(opt_g), expected)


def test_each_optimizer_steps_only_its_own_masters():
    """Stepping one optimizer must not copy or release another optimizer's masters."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    (a, b), (opt_a, opt_b) = ampx.initialize([a, b], [opt_a, opt_b], opt_level="O2",
                                             verbosity=0, init_scale=2.0**8)
    x = torch.randn(8, 4)
    with ampx.scale_loss(b(a(x)).float().pow(2).mean(), [opt_a, opt_b]) as s:
        s.backward()
    b_weight = b.weight.detach().clone()
    opt_a.step()
    assert all(p.grad is not None for p in ampx.master_params(opt_b))
    assert torch.equal(b.weight, b_weight)
    opt_b.step()
    assert not torch.equal(b.weight, b_weight)


def test_scale_policy_through_initialize_growth_bounds_hysteresis():
    model, opt = setup("O2", torch.float16, opt_cls=torch.optim.SGD, init_scale=2.0**10,
                       growth_interval=2, hysteresis=2, min_loss_scale=2.0**9,
                       max_loss_scale=2.0**11)
    amp = ampx.frontend.default_session()
    assert amp is not None
    x, y = batch()
    scales, skipped = [], []
    for overflow in [False, False, False, False, True, True, True, True, False]:
        train_step(model, opt, x, y, overflow=overflow)
        scales.append(amp.loss_scale())
        skipped.append(ampx.step_was_skipped(opt))
    assert skipped == [False] * 4 + [True] * 4 + [False]
    # growth after 2 clean steps, capped at max; hysteresis 2 tolerates the first overflow;
    # then backs off at once, down to the floor
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**11, 2.0**10, 2.0**9, 2.0**9,
                      2.0**9]


# -- gradient layouts (issue 9 item 1) -----------------------------------------------------------

class Layouts(nn.Module):
    """A conv (channels_last-able), a transposed weight and an embedding."""

    def __init__(self, transposed: bool, sparse: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        weight = torch.randn(6, 4 * 4 * 4) * 0.05
        self.w = nn.Parameter(weight.t().contiguous().t() if transposed else weight)
        self.emb = nn.Embedding(10, 6, sparse=sparse)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(1)
        return h @ self.w.t() + self.emb(ids)


def _layout_run(level: str, dtype: torch.dtype, *, channels_last: bool, transposed: bool,
                sparse: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Layouts(transposed, sparse)
    if channels_last:
        model.conv.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.Amp(level, dtype=dtype, verbosity=0, loss_scale="dynamic",
                          init_scale=2.0**8).initialize(model, opt)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 3, 4, 4, generator=g)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        ids = torch.randint(0, 10, (2,), generator=g)
        opt.zero_grad()
        loss = model(x, ids).float().pow(2).mean()
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert not ampx.step_was_skipped(opt)
    if level == "O2":  # every master keeps its model parameter's layout
        for half, master in opt._ampx.masters.pairs():
            assert half.stride() == master.stride()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_any_gradient_layout_trains_like_the_contiguous_run(level, half_dtype):
    plain = _layout_run(level, half_dtype, channels_last=False, transposed=False, sparse=False)
    odd = _layout_run(level, half_dtype, channels_last=True, transposed=True, sparse=True)
    tol = 1e-2 if half_dtype == torch.bfloat16 else 2e-3  # conv kernels differ per layout
    for a, b in zip(plain, odd):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_sparse_gradients_are_unscaled_and_checked(level, half_dtype):
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = ampx.Amp(level, dtype=half_dtype, verbosity=0, loss_scale="dynamic",
                          init_scale=2.0**8).initialize(model, opt)
    ids = torch.tensor([1, 3, 3])
    before = next(iter(ampx.master_params(opt))).detach().clone()
    with ampx.scale_loss(model(ids).float().sum(), opt) as scaled:
        scaled.backward()
    grad = next(iter(ampx.master_params(opt))).grad
    assert grad.is_sparse
    dense = grad.to_dense()
    assert torch.equal(dense[3], torch.full((4,), 2.0)) and torch.equal(dense[1], torch.ones(4))
    opt.step()
    assert not ampx.step_was_skipped(opt)
    with ampx.scale_loss(model(ids).float().sum(), opt) as scaled:
        scaled.backward()
        for p in model.parameters():
            p.grad._values()[0, 0] = float("inf")
    stepped = next(iter(ampx.master_params(opt))).detach().clone()
    opt.step()
    assert ampx.step_was_skipped(opt)
    assert torch.equal(stepped, next(iter(ampx.master_params(opt))))
    assert not torch.equal(before, stepped)
