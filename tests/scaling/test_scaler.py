"""LossScaler on its own: dynamic/static rules, bounds, hysteresis, logging, state entries."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import ampx
from ampx import _ext
from ampx.scaling import scaler as scaler_mod
from ampx.scaling.scaler import STATE_VERSION, LossScaler

CLEAN = torch.zeros(1)
INF = torch.ones(1)


def _steps(scaler: LossScaler, pattern: str) -> list[float]:
    """Run updates ('.' clean, 'x' overflow) and return the scale after each."""
    out = []
    for c in pattern:
        scaler.update_(INF if c == "x" else CLEAN)
        out.append(scaler.loss_scale())
    return out


def test_dynamic_defaults_are_apex():
    s = LossScaler("dynamic")
    assert s.dynamic
    assert s.loss_scale() == 2.0**16
    assert s.growth_interval == 2000 and s.growth_factor == 2.0 and s.backoff_factor == 0.5
    assert s.max_loss_scale == 2.0**24 and s.min_loss_scale is None
    assert s.scale.dtype == torch.float32 and s.scale.shape == (1,)


def test_init_scale_clamped_by_max():
    assert LossScaler("dynamic", init_scale=2.0**30).loss_scale() == 2.0**24
    assert LossScaler("dynamic", init_scale=8.0).loss_scale() == 8.0


def test_growth_after_window_and_reset_by_overflow():
    s = LossScaler("dynamic", init_scale=4.0, growth_interval=3)
    assert _steps(s, "..") == [4.0, 4.0]
    assert s.clean_steps == 2
    assert _steps(s, ".") == [8.0]  # the third clean step grows
    assert s.clean_steps == 0
    assert _steps(s, "..x") == [8.0, 8.0, 4.0]  # overflow halves and resets the window
    assert s.clean_steps == 0
    assert _steps(s, "...") == [4.0, 4.0, 8.0]


def test_custom_factors():
    s = LossScaler("dynamic", init_scale=81.0, growth_factor=3.0, backoff_factor=1 / 3,
                   growth_interval=1)
    assert _steps(s, "x.") == pytest.approx([27.0, 81.0])


def test_min_and_max_bounds():
    s = LossScaler("dynamic", init_scale=2.0**16, min_loss_scale=2.0**14)
    assert _steps(s, "xxxx") == [2.0**15, 2.0**14, 2.0**14, 2.0**14]
    s = LossScaler("dynamic", init_scale=2.0**23, max_loss_scale=2.0**24, growth_interval=1)
    assert _steps(s, "...") == [2.0**24, 2.0**24, 2.0**24]


def test_no_floor_never_reaches_zero():
    s = LossScaler("dynamic", init_scale=1.0)
    _steps(s, "x" * 400)
    assert s.loss_scale() > 0
    assert math.isfinite(1.0 / s.loss_scale())


def test_hysteresis_backs_off_after_n_overflows():
    s = LossScaler("dynamic", init_scale=2.0**10, hysteresis=3, growth_interval=2)
    assert _steps(s, "xx") == [2.0**10, 2.0**10]  # tolerated
    assert _steps(s, "x") == [2.0**9]  # the third backs off
    assert _steps(s, "x") == [2.0**8]  # and further ones back off at once (DeepSpeed)
    assert _steps(s, "..") == [2.0**8, 2.0**9]  # growth restores the hysteresis
    assert _steps(s, "xx") == [2.0**9, 2.0**9]
    assert _steps(s, "x") == [2.0**8]


def test_static_scaler_keeps_scale_and_counts_clean_steps():
    s = LossScaler(128.0)
    assert not s.dynamic
    assert _steps(s, "..x.") == [128.0] * 4
    assert s.clean_steps == 1


def test_scale_loss_value_and_inv_scale():
    s = LossScaler("dynamic", init_scale=8.0)
    loss = torch.tensor(1.5, dtype=torch.bfloat16)
    out = s.scale_loss_value(loss)
    assert out.dtype == torch.float32 and out.shape == () and out.item() == 12.0
    assert s.inv_scale().item() == 0.125


@pytest.mark.parametrize("found", [0.0, 1.0], ids=["clean", "overflow"])
def test_the_scale_derived_by_an_update_follows_the_new_scale(found: float) -> None:
    """After an update (the fused native one makes 1/scale and the 0-d scale with the state),
    `inv_scale` and the scaled loss use the new scale, bitwise what torch computes."""
    s = LossScaler("dynamic", init_scale=3.0, growth_interval=1)
    for _ in range(3):
        s.update_(torch.full((1,), found))
        loss = torch.tensor(1.7)
        assert torch.equal(s.inv_scale(), torch.reciprocal(s.scale))
        assert torch.equal(s.scale_loss_value(loss), loss * s.scale.reshape(()))
        assert s.scale_loss_value(loss).shape == ()
    s.set_scale(5.0)  # an in-place write: the 0-d view and the inverse follow it
    assert float(s.scale_loss_value(torch.tensor(2.0))) == 10.0
    assert torch.equal(s.inv_scale(), torch.reciprocal(s.scale))


@pytest.mark.parametrize("scale", [1.0, 3.0, 1e-30, 65536.0 * 3, 7.5e37, 0.0, math.inf])
def test_inv_scale_is_reciprocal_bitwise(scale: float):
    s = LossScaler(scale)
    assert s._scale.dtype == torch.float32 and s._scale.shape == (1,)
    assert torch.equal(s._scale, s._scale_before_overflow)
    assert s._scale_before_overflow is not s._scale
    inv = s.inv_scale()
    assert inv.dtype == torch.float32 and inv.shape == (1,)
    assert inv.view(torch.int32).item() == torch.reciprocal(s._scale).view(torch.int32).item()


def test_update_does_not_sync(monkeypatch: pytest.MonkeyPatch):
    s = LossScaler("dynamic", init_scale=8.0, growth_interval=1)

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync in the hot path")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    s.update_(INF)
    s.update_(CLEAN)
    s.scale_loss_value(torch.tensor(1.0))
    s.inv_scale()
    monkeypatch.undo()
    assert s.loss_scale() == 8.0


# -- logging ---------------------------------------------------------------------------------

def _overflow_and_report(s: LossScaler) -> None:
    s.update_(INF)
    s.report_overflow()


def test_overflow_log_names_loss_id_old_and_new_scale(caplog: pytest.LogCaptureFixture):
    s = LossScaler("dynamic", init_scale=1024.0, loss_id=2)
    with caplog.at_level(logging.INFO, logger="ampx"):
        _overflow_and_report(s)
    (record,) = [r for r in caplog.records if "overflow" in r.getMessage()]
    msg = record.getMessage()
    assert record.name == "ampx"
    assert "loss scaler 2" in msg and "512.0" in msg and "was 1024.0" in msg


def test_overflow_log_old_scale_is_before_the_first_unreported_overflow(
    caplog: pytest.LogCaptureFixture,
):
    s = LossScaler("dynamic", init_scale=1024.0)
    s.update_(INF)  # two backward passes overflow before one step
    s.update_(INF)
    with caplog.at_level(logging.INFO, logger="ampx"):
        s.report_overflow()
    assert "to 256.0 (was 1024.0)" in caplog.text


def test_overflow_log_is_rate_limited(caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch):
    now = [1000.0]
    monkeypatch.setattr(scaler_mod.time, "monotonic", lambda: now[0])
    s = LossScaler("dynamic", init_scale=2.0**20)
    with caplog.at_level(logging.INFO, logger="ampx"):
        for _ in range(10):
            _overflow_and_report(s)
        assert len([r for r in caplog.records if "overflow" in r.getMessage()]) == 3
        now[0] += 31.0
        _overflow_and_report(s)
    msgs = [r.getMessage() for r in caplog.records if "overflow" in r.getMessage()]
    assert len(msgs) == 4 and "7 similar messages suppressed" in msgs[-1]
    assert s.overflow_count == 11


def test_report_without_overflow_logs_nothing(caplog: pytest.LogCaptureFixture):
    s = LossScaler("dynamic")
    s.update_(CLEAN)
    with caplog.at_level(logging.INFO, logger="ampx"):
        s.report_overflow()
    assert caplog.records == []


def test_warning_at_floor_once(caplog: pytest.LogCaptureFixture):
    s = LossScaler("dynamic", init_scale=4.0, min_loss_scale=1.0)
    with caplog.at_level(logging.WARNING, logger="ampx"):
        for _ in range(5):
            _overflow_and_report(s)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "minimum scale 1.0" in warnings[0].getMessage()
    assert s.at_minimum()


def test_hysteresis_log_says_scale_kept(caplog: pytest.LogCaptureFixture):
    s = LossScaler("dynamic", init_scale=64.0, hysteresis=2)
    with caplog.at_level(logging.INFO, logger="ampx"):
        _overflow_and_report(s)
    assert "keeps loss scale 64.0" in caplog.text


# -- state entries -----------------------------------------------------------------------------

def test_state_dict_has_apex_keys_and_full_state():
    s = LossScaler("dynamic", init_scale=256.0, hysteresis=2, min_loss_scale=1.0,
                   growth_interval=50)
    _steps(s, "..x")
    sd = s.state_dict()
    assert sd["loss_scale"] == 256.0 and sd["unskipped"] == 0
    assert sd["version"] == STATE_VERSION and sd["dynamic"] is True
    assert sd["hysteresis"] == 2 and sd["hysteresis_tracker"] == 1
    assert sd["min_loss_scale"] == 1.0 and sd["max_loss_scale"] == 2.0**24
    assert sd["growth_interval"] == 50


def test_state_round_trip_restores_trajectory():
    a = LossScaler("dynamic", init_scale=256.0, hysteresis=2, growth_interval=4)
    _steps(a, "x...")
    b = LossScaler("dynamic", hysteresis=2, growth_interval=4)
    b.load_state_dict(a.state_dict())
    assert _steps(a, ".xx.") == _steps(b, ".xx.")


def test_apex_entry_loads():
    s = LossScaler("dynamic")
    s.load_state_dict({"loss_scale": 1024.0, "unskipped": 7})
    assert s.loss_scale() == 1024.0 and s.clean_steps == 7
    s.load_state_dict({"loss_scale": torch.tensor(64.0), "unskipped": 0})
    assert s.loss_scale() == 64.0


@pytest.mark.parametrize("entry, needle", [
    ([1.0, 2], "must be a dict"),
    ({"unskipped": 0}, "'loss_scale'"),
    ({"loss_scale": 1.0}, "'unskipped'"),
    ({"loss_scale": -1.0, "unskipped": 0}, "positive finite"),
    ({"loss_scale": float("nan"), "unskipped": 0}, "positive finite"),
    ({"loss_scale": "big", "unskipped": 0}, "positive finite"),
    ({"loss_scale": 1.0, "unskipped": -3}, "non-negative int"),
    ({"loss_scale": 1.0, "unskipped": 0, "version": 99}, "newer"),
    ({"loss_scale": 1.0, "unskipped": 0, "dynamic": "yes"}, "'dynamic'"),
    ({"loss_scale": 1.0, "unskipped": 0, "hysteresis_tracker": 1.5}, "hysteresis_tracker"),
    ({"loss_scale": 1.0, "unskipped": 0, "growth_factor": "2"}, "growth_factor"),
])
def test_malformed_entry_raises_naming_key_and_changes_nothing(entry, needle):
    s = LossScaler("dynamic", init_scale=32.0)
    with pytest.raises(ValueError, match="loss_scaler7") as info:
        s.load_state_dict(entry, "loss_scaler7")
    assert needle in str(info.value)
    assert s.loss_scale() == 32.0 and s.clean_steps == 0


def test_dynamic_static_mismatch_follows_apex():
    """apex assigned the saved scale either way: a dynamic scaler continues from a static
    entry's scale; a static scaler keeps its own (configuration) with a warning."""
    static = LossScaler(1.0)
    with pytest.warns(UserWarning, match="keeping 1.0"):
        static.load_state_dict(LossScaler("dynamic").state_dict(), "loss_scaler0")
    assert static.loss_scale() == 1.0 and static.unit_scale()
    dynamic = LossScaler("dynamic")
    dynamic.load_state_dict(LossScaler(8.0).state_dict(), "loss_scaler0")
    assert dynamic.loss_scale() == 8.0 and dynamic.dynamic


