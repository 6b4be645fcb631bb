"""on_overflow policies on their own: skip, raise (at the minimum scale or after N skips),
fp32-fallback attribution and escalation, the saved state, and the fp32 hooks at O1 and O2."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.o1 import patch
from ampx.overflow.policy import (
    Fp32Fallback,
    OverflowPersistsError,
    OverflowPolicy,
    find_module,
    float_buffers,
)
from ampx.overflow.report import OverflowReport
from ampx.scaling.journal import Journal
from ampx.scaling.protocol import amp_state_of


def report(forward: str | None = None, modules: tuple[str, ...] = ("head", "body.fc")
           ) -> OverflowReport:
    return OverflowReport(step=3, loss_ids=(0,), scales={0: (2.0, 1.0)},
                          inf_params=tuple(f"{m}.weight" for m in modules),
                          modules=tuple((m, 1) for m in modules), forward_module=forward,
                          forward_kind="inf" if forward else None)


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ValueError, match="on_overflow='explode' is not one of 'skip', 'raise'"):
        OverflowPolicy("explode")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="overflow_patience must be an int >= 1"):
            OverflowPolicy("raise", patience=bad)  # type: ignore[arg-type]


def test_skip_only_counts() -> None:
    policy = OverflowPolicy("skip", patience=1)
    for _ in range(5):
        assert policy.observe_skip(report(), at_minimum=True) is None
    assert policy.consecutive == 5 and policy.fallback == []


def test_raise_after_consecutive_skips_with_the_report() -> None:
    policy = OverflowPolicy("raise", patience=3)
    policy.observe_skip(report())
    policy.observe_clean()
    policy.observe_skip(report())
    policy.observe_skip(report())
    with pytest.raises(OverflowPersistsError, match="3 consecutive steps were skipped") as info:
        policy.observe_skip(report())
    assert isinstance(info.value, FloatingPointError)
    assert info.value.report.inf_params == ("head.weight", "body.fc.weight")
    assert "inf gradients (2): head.weight, body.fc.weight" in str(info.value)
    assert policy.consecutive == 2  # nothing counted when it raised


def test_raise_at_the_minimum_scale() -> None:
    with pytest.raises(OverflowPersistsError, match="the loss scale is at its minimum"):
        OverflowPolicy("raise", patience=100).observe_skip(report(), at_minimum=True)


def test_fallback_after_n_skips_of_the_same_module() -> None:
    policy = OverflowPolicy("fp32-fallback", patience=2)
    assert policy.observe_skip(report()) is None
    assert policy.observe_skip(report(forward="body.act")) is None
    assert policy.observe_skip(report()) == "head"
    # head is fp32 now: later backward reports are attributed to the next module
    assert policy.culprit(report()) == "body.fc"
    assert policy.observe_skip(report(forward="body.act")) == "body.act"
    # a forward origin already in fp32 that still overflows escalates to its parent
    assert policy.culprit(report(forward="body.act")) == "body"
    policy.fallback.append("(root)")
    assert policy.culprit(report(forward="(root)")) is None
    assert policy.culprit(report(modules=("head",))) is None
    assert policy.attributions == {"head": 2, "body.act": 2}


def test_state_dict_round_trip_and_validation() -> None:
    policy = OverflowPolicy("fp32-fallback", patience=1)
    policy.observe_skip(report(forward="body.fc"))
    saved = policy.state_dict()
    assert saved == {"on_overflow": "fp32-fallback", "patience": 1, "consecutive": 1,
                     "attributions": {"body.fc": 1}, "fp32_modules": ["body.fc"]}
    fresh = OverflowPolicy("fp32-fallback", patience=1)
    assert fresh.load_checked(OverflowPolicy.validate_state(saved)) == ["body.fc"]
    assert fresh.state_dict() == saved
    assert fresh.load_checked(OverflowPolicy.validate_state(saved)) == []  # idempotent
    for bad, match in (([], "expected a dict"), ({"consecutive": -1}, "consecutive"),
                       ({"attributions": {"a": "x"}}, "attributions"),
                       ({"fp32_modules": [3]}, "fp32_modules")):
        with pytest.raises(ValueError, match=match):
            OverflowPolicy.validate_state(bad, "overflow_policy")
    assert fresh.state_dict() == saved


def test_find_module_by_report_name() -> None:
    a, b = nn.Sequential(nn.Linear(1, 1)), nn.Sequential(nn.ReLU())
    assert find_module([a], "0") is a[0]
    assert find_module([a], "(root)") is a
    assert find_module([a, b], "model1.0") is b[0]
    assert find_module([a, b], "model0.(root)") is a
    for models, name in (([a], "nope"), ([a, b], "0"), ([a], "0.x")):
        with pytest.raises(KeyError, match="no module"):
            find_module(models, name)


# -- the fp32 hooks on real O1 / O2 sessions ------------------------------------------------------

class Normed(nn.Module):
    """Overflows inside in fp16 (fc's output), yet its output is small: fp32 fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.weight.fill_(4e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.abs() + 1)
        return h / h.norm(dim=-1, keepdim=True)


def net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), Normed(), nn.Linear(8, 1))


