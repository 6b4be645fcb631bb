"""OverflowWatch on real O1/O2 sessions: the fp32 fallback recovers a model that overflows in one
known layer where plain skipping stalls, survives a checkpoint round trip, and the raise policy
stops a stalled run with the report."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.optimizer import amp_state_of
from ampx.overflow_policy import OverflowPersistsError
from ampx.overflow_session import OverflowWatch, parse_detect_overflow


class Normed(nn.Module):
    """fp16 overflows inside (fc's output is ~1e5), yet the output is normalised: fp32 fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.weight.normal_(2e4, 10.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.abs() + 1)
        return x + h / h.norm(dim=-1, keepdim=True)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Normed(), nn.Linear(8, 1))


class ScalerView:
    """The scaler surface OverflowWatch uses (main's scaler logs its own line at step time)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def report_overflow(self, where: str = "") -> tuple[float, float] | None:
        return None

    def at_minimum(self) -> bool:
        return bool(self.scaler.at_minimum())


def release_from(opt: torch.optim.Optimizer) -> Any:
    state = amp_state_of(opt)
    assert state is not None

    def release(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        for half, _ in pairs:
            state.masters._by_id.pop(id(half))
        state._cache = None
    return release


def session(opt_level: str, on_overflow: str, patience: int = 3
            ) -> tuple[nn.Module, Any, Any, OverflowWatch]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp = ampx.Amp(opt_level=opt_level, verbosity=0, min_loss_scale=1.0)
    model, opt = amp.initialize(model, opt)
    state = amp_state_of(opt)
    assert state is not None
    watch = OverflowWatch([model], state.masters.pairs(), on_overflow=on_overflow,
                          patience=patience, detect_overflow="forward",
                          casts_patched=opt_level == "O1", release_masters=release_from(opt))
    return model, opt, amp, watch


def train(model: nn.Module, opt: Any, amp: Any, watch: OverflowWatch, steps: int
          ) -> tuple[list[float], list[bool]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = x[:, :1] * 0.5 + 0.2
    losses, skipped = [], []
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        skip = amp.step_was_skipped(opt)
        if skip:
            watch.on_skip(opt, [], step=step, loss_ids=[0],
                          scalers=[ScalerView(s) for s in amp.scalers])
        else:
            watch.on_clean()
        watch.after_step()
        losses.append(loss.item())
        skipped.append(skip)
    return losses, skipped


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_plain_skipping_stalls(opt_level: str) -> None:
    model, opt, amp, watch = session(opt_level, "skip")
    losses, skipped = train(model, opt, amp, watch, 12)
    assert all(skipped)
    assert watch.last(opt) is not None and watch.last(opt).forward_module == "1.fc"
    watch.remove()


# O1: 1.fc runs in fp32 after 3 skips and its normalised output fits. O2 casts 1.fc's output
# back to half, where its ~1e5 values still overflow: 3 more skips move its parent to fp32.
FALLBACKS = {"O1": ["1.fc"], "O2": ["1.fc", "1"]}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp32_fallback_recovers_and_survives_a_checkpoint(opt_level: str,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    model, opt, amp, watch = session(opt_level, "fp32-fallback", patience=3)
    with caplog.at_level(logging.WARNING, logger="ampx"):
        losses, skipped = train(model, opt, amp, watch, 40)
    expected = FALLBACKS[opt_level]
    n = 3 * len(expected)
    assert skipped[:n] == [True] * n and not any(skipped[n:])
    assert list(watch.fallbacks) == expected
    logged = [r.message for r in caplog.records if "fp32-fallback" in r.message]
    assert [m.split(": ")[2].split(" runs")[0] for m in logged] == expected  # once each
    assert losses[-1] < 0.5 * losses[n]
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict(),
             "overflow": watch.state_dict()}
    watch.remove()
    ampx.restore()

    model2, opt2, amp2, watch2 = session(opt_level, "fp32-fallback", patience=3)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    amp2.load_state_dict(saved["amp"])
    watch2.load_checked(watch2.check_state(saved["overflow"]))
    assert list(watch2.fallbacks) == expected
    losses2, skipped2 = train(model2, opt2, amp2, watch2, 5)
    assert not any(skipped2) and losses2[-1] < losses[n]
    watch2.remove()


def test_raise_stops_a_stalled_run_with_the_report() -> None:
    model, opt, amp, watch = session("O1", "raise", patience=4)
    with pytest.raises(OverflowPersistsError, match="4 consecutive steps") as info:
        train(model, opt, amp, watch, 10)
    assert info.value.report.forward_module == "1.fc"
    assert info.value.report.forward_kind in ("inf", "nan")
    assert watch.last(opt) is info.value.report
    watch.remove()


def test_bad_saved_state_and_options_are_refused() -> None:
    model, opt, amp, watch = session("O1", "fp32-fallback")
    with pytest.raises(ValueError, match="overflow_policy.fp32_modules: the models have no "
                                         "module 'nope'"):
        watch.check_state({"fp32_modules": ["nope"]})
    assert watch.fallbacks == {}
    watch.remove()
    with pytest.raises(ValueError, match="detect_overflow='backward' is not one of"):
        parse_detect_overflow("backward")
    assert parse_detect_overflow(False) is None and parse_detect_overflow("none") is None
