"""The one home of ampx's option defaults: opt levels as data, every default, validation.

An opt level is a named preset (apex's table, §2.3 of the reference). `Properties` is a
session's frozen configuration, and its field defaults are the defaults of every entry point
(`ampx.initialize`, `ampx.Amp`, the argparse flags of `ampx.options.flags`); a field whose
default is None takes the opt level's value. `resolve_properties(opt_level, **overrides)`
validates the overrides (unknown names are listed), applies apex's cross-field rules and the
skip/scale policy, and returns the `Properties` (`ampx run -O` forces options over a script's
with `ampx.options.forced`). Nothing here touches torch's namespace or the user's objects.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import torch

from .values import (
    HALF_DTYPES,
    ON_OVERFLOW_CHOICES,
    LossScale,
    OptionError,
    OptLevel,
    UnknownOptionError,
    dtype_name,
    parse_bool,
    parse_choice,
    parse_compensation,
    parse_count,
    parse_detect_overflow,
    parse_device_types,
    parse_dtype,
    parse_flag,
    parse_loss_scale,
    parse_module_names,
    parse_numerics,
    parse_opt_level,
    parse_positive,
)

__all__ = [
    "DEFAULTS",
    "LossScale",
    "OptLevel",
    "OptionError",
    "Properties",
    "UnknownOptionError",
    "brief",
    "resolve_properties",
]

@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved configuration of one ampx session; its field defaults are ampx's defaults.

    A default of None means "the opt level's value" for cast_model_type,
    patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale,
    cast_model_outputs and skip_non_finite; `resolve_properties` fills them in.

    Attributes:
        opt_level: The preset the other fields started from.
        enabled: False makes every ampx call a pass-through.
        dtype: The low-precision dtype of the session (float16 or bfloat16).
        cast_model_type: Dtype the model is cast to (None: the model is left alone).
        patch_torch_functions: Whether O1 function patching is installed.
        keep_batchnorm_fp32: Keep batchnorm modules in float32 when the model is cast.
        master_weights: Keep float32 master weights inside the optimizer (None at O1, as
            apex: the weights themselves are float32).
        loss_scale: "dynamic" or a static float (default: the level's; 1.0 with bf16).
        cast_model_outputs: Dtype forward outputs are cast to (float32 when the model is
            cast, as apex; None: outputs are left alone).
        num_losses: Number of loss scalers (one per `loss_id`).
        verbosity: 0 silences the option table and the skipped-step lines (as apex did); 2
            logs every cast made by the O1 patches.
        min_loss_scale: Floor of the dynamic scale (None: no floor).
        max_loss_scale: Ceiling of the dynamic scale; also clamps the initial scale.
        init_scale: Initial dynamic scale (before clamping by `max_loss_scale`).
        growth_factor: Factor applied after `growth_interval` clean steps.
        backoff_factor: Factor applied on an overflow.
        growth_interval: Clean steps between two growths (apex's scale window).
        hysteresis: Overflows tolerated before the scale backs off (1: back off at once).
        skip_non_finite: Skip the step when gradients are not finite. Default: with a
            dynamic scale, and with bf16 at O1-O3; never when disabled.
        allow_banned: Run banned functions (binary_cross_entropy) in float32 instead of raising.
        device_types: Device types whose tensors O1 casts (None: the models' devices).
        on_overflow: What persisting overflows do: "skip" (apex's), "raise" or
            "fp32-fallback" (see docs/debugging-overflows.md).
        overflow_patience: Skipped steps before "raise" / "fp32-fallback" act.
        detect_overflow: None, or "forward" (find the first module whose output is inf/NaN).
        numerics: None, or "report" (watch every module's overflow, underflow and precision:
            ``ampx.numerics_report()``; docs/debugging-overflows.md).
        numerics_every: Watch one step in this many (and the step after a skipped one).
        numerics_shadow_every: Re-run modules in float32 on every this-many-th watched step
            (the first included) to measure their half outputs' error (0: never).
        keep_fp32: Names of modules (as in ``named_modules()``) that run in float32.
        compensation: None, or "kahan" (O3 without master weights: each half weight keeps a
            half compensation so updates below its precision are not lost;
            docs/opt-levels.md, ``ampx.scaling.compensated``).
    """

    opt_level: OptLevel = OptLevel.O1
    enabled: bool = True
    dtype: torch.dtype = torch.float16
    cast_model_type: torch.dtype | None = None
    patch_torch_functions: bool | None = None
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | None = None
    loss_scale: LossScale | None = None
    cast_model_outputs: torch.dtype | None = None
    num_losses: int = 1
    verbosity: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    skip_non_finite: bool | None = None
    allow_banned: bool = False
    device_types: frozenset[str] | None = None
    on_overflow: str = "skip"
    overflow_patience: int = 8
    detect_overflow: str | None = None
    numerics: str | None = None
    numerics_every: int = 100
    numerics_shadow_every: int = 10
    keep_fp32: tuple[str, ...] = ()
    compensation: str | None = None

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic."""
        return self.loss_scale == "dynamic"

    @property
    def scale(self) -> LossScale:
        """The loss scale ("dynamic" or a number; unset is apex's 1.0)."""
        return 1.0 if self.loss_scale is None else self.loss_scale

    @property
    def scales_gradients(self) -> bool:
        """False on apex's short-circuit path (no masters, static scale 1.0, no inf check)."""
        return self.enabled and bool(
            self.master_weights or self.dynamic or self.scale != 1.0 or self.skip_non_finite)

    def scaler_options(self) -> dict[str, Any]:
        """The keyword arguments of `LossScaler` taken from these properties."""
        return dict(init_scale=self.init_scale, growth_factor=self.growth_factor,
                    backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
                    hysteresis=self.hysteresis, min_loss_scale=self.min_loss_scale,
                    max_loss_scale=self.max_loss_scale)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view (dtypes as their short names, device types as a sorted list)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.dtype):
                value = dtype_name(value)
            elif isinstance(value, OptLevel):
                value = value.value
            elif isinstance(value, frozenset):
                value = sorted(value)
            out[field.name] = value
        return out


