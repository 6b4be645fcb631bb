"""initialize: return shapes, atomicity, the ampx.amp module, re-initialize."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.o1 import patch


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
    # issue 9, item 10
    (dict(opt_level="O2", cast_model_type=torch.float64), "cast_model_type=torch.float64"),
    (dict(opt_level="O2", init_scale=float("inf"), max_loss_scale=float("inf")),
     "init_scale=inf must be a positive finite"),
    (dict(opt_level="O2", enabled="False"), "enabled='False' must be True or False"),
    (dict(opt_level="O1", device_types=123), "device_types=123 must be a device type"),
    (dict(opt_level="O2", min_loss_scale=2.0**20), "larger than the initial scale"),
    (dict(opt_level="O1", num_losess=2), "unknown option.*'num_losess'"),
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

    monkeypatch.setattr("ampx.scaling.scaler.LossScaler.to_", broken)
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


# -- issue 9, item 10: bad models and optimizers leave everything untouched ----------------------

def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(4, 4)


def _bad_inputs(case: str) -> tuple[Any, Any, list[nn.Module], list[torch.optim.Optimizer]]:
    m, o = _pair()
    if case == "foreign optimizer":
        other = nn.Linear(4, 4)
        o = torch.optim.SGD(other.parameters(), lr=0.1)
        return m, o, [m], [o]
    if case == "empty optimizer":
        o = torch.optim.SGD([{"params": []}], lr=0.1)
        return m, o, [m], [o]
    if case == "same model twice":
        return [m, m], o, [m], [o]
    if case == "shared parameters":
        return [m, m[0]], o, [m], [o]
    meta = _meta_model()
    return meta, None, [meta], []


BAD_INPUTS = {
    "foreign optimizer": "optimizers\\[0\\] \\(SGD\\) holds none of the models' parameters",
    "empty optimizer": "optimizers\\[0\\] \\(SGD\\) holds no parameters",
    "same model twice": "models\\[0\\] and models\\[1\\] are the same model",
    "shared parameters": "models\\[0\\] and models\\[1\\] share parameters",
    "meta model": "models\\[0\\] has 'weight' on the meta device",
}


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_are_refused_and_nothing_changes(case: str, level: str,
                                                    half_dtype: torch.dtype) -> None:
    if case == "shared parameters" and level == "O1":  # O1 does not cast: that is fine
        models, optimizers, _, _ = _bad_inputs(case)
        ampx.initialize(models, optimizers, opt_level=level, dtype=half_dtype, verbosity=0)
        return
    models, optimizers, model_list, opt_list = _bad_inputs(case)
    before = _snapshot()
    params = [[(p, p.dtype) for p in m.parameters()] for m in model_list]
    for exc_type in (ValueError, RuntimeError):
        with pytest.raises(exc_type, match=BAD_INPUTS[case]):
            ampx.initialize(models, optimizers, opt_level=level, dtype=half_dtype, verbosity=0)
    assert _same(before, _snapshot()) and ampx.frontend.default_session() is None
    assert [[(p, p.dtype) for p in m.parameters()] for m in model_list] == params
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model_list)
    assert all(not hasattr(o, "_ampx") and not o._optimizer_step_pre_hooks for o in opt_list)


# -- issue 9, item 11: a failure at any stage of initialize undoes everything ------------------

def _two_pairs() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.Linear(8, 2)]
    opts: list[torch.optim.Optimizer] = [
        torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(models[1].parameters(), lr=0.1),
    ]
    for model, opt in zip(models, opts):  # existing optimizer state (recast at O2/O3)
        model(torch.randn(4, 8 if model is models[1] else 4)).sum().backward()
        opt.step()
    return models, opts


def _state_of_everything(models: list[nn.Module], opts: list[torch.optim.Optimizer]) -> Any:
    def tensors(named: Any) -> list[Any]:
        return [(n, t, t.dtype, t.detach().clone(),
                 None if getattr(t, "grad", None) is None else t.grad.clone())
                for n, t in named]

    out: list[Any] = []
    for model in models:
        out.append(tensors(model.named_parameters()) + tensors(model.named_buffers()))
        out.append([(list(m._forward_pre_hooks), list(m._forward_hooks),
                     list(m._state_dict_hooks), list(m._load_state_dict_pre_hooks))
                    for m in model.modules()])
    for opt in opts:
        out.append([list(g["params"]) for g in opt.param_groups])
        out.append({id(p): [(k, v, v.clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in s.items()] for p, s in opt.state.items()})
        out.append((list(opt._optimizer_step_pre_hooks), list(opt._optimizer_step_post_hooks),
                    sorted(vars(opt))))
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a is b or a == b


def _inject(monkeypatch: pytest.MonkeyPatch, target: str, nth: int,
            exc: BaseException) -> list[int]:
    import pydoc

    owner_path, name = target.rsplit(".", 1)
    owner = pydoc.locate(owner_path)
    original = getattr(owner, name)
    calls = [0]

    def fail_at_nth(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, fail_at_nth)
    return calls


# (target, nth call, levels where initialize reaches that call)
STAGES = [
    ("ampx.initializer.cast_model", 1, "O1 O2 O3"),
    ("ampx.initializer.cast_model", 2, "O1 O2 O3"),
    ("torch.nn.Module.register_load_state_dict_pre_hook", 3, "O2 O3"),  # inside a cast
    ("ampx.initializer.recast_state", 1, "O2 O3"),
    ("ampx.initializer.recast_state", 2, "O2 O3"),
    ("ampx.initializer.attach", 1, "O1 O2 O3"),
    ("ampx.initializer.attach", 2, "O1 O2 O3"),
    ("torch.optim.Optimizer.register_step_post_hook", 1, "O1 O2 O3"),  # inside attach
    ("torch.optim.Optimizer.register_step_post_hook", 2, "O1 O2 O3"),
    ("ampx.scaling.scaler.LossScaler.to_", 1, "O1 O2 O3"),
    ("ampx.o1.patch.activate", 1, "O1"),
]
CASES = [(t, n, lv) for t, n, levels in STAGES for lv in levels.split()]


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
@pytest.mark.parametrize("target,nth,level", CASES,
                         ids=[f"{t.rsplit('.', 1)[-1]}#{n}-{lv}" for t, n, lv in CASES])
def test_failure_at_each_stage_of_initialize_changes_nothing(
        monkeypatch: pytest.MonkeyPatch, target: str, nth: int, level: str,
        exc: BaseException, half_dtype: torch.dtype) -> None:
    earlier_model, earlier_opt = _pair()
    earlier = ampx.initialize(earlier_model, earlier_opt, opt_level="O1", verbosity=0)
    session, patches = ampx.frontend.default_session(), patch.active()
    scalers = list(ampx.amp._amp_state.loss_scalers)
    models, opts = _two_pairs()
    before, namespaces = _state_of_everything(models, opts), _snapshot()
    calls = _inject(monkeypatch, target, nth, exc)
    with pytest.raises(type(exc)):
        ampx.initialize(models, opts, opt_level=level, dtype=half_dtype, verbosity=0)
    assert calls[0] == nth  # the fault fired where intended
    monkeypatch.undo()
    assert _equal(_state_of_everything(models, opts), before)
    assert _same(namespaces, _snapshot()) and patch.active() is patches
    assert ampx.frontend.default_session() is session and earlier[1]._ampx.owner is session
    assert ampx.amp._amp_state.loss_scalers == scalers
    # and a clean initialize of the same objects works afterwards
    ampx.initialize(models, opts, opt_level=level, dtype=half_dtype, verbosity=0)


# -- issue 11, item 3: the option table tells the truth ------------------------------------------

@pytest.mark.parametrize("level,brief", [
    ("O2", "{} training with FP32 batchnorm and FP32 master weights."),
    ("O3", "Pure {} training."),
])
def test_log_names_the_dtype_and_effective_output_cast(caplog: pytest.LogCaptureFixture,
                                                       level: str, brief: str,
                                                       half_dtype: torch.dtype) -> None:
    m, o = _pair()
    with caplog.at_level("INFO", logger="ampx"):
        m, o = ampx.initialize(m, o, opt_level=level, dtype=half_dtype)
    lines = [r.getMessage() for r in caplog.records]
    name = "BF16" if half_dtype == torch.bfloat16 else "FP16"
    assert f"Selected optimization level {level}:  {brief.format(name)}" in lines
    assert "cast_model_outputs     : float32" in lines
    assert m(torch.randn(4, 4)).dtype == torch.float32  # what the table says
