"""Opt levels as data: apex's property table, overrides, validation rules and error texts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ampx
from ampx import opt_levels
from ampx.opt_levels import OptionError, OptLevel, parse_dtype, resolve_properties

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


@pytest.mark.parametrize("kwargs", [
    dict(cast_model_type=False), dict(cast_model_type=None), dict(patch_torch_functions=False),
    dict(keep_batchnorm_fp32="True"), dict(keep_batchnorm_fp32="False"),
    dict(loss_scale="128.0"), dict(loss_scale=64), dict(master_weights=False),
])
def test_valid_overrides(kwargs: dict[str, Any]) -> None:
    props = resolve_properties("O2", **kwargs)
    if "loss_scale" in kwargs:
        assert props.loss_scale == float(kwargs["loss_scale"])
    if kwargs.get("keep_batchnorm_fp32") == "False":
        assert props.keep_batchnorm_fp32 is False
    if kwargs.get("cast_model_type") is False:
        assert props.cast_model_type is None


APEX_ZERO = ("Unexpected optimization level 01. Options are 'O0', 'O1', 'O2', 'O3'.  Note that "
             "in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero.")

# Every invalid combination, with a fragment of the documented message.
INVALID: list[tuple[dict[str, Any], str]] = [
    (dict(opt_level="01"), "the prefix O is the letter O, not the number zero"),
    (dict(opt_level="O4"), "Unexpected optimization level O4"),
    (dict(opt_level="o1"), "Unexpected optimization level o1"),
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
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_options_raise_the_documented_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError) as info:
        resolve_properties(**kwargs)
    assert message in str(info.value)
    # Legacy scripts catch RuntimeError (apex's type), new code catches ValueError.
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


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
    doc = Path(__file__).resolve().parents[1] / "docs" / "opt-levels.md"
    assert doc.read_text() == opt_levels.markdown(), (
        "regenerate: python -m ampx.lists --opt-levels > docs/opt-levels.md")


def test_docs_table_is_generated_from_presets() -> None:
    rows = dict(opt_levels.property_table())
    assert rows["master_weights"] == {"O0": "False", "O1": "None", "O2": "True", "O3": "False"}
    assert rows["cast_model_type"]["O2"] == "float16 (bf16: bfloat16)"
