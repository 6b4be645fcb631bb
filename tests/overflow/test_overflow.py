"""Overflow provenance pieces on their own: names, per-tensor flags from both kernel backends,
inf vs NaN, several loss ids, the report, the log line and its rate limit, and no host sync
on clean steps."""

from __future__ import annotations

import doctest
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ampx import _ext, _reference
from ampx.overflow import flags as provenance
from ampx.overflow import forward as forward_check
from ampx.overflow import policy as overflow_policy
from ampx.overflow import report as overflow
from ampx.overflow.flags import GradFlags, classify_nonfinite
from ampx.overflow.report import OverflowReport, ParamNames, RateLimiter, overflow_message

INF, NAN = math.inf, math.nan


# -- helpers -------------------------------------------------------------------------------------

class SyncCounter:
    """Counts Tensor.item / __bool__ / tolist calls (the host reads a step could make)."""

    NAMES = ("item", "__bool__", "tolist")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))

    def _counting(self, name: str, original: Any) -> Any:
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return original(tensor, *args, **kwargs)
        return wrapper


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> SyncCounter:
    return SyncCounter(monkeypatch)


def backends() -> Iterator[Any]:
    yield pytest.param(_reference, id="reference")
    yield pytest.param("native", id="native")


def kernels(which: Any) -> Any:
    if which is _reference:
        return _reference
    if os.environ.get("AMPX_DISABLE_EXT", "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.skip("AMPX_DISABLE_EXT is set: native kernels disabled")
    mod = _ext._native_module()
    if mod is None:
        pytest.skip(f"ampx._C not active: {_ext.IMPORT_ERROR}")
    return mod


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def scaled_backward(model: nn.Module, scale: float, poison: dict[str, float]) -> None:
    """Backward of a scaled loss; `poison` puts a value into one element of named grads."""
    for p in model.parameters():
        p.grad = None
    dtype = next(model.parameters()).dtype
    loss = model(torch.randn(5, 4, dtype=dtype)).float().pow(2).mean() * scale
    loss.backward()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in poison.items():
            params[name].grad.view(-1)[1] = value


# -- naming ----------------------------------------------------------------------------------------

def test_names_cover_models_masters_and_tied_weights() -> None:
    a, b = Net(), nn.Linear(2, 2)
    master = nn.Parameter(a.head.weight.detach().float())
    names = ParamNames.from_models([a, b], masters=[(a.head.weight, master)])
    assert names.name_of(a.blocks[1][0].weight) == "model0.blocks.1.0.weight"
    assert names.module_of(a.blocks[1][0].weight) == "model0.blocks.1.0"
    assert names.name_of(b.bias) == "model1.bias"
    assert names.name_of(master) == "model0.head.weight"
    assert names.order_of(master) == names.order_of(a.head.weight)
    assert names.name_of(torch.zeros(1)) is None and names.order_of(torch.zeros(1)) == -1
    tied = nn.Sequential(nn.Embedding(3, 4), nn.Linear(4, 3, bias=False))
    tied[1].weight = tied[0].weight
    single = ParamNames.from_models([tied])
    assert single.name_of(tied[1].weight) == "0.weight" and len(single) == 1
    assert ParamNames.from_models([nn.Linear(1, 1)]).module_of(nn.Linear(1, 1).weight) is None


def test_root_parameters_belong_to_the_root_module() -> None:
    model = nn.Module()
    model.scale = nn.Parameter(torch.ones(1))
    assert ParamNames.from_models([model]).module_of(model.scale) == overflow.ROOT_MODULE


# -- kernels: per-tensor flags ---------------------------------------------------------------------

@pytest.mark.parametrize("which", list(backends()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
def test_native_and_reference_flag_the_same_tensors(which: Any, dtype: torch.dtype) -> None:
    impl = kernels(which)
    values = [1.0, INF, 2.0, NAN, -INF, 3.0, 4.0]
    for accumulate in (None, False, True):
        src = [torch.full((n,), 0.5, dtype=dtype) for n in (3, 70000, 1, 129, 5, 2, 40000)]
        for t, v in zip(src, values):
            t[-1] = v
        flags = torch.zeros(len(src))
        found = torch.zeros(1)
        inv = torch.tensor([0.5])
        if accumulate is None:
            impl.unscale_(src, inv, found, flags)
        else:
            dst = [torch.zeros(t.numel()) for t in src]
            impl.unscale_into_(src, dst, inv, found, flags, accumulate)
        assert flags.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
        assert found.item() == 1.0


@pytest.mark.parametrize("which", list(backends()))
def test_flags_map_to_parameter_names(which: Any, half_dtype: torch.dtype) -> None:
    impl = kernels(which)
    model = Net().to(half_dtype)
    names = ParamNames.from_models([model])
    scaled_backward(model, 1024.0, {"blocks.1.0.weight": INF, "embed.bias": NAN})
    tracker = GradFlags(names)
    params = [p for p in model.parameters() if p.grad is not None]
    flags = tracker.flags_for(0, params, params[0].device)
    impl.unscale_([p.grad for p in params], torch.tensor([1 / 1024]), torch.zeros(1), flags)
    report = tracker.report(step=4, loss_ids=[0], scales={0: (1024.0, 512.0)})
    assert report.inf_params == ("blocks.1.0.weight",)
    assert report.nan_params == ("embed.bias",)
    assert report.params == ("blocks.1.0.weight", "embed.bias")  # closest to the loss first
    assert report.modules == (("blocks.1.0", 1), ("embed", 1))
    assert report.culprit == "blocks.1.0"
    assert (report.step, report.loss_id, report.scale_before, report.scale_after) == \
        (4, 0, 1024.0, 512.0)


def test_o2_masters_hold_the_values_and_the_names(half_dtype: torch.dtype) -> None:
    model = Net().to(half_dtype)
    masters = {id(p): nn.Parameter(p.detach().float()) for p in model.parameters()}
    pairs = [(p, masters[id(p)]) for p in model.parameters()]
    names = ParamNames.from_models([model], masters=pairs)
    scaled_backward(model, 8.0, {"head.weight": -INF})
    tracker = GradFlags(names)
    src = [p.grad for p, _ in pairs]
    for _, m in pairs:
        m.grad = torch.empty_like(m)
    flags = tracker.flags_for(0, [m for _, m in pairs], torch.device("cpu"))
    _ext.unscale_into_(src, [m.grad for _, m in pairs], torch.tensor([0.125]), torch.zeros(1),
                       flags)
    for p, _ in pairs:
        p.grad = None  # O2 releases the half grads; the masters' grads are classified
    report = tracker.report(step=0, loss_ids=[0], scales={0: (8.0, 4.0)})
    assert report.inf_params == ("head.weight",) and report.nan_params == ()


def test_inf_and_nan_in_one_gradient_and_a_vanished_gradient() -> None:
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    names = ParamNames()
    names.add(a, "a")
    names.add(b, "b")
    a.grad = torch.tensor([INF, NAN, 1.0])
    b.grad = torch.tensor([INF, 1.0])
    tracker = GradFlags(names)
    flags = tracker.flags_for(0, [a, b], torch.device("cpu"))
    _ext.unscale_([a.grad, b.grad], torch.ones(1), torch.zeros(1), flags)
    b.grad = None
    report = tracker.report(step=1, loss_ids=[0], scales={})
    assert report.inf_params == ("a",) and report.nan_params == ("a",)
    assert report.unknown_params == ("b",)
    assert classify_nonfinite([None, torch.tensor([NAN, INF])]) == [(False, False), (True, True)]


def test_several_loss_ids_are_told_apart() -> None:
    model = Net()
    names = ParamNames.from_models([model])
    tracker = GradFlags(names)
    inv = torch.ones(1)
    for loss_id, poison in ((0, {}), (1, {"head.bias": INF}), (2, {"embed.weight": NAN})):
        scaled_backward(model, 1.0, poison)
        params = list(model.parameters())
        flags = tracker.flags_for(loss_id, params, torch.device("cpu"))
        _ext.unscale_([p.grad for p in params], inv, torch.zeros(1), flags)
        stash = [p.grad.clone() for p in params]
    for p, g in zip(params, stash):
        p.grad = g  # the last pass's grads are what is left (earlier ones were accumulated)
    report = tracker.report(step=2, loss_ids=[2, 0, 1],
                            scales={1: (4.0, 2.0), 2: (8.0, 4.0)})
    assert report.loss_ids == (0, 1, 2)
    assert report.params_by_loss == {1: ("head.bias",), 2: ("embed.weight",)}
    assert report.loss_id == 1 and report.scale_after == 2.0
    assert report.nan_params == ("embed.weight",)


def test_clean_steps_read_nothing_from_the_device(syncs: SyncCounter) -> None:
    model = Net()
    names = ParamNames.from_models([model])
    for _ in range(3):  # flags are per step: a clean step never builds a report
        tracker = GradFlags(names)
        scaled_backward(model, 2.0, {})
        params = list(model.parameters())
        flags = tracker.flags_for(0, params, torch.device("cpu"))
        _ext.unscale_([p.grad for p in params], torch.tensor([0.5]), torch.zeros(1), flags)
    assert syncs.calls == []


def test_a_skipped_step_reads_the_flags_once_and_classifies_once(syncs: SyncCounter) -> None:
    model = Net()
    tracker = GradFlags(ParamNames.from_models([model]))
    scaled_backward(model, 2.0, {"head.bias": INF})
    params = list(model.parameters())
    for chunk in (params[:3], params[3:]):
        flags = tracker.flags_for(0, chunk, torch.device("cpu"))
        _ext.unscale_([p.grad for p in chunk], torch.tensor([0.5]), torch.zeros(1), flags)
    tracker.report(step=0, loss_ids=[0], scales={})
    assert syncs.calls == ["tolist", "tolist"]


# -- the report and the log line -------------------------------------------------------------------

def report(**kw: Any) -> OverflowReport:
    base: dict[str, Any] = dict(step=7, loss_ids=(0,), scales={0: (65536.0, 32768.0)},
                                inf_params=("dec.layers.11.fc2.weight", "dec.layers.11.fc1.weight",
                                            "dec.layers.10.fc2.weight", "embed.weight"),
                                modules=(("dec.layers.11.fc2", 1), ("dec.layers.11.fc1", 1)))
    base.update(kw)
    return OverflowReport(**base)


def test_log_line_names_the_top_offender() -> None:
    r = report()
    line = overflow_message(loss_id=0, old_scale=r.scale_before, new_scale=r.scale_after,
                            dynamic=True, where=r.where())
    assert line == ("Gradient overflow in dec.layers.11.fc2.weight (+3 more). Skipping step, "
                    "loss scaler 0 reducing loss scale to 32768")
    fwd = report(forward_module="dec.layers.11.attn", forward_kind="inf").where()
    assert fwd.endswith("; activations first inf in dec.layers.11.attn")


def test_log_line_variants() -> None:
    static = overflow_message(loss_id=1, old_scale=1.0, new_scale=1.0, dynamic=False,
                              where="in w", suppressed=4)
    assert static == ("Non-finite gradients in w. Skipping step, loss scaler 1 keeps its static "
                      "loss scale 1 (4 similar messages suppressed)")
    held = overflow_message(loss_id=0, old_scale=8.0, new_scale=8.0, dynamic=True, hysteresis=2)
    assert held.startswith("Gradient overflow. Skipping step, loss scaler 0 keeps loss scale 8 "
                           "(hysteresis=2")
    tiny = overflow_message(loss_id=0, old_scale=2.0**-20, new_scale=2.0**-21, dynamic=True)
    assert tiny.endswith(f"to {2.0**-21!r}")


def test_rank_in_the_log_line_and_the_summary() -> None:
    r = report(rank=1, param_ranks={"dec.layers.11.fc2.weight": (1,)})
    assert r.where().endswith("; on rank 1")
    both = report(rank=0, inf_params=(), modules=(),
                  param_ranks={"w": (0, 1)}).where()
    assert both == "in w; on ranks 0,1"
    text = report(nan_params=("x",), rank=0).summary()
    assert "on rank 0" in text and "NaN gradients (1): x" in text
    assert "loss 0: scale 65536 -> 32768" in text
    assert "modules (closest to the loss first): dec.layers.11.fc2 (1)" in text


def test_report_as_dict_is_json_and_complete() -> None:
    import json

    r = report(params_by_loss={0: ("a",)}, param_ranks={"a": (0,)}, rank=0)
    data = json.loads(json.dumps(r.as_dict()))
    assert data["inf_params"][0] == "dec.layers.11.fc2.weight"
    assert data["scales"] == {"0": [65536.0, 32768.0]}
    assert data["param_ranks"] == {"a": [0]} and data["rank"] == 0
    assert set(data) == {f for f in OverflowReport.__dataclass_fields__}


def test_empty_report_defaults() -> None:
    r = OverflowReport(step=0, loss_ids=(), scales={})
    assert (r.loss_id, r.culprit, r.where(), r.params) == (0, None, "", ())
    assert math.isnan(r.scale_before) and math.isnan(r.scale_after)


def test_rate_limiter_lets_the_first_through_then_one_per_interval() -> None:
    now = [0.0]
    limiter = RateLimiter(first=2, interval_s=10.0, clock=lambda: now[0])
    assert [limiter.allow()[0] for _ in range(5)] == [True, True, False, False, False]
    now[0] = 10.5
    assert limiter.allow() == (True, 3)
    assert limiter.allow() == (False, 0)


def test_doctests_of_the_provenance_modules() -> None:
    for module in (overflow, provenance, forward_check, overflow_policy):
        result = doctest.testmod(module)
        assert result.failed == 0
    assert doctest.testmod(overflow).attempted >= 5


def test_record_takes_flags_filled_elsewhere_and_checks_lengths() -> None:
    emb = nn.Embedding(5, 3, sparse=True)
    names = ParamNames.from_models([emb])
    emb(torch.tensor([1, 2])).sum().backward()
    emb.weight.grad = emb.weight.grad * math.inf  # a sparse gradient holding inf
    tracker = GradFlags(names)
    tracker.record(3, [emb.weight], torch.ones(1))
    r = tracker.report(step=0, loss_ids=[3], scales={})
    assert r.inf_params == ("weight",) and r.params_by_loss == {3: ("weight",)}
    with pytest.raises(ValueError, match="2 flags for 1 parameters"):
        tracker.record(0, [emb.weight], torch.ones(2))