DEFAULTS = Properties()
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Properties))

# apex's table (reference §2.3). "half" stands for the session's dtype (fp16 unless dtype=bf16).
_HALF = "half"
_LEVEL_FIELDS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                 "master_weights", "loss_scale")
_PRESETS: dict[OptLevel, tuple[Any, ...]] = {
    OptLevel.O0: (torch.float32, False, None, False, 1.0),
    OptLevel.O1: (None, True, None, None, "dynamic"),
    OptLevel.O2: (_HALF, False, True, True, "dynamic"),
    OptLevel.O3: (_HALF, False, False, False, 1.0),
}
# apex's "Selected optimization level" lines; {half} is FP16 (apex's words) or BF16.
_BRIEFS: dict[OptLevel, str] = {
    OptLevel.O0: "Pure FP32 training.",
    OptLevel.O1: "Insert automatic casts around Pytorch functions and Tensor methods.",
    OptLevel.O2: "{half} training with FP32 batchnorm and FP32 master weights.",
    OptLevel.O3: "Pure {half} training.",
}


def brief(level: OptLevel | str, dtype: torch.dtype = torch.float16) -> str:
    """apex's one-line description of a level, naming the session's half dtype.

    >>> brief("O2", torch.bfloat16)
    'BF16 training with FP32 batchnorm and FP32 master weights.'
    """
    half = "BF16" if dtype == torch.bfloat16 else "FP16"
    return _BRIEFS[parse_opt_level(level)].format(half=half)


def preset(level: OptLevel) -> dict[str, Any]:
    """The level's values of apex's five level fields ("half" stands for the session dtype)."""
    return dict(zip(_LEVEL_FIELDS, _PRESETS[level]))


# -- resolving --------------------------------------------------------------------------------

def _check_names(overrides: Mapping[str, Any]) -> None:
    unknown = [name for name in overrides if name not in FIELDS]
    if not unknown:
        return
    hints = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
             for name in unknown for close in [difflib.get_close_matches(name, FIELDS, 1)]]
    raise UnknownOptionError(
        f"ampx.initialize: unknown option(s) {', '.join(hints)}. "
        f"The options are: {', '.join(FIELDS)}."
    )


def _session_dtype(level: OptLevel, given: Mapping[str, Any]) -> torch.dtype:
    dtype = given.get("dtype")
    half = DEFAULTS.dtype if dtype is None else parse_dtype(dtype)
    cast = given.get("cast_model_type")
    if level is not OptLevel.O1 and isinstance(cast, torch.dtype) and cast in HALF_DTYPES:
        # cast_model_type=torch.bfloat16 alone selects bf16 for the whole session.
        if dtype is None:
            return cast
        if cast != half:
            raise OptionError(
                f"ampx.initialize: cast_model_type={cast} conflicts with dtype={dtype!r}; "
                "pass one of them, or the same half dtype to both."
            )
    return half


