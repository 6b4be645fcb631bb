"""compensation="kahan" at O3 (issue 40): half weights that keep the update's lost bits.

Each optimizer is trained the same way in float32, at plain O3 and at O3 with compensation
(bf16, many small steps): the compensated weights stay close to float32's and much closer
than plain O3's. Also: the options' checks, torch's state format on the fused path, the
initial residual, bitwise reproducibility and resume, skipped steps, LR schedulers, LBFGS's
closure in the half model, and transactions under injected faults (runs on both backends:
this directory is marked ``kernel_backend``).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.compat.apex.optimizers import FusedAdam
from ampx.scaling import compensated

BF16 = torch.bfloat16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 16, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def _loss(model: nn.Module) -> torch.Tensor:
    x, y = _data()
    return ((model(x).float() - y) ** 2).mean()


def _half_loss(model: nn.Module) -> torch.Tensor:
    """A plain half model (no ampx): its inputs cast by hand."""
    x, y = _data()
    return ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _make(level: str | None, opt_cls: Any, comp: str | None = None, **kw: Any) -> tuple:
    model = _model()
    opt = opt_cls(model.parameters(), **kw)
    amp = None
    if level is not None:
        amp = ampx.Amp(level, dtype=BF16, compensation=comp, verbosity=0)
        model, opt = amp.initialize(model, opt)
    return amp, model, opt


def _step(amp: Any, model: nn.Module, opt: Any) -> None:
    opt.zero_grad()
    loss = _loss(model) if amp is not None or next(model.parameters()).dtype == torch.float32 \
        else _half_loss(model)
    if amp is None:
        loss.backward()
    else:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()


def _train(level: str | None, opt_cls: Any, comp: str | None, steps: int, **kw: Any) -> tuple:
    amp, model, opt = _make(level, opt_cls, comp, **kw)
    for _ in range(steps):
        _step(amp, model, opt)
    return amp, model, opt


OPTIMIZERS: list[tuple[str, Any, dict[str, Any]]] = [
    ("sgd", torch.optim.SGD, dict(lr=1e-3)),
    ("sgd-momentum", torch.optim.SGD, dict(lr=1e-3, momentum=0.9, weight_decay=1e-2)),
    ("sgd-nesterov-foreach", torch.optim.SGD,
     dict(lr=1e-3, momentum=0.9, nesterov=True, foreach=True)),
    ("sgd-dampening-maximize", torch.optim.SGD,
     dict(lr=1e-3, momentum=0.5, dampening=0.3, maximize=True)),
    ("adam", torch.optim.Adam, dict(lr=1e-4, foreach=False)),
    ("adam-foreach-l2", torch.optim.Adam, dict(lr=1e-4, foreach=True, weight_decay=1e-2)),
    ("adam-fused", torch.optim.Adam, dict(lr=1e-4, fused=True)),
    ("adam-amsgrad", torch.optim.Adam, dict(lr=1e-4, amsgrad=True)),  # the general path
    ("adamw", torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.1)),
    ("adamw-fused", torch.optim.AdamW, dict(lr=1e-4, fused=True, weight_decay=0.1)),
    ("adagrad", torch.optim.Adagrad, dict(lr=1e-3)),
    ("rmsprop", torch.optim.RMSprop, dict(lr=1e-4)),
    ("apex-fusedadam", FusedAdam, dict(lr=1e-4)),
]


@pytest.mark.parametrize("name,opt_cls,kw", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_closer_to_fp32_than_plain_o3(name: str, opt_cls: Any, kw: dict[str, Any]) -> None:
    steps = 150
    _, ref, _ = _train(None, opt_cls, None, steps, **kw)
    _, plain, _ = _train("O3", opt_cls, None, steps, **kw)
    _, kahan, opt = _train("O3", opt_cls, "kahan", steps, **kw)
    target = _flat(ref)
    err_plain = (_flat(plain) - target).abs().max().item()
    err_kahan = (_flat(kahan) - target).abs().max().item()
    assert all(p.dtype == BF16 for p in kahan.parameters())  # the weights stay half
    assert err_kahan < err_plain / 3, (err_kahan, err_plain)
    assert err_kahan < 1e-2  # (bf16 forward and gradients: Adam's normalised steps differ)
    assert all(opt.state[p][compensated.KEY].dtype == BF16 for p in kahan.parameters())


def test_fused_path_keeps_torchs_state_format() -> None:
    for opt_cls, kw, keys in [
        (torch.optim.SGD, dict(lr=1e-3, momentum=0.9), {"momentum_buffer"}),
        (torch.optim.AdamW, dict(lr=1e-3), {"step", "exp_avg", "exp_avg_sq"}),
        (torch.optim.Adam, dict(lr=1e-3, fused=True), {"step", "exp_avg", "exp_avg_sq"}),
    ]:
        _, plain, popt = _train("O3", opt_cls, None, 2, **kw)
        _, kahan, kopt = _train("O3", opt_cls, "kahan", 2, **kw)
        assert compensated.fused_path(kopt)
        for p, q in zip(plain.parameters(), kahan.parameters()):
            torch_state, ours = popt.state[p], kopt.state[q]
            assert set(ours) == keys | {compensated.KEY} and set(torch_state) == keys
            for key in keys:
                a, b = torch_state[key], ours[key]
                assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape), key
            if "step" in keys:
                assert ours["step"].item() == 2.0


def test_a_plain_torch_optimizer_loads_the_state() -> None:
    """Going back to plain torch: the state is torch's, the extra entry is ignored."""
    for opt_cls, kw in [(torch.optim.AdamW, dict(lr=1e-3)),
                        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))]:
        _, kahan, opt = _train("O3", opt_cls, "kahan", 3, **kw)
        plain_model = _model().to(BF16)
        plain_model.load_state_dict(kahan.state_dict())
        plain = opt_cls(plain_model.parameters(), **kw)
        plain.load_state_dict(opt.state_dict())
        _step(None, plain_model, plain)  # torch's own step on that state
        assert torch.isfinite(_flat(plain_model)).all()
        assert (_flat(plain_model) - _flat(kahan)).abs().max() < 0.05