# -- overflow storms recover (issue 9 item 8) ----------------------------------------------------

def test_storm_stops_at_a_floor_of_one_and_the_message_is_true(caplog):
    s = LossScaler("dynamic", init_scale=2.0**16, growth_interval=3)
    with caplog.at_level(logging.INFO, logger="ampx"):
        for _ in range(200):  # a long overflow storm
            s.update_(torch.ones(1))
            s.report_overflow()
    assert s.loss_scale() == 1.0 and s.floor == 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "minimum scale 1.0" in warnings[0]
    assert "keep overflowing" not in warnings[0] and "grows again after 3 clean" in warnings[0]
    for _ in range(3):  # the storm is over: the scale grows back
        s.update_(torch.zeros(1))
    assert s.loss_scale() == 2.0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_training_recovers_after_an_overflow_storm(level):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=torch.float16,
                                 loss_scale="dynamic", verbosity=0, growth_interval=2)
    x = torch.randn(16, 8)

    def step(poison: bool) -> None:
        opt.zero_grad()
        with ampx.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            if poison:
                next(iter(model.parameters())).grad.fill_(float("inf"))
        opt.step()

    for _ in range(60):
        step(True)
    before = [p.detach().clone() for p in ampx.master_params(opt)]
    step(False)
    assert not ampx.step_was_skipped(opt)
    # at the floor the fp16 gradients are ordinary values: the step moves the weights
    assert all(not torch.equal(a, b) for a, b in zip(before, ampx.master_params(opt)))
    session = ampx.frontend.default_session()
    assert session is not None and session.loss_scale() == 1.0
    step(False)
    assert session.loss_scale() == 2.0  # growing back after growth_interval clean steps