def test_o1_fallback_runs_the_module_with_casts_off() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O1", verbosity=0)
    x = torch.randn(3, 4)
    assert not torch.isfinite(model(x)).all()
    seen: list[torch.dtype] = []
    hook = model[1].fc.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    fallback = Fp32Fallback(model[1], disable_casts=True, cast_back=False)
    out = model(x)
    assert torch.isfinite(out).all() and seen == [torch.float32]
    assert patch.casts_enabled()  # re-enabled after the module
    fallback.remove()
    hook.remove()
    assert not torch.isfinite(model(x)).all()


def test_o1_fallback_reenables_casts_after_an_exception_and_an_interrupt() -> None:
    class Boom(nn.Module):
        def __init__(self, exc: BaseException) -> None:
            super().__init__()
            self.exc = exc

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise self.exc

    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampx.initialize(model, opt, opt_level="O1", verbosity=0)
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        boom = Boom(exc)
        fallback = Fp32Fallback(boom, disable_casts=True, cast_back=False)
        with pytest.raises(type(exc)):
            boom(torch.ones(1))
        fallback.unwind()  # the step boundary; needed after a BaseException only
        assert patch.casts_enabled()
        fallback.remove()


def test_o2_fallback_gives_the_module_its_fp32_masters(half_dtype: torch.dtype) -> None:
    model = net()
    originals = list(model[1].parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O2", cast_model_type=half_dtype,
                                 verbosity=0)
    state = amp_state_of(opt)
    assert state is not None
    x = torch.randn(3, 4)
    if half_dtype == torch.float16:
        assert not torch.isfinite(model(x)).all()
    masters = {id(h): m for h, m in state.masters.pairs()}
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(masters[id(p)]) in stepped for p in originals)  # the optimizer's own fp32
    fallback = Fp32Fallback(model[1], disable_casts=False, cast_back=True,
                            master_of=state.masters.master_of)
    seen: list[torch.dtype] = []
    weights: list[torch.Tensor] = []
    model[2].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    model[1].fc.register_forward_pre_hook(lambda m, a: weights.append(m.weight))
    out = model(x)
    assert torch.isfinite(out).all() and seen == [half_dtype]
    # it computed with the masters, bit for bit ...
    assert torch.equal(weights[0], masters[id(originals[0])])
    # ... while the model keeps its own half Parameters (a DDP wrapper made earlier holds
    # them), and their gradients are where DDP and the unscale look for them
    assert list(model[1].parameters()) == originals
    assert all(p.dtype == half_dtype for p in model[1].parameters())
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == half_dtype for p in originals)
    assert all(masters[id(p)].grad is None for p in originals)
    fallback.remove()


def test_nested_fallbacks_keep_fp32_between_them() -> None:
    inner = nn.Linear(2, 2).half()
    outer = nn.Sequential(inner)
    seen: list[Any] = []
    inner.register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, out.dtype)))
    masters = {id(p): nn.Parameter(p.detach().float()) for p in outer.parameters()}
    hooks = [Fp32Fallback(outer, disable_casts=False, cast_back=True,
                          master_of=lambda p: masters.get(id(p)))]
    float_buffers(outer, Journal())
    hooks.append(Fp32Fallback(inner, disable_casts=False, cast_back=True,
                              master_of=lambda p: masters.get(id(p))))
    out = outer(torch.ones(1, 2, dtype=torch.float16))
    assert out.dtype == torch.float16 and seen == [(torch.float32, torch.float32)]
    for h in hooks:
        h.remove()