def test_general_path_for_every_other_optimizer() -> None:
    assert not compensated.fused_path(_make("O3", torch.optim.Adagrad, "kahan", lr=1)[2])
    assert not compensated.fused_path(_make("O3", torch.optim.Adam, "kahan", amsgrad=True)[2])
    assert compensated.fused_path(_make("O3", torch.optim.Adam, "kahan", foreach=True)[2])


def test_initial_compensation_keeps_the_fp32_weights() -> None:
    fp32 = _flat(_model())
    _, model, opt = _make("O3", torch.optim.SGD, "kahan", lr=0.1)
    x = _values(model, opt)
    rel = ((x - fp32).abs() / fp32.abs().clamp_min(1e-30)).max().item()
    assert rel < 2.0**-15  # about 16 bits, against bf16's 8
    assert (_flat(model) - fp32).abs().max() > 0  # the half weight alone is coarser


def test_options_are_checked() -> None:
    assert ampx.Amp("O3", compensation="kahan").properties.compensation == "kahan"
    assert ampx.Amp("O2", master_weights=False, compensation="kahan").properties.compensation
    assert ampx.Amp("O3", compensation="none").properties.compensation is None
    for level in ("O0", "O1", "O2"):
        with pytest.raises(ValueError, match="compensation='kahan'.*O3"):
            ampx.Amp(level, compensation="kahan")
    with pytest.raises(ValueError, match="compensation='stochastic' is not one of 'kahan'"):
        ampx.Amp("O3", compensation="stochastic")


def test_bitwise_reproducible() -> None:
    runs = [_flat(_train("O3", torch.optim.AdamW, "kahan", 20, lr=1e-3)[1]) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.AdamW, dict(lr=1e-3)),
                                        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
                                        (torch.optim.RMSprop, dict(lr=1e-3))],
                         ids=["adamw", "sgd", "rmsprop"])
def test_resume_is_bitwise(opt_cls: Any, kw: dict[str, Any]) -> None:
    amp, model, opt = _train("O3", opt_cls, "kahan", 5, **kw)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "amp": amp.state_dict()}, buf)
    for _ in range(5):
        _step(amp, model, opt)
    buf.seek(0)
    saved = torch.load(buf)
    amp2, model2, opt2 = _make("O3", opt_cls, "kahan", **kw)  # fresh objects
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    amp2.load_state_dict(saved["amp"])
    for _ in range(5):
        _step(amp2, model2, opt2)
    assert torch.equal(_flat(model), _flat(model2))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p][compensated.KEY], opt2.state[q][compensated.KEY])


def test_a_weight_written_before_the_first_step_drops_its_residual() -> None:
    """As DDP's broadcast: the written half weight is the whole value (c = 0 on every rank)."""
    _, model, opt = _make("O3", torch.optim.SGD, "kahan", lr=0.0)
    first = next(model.parameters())
    with torch.no_grad():
        first.copy_(torch.ones_like(first))
    _step(None, model, opt)
    assert not opt.state[first][compensated.KEY].any()
    assert opt.state[list(model.parameters())[1]][compensated.KEY].any()  # not written


