"""The clean unscale pass (`ampx._C.unscale_pass`) is the general path's results in one call.

`unscale.run_clean` takes the usual pass (nothing accumulated, dense contiguous plain
gradients on the scaler's device) in one native call; anything else must come back None,
before any tensor is written, so the general path (`plan` + `run`) takes it. Compared here
bitwise, result by result and flag by flag, against the general path on the same gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampx import _ext
from ampx.scaling import unscale
from ampx.scaling.masters import ParamCache

pytestmark = pytest.mark.skipif(_ext._native_module() is None,
                                reason="the clean pass is native only")


def _cache(models: list[nn.Parameter], masters: list[nn.Parameter],
           others: list[nn.Parameter]) -> ParamCache:
    return ParamCache((), masters + others, list(zip(models, masters)), models, masters, others)


def _params(dtype: torch.dtype, bad: bool, o2: bool, seed: int = 0
            ) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (33,), (3, 4, 2), (1,)]
    models, masters, others = [], [], []
    for i, shape in enumerate(shapes):
        p = nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        p.grad = (torch.randn(shape, generator=g) * 300).to(dtype)
        if bad and i == 2:
            p.grad.view(-1)[7] = float("inf")
        if o2 and i % 2 == 0:
            models.append(p)
            masters.append(nn.Parameter(p.detach().float()))
        else:
            others.append(p)
    others.append(nn.Parameter(torch.zeros(2, dtype=dtype)))  # no gradient: skipped
    return models, masters, others


def _by_position(cache: ParamCache, work: unscale.UnscaleWork, flags: torch.Tensor | None
                 ) -> tuple[dict[int, torch.Tensor], dict[int, float]]:
    """{position in cache.targets: new gradient} and {position: per-tensor flag}."""
    where = {id(t): i for i, t in enumerate(cache.targets)}
    grads = {where[id(t)]: g for (t, _, _), g in zip(work.assign, work.results)}
    for t in work.flag_params:  # checked in place: the gradient is its own result
        grads.setdefault(where[id(t)], t.grad)
    assert flags is not None and len(flags) == len(work.flag_params)
    return grads, {where[id(t)]: float(f) for t, f in zip(work.flag_params, flags)}


@pytest.mark.parametrize("o2", [False, True], ids=["O1", "O2"])
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-10], ids=["unit", "scaled"])
def test_the_clean_pass_equals_the_general_path_bitwise(
        half_dtype: torch.dtype, o2: bool, bad: bool, scale: float) -> None:
    inv = torch.full((1,), scale)
    unit = scale == 1.0
    general_cache = _cache(*_params(half_dtype, bad, o2))
    found_general = torch.zeros(1)
    work_general = unscale.plan(general_cache, {})
    flags_general = unscale.run(work_general, inv, found_general, True, unit)

    cache = _cache(*_params(half_dtype, bad, o2))
    clean = unscale.run_clean(cache, {}, inv, True, unit)
    assert clean is not None
    work, flags, found = clean

    assert torch.equal(found, found_general) and bool(found.item()) is bad
    grads, flag_of = _by_position(cache, work, flags)
    want_grads, want_flag_of = _by_position(general_cache, work_general, flags_general)
    assert flag_of == want_flag_of and sorted(grads) == sorted(want_grads)
    for i, want in want_grads.items():
        assert grads[i].dtype == want.dtype and torch.equal(grads[i], want), i
    assert [id(p) for p in work.clear] == [id(p) for p in cache.models]
    if unit and not o2:  # nothing allocated: every gradient was checked where it is
        assert work.assign == []


@pytest.mark.parametrize("case", ["channels_last", "sparse", "subclass", "requires_grad",
                                  "master_has_grad", "float64_scale", "stash"])
def test_anything_but_a_clean_pass_is_left_to_the_general_path(case: str) -> None:
    models, masters, others = _params(torch.float16, False, o2=True)
    if case == "channels_last":
        p = nn.Parameter(torch.randn(2, 3, 4, 4).half())
        p.grad = torch.randn(2, 3, 4, 4).half().to(memory_format=torch.channels_last)
        others.append(p)
    elif case == "sparse":
        p = nn.Parameter(torch.randn(4, 3).half())
        p.grad = torch.randn(4, 3).half().to_sparse()
        others.append(p)
    elif case == "subclass":
        class Marked(torch.Tensor):
            pass

        others[0].grad = others[0].grad.as_subclass(Marked)
    elif case == "requires_grad":
        others[0].grad = others[0].grad.clone().requires_grad_()
    elif case == "master_has_grad":
        masters[0].grad = torch.zeros_like(masters[0])
    cache = _cache(models, masters, others)
    before = [None if p.grad is None else p.grad.clone() for p in cache.sources]
    inv = torch.full((1,), 0.5, dtype=torch.float64 if case == "float64_scale"
                     else torch.float32)
    stash = {1: (others[0], others[0].grad)} if case == "stash" else {}
    assert unscale.run_clean(cache, stash, inv, True, False) is None
    for p, old in zip(cache.sources, before):  # nothing was written
        assert (p.grad is None) == (old is None)
        if old is not None and not p.grad.is_sparse:
            assert torch.equal(p.grad, old)


def _ampx_calls_per_step(level: str, dtype: torch.dtype, layers: int) -> int:
    """Calls of ampx's Python functions in one clean training step (after two warm-up steps):
    zero_grad, forward, scale_loss with its backward, step."""
    import sys
    from pathlib import Path

    import ampx

    root = str(Path(ampx.__file__).parent)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    amp = ampx.Amp(level, dtype=dtype, verbosity=0)
    model, opt = amp.initialize(model, opt)
    x = torch.randn(4, 8)
    calls = [0]

    def count(frame: object, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):  # type: ignore[attr-defined]
            calls[0] += 1

    try:
        for i in range(3):
            if i == 2:
                sys.setprofile(count)
            try:
                opt.zero_grad()
                loss = model(x.to(dtype) if level == "O2" else x).float().pow(2).mean()
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
            finally:
                sys.setprofile(None)
        assert not ampx.step_was_skipped(opt)
    finally:
        amp.restore()
    return calls[0]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_clean_step_runs_no_python_per_parameter(level: str, dtype: torch.dtype) -> None:
    """The clean step's Python in ampx is the same for 4 layers as for 16: checks, the unscale,
    the scaler's update, O2's copy and the release of the masters' gradients are native calls
    over all parameters (the O1 cast-cache misses and the step flag's reads too)."""
    small = _ampx_calls_per_step(level, dtype, 4)
    large = _ampx_calls_per_step(level, dtype, 16)
    assert small == large, f"{small} calls of ampx's Python with 4 layers, {large} with 16"
    assert 0 < small < 120
