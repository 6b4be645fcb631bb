"""Opt levels as data: apex's property table, overrides, validation rules and error texts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ampx
from ampx import _docs
from ampx.options import levels as opt_levels
from ampx.options.levels import (
    OptionError,
    OptLevel,
    UnknownOptionError,
    parse_dtype,
    resolve_properties,
)

# apex's table (reference §2.3), float16.
APEX_TABLE = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_presets_match_apex(level: str) -> None:
    props = resolve_properties(level)
    assert props.opt_level is OptLevel(level)
    assert props.enabled is True
    assert props.dtype == torch.float16
    for key, value in APEX_TABLE[level].items():
        assert getattr(props, key) == value, key
    assert props.min_loss_scale is None and props.max_loss_scale == 2.0**24


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_bf16_presets(level: str) -> None:
    props = resolve_properties(level, dtype=torch.bfloat16)
    assert props.dtype == torch.bfloat16
    expected = APEX_TABLE[level]["cast_model_type"]
    if expected == torch.float16:
        expected = torch.bfloat16
    assert props.cast_model_type == expected
    assert props.loss_scale == 1.0  # bf16 needs no scaling; non-finite steps still skip
    assert resolve_properties(level, dtype="bf16", loss_scale="dynamic").loss_scale == "dynamic"


@pytest.mark.parametrize("text,dtype", [
    ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
])
def test_dtype_spellings(text: Any, dtype: torch.dtype) -> None:
    assert parse_dtype(text) == dtype
    assert resolve_properties("O2", dtype=text).cast_model_type == dtype


def test_cast_model_type_bf16_selects_the_session_dtype() -> None:
    props = resolve_properties("O2", cast_model_type=torch.bfloat16)
    assert props.dtype == torch.bfloat16 and props.cast_model_type == torch.bfloat16


@pytest.mark.parametrize("kwargs,field,expected", [
    (dict(cast_model_type=False), "cast_model_type", None),
    (dict(cast_model_type=None), "cast_model_type", torch.float16),  # None: the level's
    (dict(patch_torch_functions=False), "patch_torch_functions", False),
    (dict(keep_batchnorm_fp32="True"), "keep_batchnorm_fp32", True),
    (dict(keep_batchnorm_fp32="False"), "keep_batchnorm_fp32", False),
    (dict(loss_scale="128.0"), "loss_scale", 128.0),
    (dict(loss_scale=64), "loss_scale", 64.0),
    (dict(master_weights=False), "master_weights", False),
    (dict(master_weights="False"), "master_weights", False),  # a string, read as apex's
])
def test_valid_overrides(kwargs: dict[str, Any], field: str, expected: Any) -> None:
    props = resolve_properties("O2", **kwargs)
    assert getattr(props, field) == expected and type(getattr(props, field)) is type(expected)
    # every other field keeps O2's value
    default = resolve_properties("O2")
    others = {k: v for k, v in default.as_dict().items() if k not in (field, "skip_non_finite",
                                                                      "cast_model_outputs")}
    assert {k: props.as_dict()[k] for k in others} == others


APEX_ZERO = ("Unexpected optimization level 01. Options are 'O0', 'O1', 'O2', 'O3'.  Note that "
             "in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero.")

# Every invalid combination, with a fragment of the documented message.
INVALID: list[tuple[dict[str, Any], str]] = [
    (dict(opt_level="01"), "the prefix O is the letter O, not the number zero"),
    (dict(opt_level="O4"), "Unexpected optimization level O4"),
    (dict(opt_level="o1"), "Unexpected optimization level o1"),
    (dict(opt_level="o2"), "case-sensitive: did you mean 'O2' (a capital letter O)?"),
    (dict(opt_level="O1", cast_model_type=torch.float16), "O1 inserts casts around Torch"),
    (dict(opt_level="O1", cast_model_type=torch.bfloat16), "O1 inserts casts around Torch"),
    (dict(opt_level="O2", cast_model_type="half"), "must be a torch dtype"),
    (dict(opt_level="O2", cast_model_type=torch.bfloat16, dtype="fp16"), "conflicts with"),
    (dict(opt_level="O0", patch_torch_functions=True),
     "patch_torch_functions=True should only be set by selecting opt_level='O1'"),
    (dict(opt_level="O2", patch_torch_functions=True), "should only be set by selecting"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True),
     "With opt_level O1, batchnorm functions are automatically patched"),
    (dict(opt_level="O1", keep_batchnorm_fp32=False), "keep_batchnorm_fp32 should be None"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32='yes' is not valid"),
    (dict(opt_level="O1", master_weights=True),
     "It doesn't make sense to use master_weights with O1"),
    (dict(opt_level="O1", master_weights=False), "master_weights with O1"),
    (dict(opt_level="O2", loss_scale="big"), "neither 'dynamic' nor a number"),
    (dict(opt_level="O2", loss_scale=0), "positive finite"),
    (dict(opt_level="O2", loss_scale=float("inf")), "positive finite"),
    (dict(opt_level="O2", loss_scale=True), "use 'dynamic' or a number"),
    (dict(opt_level="O2", dtype="fp8"), "is not a half-precision dtype"),
    (dict(opt_level="O2", dtype=torch.float32), "is not a half-precision dtype"),
    (dict(opt_level="O2", cast_model_outputs="float"), "must be a torch dtype"),
    (dict(opt_level="O2", num_losses=0), "num_losses=0 must be an int >= 1"),
    (dict(opt_level="O2", num_losses=True), "num_losses=True"),
    (dict(opt_level="O2", verbosity=3), "verbosity=3 must be 0, 1 or 2"),
    (dict(opt_level="O2", min_loss_scale=-1.0), "min_loss_scale=-1.0 must be a positive"),
    (dict(opt_level="O2", max_loss_scale=0), "max_loss_scale=0 must be a positive"),
    (dict(opt_level="O2", min_loss_scale=4.0, max_loss_scale=2.0), "is larger than"),
    (dict(opt_level="O2", init_scale=0), "init_scale=0"),
    (dict(opt_level="O2", growth_factor=0.5), "growth_factor=0.5 must be >= 1"),
    (dict(opt_level="O2", backoff_factor=2.0), "backoff_factor=2.0 must be in (0, 1]"),
    (dict(opt_level="O2", growth_interval=0), "growth_interval=0 must be an int >= 1"),
    (dict(opt_level="O2", hysteresis=1.5), "hysteresis=1.5 must be an int >= 1"),
    # issue 9, item 10: values that used to be accepted
    (dict(opt_level="O2", cast_model_type=torch.float64), "cast_model_type=torch.float64"),
    (dict(opt_level="O0", cast_model_type=torch.int8), "cast_model_type=torch.int8"),
    (dict(opt_level="O2", init_scale=float("inf"), max_loss_scale=float("inf")),
     "init_scale=inf must be a positive finite"),
    (dict(opt_level="O2", init_scale=1e39), "init_scale=1e+39 must be a positive finite"),
    (dict(opt_level="O2", loss_scale=1e39), "loss_scale=1e+39 must be a positive finite"),
    (dict(opt_level="O2", enabled="False"), "enabled='False' must be True or False"),
    (dict(opt_level="O2", enabled="yes"), "enabled='yes' must be True or False"),
    (dict(opt_level="O1", device_types=123), "device_types=123 must be a device type"),
    (dict(opt_level="O1", device_types=["cuda", 1]), "device_types=['cuda', 1]"),
    (dict(opt_level="O1", device_types="gpu"), "'gpu' is not a torch device type"),
    (dict(opt_level="O1", device_types=[]), "device_types=[] must be a device type"),
    (dict(opt_level="O2", min_loss_scale=2.0**17), "larger than the initial scale 65536.0"),
    (dict(opt_level="O2", min_loss_scale=8.0, init_scale=4.0), "first overflow would raise"),
    (dict(opt_level="O2", min_loss_scale=8.0, max_loss_scale=4.0), "larger than max_loss_scale"),
    (dict(opt_level="O2", hysteresis=2**40), "hysteresis=1099511627776 must be an int >= 1"),
    (dict(opt_level="O2", growth_interval=2**31), "< 2**31"),
    (dict(opt_level="O2", skip_non_finite="no"), "skip_non_finite='no' must be True or False"),
    (dict(opt_level="O1", allow_banned="yes"), "allow_banned='yes' must be True or False"),
    (dict(opt_level="O2", master_weights="maybe"), "master_weights='maybe' is not valid"),
    (dict(opt_level="O2", cast_model_outputs=torch.int64), "cast_model_outputs=torch.int64"),
    # the overflow-provenance options
    (dict(opt_level="O2", on_overflow="stop"), "on_overflow='stop' is not one of 'skip', "),
    (dict(opt_level="O2", overflow_patience=0), "overflow_patience=0 must be an int >= 1"),
    (dict(opt_level="O2", detect_overflow="backward"), "detect_overflow='backward' is not one"),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_options_raise_the_documented_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError) as info:
        resolve_properties(**kwargs)
    assert message in str(info.value)
    # Legacy scripts catch RuntimeError (apex's type), new code catches ValueError.
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_a_lowercase_letter_o_is_not_told_about_the_number_zero() -> None:
    with pytest.raises(RuntimeError) as info:
        resolve_properties(" o3")
    assert str(info.value) == ("Unexpected optimization level  o3. Options are 'O0', 'O1', 'O2', "
                               "'O3'.  Opt levels are case-sensitive: did you mean 'O3' "
                               "(a capital letter O)?")


def test_zero_instead_of_letter_o_message_is_apex_verbatim() -> None:
    with pytest.raises(RuntimeError) as info:
        resolve_properties("01")
    assert str(info.value) == APEX_ZERO
    with pytest.raises(ValueError):
        ampx.Amp("00")


def test_as_dict_is_jsonable() -> None:
    import json

    data = resolve_properties("O2", dtype="bf16").as_dict()
    assert json.loads(json.dumps(data))["cast_model_type"] == "bfloat16"
    assert data["opt_level"] == "O2"


def test_committed_opt_levels_doc_matches_generated() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "opt-levels.md"
    assert doc.read_text() == _docs.opt_levels_markdown(), (
        "regenerate: python -m ampx._docs opt-levels > docs/opt-levels.md")


def test_docs_main_prints_the_pages(capsys: pytest.CaptureFixture) -> None:
    assert _docs.main(["opt-levels"]) == 0
    assert capsys.readouterr().out == _docs.opt_levels_markdown()
    assert _docs.main(["nonsense"]) == 2
    assert "usage" in capsys.readouterr().err


def test_docs_table_is_generated_from_presets() -> None:
    rows = dict(_docs.property_table())
    assert rows["master_weights"] == {"O0": "False", "O1": "None", "O2": "True", "O3": "False"}
    assert rows["cast_model_type"]["O2"] == "float16 (bf16: bfloat16)"
    assert rows["cast_model_outputs"] == {"O0": "float32", "O1": "None", "O2": "float32",
                                          "O3": "float32"}
    assert rows["skip_non_finite"] == {"O0": "False", "O1": "True", "O2": "True",
                                       "O3": "False (bf16: True)"}


@pytest.mark.parametrize("names", [["los_scale"], ["opt_levle", "foo"]])
def test_unknown_option_names_are_listed(names: list[str]) -> None:
    with pytest.raises(UnknownOptionError) as info:
        resolve_properties("O1", **{name: 1 for name in names})
    text = str(info.value)
    for name in names:
        assert repr(name) in text
    assert "The options are: opt_level, enabled, dtype" in text
    # a TypeError (as Python's own unexpected-keyword error), an OptionError, a RuntimeError
    assert isinstance(info.value, (TypeError)) and isinstance(info.value, OptionError)
    if names == ["los_scale"]:
        assert "did you mean 'loss_scale'?" in text
    with pytest.raises(UnknownOptionError, match="los_scale"):
        ampx.Amp("O2", los_scale=4)


# The skip/scale policy: Properties is the one place that says whether steps are skipped.
SKIPS = {  # (level, dtype, loss_scale override) -> skip_non_finite
    ("O0", "fp16", None): False, ("O0", "bf16", None): False, ("O0", "fp16", "dynamic"): True,
    ("O1", "fp16", None): True, ("O1", "bf16", None): True, ("O1", "fp16", 128.0): False,
    ("O2", "fp16", None): True, ("O2", "bf16", None): True, ("O2", "fp16", 1.0): False,
    ("O3", "fp16", None): False, ("O3", "bf16", None): True, ("O3", "fp16", "dynamic"): True,
}


@pytest.mark.parametrize("key", SKIPS, ids=[f"{lv}-{dt}-{ls}" for lv, dt, ls in SKIPS])
def test_properties_answer_whether_steps_are_skipped(key: tuple) -> None:
    level, dtype, scale = key
    props = resolve_properties(level, dtype=dtype, loss_scale=scale)
    assert props.skip_non_finite is SKIPS[key]
    amp = ampx.Amp(level, dtype=dtype, loss_scale=scale, verbosity=0)
    assert amp.skips_non_finite is props.skip_non_finite
    # an explicit value wins; disabled never skips
    assert resolve_properties(level, dtype=dtype, skip_non_finite=not SKIPS[key]) \
        .skip_non_finite is (not SKIPS[key])
    assert resolve_properties(level, enabled=False).skip_non_finite is False
    expected_scaling = bool(props.master_weights) or props.loss_scale != 1.0 or SKIPS[key]
    assert props.scales_gradients is expected_scaling is amp.scales_gradients


@pytest.mark.parametrize("level,fp16,bf16", [
    ("O0", "Pure FP32 training.", "Pure FP32 training."),
    ("O1", "Insert automatic casts around Pytorch functions and Tensor methods.",
     "Insert automatic casts around Pytorch functions and Tensor methods."),
    ("O2", "FP16 training with FP32 batchnorm and FP32 master weights.",
     "BF16 training with FP32 batchnorm and FP32 master weights."),
    ("O3", "Pure FP16 training.", "Pure BF16 training."),
])
def test_brief_names_the_session_dtype(level: str, fp16: str, bf16: str) -> None:
    assert opt_levels.brief(level) == fp16  # apex's words
    assert opt_levels.brief(level, torch.bfloat16) == bf16


@pytest.mark.parametrize("level,expected", [("O0", torch.float32), ("O1", None),
                                            ("O2", torch.float32), ("O3", torch.float32)])
def test_cast_model_outputs_is_the_effective_value(level: str, expected: Any) -> None:
    assert resolve_properties(level).cast_model_outputs == expected
    assert resolve_properties(level, cast_model_outputs=torch.float16).cast_model_outputs \
        == torch.float16


@pytest.mark.parametrize("kwargs,expected", [
    ({}, ("skip", 8, None)),
    (dict(on_overflow="raise", overflow_patience=3), ("raise", 3, None)),
    (dict(on_overflow="fp32-fallback", detect_overflow="forward"), ("fp32-fallback", 8, "forward")),
    (dict(detect_overflow=False), ("skip", 8, None)),
    (dict(detect_overflow="none"), ("skip", 8, None)),
])
def test_overflow_options(kwargs: dict[str, Any], expected: tuple) -> None:
    props = resolve_properties("O2", **kwargs)
    assert (props.on_overflow, props.overflow_patience, props.detect_overflow) == expected
    ampx.frontend.set_forced_options({"detect_overflow": "forward"})  # `ampx run` can force it
    assert ampx.Amp("O2", verbosity=0, **kwargs).properties.detect_overflow == "forward"
