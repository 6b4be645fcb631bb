"""`optimizer.step()` runs with O1's casts off (a per-thread flag); results are unchanged."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampx
from ampx.o1 import regions
from ampx.o1.registry import PATCHES


@pytest.fixture(autouse=True)
def _python_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter below sees the closures' frames: install them, not the native wrappers
    (tests/o1/test_native_wrapper.py checks the native ones read the same step flag)."""
    monkeypatch.setattr(PATCHES, "native_class", [None])


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw-for-loop": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
    "sgd-for-loop": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
}


def _train(make_opt: Callable[..., torch.optim.Optimizer], dtype: str,
           steps: int = 3) -> tuple[list[int], list[torch.Tensor]]:
    """O1 training; returns the cast-code calls counted in each `step()` and the params."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2))
    amp = ampx.Amp("O1", dtype=dtype, verbosity=0)
    model, opt = amp.initialize(model, make_opt(model.parameters()))
    entries: list[int] = []
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        # A wrapper that casts runs code of the converters (casters.py, casting.py, or the
        # converter closures of wrappers.py); a wrapper with casts off calls the original.
        code = frame.f_code
        if event == "call" and (code.co_filename.endswith(("casters.py", "casting.py")) or (
                code.co_filename.endswith("wrappers.py") and code.co_name != "ampx_cast")):
            count[0] += 1

    try:
        x = torch.randn(4, 8)
        for _ in range(steps):
            opt.zero_grad()
            loss = model(x).float().square().mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            count[0] = 0
            sys.setprofile(profile)
            try:
                opt.step()
            finally:
                sys.setprofile(None)
            entries.append(count[0])
            assert getattr(torch.Tensor.mul_, "__ampx_policy__", None) is not None
        return entries, [p.detach().clone() for p in model.parameters()]
    finally:
        amp.restore()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_no_cast_during_step(name: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    entries, params = _train(OPTIMIZERS[name], dtype)
    assert entries == [0, 0, 0]
    # Casts left on during the step: same parameters, bit for bit.
    monkeypatch.setattr(regions, "start_step", lambda frame, key: None)
    before_entries, before = _train(OPTIMIZERS[name], dtype)
    if "for-loop" in name:
        assert min(before_entries) > 0  # the counter does see casts when they run
    for got, want in zip(params, before):
        assert torch.equal(got, want)


class _Raising(torch.optim.SGD):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("boom")


def test_step_that_raises_leaves_casts_on() -> None:
    model = nn.Linear(4, 4)
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0)
    model, opt = amp.initialize(model, _Raising(model.parameters(), lr=0.1))
    wrapper = torch.Tensor.add_
    try:
        loss = model(torch.randn(2, 4)).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert torch.Tensor.add_ is wrapper  # never swapped out
        assert not regions.casts_disabled()
        assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    finally:
        amp.restore()


def test_a_step_that_raises_after_many_ops_leaves_casts_on_for_the_same_code() -> None:
    """The step flag remembers the frame its reads come from (one or two hops instead of a
    walk down to torch's step wrapper); after a step that raised, the same code run outside a
    step, and the loop that called `step()`, cast again."""
    a = torch.randn(3, 3)

    def ops(n: int) -> list[torch.dtype]:
        return [torch.mm(a, a).dtype for _ in range(n)]  # wrapped: cast to bf16 when casts on

    def products() -> Any:  # a generator's frame resumes under whoever calls next()
        while True:
            yield torch.mm(a, a).dtype

    seen: list[torch.dtype] = []
    resumed = products()

    class RaisingAfterOps(torch.optim.SGD):
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            seen.extend(ops(5))  # casts off in the step, read 5 times from one frame
            seen.extend(ops(5))
            seen.extend([next(resumed), next(resumed)])
            raise RuntimeError("boom")

    model = nn.Linear(3, 3)
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0)
    model, opt = amp.initialize(model, RaisingAfterOps(model.parameters(), lr=0.1))
    try:
        loss = model(torch.randn(2, 3)).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert seen == [torch.float32] * 12
        assert next(resumed) == torch.bfloat16  # (the first read after the step)
        assert ops(3) == [torch.bfloat16] * 3
        assert torch.mm(a, a).dtype == torch.bfloat16
        assert not regions.casts_disabled()
    finally:
        amp.restore()


def test_restore_inside_a_step_restores_torch() -> None:
    model = nn.Linear(4, 4)
    amp = ampx.Amp("O1", dtype="bf16", verbosity=0)

    class Restoring(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            amp.restore()  # the session ends inside the step: nothing to put back afterwards
            return super().step(closure)

    model, opt = amp.initialize(model, Restoring(model.parameters(), lr=0.1))
    loss = model(torch.randn(2, 4)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert ampx.o1.patch.active() is None
    assert getattr(torch.Tensor.add_, "__ampx_policy__", None) is None
    assert not regions.casts_disabled()