def _check_cast_model_type(level: OptLevel, cast: Any) -> torch.dtype | None:
    if cast and cast not in (torch.float32, *HALF_DTYPES):
        raise OptionError(
            f"ampx.initialize: cast_model_type={cast!r} must be a torch dtype ampx casts models "
            "to: torch.float16 or torch.bfloat16 (O2/O3) or torch.float32 (O0); or a falsy "
            "value (don't cast the model)."
        )
    if level is OptLevel.O1 and cast not in (False, torch.float32):
        raise OptionError(
            "O1 inserts casts around Torch functions rather than model weights, so with O1, "
            "the model weights themselves should remain FP32. If you wish to cast the model "
            "to a different type, use opt_level='O2' or 'O3'. "
            f"cast_model_type was {cast}"
        )
    return cast or None


def _level_values(level: OptLevel, half: torch.dtype, given: Mapping[str, Any]) -> dict[str, Any]:
    """apex's five level fields after the overrides, with apex's checks and messages."""
    values = preset(level)
    if given.get("cast_model_type") is not None:
        values["cast_model_type"] = _check_cast_model_type(level, given["cast_model_type"])
    patch_fns = given.get("patch_torch_functions")
    if patch_fns is not None:
        if patch_fns and level is not OptLevel.O1:
            raise OptionError(
                "Currently, patch_torch_functions=True should only be set by selecting "
                "opt_level='O1'."
            )
        values["patch_torch_functions"] = bool(patch_fns)
    keep_bn = parse_bool("keep_batchnorm_fp32", given.get("keep_batchnorm_fp32"))
    if keep_bn is not None:
        if level is OptLevel.O1:
            raise OptionError(
                "With opt_level O1, batchnorm functions are automatically patched to run in "
                "FP32, so keep_batchnorm_fp32 should be None. "
                f"keep_batchnorm_fp32 was {given['keep_batchnorm_fp32']}"
            )
        values["keep_batchnorm_fp32"] = keep_bn
    if given.get("master_weights") is not None:
        if level is OptLevel.O1:
            raise OptionError(
                "It doesn't make sense to use master_weights with O1. With O1, your model "
                "weights themselves should be FP32."
            )
        values["master_weights"] = parse_bool("master_weights", given["master_weights"])
    if given.get("loss_scale") is not None:
        values["loss_scale"] = parse_loss_scale(given["loss_scale"])
    elif half is torch.bfloat16:
        values["loss_scale"] = 1.0  # bf16 has fp32's exponent range; inf/NaN still skip
    if values["cast_model_type"] == _HALF:
        values["cast_model_type"] = half
    return values


def _scaler_values(options: Mapping[str, Any], dynamic: bool) -> dict[str, Any]:
    """The scaling and bookkeeping fields, each checked (names in every message)."""
    min_scale = options["min_loss_scale"]
    min_scale = None if min_scale is None else parse_positive("min_loss_scale", min_scale)
    max_scale = parse_positive("max_loss_scale", options["max_loss_scale"], finite=False)
    init = parse_positive("init_scale", options["init_scale"])
    if min_scale is not None and min_scale > max_scale:
        raise OptionError(
            f"ampx.initialize: min_loss_scale={options['min_loss_scale']} is larger than "
            f"max_loss_scale={options['max_loss_scale']}."
        )
    if dynamic and min_scale is not None and min_scale > min(init, max_scale):
        raise OptionError(
            f"ampx.initialize: min_loss_scale={options['min_loss_scale']} is larger than the "
            f"initial scale {min(init, max_scale)} (min(init_scale, max_loss_scale)): the "
            "first overflow would raise the scale."
        )
    growth = parse_positive("growth_factor", options["growth_factor"])
    if growth < 1.0:
        raise OptionError(
            f"ampx.initialize: growth_factor={options['growth_factor']!r} must be >= 1.")
    backoff = parse_positive("backoff_factor", options["backoff_factor"])
    if backoff > 1.0:
        raise OptionError(
            f"ampx.initialize: backoff_factor={options['backoff_factor']!r} must be in (0, 1].")
    if options["verbosity"] not in (0, 1, 2) or isinstance(options["verbosity"], bool):
        raise OptionError(
            f"ampx.initialize: verbosity={options['verbosity']!r} must be 0, 1 or 2.")
    return dict(
        min_loss_scale=min_scale, max_loss_scale=max_scale, init_scale=init,
        growth_factor=growth, backoff_factor=backoff,
        growth_interval=parse_count("growth_interval", options["growth_interval"]),
        hysteresis=parse_count("hysteresis", options["hysteresis"]),
        num_losses=parse_count("num_losses", options["num_losses"]),
        verbosity=options["verbosity"],
    )


