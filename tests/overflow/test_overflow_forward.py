"""The opt-in forward detector: first module whose output became non-finite, at O1 and O2, with
no host sync until asked, bounded memory, and clean removal."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.overflow.forward import ForwardDetector


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([Block() for _ in range(n)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def overflowing_net(layer: int = 2) -> Net:
    """fp16 overflows in layers[layer].fc's output (finite in fp32 and bf16)."""
    net = Net()
    with torch.no_grad():
        net.layers[layer].fc.weight.fill_(4e4)
    return net


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_names_the_layer_whose_fp16_output_overflowed(opt_level: str) -> None:
    model = overflowing_net(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level=opt_level, verbosity=0)
    detector = ForwardDetector([model])
    try:
        out = model(torch.randn(4, 8))
        assert not torch.isfinite(out).all()
        assert detector.first_nonfinite() == ("layers.2.fc", "inf")
    finally:
        detector.remove()


def test_fp32_run_of_the_same_model_is_clean() -> None:
    model = overflowing_net(2)
    detector = ForwardDetector([model])
    model(torch.randn(4, 8))
    assert detector.first_nonfinite() is None
    detector.remove()


def test_nan_is_told_from_inf_and_the_first_one_wins(half_dtype: torch.dtype) -> None:
    model = Net().to(half_dtype)
    with torch.no_grad():
        model.layers[1].fc.bias[3] = math.nan
        model.layers[3].fc.bias[0] = math.inf
    detector = ForwardDetector([model])
    model(torch.randn(2, 8, dtype=half_dtype))
    assert detector.first_nonfinite() == ("layers.1.fc", "nan")
    detector.remove()


def test_no_host_sync_until_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(t: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original,
                     **k: Any) -> Any:
            calls.append(_name)
            return _orig(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    model = overflowing_net(1).half()
    detector = ForwardDetector([model])
    for _ in range(3):
        model(torch.randn(2, 8).half()).float().sum().backward()
        detector.clear()
    model(torch.randn(2, 8).half())
    assert calls == []
    assert detector.first_nonfinite() == ("layers.1.fc", "inf")
    assert calls == ["tolist"]
    detector.remove()


def test_no_grad_forwards_are_not_recorded_and_clear_resets() -> None:
    model = Net()
    detector = ForwardDetector([model])
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert detector.recorded == 0
    model(torch.randn(2, 8))
    assert detector.recorded == len(list(model.modules())) - 1  # a ModuleList is never called
    detector.clear()
    assert detector.recorded == 0 and detector.first_nonfinite() is None
    detector.remove()


def test_memory_is_bounded_when_steps_never_come() -> None:
    model = Net().half()
    detector = ForwardDetector([model], capacity=10)
    for _ in range(50):
        model(torch.randn(2, 8).half())
    n_modules = len(list(model.modules())) - 1  # the ModuleList is never called
    assert detector.recorded == 10 + n_modules
    with torch.no_grad():
        model.layers[3].fc.bias[0] = math.nan
    model(torch.randn(2, 8).half())  # beyond capacity: folded per module, still found
    assert detector.first_nonfinite() == ("layers.3.fc", "nan")
    assert detector.recorded == 10 + n_modules
    detector.remove()


def test_tuple_and_dict_outputs_and_several_models() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return {"a": x, "b": (x * math.inf, None)}

    class Twin(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return (torch.zeros(0), x.log())  # empty tensors are ignored; log(-1) is NaN

    first, second = nn.Sequential(nn.Identity(), Twin()), nn.Sequential(Pair())
    detector = ForwardDetector([first, second])
    second(torch.ones(2))
    assert detector.first_nonfinite() is None  # dict values one level deep only
    first(-torch.ones(2))
    assert detector.first_nonfinite() == ("model0.1", "nan")
    detector.remove()


def test_remove_takes_every_hook_away_and_bad_capacity_is_refused() -> None:
    model = Net()
    before = sum(len(m._forward_hooks) for m in model.modules())
    ForwardDetector([model]).remove()
    assert sum(len(m._forward_hooks) for m in model.modules()) == before
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ForwardDetector([model], capacity=0)
