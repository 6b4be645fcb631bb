"""initialize: return shapes, atomicity, the ampx.amp module, re-initialize."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx import patch


def _snapshot() -> list[dict[str, Any]]:
    return [dict(vars(ns)) for ns in (torch, torch.Tensor, torch.nn.functional, torch._VF,
                                      torch.nn.RNNBase)]


def _same(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> bool:
    return all(a.keys() == b.keys() and all(a[k] is b[k] for k in a)
               for a, b in zip(before, after))


def _pair() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_return_shapes_follow_apex(level: str) -> None:
    m, o = _pair()
    assert ampx.initialize(m, opt_level=level, verbosity=0) is m
    m, o = _pair()
    out = ampx.initialize(m, o, opt_level=level, verbosity=0)
    assert out[0] is m and out[1] is o
    (m1, o1), (m2, o2) = _pair(), _pair()
    models, opts = ampx.initialize([m1, m2], [o1, o2], opt_level=level, verbosity=0)
    assert models == [m1, m2] and opts == [o1, o2]
    m, o = _pair()
    model, opts = ampx.initialize(m, [o], opt_level=level, verbosity=0)
    assert model is m and opts == [o]
    m, _ = _pair()
    model, opts = ampx.initialize(m, [], opt_level=level, verbosity=0)
    assert model is m and opts == []


def test_disabled_returns_inputs_untouched() -> None:
    m, o = _pair()
    before = _snapshot()
    assert ampx.initialize(m, o, enabled=False) == (m, o)
    assert ampx.initialize(m, enabled=False) is m
    assert _same(before, _snapshot()) and not hasattr(o, "_ampx")


@pytest.mark.parametrize("kwargs,error", [
    (dict(opt_level="01"), "the prefix O is the letter O"),
    (dict(opt_level="O1", master_weights=True), "master_weights with O1"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32 should be None"),
    (dict(opt_level="O1", cast_model_type=torch.float16), "O1 inserts casts"),
    (dict(opt_level="O2", patch_torch_functions=True), "should only be set by selecting"),
    (dict(opt_level="O2", loss_scale="x"), "neither 'dynamic' nor a number"),
    (dict(opt_level="O2", dtype="int8"), "not a half-precision dtype"),
])
def test_invalid_options_leave_everything_untouched(kwargs: dict[str, Any], error: str) -> None:
    ampx.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=0)  # an earlier session
    before = _snapshot()
    m, o = _pair()
    params = [(p, p.dtype) for p in m.parameters()]
    for exc_type in (ValueError, RuntimeError):  # new code and legacy apex code
        with pytest.raises(exc_type, match=error.replace("(", r"\(")):
            ampx.initialize(m, o, verbosity=0, **kwargs)
    assert _same(before, _snapshot())
    assert [(p, p.dtype) for p in m.parameters()] == params and not hasattr(o, "_ampx")
    assert not m._forward_pre_hooks


@pytest.mark.parametrize("models,optimizers,error", [
    ((nn.Linear(2, 2),), None, "models must be either a single model or a list of models"),
    (nn.Linear(2, 2), (1,), "optimizers must be either a single optimizer or a list"),
    (nn.DataParallel(nn.Linear(2, 2)), None, "Parallel wrappers should only be applied"),
])
def test_bad_models_and_optimizers(models: Any, optimizers: Any, error: str) -> None:
    before = _snapshot()
    with pytest.raises((TypeError, RuntimeError), match=error):
        ampx.initialize(models, optimizers, opt_level="O1", verbosity=0)
    assert _same(before, _snapshot())


def test_failure_late_in_initialize_is_atomic(monkeypatch: pytest.MonkeyPatch) -> None:
    m, o = _pair()
    params = {n: (p, p.detach().clone()) for n, p in m.named_parameters()}

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("late failure")

    monkeypatch.setattr("ampx.frontend.LossScaler.to_", broken)
    before = _snapshot()
    for level in ("O2", "O3", "O1"):
        with pytest.raises(RuntimeError, match="late failure"):
            ampx.initialize(m, o, opt_level=level, verbosity=0)
        assert _same(before, _snapshot())
        for name, p in m.named_parameters():
            assert p is params[name][0] and p.dtype == torch.float32
            assert torch.equal(p, params[name][1])
        assert o.param_groups[0]["params"] == [p for p, _ in params.values()]
        assert not hasattr(o, "_ampx") and not m._forward_pre_hooks and not m._forward_hooks
        assert not o._optimizer_step_pre_hooks


def test_same_optimizer_twice_raises_apex_error() -> None:
    m, o = _pair()
    ampx.initialize(m, o, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="should only be passed through amp.initialize once"):
        ampx.initialize(nn.Linear(2, 2), o, opt_level="O1", verbosity=0)


def test_amp_module_holds_apex_names() -> None:
    import types

    from ampx import amp

    assert isinstance(amp, types.ModuleType)
    for name in ("init", "initialize", "scale_loss", "state_dict", "load_state_dict",
                 "master_params",
                 "disable_casts", "half_function", "float_function", "promote_function",
                 "register_half_function", "register_float_function",
                 "register_promote_function", "_amp_state"):
        assert name in amp.__dict__, name
    assert amp.initialize is ampx.initialize and amp.scale_loss is ampx.scale_loss


def test_deinitialize_is_restore_and_initialize_again_works() -> None:
    assert ampx.deinitialize is ampx.restore
    m, o = _pair()
    m, o = ampx.initialize(m, o, opt_level="O1", verbosity=0)
    ampx.deinitialize()
    assert patch.active() is None
    m2, o2 = _pair()
    ampx.initialize(m2, o2, opt_level="O1", dtype="bf16", verbosity=0)
    assert patch.active() is not None
    assert torch.mm(torch.rand(8, 64), torch.rand(64, 64)).dtype == torch.bfloat16


def test_device_types_default_to_model_devices_and_can_be_overridden() -> None:
    m = nn.Linear(64, 64)
    ampx.initialize(m, opt_level="O1", dtype="bf16", verbosity=0)
    assert patch.active().config.device_types == frozenset({"cpu"})  # type: ignore[union-attr]
    ampx.initialize(nn.Linear(2, 2), opt_level="O1", device_types=["meta"], verbosity=0)
    assert torch.mm(torch.rand(2, 2), torch.rand(2, 2)).dtype == torch.float32