def test_non_finite_step_is_skipped_whole() -> None:
    amp, model, opt = _train("O3", torch.optim.AdamW, "kahan", 2, lr=1e-3)
    before = copy.deepcopy((_flat(model), opt.state_dict()))
    opt.zero_grad()
    with amp.scale_loss(_loss(model) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt) if hasattr(amp, "step_was_skipped") else True
    assert torch.equal(before[0], _flat(model))
    _same_state(before[1], opt.state_dict())


def _values(model: nn.Module, opt: Any) -> torch.Tensor:
    """x = f32(w) + f32(c) of every parameter (a pair may change while x stays)."""
    return torch.cat([(p.detach().float() + opt.state[p][compensated.KEY].float()).flatten()
                      for p in model.parameters()])


def test_lr_scheduler_drives_the_fused_path() -> None:
    amp, model, opt = _make("O3", torch.optim.SGD, "kahan", lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0 if epoch >= 1 else 1.0)
    start = _values(model, opt)
    _step(amp, model, opt)
    sched.step()
    frozen = _values(model, opt)
    assert not torch.equal(start, frozen)
    _step(amp, model, opt)  # lr 0 now: nothing moves
    assert torch.equal(frozen, _values(model, opt))


def test_lbfgs_closure_runs_in_the_half_model() -> None:
    seen: list[torch.dtype] = []

    def run(level: str | None, comp: str | None) -> nn.Module:
        model = _model()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5,
                                line_search_fn="strong_wolfe")
        if level is not None:
            # bf16's default skip check evaluates the closure before the step; LBFGS
            # evaluates it again inside, so this run turns that check off
            model, opt = ampx.initialize(model, opt, opt_level=level, dtype=BF16,
                                         compensation=comp, skip_non_finite=False,
                                         verbosity=0)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            seen.append(next(model.parameters()).dtype)
            loss = _loss(model)
            loss.backward()
            return loss

        for _ in range(3):
            out = opt.step(closure)
            assert isinstance(out, torch.Tensor)
        return model

    ref = _flat(run(None, None))
    seen.clear()
    kahan = run("O3", "kahan")
    assert seen and set(seen) == {BF16}  # every evaluation ran the half model
    assert all(p.dtype == BF16 for p in kahan.parameters())
    assert (_flat(kahan) - ref).abs().max().item() < 0.05  # (bf16 forward: not closer)


# -- transactions --------------------------------------------------------------------------------

def _snapshot(model: nn.Module, opt: Any) -> tuple:
    return _flat(model).clone(), copy.deepcopy(opt.state_dict())


def _same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_state(x, y)
    else:
        assert a == b


def _check_unchanged(model: nn.Module, opt: Any, before: tuple) -> None:
    assert torch.equal(before[0], _flat(model))
    _same_state(before[1], opt.state_dict())


class _Boom(Exception):
    pass


class _RaisingAdagrad(torch.optim.Adagrad):
    """Changes its parameters and state, then raises (a fault inside the optimizer's step)."""

    fault: type[BaseException] = _Boom

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        raise self.fault


