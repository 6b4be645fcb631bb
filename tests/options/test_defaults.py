"""Each default is written once, in `ampx.options.levels.DEFAULTS`; the entry points read it."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ampx
from ampx import frontend
from ampx.options import flags as options
from ampx.options import levels as opt_levels
from ampx.options.values import parse_dtype
from ampx.scaling.scaler import LossScaler

DEFAULTS = opt_levels.DEFAULTS
# Parameters of the entry points that are not `Properties` fields.
NOT_PROPERTIES = {"self", "models", "optimizers", "sync_overflow", "process_group", "overrides",
                  "options", "loss_id", "device"}


def _default(field: str) -> Any:
    value = getattr(DEFAULTS, field)
    return value.value if isinstance(value, opt_levels.OptLevel) else value


def drift(function: Callable[..., Any]) -> dict[str, tuple[Any, Any]]:
    """{parameter: (its default, Properties' default)} for every default that differs."""
    out = {}
    for name, param in inspect.signature(function).parameters.items():
        if name in NOT_PROPERTIES or param.kind is param.VAR_KEYWORD:
            continue
        assert name in opt_levels.FIELDS, f"{function.__qualname__}: {name} is no Properties field"
        if param.default is param.empty or param.default != _default(name):
            out[name] = (param.default, _default(name))
    return out


@pytest.mark.parametrize("function", [ampx.initialize, ampx.amp.initialize, ampx.Amp.__init__,
                                      opt_levels.resolve_properties],
                         ids=["ampx.initialize", "amp.initialize", "Amp", "resolve_properties"])
def test_entry_point_defaults_are_the_properties_defaults(function: Callable[..., Any]) -> None:
    assert drift(function) == {}


def test_module_initialize_keeps_apex_signature() -> None:
    params = list(inspect.signature(frontend.initialize).parameters)
    assert params == ["models", "optimizers", "enabled", "opt_level", "cast_model_type",
                      "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
                      "loss_scale", "cast_model_outputs", "num_losses", "verbosity",
                      "min_loss_scale", "max_loss_scale", "options"]


def test_the_check_fails_on_drift() -> None:
    def drifted(models: Any, opt_level: str = "O2", max_loss_scale: float = 2.0**20,
                **options: Any) -> None:
        """A copy of an entry point whose defaults drifted."""

    assert drift(drifted) == {"opt_level": ("O2", "O1"), "max_loss_scale": (2.0**20, 2.0**24)}


def test_loss_scaler_defaults_match() -> None:
    params = inspect.signature(LossScaler.__init__).parameters
    for name, value in DEFAULTS.scaler_options().items():
        if name in params and params[name].default is not params[name].empty:
            assert params[name].default == value, name
    assert params["loss_scale"].default == "dynamic"  # a bare LossScaler is apex's dynamic one


def test_argparse_flag_defaults_match() -> None:
    parser = argparse.ArgumentParser()
    options.add_args(parser)
    args = parser.parse_args([])
    assert parse_dtype(args.amp_dtype) == DEFAULTS.dtype
    assert args.init_scale == DEFAULTS.init_scale
    assert args.scale_window == DEFAULTS.growth_interval
    assert args.hysteresis == DEFAULTS.hysteresis
    assert args.loss_scale is DEFAULTS.loss_scale is None
    assert args.keep_batchnorm_fp32 is DEFAULTS.keep_batchnorm_fp32 is None
    assert args.master_weights is DEFAULTS.master_weights is None
    # the documented exception: --min-loss-scale is fairseq's 1e-4
    assert args.min_loss_scale == 1e-4 and DEFAULTS.min_loss_scale is None
    # and a session from no flags but a level is Properties' defaults for that level
    props = ampx.Amp.from_args(parser.parse_args(["--opt-level", "O2"])).properties
    expected = opt_levels.resolve_properties("O2", min_loss_scale=1e-4)
    assert props == expected


def test_a_session_without_options_is_the_default_properties() -> None:
    props = ampx.Amp().properties
    assert props == opt_levels.resolve_properties()
    for name in opt_levels.FIELDS:
        if _default(name) is not None:  # None fields take the level's value
            assert getattr(props, name) == getattr(DEFAULTS, name), name
    assert props.dtype == torch.float16 and props.opt_level is opt_levels.OptLevel.O1
