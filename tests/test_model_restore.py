"""`restore()` takes every hook a session put on its models off (issue 33, item 8).

Repeated ``initialize`` -> ``restore()`` cycles on one model used to stack the input-cast,
output-cast and state-dict hooks (3 cycles, 3 forward pre-hooks); after restore nothing ampx
created may act on the model: no input cast, no fp32 state dict, no load into old masters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampx

HOOK_DICTS_OF_A_TENSOR = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Sequential(nn.Linear(16, 4)))


def _hooks(model: nn.Module) -> dict[str, int]:
    """How many entries every hook dict of every submodule and parameter holds."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if "hook" in attr and isinstance(value, (dict, set)):
                counts[f"{name}.{attr}"] = len(value)
    for name, param in model.named_parameters():
        for attr in HOOK_DICTS_OF_A_TENSOR:
            counts[f"{name}.{attr}"] = len(getattr(param, attr, None) or {})
    return counts


def _global_hooks() -> list[int]:
    from torch.nn.modules import module as torch_module

    return [len(getattr(torch_module, name)) for name in dir(torch_module)
            if name.startswith("_global") and name.endswith("hooks")]


def _step(model: nn.Module, opt: torch.optim.Optimizer, amp: ampx.Amp | None) -> None:
    scale_loss = ampx.scale_loss if amp is None else amp.scale_loss
    opt.zero_grad()
    loss = model(torch.randn(8, 8)).float().pow(2).mean()
    with scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("api", ["module", "object"])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_restore_removes_every_hook_of_every_cycle(level: str, half_dtype: torch.dtype,
                                                   api: str) -> None:
    model = _net()
    pristine, pristine_global = _hooks(model), _global_hooks()
    for cycle in range(3):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        options = dict(opt_level=level, dtype=half_dtype, verbosity=0,
                       cast_model_outputs=torch.float32, detect_overflow="forward",
                       on_overflow="fp32-fallback")
        amp = None
        if api == "module":
            model, opt = ampx.initialize(model, opt, **options)
            session = ampx.frontend.default_session()
        else:
            session = amp = ampx.Amp(**options)
            model, opt = amp.initialize(model, opt)
        watch = session.overflow_watch if session is not None else None
        assert (watch is None) == (level == "O3" and half_dtype == torch.float16)  # apex's 1.0
        if watch is not None and level == "O2" and cycle < 2:  # as after overflows in it
            watch.apply_fallback("3")  # (the last cycle casts it back to half)
        assert _hooks(model) != pristine  # the session hooked the model
        _step(model, opt, amp)
        if amp is None:
            ampx.restore()
        else:
            amp.restore()
        assert _hooks(model) == pristine, f"cycle {cycle}"
        assert _global_hooks() == pristine_global
    _nothing_acts(model, opt, half_dtype, level)


def _nothing_acts(model: nn.Module, opt: torch.optim.Optimizer, half_dtype: torch.dtype,
                  level: str) -> None:
    """After restore the model is a plain half model: ampx's casts and state hooks are gone."""
    model.eval()
    assert model(torch.randn(2, 8).to(half_dtype)).dtype == half_dtype  # no output cast
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.randn(2, 8))  # no input cast either
    state = model.state_dict()
    assert state["0.weight"].dtype == half_dtype  # saved as it is, not as fp32 masters
    own = {id(p) for p in model.parameters()}
    masters = [p for p in opt.param_groups[0]["params"] if id(p) not in own]
    assert len(masters) == (4 if level == "O2" else 0)
    before = [m.detach().clone() for m in masters]
    model.load_state_dict({k: torch.zeros_like(v) if v.is_floating_point() else v
                           for k, v in state.items()})
    assert model[0].weight.count_nonzero() == 0
    # the optimizer's fp32 masters are no longer written by the model's loads
    assert all(torch.equal(a, b) for a, b in zip(before, masters))


def test_a_new_session_over_another_model_leaves_the_first_models_hooks() -> None:
    """Replacing the default session drops its O1 patches only: its model keeps its hooks."""
    first, second = _net(), _net(1)
    ampx.initialize(first, opt_level="O1", cast_model_outputs=torch.float16, verbosity=0)
    hooked = _hooks(first)
    ampx.initialize(second, opt_level="O2", verbosity=0)
    assert _hooks(first) == hooked
    assert first(torch.randn(4, 8)).dtype == torch.float16  # its output cast still acts
