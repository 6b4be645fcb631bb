"""The optimizer's own arithmetic under O1 (issue 41).

An optimizer's update loop (SGD with momentum, Adam, AdamW, RMSprop: the for-loop forms that
torch picks on CPU) calls patched Tensor methods on float32 state hundreds of times per step:
`mul_`, `add_`, `addcmul_`, `addcdiv_`, `+=`, `/`. Inside a step O1's casts are off; the
native wrapper answers those calls without running any Python (no closure, no
`StepScope.__bool__`). The patches themselves stay: for user code each of them still gives
another result than torch's own type promotion would, which the second test shows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampx
import ampx.o1
from ampx.o1 import regions, wrappers

_O1 = Path(ampx.o1.__file__).parent
_WRAPPER_SOURCES = {str(_O1 / name) for name in ("wrappers.py", "casters.py", "casting.py")}
_SCOPE_READS = {"StepScope.__bool__", "StepScope.running"}

_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, foreach=False),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, foreach=False),
}


def _wrapper_python() -> Callable[[], list[str]]:
    """Start recording entries into a cast wrapper's Python: the closures and converters of
    ampx.o1 and the step scope's methods. Returns the reader."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename in _WRAPPER_SOURCES or code.co_qualname in _SCOPE_READS:
            seen.append(code.co_qualname)

    sys.setprofile(profile)

    def stop() -> list[str]:
        sys.setprofile(None)
        return seen

    return stop


@pytest.mark.skipif(wrappers.native_class() is None,
                    reason="the native extension (CastWrapper) is not built")
@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_an_optimizer_step_runs_no_cast_wrapper_python(name: str,
                                                       half_dtype: torch.dtype) -> None:
    """A clean step's update loop reaches the patched methods only through the native
    wrapper's step test: no closure, no converter, no StepScope method runs; the casts are
    off in the step and on again after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = _OPTIMIZERS[name](model.parameters())
    amp = ampx.Amp("O1", dtype=half_dtype, verbosity=0)
    model, opt = amp.initialize(model, opt)
    x = torch.rand(4, 8)
    try:
        for step in range(3):
            opt.zero_grad()
            out = model(x)
            assert out.dtype == half_dtype
            with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            before = [p.detach().clone() for p in model.parameters()]
            stop = _wrapper_python()
            try:
                opt.step()
            finally:
                entered = stop()
            if step:  # the first step also makes the optimizer's state
                assert entered == [], f"{name}: the step ran {entered}"
            assert not isinstance(regions._CASTS_DISABLED.get(), regions.StepScope)
            assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert torch.nn.functional.linear(x, torch.rand(4, 8)).dtype == half_dtype
    finally:
        amp.restore()


def _patched(fn: Callable[[], torch.Tensor], half_dtype: torch.dtype) -> torch.Tensor:
    model = nn.Linear(2, 2)
    amp = ampx.Amp("O1", dtype=half_dtype, verbosity=0)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        return fn()
    finally:
        amp.restore()


# The in-place methods the update loops reach (INPLACE_MATCH_SELF): other operands take
# self's dtype first. Torch's own promotion computes a half self with a float32 operand in
# float32 and rounds once; O1 rounds the operand to half first, so some elements differ.
_INPLACE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "add_": lambda s, o: s.add_(o, alpha=0.5),
    "mul_": lambda s, o: s.mul_(o),
    "addcmul_": lambda s, o: s.addcmul_(o, o, value=0.5),
    "addcdiv_": lambda s, o: s.addcdiv_(o, o.flip(0), value=0.5),
    "__iadd__": lambda s, o: s.__iadd__(o),
}

# The out-of-place ones (PROMOTE): a 0-dim float32 operand joins the result's dtype under O1
# (the widest floating type), where torch's promotion keeps the half tensor's dtype.
_PROMOTE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "__truediv__": lambda s, o: s / o,
    "__add__": lambda s, o: s + o,
    "add": lambda s, o: torch.add(s, o),
    "mul": lambda s, o: torch.mul(s, o),
    "addcdiv": lambda s, o: torch.addcdiv(s, s, o),
}


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(_INPLACE))
def test_in_place_patches_the_optimizers_reach_are_still_needed(name: str,
                                                                half_dtype: torch.dtype) -> None:
    """Dropping the patch for torch's type promotion would change user results: values."""
    op = _INPLACE[name]

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        target = torch.rand(4096).to(half_dtype)
        other = torch.rand(4096) + 0.25
        op(target, other)
        return target

    with_patch, plain = _patched(run, half_dtype), run()
    assert with_patch.dtype == plain.dtype == half_dtype
    assert not torch.equal(with_patch, plain)
    # O1's answer is self's dtype applied to the operand first (apex's in-place rule).
    torch.manual_seed(0)
    target, other = torch.rand(4096).to(half_dtype), torch.rand(4096) + 0.25
    op(target, other.to(half_dtype))
    assert torch.equal(with_patch, target)


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(_PROMOTE))
def test_out_of_place_patches_the_optimizers_reach_are_still_needed(
        name: str, half_dtype: torch.dtype) -> None:
    """Dropping the patch for torch's type promotion would change user results: dtypes."""
    op = _PROMOTE[name]
    values = torch.linspace(0.5, 2.0, 16)

    def run() -> torch.Tensor:
        return torch.as_tensor(op(values.to(half_dtype), torch.tensor(1.0 / 3.0)))

    with_patch, plain = _patched(run, half_dtype), run()
    assert (with_patch.dtype, plain.dtype) == (torch.float32, half_dtype)


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_comparison_the_fused_step_reaches_is_still_needed(half_dtype: torch.dtype) -> None:
    """`>` (fused Adam's step count test): under O1 a half tensor and a 0-dim float32 tensor
    compare in float32, under torch's promotion in half (a third rounds to a half third)."""
    third = torch.tensor(1.0 / 3.0)

    def run() -> torch.Tensor:
        rounded = third.reshape(1).to(half_dtype)
        return torch.cat([rounded > third, third > rounded])

    assert run().tolist() == [False, False]
    assert sorted(_patched(run, half_dtype).tolist()) == [False, True]