_SCALER_TENSORS = ("_scale", "_growth_tracker", "_hysteresis_tracker",
                   "_overflows_since_report", "_scale_before_overflow")


@pytest.mark.skipif(_ext._native_module() is None, reason="the fused update is native")
def test_a_replaced_state_is_written_again_only_when_nothing_else_holds_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The native update writes the state after next into the set the last commit replaced
    (no allocation per pass), with the values of fresh tensors; a set something else still
    holds (a kept `scale`, a graph that saved the scaled loss's factor) is left alone."""
    s = LossScaler("dynamic", init_scale=4.0, growth_interval=2)
    ref = LossScaler("dynamic", init_scale=4.0, growth_interval=2)
    seen = []
    for c in "..x...x..":
        found = INF if c == "x" else CLEAN
        s.update_(found)
        with monkeypatch.context() as m:
            m.setattr(_ext, "next_scale_state", lambda *args: None)  # torch's ops, fresh
            ref.update_(found)
        for name in _SCALER_TENSORS:
            assert torch.equal(getattr(s, name), getattr(ref, name)), name
        assert torch.equal(s.inv_scale(), torch.reciprocal(s.scale))
        assert float(s.scale_loss_value(torch.tensor(1.0))) == s.loss_scale()
        seen.append(id(s.scale))
    assert len(set(seen[2:])) == 2  # from the third update on, two sets take turns

    # a state made but not committed yet (another thread's pass between its update and its
    # commit) holds the spare: the next update makes fresh tensors
    first = _ext.next_scale_state(s.tensors(), CLEAN, s.rule, s._spare)
    values = [t.clone() for t in first]
    second = _ext.next_scale_state(s.tensors(), INF, s.rule, s._spare)
    assert all(a is not b for a, b in zip(first, second))
    assert all(torch.equal(a, b) for a, b in zip(first, values))
    del first, second

    held = s.scale
    value = held.item()
    loss = torch.tensor(3.0, requires_grad=True)
    scaled = s.scale_loss_value(loss)  # the graph saves the 0-d view of this scale
    for _ in range(6):  # growth every 2 clean updates: the scale moves on
        s.update_(CLEAN)
    assert s.loss_scale() == value * 8
    assert held.item() == value  # never written again
    scaled.backward()  # the saved factor is intact (a write would fail the version check)
    assert loss.grad is not None and loss.grad.item() == value
