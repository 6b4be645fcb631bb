"""The forward detector's records and hooks have a lifetime (issue 22 items 8 and 9).

Its records are per step even when ``on_overflow="raise"`` ends the step by raising, and its
hooks come off with ``restore()`` and when a new ``initialize`` watches the same model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampx
from ampx.overflow.forward import _Hook
from ampx.overflow.policy import OverflowPersistsError


class Gain(nn.Module):
    """Multiplies by `factor` (set to inf to make this module's output overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.a = Gain()
        self.second = nn.Linear(4, 2)
        self.b = Gain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.second(self.a(self.first(x))))


def detector_hooks(model: nn.Module) -> int:
    return sum(isinstance(h, _Hook) for m in model.modules() for h in m._forward_hooks.values())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_after_a_raise_the_next_report_names_its_own_module(level: str,
                                                            half_dtype: torch.dtype) -> None:
    """Item 8: the raise skipped clearing the records, so the next report named the previous
    step's module."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = ampx.Amp(level, dtype=half_dtype, loss_scale=1.0, skip_non_finite=True, verbosity=0,
                   on_overflow="raise", overflow_patience=1, detect_overflow="forward")
    model, opt = amp.initialize(model, opt)
    x = torch.randn(3, 4)
    named = []
    for culprit in (model.a, model.b):
        model.a.factor = model.b.factor = 1.0
        culprit.factor = float("inf")
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        with pytest.raises(OverflowPersistsError) as info:
            opt.step()
        named.append(info.value.report.forward_module)
    assert named == ["a", "b"]
    model.b.factor = 1.0  # a clean step afterwards is reported clean
    opt.zero_grad()
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not ampx.step_was_skipped(opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_restore_and_a_second_initialize_leave_one_set_of_hooks(level: str) -> None:
    """Item 9: restore() left the hooks; a second initialize(detect_overflow="forward") on the
    same model doubled them."""
    model = Net()
    modules = len(list(model.modules()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level=level, verbosity=0,
                                 detect_overflow="forward")
    assert detector_hooks(model) == modules
    ampx.restore()
    assert detector_hooks(model) == 0

    model2 = Net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    model2, opt2 = ampx.initialize(model2, opt2, opt_level=level, verbosity=0,
                                   detect_overflow="forward")
    opt3 = torch.optim.SGD(model2.parameters(), lr=0.1)
    ampx.initialize(model2, opt3, opt_level="O1", verbosity=0, detect_overflow="forward")
    assert detector_hooks(model2) == modules
    ampx.restore()
    assert detector_hooks(model2) == 0


def test_restore_of_an_amp_object_removes_its_detector() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = ampx.Amp("O1", verbosity=0, detect_overflow="forward")
    amp.initialize(model, opt)
    assert detector_hooks(model) > 0
    amp.restore()
    assert detector_hooks(model) == 0
