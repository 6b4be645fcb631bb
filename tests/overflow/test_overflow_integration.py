"""Overflow provenance through the public API: initialize(on_overflow=, detect_overflow=),
ampx.last_overflow(optimizer), the log line, the state dict, telemetry, and host syncs."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

import ampx

INF, NAN = math.inf, math.nan


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class PoisonGrad(torch.autograd.Function):
    """Identity in forward; backward puts `value` into the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: float) -> torch.Tensor:
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        grad.view(-1)[0] = ctx.value
        return grad, None


def init(model: nn.Module, level: str, dtype: torch.dtype = torch.float16, **kw: Any
         ) -> tuple[nn.Module, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0, **kw)


def step(model: nn.Module, opt: torch.optim.Optimizer, loss_id: int = 0,
         x: torch.Tensor | None = None) -> torch.Tensor:
    opt.zero_grad()
    x = torch.randn(4, 8) if x is None else x
    loss = model(x).float().pow(2).mean()
    with ampx.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_param_hook_inf_is_named_exactly(level: str, half_dtype: torch.dtype,
                                           caplog: pytest.LogCaptureFixture) -> None:
    model, opt = init(Net(), level, half_dtype)
    model.layers[2].fc.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), INF))
    with caplog.at_level(logging.DEBUG, logger="ampx"):  # verbosity=0: the skip line is DEBUG
        step(model, opt)
    assert ampx.step_was_skipped(opt)
    report = ampx.last_overflow(opt)
    assert report is not None
    assert report.inf_params == ("layers.2.fc.weight",) and report.nan_params == ()
    assert report.modules == (("layers.2.fc", 1),)
    assert report.step == 0 and report.loss_ids == (0,)
    assert any(r.getMessage().startswith("Gradient overflow in layers.2.fc.weight")
               or r.getMessage().startswith("Non-finite gradients in layers.2.fc.weight")
               for r in caplog.records)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_inf_made_in_one_layers_backward_ranks_that_layer_first(level: str) -> None:
    class Poisoned(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i == 2:
                    x = PoisonGrad.apply(x, INF)  # layer 2's output gradient: inf
            return self.head(x)

    model, opt = init(Poisoned(), level)
    step(model, opt)
    report = ampx.last_overflow(opt)
    assert report is not None and report.culprit == "layers.2.fc"
    assert report.params[0] == "layers.2.fc.bias" or report.params[0] == "layers.2.fc.weight"
    assert "head.weight" not in report.params and "layers.3.fc.weight" not in report.params


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_forward_detector_names_the_layer_that_overflowed(level: str) -> None:
    net = Net()
    with torch.no_grad():
        net.layers[1].fc.weight.fill_(4e4)
    model, opt = init(net, level, detect_overflow="forward")
    step(model, opt)
    report = ampx.last_overflow(opt)
    assert report is not None
    assert (report.forward_module, report.forward_kind) == ("layers.1.fc", "inf")
    assert report.culprit == "layers.1.fc"


def test_nan_and_inf_are_told_apart_and_loss_ids_kept(half_dtype: torch.dtype) -> None:
    model, opt = init(Net(), "O2", half_dtype, num_losses=2)
    model.head.bias.register_hook(lambda g: g * NAN)
    step(model, opt, loss_id=1)
    report = ampx.last_overflow(opt)
    assert report is not None
    assert report.nan_params == ("head.bias",) and report.inf_params == ()
    assert report.loss_ids == (1,) and report.params_by_loss == {1: ("head.bias",)}


def test_clean_steps_make_no_extra_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = init(Net(), "O2", detect_overflow="forward")
    step(model, opt)  # warm up (caches)
    calls: list[str] = []
    for name in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(t: torch.Tensor, *a: Any, _n: str = name, _o: Any = original,
                     **k: Any) -> Any:
            calls.append(_n)
            return _o(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    for _ in range(3):
        step(model, opt)
    monkeypatch.undo()
    assert not ampx.step_was_skipped(opt) and ampx.last_overflow(opt) is None
    assert calls == ["item"] * 3  # the skip decision's one read per step, nothing more


def test_raise_policy_raises_floating_point_error_with_the_report() -> None:
    model, opt = init(Net(), "O1", on_overflow="raise", overflow_patience=2)
    model.head.weight.register_hook(lambda g: g * INF)
    step(model, opt)
    with pytest.raises(FloatingPointError) as info:
        step(model, opt)
    assert info.value.report.inf_params == ("head.weight",)  # type: ignore[attr-defined]


def test_telemetry_step_records_carry_the_offenders(tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tel.jsonl"
    monkeypatch.setenv("AMPX_TELEMETRY", str(path))
    model, opt = init(Net(), "O1")
    handle = model.embed.bias.register_hook(lambda g: g * INF)
    step(model, opt)
    handle.remove()
    step(model, opt)
    monkeypatch.delenv("AMPX_TELEMETRY")
    from ampx import telemetry

    telemetry.sink()
    steps = [json.loads(line) for line in path.read_text().splitlines()
             if json.loads(line)["event"] == "step"]
    assert steps[0]["skipped"] and steps[0]["overflow"]["inf_params"] == ["embed.bias"]
    assert not steps[1]["skipped"] and steps[1].get("overflow") is None


def test_fairseq_wrapper_exceptions_carry_the_report() -> None:
    from ampx.compat.fairseq.optimizer import AmpOptimizer

    model = Net()
    amp = ampx.Amp(opt_level="O2", init_scale=4.0, min_loss_scale=1.0, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01))
    wrapper = AmpOptimizer(opt, amp)
    model.layers[0].fc.bias.register_hook(lambda g: g * INF)
    with pytest.raises(OverflowError) as info:
        wrapper.zero_grad()
        wrapper.backward(model(torch.randn(4, 8)).float().pow(2).mean())
        wrapper.step()
    assert info.value.report.inf_params == ("layers.0.fc.bias",)  # type: ignore[attr-defined]
    with pytest.raises(FloatingPointError, match="Minimum loss scale") as fp:
        for _ in range(3):
            try:
                wrapper.zero_grad()
                wrapper.backward(model(torch.randn(4, 8)).float().pow(2).mean())
                wrapper.step()
            except OverflowError:
                pass
    assert fp.value.report.modules[0][0] == "layers.0.fc"  # type: ignore[attr-defined]
    assert "inf gradients (1): layers.0.fc.bias" in str(fp.value)


class Normed(nn.Module):
    """fp16 overflows inside (fc's output is ~2e5), yet the output is normalised: fp32 fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.weight.normal_(2e4, 10.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.abs() + 1)
        return x + h / h.norm(dim=-1, keepdim=True)


def overflow_prone(level: str, on_overflow: str, checkpoint: dict[str, Any] | None = None
                   ) -> tuple[nn.Module, torch.optim.Optimizer, ampx.Amp]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Normed(), nn.Linear(8, 1))
    amp = ampx.Amp(opt_level=level, on_overflow=on_overflow, overflow_patience=3,
                   detect_overflow="forward", min_loss_scale=1.0, verbosity=0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05))
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
    return model, opt, amp


def regress(model: nn.Module, opt: torch.optim.Optimizer, amp: ampx.Amp, steps: int
            ) -> tuple[list[float], list[bool]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = x[:, :1] * 0.5 + 0.2
    losses, skipped = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
        skipped.append(amp.step_was_skipped(opt))
    return losses, skipped


# O1: 1.fc runs in fp32 after 3 skips and its normalised output fits. O2 casts 1.fc's output
# back to half, where its ~2e5 values still overflow: 3 more skips move its parent to fp32.
FALLBACKS = {"O1": ["1.fc"], "O2": ["1.fc", "1"]}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp32_fallback_recovers_where_skipping_stalls(level: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    stalled = regress(*overflow_prone(level, "skip"), steps=12)[1]
    assert all(stalled)
    ampx.restore()
    model, opt, amp = overflow_prone(level, "fp32-fallback")
    with caplog.at_level(logging.DEBUG, logger="ampx"):  # verbosity=0: the skip line is DEBUG
        losses, skipped = regress(model, opt, amp, 40)
    expected = FALLBACKS[level]
    n = 3 * len(expected)
    assert skipped[:n] == [True] * n and not any(skipped[n:])
    assert losses[-1] < 0.5 * losses[n]
    logged = [r.getMessage() for r in caplog.records if "runs in float32" in r.getMessage()]
    assert [m.split(": ")[2].split(" runs")[0] for m in logged] == expected  # once each
    assert any("Gradient overflow" in r.getMessage() and "activations first" in r.getMessage()
               for r in caplog.records)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "amp": amp.state_dict()}
    assert saved["amp"]["overflow_policy"]["fp32_modules"] == expected
    ampx.restore()
    model2, opt2, amp2 = overflow_prone(level, "fp32-fallback", saved)
    assert amp2.overflow_watch is not None and list(amp2.overflow_watch.fallbacks) == expected
    losses2, skipped2 = regress(model2, opt2, amp2, 5)
    assert not any(skipped2) and losses2[-1] < losses[n]


def test_a_malformed_policy_entry_changes_nothing() -> None:
    model, opt, amp = overflow_prone("O1", "fp32-fallback")
    before = amp.state_dict()
    bad = dict(before, overflow_policy={"fp32_modules": ["no.such.module"]})
    with pytest.raises(ampx.CheckpointError, match="no module 'no.such.module'"):
        amp.load_state_dict(bad)
    assert amp.state_dict() == before


def test_bad_provenance_options_are_refused_by_name() -> None:
    for kwargs, match in (({"on_overflow": "ignore"}, "on_overflow='ignore'"),
                          ({"overflow_patience": 0}, "overflow_patience"),
                          ({"detect_overflow": "backward"}, "detect_overflow='backward'")):
        with pytest.raises(ValueError, match=match):
            ampx.Amp(opt_level="O1", **kwargs)


def test_fused_optimizers_skip_on_the_device_and_get_no_report() -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    model, opt = ampx.initialize(model, opt, opt_level="O2", verbosity=0)
    model.head.bias.register_hook(lambda g: g * INF)
    step(model, opt)
    assert ampx.step_was_skipped(opt) and ampx.last_overflow(opt) is None


def test_watch_state_checks_and_detect_values() -> None:
    from ampx.options.values import parse_detect_overflow

    model, opt, amp = overflow_prone("O1", "fp32-fallback")
    watch = amp.overflow_watch
    assert watch is not None
    with pytest.raises(ValueError, match="overflow_policy.fp32_modules: the models have no "
                                         "module 'nope'"):
        watch.check_state({"fp32_modules": ["nope"]})
    assert watch.fallbacks == {}
    with pytest.raises(ValueError, match="detect_overflow='backward' is not one of"):
        parse_detect_overflow("backward")
    assert parse_detect_overflow(False) is None and parse_detect_overflow("none") is None


def test_a_skip_session_keeps_apex_checkpoint_keys() -> None:
    model, opt = init(Net(), "O2")
    assert list(ampx.state_dict()) == ["loss_scaler0"]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_two_losses_in_one_step_are_told_apart(level: str) -> None:
    class TwoHeads(Net):
        def forward(self, x: torch.Tensor) -> Any:
            h = self.embed(x)
            return self.head(h), self.layers[0](h)

    model, opt = init(TwoHeads(), level, num_losses=2, init_scale=2.0**8)
    model.layers[0].fc.weight.register_hook(lambda g: g * INF)
    opt.zero_grad()
    out0, out1 = model(torch.randn(4, 8))
    for loss_id, out in ((0, out0), (1, out1)):
        with ampx.scale_loss(out.float().pow(2).mean(), opt, loss_id=loss_id) as scaled:
            scaled.backward(retain_graph=loss_id == 0)
    opt.step()
    report = ampx.last_overflow(opt)
    assert report is not None and report.loss_ids == (0, 1)
    assert report.params_by_loss == {1: ("layers.0.fc.weight",)}
    assert set(report.scales) == {1} and report.loss_id == 1
    assert report.scale_after == report.scale_before / 2