def _outputs(given: Any, cast_model_type: torch.dtype | None) -> torch.dtype | None:
    if given is None:  # apex: a cast model's outputs come back float32
        return None if cast_model_type is None else torch.float32
    if not isinstance(given, torch.dtype) or not given.is_floating_point:
        raise OptionError(
            f"ampx.initialize: cast_model_outputs={given!r} must be a torch dtype "
            "(a floating one, such as torch.float32)."
        )
    return given


def skip_policy(enabled: bool, level: OptLevel, dtype: torch.dtype, loss_scale: LossScale,
                requested: Any) -> bool:
    """Whether steps with non-finite gradients are skipped (the one place that decides)."""
    if not enabled:
        return False
    if requested is not None:
        return parse_flag("skip_non_finite", requested)
    return loss_scale == "dynamic" or (dtype == torch.bfloat16 and level is not OptLevel.O0)


def resolve_properties(opt_level: Any = DEFAULTS.opt_level.value, **overrides: Any) -> Properties:
    """Apply overrides to an opt level's preset, with apex's checks.

    Args:
        opt_level: "O0", "O1", "O2" or "O3".
        **overrides: Any other `Properties` field (see its attributes). None means "the
            default" (apex skipped None overrides). `dtype` picks float16 (apex's) or
            bfloat16; with bfloat16 the default loss scale is a static 1.0.

    Returns:
        The frozen `Properties`.

    Raises:
        UnknownOptionError: For option names `Properties` doesn't have (all are listed).
        OptionError: For an unknown opt level, an inconsistent override or a bad value. The
            messages are apex's where apex had one.
    """
    _check_names(overrides)
    level = parse_opt_level(opt_level)
    options = {name: getattr(DEFAULTS, name) for name in FIELDS}
    given = {k: v for k, v in overrides.items() if v is not None}
    options.update(given)
    enabled = parse_flag("enabled", options["enabled"])
    half = _session_dtype(level, given)
    values = _level_values(level, half, given)
    return Properties(
        opt_level=level, enabled=enabled, dtype=half, **values,
        cast_model_outputs=_outputs(given.get("cast_model_outputs"), values["cast_model_type"]),
        **_scaler_values(options, values["loss_scale"] == "dynamic"),
        skip_non_finite=skip_policy(enabled, level, half, values["loss_scale"],
                                    given.get("skip_non_finite")),
        allow_banned=parse_flag("allow_banned", options["allow_banned"]),
        device_types=parse_device_types(given.get("device_types")),
        on_overflow=parse_choice("on_overflow", options["on_overflow"], ON_OVERFLOW_CHOICES),
        overflow_patience=parse_count("overflow_patience", options["overflow_patience"]),
        detect_overflow=parse_detect_overflow(given.get("detect_overflow")),
        numerics=parse_numerics(given.get("numerics")),
        numerics_every=parse_count("numerics_every", options["numerics_every"]),
        numerics_shadow_every=parse_count("numerics_shadow_every",
                                          options["numerics_shadow_every"], minimum=0),
        keep_fp32=parse_module_names("keep_fp32", options["keep_fp32"]),
        compensation=_compensation(given.get("compensation"), values),
    )


def _compensation(given: Any, values: Mapping[str, Any]) -> str | None:
    """The compensation mode, valid only where the half model has no fp32 masters (O3)."""
    mode = parse_compensation(given)
    if mode is not None and (values["master_weights"]
                             or values["cast_model_type"] not in HALF_DTYPES):
        raise OptionError(
            f"ampx.initialize: compensation={mode!r} compensates half weights that have no "
            "fp32 master: use it with opt_level='O3' (or O2 with master_weights=False), not "
            f"with cast_model_type={values['cast_model_type']}, "
            f"master_weights={values['master_weights']}.")
    return mode
