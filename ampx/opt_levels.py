"""Opt levels O0-O3 as data, their overrides and apex's validation rules.

An opt level is a named preset (apex's table, §2.3 of the reference); `resolve_properties`
applies the user's overrides to it, checks apex's cross-field rules and returns a frozen
`Properties`. Nothing here touches torch's namespace or the user's objects.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Union

import torch

__all__ = [
    "OPT_LEVELS",
    "LossScale",
    "OptLevel",
    "OptionError",
    "Properties",
    "parse_dtype",
    "resolve_properties",
]

LossScale = Union[float, str]  # a number or "dynamic"


class OptionError(ValueError, RuntimeError):
    """A bad `initialize` option.

    A subclass of both ValueError (what new code expects for a bad value) and RuntimeError
    (what apex raised, and what legacy scripts catch).
    """


class OptLevel(str, enum.Enum):
    """The four apex optimization levels; the values are the strings users type."""

    O0 = "O0"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"


@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved configuration of one ampx session.

    Attributes:
        opt_level: The preset the other fields started from.
        enabled: False makes every ampx call a pass-through.
        dtype: The low-precision dtype of the session (float16 or bfloat16).
        cast_model_type: Dtype the model is cast to (None: the model is left alone).
        patch_torch_functions: Whether O1 function patching is installed.
        keep_batchnorm_fp32: Keep batchnorm modules in float32 when the model is cast.
        master_weights: Keep float32 master weights inside the optimizer (None at O1, as
            apex: the weights themselves are float32).
        loss_scale: "dynamic" or a static float.
        cast_model_outputs: Dtype forward outputs are cast to (None: the default for the level).
        num_losses: Number of loss scalers (one per `loss_id`).
        min_loss_scale: Floor of the dynamic scale (None: no floor).
        max_loss_scale: Ceiling of the dynamic scale; also clamps the initial scale.
        init_scale: Initial dynamic scale (before clamping by `max_loss_scale`).
        growth_factor: Factor applied after `growth_interval` clean steps.
        backoff_factor: Factor applied on an overflow.
        growth_interval: Clean steps between two growths (apex's scale window).
        hysteresis: Overflows tolerated before the scale backs off (1: back off at once).
        skip_non_finite: Skip the step when gradients are not finite, even with a static scale.
        allow_banned: Run banned functions (binary_cross_entropy) in float32 instead of raising.
        verbosity: 0 silences info logs; 2 logs every cast made by the O1 patches.
    """

    opt_level: OptLevel
    enabled: bool
    dtype: torch.dtype
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: LossScale
    cast_model_outputs: torch.dtype | None = None
    num_losses: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    skip_non_finite: bool = True
    allow_banned: bool = False
    verbosity: int = 1

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic."""
        return self.loss_scale == "dynamic"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view (dtypes as their short names)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.dtype):
                value = str(value).replace("torch.", "")
            elif isinstance(value, OptLevel):
                value = value.value
            out[field.name] = value
        return out


# apex's table (reference §2.3). "half" stands for the session's dtype (fp16 unless dtype=bf16).
_HALF = "half"
_PRESETS: dict[OptLevel, dict[str, Any]] = {
    OptLevel.O0: dict(cast_model_type=torch.float32, patch_torch_functions=False,
                      keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    OptLevel.O1: dict(cast_model_type=None, patch_torch_functions=True,
                      keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    OptLevel.O2: dict(cast_model_type=_HALF, patch_torch_functions=False,
                      keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    OptLevel.O3: dict(cast_model_type=_HALF, patch_torch_functions=False,
                      keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}

BRIEFS: dict[OptLevel, str] = {
    OptLevel.O0: "Pure FP32 training.",
    OptLevel.O1: "Insert automatic casts around Pytorch functions and Tensor methods.",
    OptLevel.O2: "FP16 training with FP32 batchnorm and FP32 master weights.",
    OptLevel.O3: "Pure FP16 training.",
}

OPT_LEVELS: tuple[str, ...] = tuple(level.value for level in OptLevel)
_HALF_DTYPES = (torch.float16, torch.bfloat16)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "torch.float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
}


def parse_dtype(value: Any, *, api: str = "ampx.initialize") -> torch.dtype:
    """Turn `float16`/`bfloat16` (a torch dtype or a string such as "bf16") into a dtype.

    >>> parse_dtype("bf16")
    torch.bfloat16
    >>> parse_dtype(torch.float16)
    torch.float16
    """
    if isinstance(value, torch.dtype):
        if value in (torch.float16, torch.bfloat16):
            return value
    elif isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.strip().lower()]
    raise OptionError(
        f"{api}: dtype={value!r} is not a half-precision dtype. "
        "Use torch.float16 or torch.bfloat16 (or the strings 'fp16', 'bf16', 'float16', "
        "'bfloat16')."
    )


def parse_opt_level(value: Any) -> OptLevel:
    """Validate an opt level with apex's message (the letter O, not the number zero)."""
    try:
        return OptLevel(value)
    except ValueError:
        raise OptionError(
            f"Unexpected optimization level {value}. Options are 'O0', 'O1', 'O2', 'O3'.  "
            "Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        ) from None


def _parse_bool_or_none(name: str, value: Any) -> bool | None:
    # apex accepts the strings "True"/"False" here (argparse-fed scripts pass them).
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise OptionError(
        f"ampx.initialize: {name}={value!r} is not valid; use True, False or None "
        "(or the strings 'True'/'False')."
    )


def _parse_loss_scale(value: Any) -> LossScale:
    if value == "dynamic":
        return "dynamic"
    if isinstance(value, bool):
        raise OptionError(f"ampx.initialize: loss_scale={value!r}; use 'dynamic' or a number.")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise OptionError(
            f"ampx.initialize: loss_scale={value!r} is neither 'dynamic' nor a number."
        ) from None
    if not (scale > 0 and scale != float("inf")):
        raise OptionError(
            f"ampx.initialize: loss_scale={value!r} must be a positive finite number."
        )
    return scale


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise OptionError(f"ampx.initialize: {name}={value!r} must be a positive number.")
    return float(value)


def resolve_properties(
    opt_level: Any = "O1",
    *,
    enabled: bool = True,
    dtype: Any = None,
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    skip_non_finite: bool | None = None,
    allow_banned: bool = False,
) -> Properties:
    """Apply overrides to an opt level's preset, with apex's checks.

    Args:
        opt_level: "O0", "O1", "O2" or "O3".
        enabled: False gives a disabled (pass-through) configuration.
        dtype: The half dtype: float16 (apex's) or bfloat16. With bfloat16 the default loss
            scale is a static 1.0 (bf16 has fp32's range) but non-finite gradients still skip
            the step.
        cast_model_type: Override; any falsy value means "don't cast the model".
        patch_torch_functions: Override; only valid with O1.
        keep_batchnorm_fp32: Override; True/False/None or "True"/"False".
        master_weights: Override; not valid with O1.
        loss_scale: Override; "dynamic", a number or a numeric string.
        cast_model_outputs: Dtype the model's outputs are cast to.
        num_losses: Number of loss scalers.
        verbosity: 0, 1 or 2.
        min_loss_scale: Floor of the dynamic scale.
        max_loss_scale: Ceiling of the dynamic scale.
        init_scale: Initial dynamic scale.
        growth_factor: Growth factor (> 1).
        backoff_factor: Backoff factor (in (0, 1)).
        growth_interval: Clean steps between growths.
        hysteresis: Overflows tolerated before backing off.
        skip_non_finite: Skip steps with non-finite gradients (default True).
        allow_banned: Run banned functions in float32 instead of raising.

    Returns:
        The frozen `Properties`.

    Raises:
        OptionError: For an unknown opt level, an inconsistent override or a bad value. The
            messages are apex's where apex had one.
    """
    level = parse_opt_level(opt_level)
    half = parse_dtype(dtype) if dtype is not None else torch.float16
    if (level is not OptLevel.O1 and isinstance(cast_model_type, torch.dtype)
            and cast_model_type in _HALF_DTYPES):
        # cast_model_type=torch.bfloat16 alone selects bf16 for the whole session.
        if dtype is None:
            half = cast_model_type
        elif cast_model_type != half:
            raise OptionError(
                f"ampx.initialize: cast_model_type={cast_model_type} conflicts with "
                f"dtype={dtype!r}; pass one of them, or the same half dtype to both."
            )
    preset = dict(_PRESETS[level])

    if cast_model_type is not None:
        if cast_model_type and not isinstance(cast_model_type, torch.dtype):
            raise OptionError(
                f"ampx.initialize: cast_model_type={cast_model_type!r} must be a torch dtype "
                "or a falsy value (don't cast the model)."
            )
        if level is OptLevel.O1 and cast_model_type not in (False, torch.float32):
            raise OptionError(
                "O1 inserts casts around Torch functions rather than model weights, so with O1, "
                "the model weights themselves should remain FP32. If you wish to cast the model "
                "to a different type, use opt_level='O2' or 'O3'. "
                f"cast_model_type was {cast_model_type}"
            )
        preset["cast_model_type"] = cast_model_type or None
    if patch_torch_functions is not None:
        if patch_torch_functions and level is not OptLevel.O1:
            raise OptionError(
                "Currently, patch_torch_functions=True should only be set by selecting "
                "opt_level='O1'."
            )
        preset["patch_torch_functions"] = bool(patch_torch_functions)
    keep_bn = _parse_bool_or_none("keep_batchnorm_fp32", keep_batchnorm_fp32)
    if keep_bn is not None:
        if level is OptLevel.O1:
            raise OptionError(
                "With opt_level O1, batchnorm functions are automatically patched to run in "
                "FP32, so keep_batchnorm_fp32 should be None. "
                f"keep_batchnorm_fp32 was {keep_batchnorm_fp32}"
            )
        preset["keep_batchnorm_fp32"] = keep_bn
    if master_weights is not None:
        if level is OptLevel.O1:
            raise OptionError(
                "It doesn't make sense to use master_weights with O1. With O1, your model "
                "weights themselves should be FP32."
            )
        preset["master_weights"] = bool(master_weights)


    explicit_scale = loss_scale is not None
    if explicit_scale:
        preset["loss_scale"] = _parse_loss_scale(loss_scale)
    elif half is torch.bfloat16:
        # bf16 has fp32's exponent range: scaling buys nothing, but inf/NaN still skip.
        preset["loss_scale"] = 1.0

    if cast_model_outputs is not None and not isinstance(cast_model_outputs, torch.dtype):
        raise OptionError(
            f"ampx.initialize: cast_model_outputs={cast_model_outputs!r} must be a torch dtype."
        )
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise OptionError(f"ampx.initialize: num_losses={num_losses!r} must be an int >= 1.")
    if verbosity not in (0, 1, 2):
        raise OptionError(f"ampx.initialize: verbosity={verbosity!r} must be 0, 1 or 2.")
    min_scale = None if min_loss_scale is None else _positive("min_loss_scale", min_loss_scale)
    max_scale = _positive("max_loss_scale", max_loss_scale)
    if min_scale is not None and min_scale > max_scale:
        raise OptionError(
            f"ampx.initialize: min_loss_scale={min_loss_scale} is larger than "
            f"max_loss_scale={max_loss_scale}."
        )
    init = _positive("init_scale", init_scale)
    growth = _positive("growth_factor", growth_factor)
    if growth < 1.0:
        raise OptionError(f"ampx.initialize: growth_factor={growth_factor!r} must be >= 1.")
    backoff = _positive("backoff_factor", backoff_factor)
    if backoff > 1.0:
        raise OptionError(
            f"ampx.initialize: backoff_factor={backoff_factor!r} must be in (0, 1]."
        )
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(f"ampx.initialize: {name}={value!r} must be an int >= 1.")

    cast_type = preset["cast_model_type"]
    if cast_type == _HALF:
        cast_type = half
    return Properties(
        opt_level=level,
        enabled=bool(enabled),
        dtype=half,
        cast_model_type=cast_type,
        patch_torch_functions=bool(preset["patch_torch_functions"]),
        keep_batchnorm_fp32=preset["keep_batchnorm_fp32"],
        master_weights=preset["master_weights"],
        loss_scale=preset["loss_scale"],
        cast_model_outputs=cast_model_outputs,
        num_losses=num_losses,
        min_loss_scale=min_scale,
        max_loss_scale=max_scale,
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        skip_non_finite=True if skip_non_finite is None else bool(skip_non_finite),
        allow_banned=bool(allow_banned),
        verbosity=verbosity,
    )


def property_table() -> list[tuple[str, dict[str, str]]]:
    """Rows of the opt-level table (for docs/opt-levels.md), generated from the presets."""
    rows = []
    for field in ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                  "master_weights", "loss_scale"):
        cells = {}
        for level in OptLevel:
            fp16 = getattr(resolve_properties(level.value), field)
            bf16 = getattr(resolve_properties(level.value, dtype=torch.bfloat16), field)
            text = str(fp16).replace("torch.", "")
            if bf16 != fp16:
                text += f" (bf16: {str(bf16).replace('torch.', '')})"
            cells[level.value] = text
        rows.append((field, cells))
    return rows


