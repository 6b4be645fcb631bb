"""Forced options (`ampx run -O O2 --dtype bf16`): parsed once at the command line, then a value."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import ampx
from ampx import frontend
from ampx.cli import main as cli
from ampx.cli import run as runner
from ampx.options import values
from ampx.options.forced import FORCEABLE, ForcedOptions
from ampx.options.values import OptionError, OptLevel


def test_parse_gives_typed_values_and_apply_drops_level_options() -> None:
    forced = ForcedOptions.parse({"opt_level": "O2", "dtype": "bf16", "loss_scale": "dynamic"})
    assert forced.options == {"opt_level": OptLevel.O2, "dtype": torch.bfloat16,
                              "loss_scale": "dynamic"}
    requested = {"opt_level": "O1", "loss_scale": 128.0, "patch_torch_functions": True}
    assert ForcedOptions().apply(requested) == requested
    assert forced.apply(requested) == {"opt_level": OptLevel.O2, "loss_scale": "dynamic",
                                       "dtype": torch.bfloat16}
    assert forced.describe() == "opt_level='O2', dtype='bfloat16', loss_scale='dynamic'"
    with pytest.raises(TypeError):
        forced.options["opt_level"] = "O3"  # type: ignore[index]  # read-only


def test_json_round_trip_restores_the_types() -> None:
    forced = ForcedOptions.parse({"opt_level": "O3", "dtype": torch.float16, "enabled": False,
                                  "min_loss_scale": 2.0, "detect_overflow": "forward"})
    text = forced.to_json()
    assert json.loads(text)["dtype"] == "float16"
    back = ForcedOptions.from_json(text)
    assert back == forced and back.options["opt_level"] is OptLevel.O3
    assert back.options["dtype"] is torch.float16


def test_set_forced_options_reaches_every_session_and_bad_calls_change_nothing() -> None:
    frontend.set_forced_options({"opt_level": "O3"})
    amp = ampx.Amp("O1", keep_batchnorm_fp32=None, patch_torch_functions=True, verbosity=0)
    assert amp.properties.opt_level is OptLevel.O3 and amp.requested["opt_level"] == "O1"
    assert amp.forced == {"opt_level": "O3"}
    with pytest.raises(ValueError, match="cannot force \\['init_scale'\\]"):
        frontend.set_forced_options({"init_scale": 2.0})
    with pytest.raises(OptionError, match="not a half-precision dtype"):
        frontend.set_forced_options({"dtype": "fp8"})
    assert frontend.forced_options().jsonable() == {"opt_level": "O3"}  # unchanged
    frontend.set_forced_options(None)
    assert not frontend.forced_options()


@pytest.mark.parametrize("forced,error", [
    ({"opt_level": "O1", "master_weights": True}, "master_weights with O1"),
    ({"dtype": "fp8"}, "not a half-precision dtype"),
    ({"opt_level": "00"}, "the letter O, not the number zero"),
    ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, "is larger than"),
    ({"master_weights": True}, None),  # the script's level decides
    ({"enabled": False, "opt_level": "O2"}, None),
])
def test_parse_checks_values_against_each_other(forced: dict[str, Any],
                                                error: str | None) -> None:
    if error is None:
        assert set(ForcedOptions.parse(forced).options) == set(forced)
    else:
        with pytest.raises(OptionError, match=error):
            ForcedOptions.parse(forced)


def test_every_forceable_option_has_a_parser() -> None:
    assert FORCEABLE == ("opt_level", "dtype", "loss_scale", "keep_batchnorm_fp32",
                         "master_weights", "min_loss_scale", "max_loss_scale", "enabled",
                         "detect_overflow", "numerics", "numerics_every", "compensation")


def test_ampx_run_parses_the_opt_level_once(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Any) -> None:
    """From `ampx run -O O2 --dtype bf16` to the script's session: one parse of each value."""
    calls: list[tuple[str, Any]] = []
    real_level, real_dtype = values.parse_opt_level, values.parse_dtype

    def count_level(value: Any) -> OptLevel:
        calls.append(("opt_level", value))
        return real_level(value)

    def count_dtype(value: Any, **kwargs: Any) -> torch.dtype:
        calls.append(("dtype", value))
        return real_dtype(value, **kwargs)

    import ampx.options.forced as forced_module
    import ampx.options.levels as levels_module

    for module in (values, forced_module, levels_module):
        monkeypatch.setattr(module, "parse_opt_level", count_level, raising=False)
        monkeypatch.setattr(module, "parse_dtype", count_dtype, raising=False)
    script = tmp_path / "script.py"
    script.write_text("import ampx\nprint('forced', ampx.frontend.forced_options().describe())\n")
    captured: list[runner.RunRequest] = []
    monkeypatch.setattr(runner, "run", lambda request: captured.append(request) or 0)
    assert cli.main(["run", "-q", "-O", "O2", "--dtype", "bf16", str(script)]) == 0
    (request,) = captured
    assert request.forced.options == {"opt_level": OptLevel.O2, "dtype": torch.bfloat16}
    # text is parsed once; what the checks see later are the parsed values themselves
    parses = [c for c in calls if type(c[1]) is str]
    assert parses == [("opt_level", "O2"), ("dtype", "bf16")], calls
    assert all(isinstance(v, (OptLevel, torch.dtype)) for _, v in calls if type(v) is not str)
    # the child's copy is decoded, not parsed, and equals the parent's value
    config = runner.child_config(request)
    assert ForcedOptions.from_json(config["forced"]) == request.forced
    assert [c for c in calls if type(c[1]) is str] == parses


