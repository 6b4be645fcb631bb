"""apex's L0 amp test behaviours, its load rule and the hand-driven scaler (issue 23 items 4-6).

apex's test_add_param_group and test_multiple_models_optimizers_losses write
``_amp_state.loss_scalers[i]._loss_scale`` (4.0, 16.0) right after initialize at every opt
level, O0 included, with ``cast_model_type=False``; the trained weights must equal a plain
torch run. An apex fp16 checkpoint must resume under ``ampx run --dtype bf16``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import ampx
from ampx import amp
from ampx.compat.apex import normalization
from ampx.scaling.scaler import LossScaler

LEVELS = ["O0", "O1", "O2", "O3"]
ROOT = Path(__file__).resolve().parents[2]


class _Model(nn.Module):
    def __init__(self, unique: int) -> None:
        super().__init__()
        self.weight0 = nn.Parameter(torch.full((2,), 1.0 + unique))
        self.weight1 = nn.Parameter(torch.full((2,), 2.0 + unique))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight0 * self.weight1).sum()


X = torch.tensor([1.0, 0.5])


def _plain(steps: list[list[tuple[int, float]]], lrs: tuple[float, float]) -> list[torch.Tensor]:
    """The reference: torch alone; each step sums loss_k * (1 for each model k listed)."""
    models = [_Model(1), _Model(2)]
    opt = torch.optim.SGD([{"params": m.parameters(), "lr": lr} for m, lr in zip(models, lrs)],
                          momentum=0.125)
    for step in steps:
        opt.zero_grad()
        for k, _ in step:
            models[k](X).backward()
        opt.step()
    return [p.detach().clone() for m in models for p in m.parameters()]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("zero_before_add", [True, False])
def test_add_param_group_with_a_scale_set_after_initialize(
        level: str, zero_before_add: bool, half_dtype: torch.dtype) -> None:
    model0, model1 = _Model(1), _Model(2)
    opt = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
    [model0, model1], opt = amp.initialize([model0, model1], opt, opt_level=level,
                                           dtype=half_dtype, verbosity=0,
                                           cast_model_type=False)
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0
    opt.zero_grad()
    with amp.scale_loss(model0(X), opt) as scaled:
        scaled.backward()
    opt.step()
    if zero_before_add:
        opt.zero_grad()
    opt.add_param_group({"params": model1.parameters(), "lr": 0.5})
    if not zero_before_add:
        opt.zero_grad()
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model0(X) + model1(X), opt) as scaled:
            scaled.backward()
        opt.step()
    # reference: model1 joins after the first step (its momentum starts then)
    ref0, ref1 = _Model(1), _Model(2)
    ref = torch.optim.SGD([{"params": ref0.parameters(), "lr": 0.25}], momentum=0.125)
    ref0(X).backward()
    ref.step()
    ref.zero_grad()
    ref.add_param_group({"params": ref1.parameters(), "lr": 0.5})
    for _ in range(2):
        ref.zero_grad()
        (ref0(X) + ref1(X)).backward()
        ref.step()
    got = [p for m in (model0, model1) for p in m.parameters()]
    want = [p for m in (ref0, ref1) for p in m.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, rtol=0, atol=0)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 4.0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("inject_inf", [None, 1])
def test_multiple_models_optimizers_losses(level: str, inject_inf: int | None,
                                           half_dtype: torch.dtype) -> None:
    model0, model1 = _Model(1), _Model(2)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.25, momentum=0.125)
    opt1 = torch.optim.SGD(model1.parameters(), lr=0.5, momentum=0.25)
    [model0, model1], [opt0, opt1] = amp.initialize(
        [model0, model1], [opt0, opt1], opt_level=level, dtype=half_dtype, verbosity=0,
        cast_model_type=False, num_losses=2)
    scalers = amp._amp_state.loss_scalers
    scalers[0]._loss_scale = 4.0
    scalers[1]._loss_scale = 16.0
    dynamic = scalers[1].dynamic
    skips = ampx.frontend.default_session().skips_non_finite  # bf16: skip, keep the scale
    skipped = []
    for i in range(3):
        opt0.zero_grad()
        opt1.zero_grad()
        with amp.scale_loss(model0(X), opt0, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(model1(X), opt1, loss_id=1) as scaled:
            scaled.backward()
            if inject_inf == i:
                model1.weight0.grad[0] = float("inf")
        opt0.step()
        opt1.step()
        skipped.append(ampx.frontend.default_session().step_was_skipped(opt1))
    # apex: a dynamic scaler skips the poisoned step and halves; a static one never checks
    # (ampx's bf16 default also skips non-finite steps, keeping the scale)
    expected_skip = [inject_inf == i and (dynamic or skips) for i in range(3)]
    assert skipped == expected_skip
    assert scalers[0].loss_scale() == 4.0
    assert scalers[1].loss_scale() == (8.0 if any(expected_skip) and dynamic else 16.0)
    if inject_inf is None:
        ref0, ref1 = _Model(1), _Model(2)
        r0 = torch.optim.SGD(ref0.parameters(), lr=0.25, momentum=0.125)
        r1 = torch.optim.SGD(ref1.parameters(), lr=0.5, momentum=0.25)
        for _ in range(3):
            r0.zero_grad()
            r1.zero_grad()
            ref0(X).backward()
            ref1(X).backward()
            r0.step()
            r1.step()
        for g, w in zip([*model0.parameters(), *model1.parameters()],
                        [*ref0.parameters(), *ref1.parameters()]):
            torch.testing.assert_close(g.float(), w, rtol=0, atol=0)


# -- the hand-driven scaler (apex's LossScaler methods) -------------------------------------------

def test_scaler_driven_by_hand_like_apex() -> None:
    scaler = LossScaler("dynamic", init_scale=8.0)
    model = [torch.tensor([8.0, 16.0], dtype=torch.float16)]
    master = [torch.zeros(2)]
    scaler.clear_overflow_state()
    scaler.unscale(model, master, 8.0)
    assert master[0].tolist() == [1.0, 2.0] and not scaler._has_overflow
    assert scaler.update_scale() is False and scaler.loss_scale() == 8.0
    scaler.clear_overflow_state()
    scaler.unscale([torch.tensor([float("inf"), 1.0])], [torch.zeros(2)], None)
    assert scaler._has_overflow
    assert scaler.update_scale() is True and scaler.loss_scale() == 4.0
    assert scaler._unskipped == 0
    scaler.clear_overflow_state()
    assert not scaler._has_overflow
    grads = [torch.tensor([4.0, 8.0])]  # in place
    scaler.unscale(grads, grads, None, models_are_masters=True)
    assert grads[0].tolist() == [1.0, 2.0]
    out, stashed = [torch.zeros(2)], [torch.tensor([1.0, 1.0])]
    scaler.unscale_with_stashed([torch.tensor([4.0, 4.0])], stashed, out)
    assert out[0].tolist() == [2.0, 2.0] and stashed[0].tolist() == [1.0, 1.0]
    static = LossScaler(2.0)
    static.clear_overflow_state()
    static.unscale([torch.tensor([float("nan")])], [torch.zeros(1)], None)
    assert static.update_scale() is False and static.loss_scale() == 2.0  # never skips
    assert static._unskipped == 1


# -- apex.normalization's function names --------------------------------------------------------

def test_fused_layer_norm_functions_match_torch(half_dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 8, dtype=half_dtype, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    out = normalization.FusedLayerNormAffineFunction.apply(x, w.to(half_dtype),
                                                           b.to(half_dtype), (8,), 1e-5)
    ref = nn.functional.layer_norm(x.float(), (8,), w.to(half_dtype).float(),
                                   b.to(half_dtype).float(), 1e-5)
    assert out.dtype == half_dtype
    torch.testing.assert_close(out, ref.to(half_dtype))
    out.float().sum().backward()
    assert x.grad is not None and w.grad is not None
    mixed = normalization.FusedLayerNormAffineMixedDtypesFunction.apply(x, w, b, 8, 1e-5)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, nn.functional.layer_norm(x.float(), (8,), w, b, 1e-5))
    plain = normalization.fused_layer_norm(x, 8)
    assert plain.dtype == half_dtype
    rms = normalization.FusedRMSNormAffineFunction.apply(x, w.to(half_dtype), (8,), 1e-6)
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(half_dtype).float()
    torch.testing.assert_close(rms, want.to(half_dtype))
    assert normalization.mixed_dtype_fused_rms_norm_affine(x, w, 8).dtype == torch.float32
    assert normalization.fused_rms_norm(x, 8).dtype == half_dtype
    assert normalization.fused_layer_norm_affine(x, w, b, 8).dtype == half_dtype


def test_apex_names_bert_imports_resolve() -> None:
    from ampx.compat import apex_alias

    assert apex_alias.install() is True
    try:
        from apex.normalization.fused_layer_norm import (  # type: ignore[import-not-found]
            FusedLayerNormAffineFunction,
        )
        from apex.parallel.distributed import flat_dist_call  # type: ignore[import-not-found]
        assert FusedLayerNormAffineFunction is normalization.FusedLayerNormAffineFunction
        assert callable(flat_dist_call)
    finally:
        apex_alias.uninstall()
        for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
            del sys.modules[name]


# -- an apex fp16 checkpoint resumes under `ampx run --dtype bf16` ---------------------------------

RESUME = textwrap.dedent("""
    import torch
    from apex import amp
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1")
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 120}})
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    state = amp.state_dict()["loss_scaler0"]
    print("RESUMED", next(model.parameters()).dtype, state["loss_scale"], state["unskipped"])
""")


def test_apex_fp16_checkpoint_resumes_under_dtype_bf16(tmp_path: Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    import os
    env = dict(os.environ, **env)
    env.pop("AMPX_TELEMETRY", None)
    done = subprocess.run([sys.executable, "-m", "ampx", "run", "--dtype", "bf16", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESUMED torch.float32 1.0 123" in done.stdout  # O1 bf16: static 1.0, counters kept
    assert (done.stdout + done.stderr).count("keeping 1.0") == 1  # one clear warning