_OVERRIDE_RULES: tuple[tuple[str, str], ...] = (
    ("opt_level", "anything but 'O0'-'O3' (e.g. the digit zero in '00')"),
    ("cast_model_type", "a half dtype with O1; not a dtype or falsy; a half dtype other "
                        "than `dtype`"),
    ("patch_torch_functions", "True with any level but O1"),
    ("keep_batchnorm_fp32", "anything but None with O1; not True/False/None/'True'/'False'"),
    ("master_weights", "anything but None with O1"),
    ("loss_scale", "not 'dynamic', a positive finite number or a numeric string"),
    ("dtype", "not float16/bfloat16 (or 'fp16', 'bf16', 'float16', 'bfloat16', 'half')"),
    ("cast_model_outputs", "not a torch dtype"),
    ("num_losses", "not an int >= 1"),
    ("verbosity", "not 0, 1 or 2"),
    ("min_loss_scale / max_loss_scale", "not positive, or min > max"),
    ("init_scale", "not positive"),
    ("growth_factor / backoff_factor", "growth < 1, backoff outside (0, 1]"),
    ("growth_interval / hysteresis", "not an int >= 1"),
)


def markdown() -> str:
    """The text of docs/opt-levels.md, generated from the presets and rules in this module.

    `python -m ampx.lists --opt-levels > docs/opt-levels.md` regenerates the page; a test
    checks that the committed page matches.
    """
    levels = [level.value for level in OptLevel]
    lines = [
        "# Opt levels",
        "",
        "<!-- Generated by `python -m ampx.lists --opt-levels > docs/opt-levels.md`. -->",
        "",
        "`ampx.initialize(model, optimizer, opt_level=...)` takes apex's four levels (the",
        "letter O, not the digit zero). Each is a preset of the properties below; keyword",
        "overrides change one property, with apex's validation rules and messages. `dtype`",
        "picks the half type: `torch.float16` (apex's, the default) or `torch.bfloat16`",
        "(also as the strings 'fp16', 'bf16', 'float16', 'bfloat16').",
        "",
        "| level | what it does |",
        "| --- | --- |",
    ]
    lines += [f"| {level.value} | {BRIEFS[level]} |" for level in OptLevel]
    lines += [
        "",
        "## Properties of each level",
        "",
        "Generated from `ampx.opt_levels.resolve_properties`; \"(bf16: x)\" is the value",
        "when `dtype=torch.bfloat16` differs from the float16 one.",
        "",
        "| property | " + " | ".join(levels) + " |",
        "| --- | " + " | ".join("---" for _ in levels) + " |",
    ]
    for field, cells in property_table():
        lines.append(f"| {field} | " + " | ".join(cells[level] for level in levels) + " |")
    lines += [
        "",
        "With bf16 the default loss scale is a static 1.0 (bf16 has float32's exponent range),",
        "and steps whose gradients are not finite are still skipped.",
        "",
        "## Invalid options",
        "",
        "Each raises `ampx.OptionError`, a subclass of both `ValueError` (what new code",
        "expects) and `RuntimeError` (what apex raised and legacy scripts catch). Nothing is",
        "changed when `initialize` raises: torch, the model and the optimizer are as before.",
        "",
        "| option | rejected when |",
        "| --- | --- |",
    ]
    lines += [f"| `{name}` | {rule} |" for name, rule in _OVERRIDE_RULES]
    lines += [
        "",
        "apex's messages are kept word for word where apex had one, for example:",
        "",
        "```",
    ]
    for kwargs in ({"opt_level": "01"}, {"opt_level": "O1", "master_weights": True},
                   {"opt_level": "O2", "patch_torch_functions": True}):
        try:
            resolve_properties(**kwargs)
        except OptionError as exc:
            lines.append(f"{_call_text(kwargs)}: {exc}")
    lines += ["```", ""]
    return "\n".join(lines)


def _call_text(kwargs: dict[str, Any]) -> str:
    return "initialize(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