@pytest.mark.parametrize("fault", [_Boom, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["hook", "closure", "general-step", "kernel-prepare"])
def test_a_fault_in_the_step_changes_nothing(fault: type[BaseException], where: str) -> None:
    opt_cls: Any = _RaisingAdagrad if where == "general-step" else torch.optim.AdamW
    amp, model, opt = _train("O3", opt_cls, "kahan", 0, lr=1e-3)
    if where != "general-step":
        for _ in range(2):
            _step(amp, model, opt)
    opt.zero_grad()
    with amp.scale_loss(_loss(model), opt) as scaled:
        scaled.backward()
    before = _snapshot(model, opt)
    args: tuple = ()
    restore: Callable[[], None] = lambda: None  # noqa: E731
    if where == "hook":
        def hook(*_: Any) -> None:
            raise fault
        handle = opt.register_step_pre_hook(hook)  # after ampx's: runs after its pre-hook
        restore = handle.remove
    elif where == "closure":
        def closure() -> Any:
            raise fault
        args = (closure,)
    elif where == "general-step":
        _RaisingAdagrad.fault = fault
    else:
        real = compensated._prepare_adam

        def broken(*a: Any) -> None:
            raise fault
        compensated._prepare_adam = broken  # type: ignore[assignment]
        restore = lambda: setattr(compensated, "_prepare_adam", real)  # noqa: E731
    with pytest.raises(fault):
        opt.step(*args)
    restore()
    _check_unchanged(model, opt, before)
    if where == "general-step":
        return
    ref_amp, ref_model, ref_opt = _train("O3", opt_cls, "kahan", 2, lr=1e-3)
    _step(ref_amp, ref_model, ref_opt)
    opt.step()  # the pending step completes as an uninterrupted one
    assert torch.equal(_flat(ref_model), _flat(model))


def test_a_failing_kernel_is_finished_on_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels write nothing when they raise: the step rolls forward, then re-raises."""
    ref_amp, ref_model, ref_opt = _train("O3", torch.optim.SGD, "kahan", 3, lr=1e-2,
                                         momentum=0.9)
    amp, model, opt = _train("O3", torch.optim.SGD, "kahan", 2, lr=1e-2, momentum=0.9)

    class Failing:
        def compensated_sgd_(self, *a: Any, **k: Any) -> None:
            raise RuntimeError("native kernel failed")

    monkeypatch.setattr(compensated, "_kernels", lambda: Failing())
    with pytest.raises(RuntimeError, match="native kernel failed"):
        _step(amp, model, opt)
    monkeypatch.undo()
    assert torch.equal(_flat(ref_model), _flat(model))
    _same_state(ref_opt.state_dict(), opt.state_dict())


# -- memory --------------------------------------------------------------------------------------

def _held_bytes(model: nn.Module, opt: Any) -> tuple[int, int]:
    """(bytes of every tensor a parameter holds at the step, parameter count): weights,
    gradients, O2's masters and their gradients, optimizer state (scalars left out)."""
    seen: dict[int, torch.Tensor] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            seen[id(t)] = t

    tensors = [*model.parameters(), *ampx.master_params(opt)]
    for t in tensors:
        add(t)
        add(t.grad)
    for entry in opt.state.values():
        for value in entry.values():
            add(value)
    count = sum(p.numel() for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in seen.values()), count


@pytest.mark.parametrize("mode", compensated.MODES)
@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adamw"])
def test_bytes_per_parameter_rules_match_a_measured_run(mode: str, opt_name: str) -> None:
    level, _, comp = mode.partition("+")
    opt_cls: Any = torch.optim.AdamW if opt_name == "adamw" else torch.optim.SGD
    kw = dict(lr=1e-3) if opt_name == "adamw" else dict(lr=1e-3, momentum=0.9)
    amp, model, opt = _make(level, opt_cls, comp or None, **kw)
    _step(amp, model, opt)  # the state exists from the first step on
    opt.zero_grad()
    with amp.scale_loss(_loss(model), opt) as scaled:  # (amp is set: level is never None)
        scaled.backward()
    held, count = _held_bytes(model, opt)  # what the step sees
    assert held == count * sum(compensated.bytes_per_param(mode, opt_name).values())


def test_info_prints_the_bytes_per_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    from ampx.cli import main as cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "O3+kahan  2        2      0        2" in out


# -- the command line ----------------------------------------------------------------------------

def test_ampx_run_forces_the_compensation() -> None:
    from ampx.cli import main as cli

    args = cli.build_parser().parse_args(["run", "-O", "O3", "--compensation", "kahan", "x.py"])
    forced = cli._forced_from_args(args)
    assert forced.options["compensation"] == "kahan"
    props = ampx.options.levels.resolve_properties(**forced.apply({"opt_level": "O1"}))
    assert props.compensation == "kahan" and props.master_weights is False
    bad = cli.build_parser().parse_args(["run", "-O", "O2", "--compensation", "kahan", "x.py"])
    with pytest.raises(cli._UsageError, match="compensation='kahan'"):
        cli._forced_from_args(bad)


def test_the_sweep_has_an_o3_kahan_row(tmp_path: Any) -> None:
    from ampx.cli import main as cli
    from ampx.cli.sweep.command import spec_from_args
    from ampx.cli.sweep.run import command_for

    args = cli.build_parser().parse_args(["sweep", "--out", str(tmp_path)])
    args.script_args = []  # (what `ampx sweep`'s main sets)
    spec = spec_from_args(args)
    labels = [c.label for c in spec.configs]
    assert "O3+kahan bf16" in labels and labels.index("O3+kahan bf16") > labels.index("O3 bf16")
    config = spec.configs[labels.index("O3+kahan bf16")]
    cmd = command_for(spec, config, tmp_path / "t.jsonl")
    assert cmd[cmd.index("--opt-level") + 1] == "O3"
    assert cmd[cmd.index("--compensation") + 1] == "kahan"
    levels = cli.build_parser().parse_args(["sweep", "--levels", "O0,o3+KAHAN"]).levels
    assert levels == ["O0", "O3+kahan"]