def test_a_forced_dtype_other_than_the_scripts_is_logged_at_any_verbosity(
        caplog: pytest.LogCaptureFixture) -> None:
    forced = ForcedOptions.parse({"dtype": "bf16"})
    assert forced.dtype_note({"dtype": "bfloat16"}) is None  # what the script asked for
    assert ForcedOptions.parse({"opt_level": "O2"}).dtype_note({}) is None  # no dtype forced
    assert ForcedOptions.parse({"dtype": "fp16"}).dtype_note({}) is None  # apex's default
    note = forced.dtype_note({"opt_level": "O2", "dtype": "fp16"})
    assert note is not None and "passed dtype='fp16'" in note
    frontend.set_forced_options({"dtype": "bf16"})
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="ampx"):
        ampx.initialize(model, opt, opt_level="O2", verbosity=0)  # as an apex script calls it
    assert model.weight.dtype == torch.bfloat16
    assert [r.getMessage() for r in caplog.records] == [
        "ampx run --dtype bfloat16: training in bfloat16. The script's initialize passed no dtype "
        "(apex's API trains float16), so its own flags and logs that say float16 (the HF "
        "Trainer's --fp16, for one) do not describe this run."]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_forced_dtype_carries_the_scripts_half_outputs_along(
        level: str, caplog: pytest.LogCaptureFixture) -> None:
    """apex scripts wrote cast_model_outputs=torch.float16 to mean "the half dtype": under
    `ampx run --dtype bf16` the outputs come back bf16 (float16 would overflow past 65504),
    with a note; float32 outputs, or a script that asked for bf16 itself, are left alone."""
    forced = ForcedOptions.parse({"dtype": "bf16"})
    assert forced.apply({"cast_model_outputs": torch.float16})["cast_model_outputs"] \
        == torch.bfloat16
    assert forced.apply({"cast_model_outputs": torch.float32})["cast_model_outputs"] \
        == torch.float32
    assert forced.apply({"dtype": "bf16", "cast_model_outputs": torch.float16})[
        "cast_model_outputs"] == torch.float16  # the script chose both itself
    frontend.set_forced_options({"dtype": "bf16"})
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(3e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="ampx"):
        model, opt = ampx.initialize(model, opt, opt_level=level, verbosity=0,
                                     cast_model_outputs=torch.float16)
    out = model(torch.ones(2, 4))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()  # 1.2e5: past fp16's max
    (note,) = [r.getMessage() for r in caplog.records]
    assert note.endswith("Its cast_model_outputs=torch.float16 is read as the half dtype: the "
                         "model's outputs come back bfloat16.")
