"""Parsers of single option values, shared by `initialize`, the argparse helpers and the CLI.

Each parser takes what a user may pass for one option (a dtype or its name, "O1", "True",
"128.0", ...) and returns the normalised value, or raises `OptionError` naming the option.
The choice lists (opt levels, dtype spellings) and apex's "letter O" hint live here once.
"""

from __future__ import annotations

import enum
from typing import Any, Union

import torch

__all__ = [
    "DETECT_OVERFLOW_CHOICES",
    "DTYPE_CHOICES",
    "ON_OVERFLOW_CHOICES",
    "LETTER_O_HINT",
    "OPT_LEVELS",
    "LossScale",
    "OptLevel",
    "OptionError",
    "UnknownOptionError",
    "HALF_DTYPES",
    "dtype_name",
    "parse_bool",
    "short_dtype_name",
    "parse_choice",
    "parse_compensation",
    "parse_detect_overflow",
    "parse_module_names",
    "parse_numerics",
    "parse_device_types",
    "parse_dtype",
    "parse_flag",
    "parse_loss_scale",
    "parse_opt_level",
]


class OptionError(ValueError, RuntimeError):
    """A bad `initialize` option.

    A subclass of both ValueError (what new code expects for a bad value) and RuntimeError
    (what apex raised, and what legacy scripts catch).
    """


class UnknownOptionError(OptionError, TypeError):
    """An option name no entry point knows (also a TypeError, as for any unexpected keyword)."""


LossScale = Union[float, str]  # a number or "dynamic"


class OptLevel(str, enum.Enum):
    """The four apex optimization levels; the values are the strings users type."""

    O0 = "O0"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"


OPT_LEVELS: tuple[str, ...] = tuple(level.value for level in OptLevel)
LETTER_O_HINT = ("Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the "
                 "number zero.")
DTYPE_CHOICES: tuple[str, ...] = ("fp16", "bf16")  # the command-line spellings of HALF_DTYPES
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "torch.float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
}
HALF_DTYPES = (torch.float16, torch.bfloat16)  # the one table of ampx's low-precision dtypes
ON_OVERFLOW_CHOICES: tuple[str, ...] = ("skip", "raise", "fp32-fallback")
DETECT_OVERFLOW_CHOICES: tuple[str, ...] = ("forward",)  # or None: off
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the scalers keep float32 state
INT32_MAX = 2**31 - 1  # and int32 counters


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as initialize, telemetry and the CLI print it: "bfloat16", not "torch.bfloat16".

    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    return str(dtype).replace("torch.", "")


def short_dtype_name(dtype: torch.dtype) -> str:
    """A half dtype as the command line spells it: "fp16" or "bf16".

    >>> short_dtype_name(torch.bfloat16)
    'bf16'
    """
    return DTYPE_CHOICES[HALF_DTYPES.index(dtype)]


def parse_dtype(value: Any, *, api: str = "ampx.initialize") -> torch.dtype:
    """Turn `float16`/`bfloat16` (a torch dtype or a string such as "bf16") into a dtype.

    >>> parse_dtype("bf16")
    torch.bfloat16
    >>> parse_dtype(torch.float16)
    torch.float16
    """
    if isinstance(value, torch.dtype):
        if value in HALF_DTYPES:
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
        pass
    hint = LETTER_O_HINT  # apex's message; a lowercase "o2" has the letter, only not capital
    if isinstance(value, str) and value.strip().upper() in OPT_LEVELS:
        hint = (f"Opt levels are case-sensitive: did you mean {value.strip().upper()!r} "
                "(a capital letter O)?")
    raise OptionError(
        f"Unexpected optimization level {value}. Options are 'O0', 'O1', 'O2', 'O3'.  " + hint
    )


def parse_bool(name: str, value: Any, *, api: str = "ampx.initialize") -> bool | None:
    """True/False/None, or apex's strings "True"/"False" (argparse-fed scripts pass them)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise OptionError(
        f"{api}: {name}={value!r} is not valid; use True, False or None "
        "(or the strings 'True'/'False')."
    )


def parse_loss_scale(value: Any, *, api: str = "ampx.initialize") -> LossScale:
    """"dynamic", or a positive number (a numeric string too) that fits the float32 scaler."""
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    if isinstance(value, bool):
        raise OptionError(f"{api}: loss_scale={value!r}; use 'dynamic' or a number.")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{api}: loss_scale={value!r} is neither 'dynamic' nor a number.") \
            from None
    if not 0 < scale <= FLOAT32_MAX:
        raise OptionError(f"{api}: loss_scale={value!r} must be a positive finite number.")
    return scale


def parse_positive(name: str, value: Any, *, finite: bool = True) -> float:
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else -1
    if not number > 0 or (finite and not number <= FLOAT32_MAX):
        kind = "finite number (a float32 scale)" if finite else "number"
        raise OptionError(f"ampx.initialize: {name}={value!r} must be a positive {kind}.")
    return float(number)


def parse_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not minimum <= value <= INT32_MAX:
        raise OptionError(f"ampx.initialize: {name}={value!r} must be an int >= {minimum} "
                          "(and < 2**31, the scalers' int32 counters).")
    return value


def parse_flag(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise OptionError(
        f"ampx.initialize: {name}={value!r} must be True or False (a bool: any non-empty "
        "string, even 'False', would read as True)."
    )


def parse_device_types(value: Any) -> frozenset[str] | None:
    """None, a device type ("cuda"), a torch.device, or a list of those -> a frozenset."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, torch.device)) else value
    message = (f"ampx.initialize: device_types={value!r} must be a device type such as "
               "'cuda' or 'cpu', or a list of them.")
    try:
        names = [t.type if isinstance(t, torch.device) else t for t in items]
    except TypeError:
        raise OptionError(message) from None
    for name in names:
        if not isinstance(name, str):
            raise OptionError(message)
        try:
            torch.device(name)
        except RuntimeError:
            raise OptionError(f"{message} {name!r} is not a torch device type.") from None
    if not names:
        raise OptionError(message)
    return frozenset(names)


def parse_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of `choices` (the strings), or an `OptionError` naming the option and the choices."""
    if isinstance(value, str) and value in choices:
        return value
    raise OptionError(f"ampx.initialize: {name}={value!r} is not one of "
                      f"{', '.join(repr(c) for c in choices)}.")


NUMERICS_CHOICES = ("report",)
COMPENSATION_CHOICES = ("kahan",)
SWEEP_EXTRA = "O3+kahan"  # `ampx sweep`'s row for O3 with compensation="kahan"


def parse_compensation(value: Any) -> str | None:
    """None/False/"none" (off) or "kahan" (compensated half weights at O3)."""
    if value is None or value is False or value == "none":
        return None
    return parse_choice("compensation", value, COMPENSATION_CHOICES)


def parse_numerics(value: Any) -> str | None:
    """None/False/"none" (off) or "report" (the per-module numerics report)."""
    if value is None or value is False or value == "none":
        return None
    return parse_choice("numerics", value, NUMERICS_CHOICES)


def parse_module_names(name: str, value: Any) -> tuple[str, ...]:
    """Module names: a list/tuple of strings, or one comma-separated string (the CLI's)."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and v for v in value):
        raise OptionError(f"ampx.initialize: {name}={value!r} must be a list of module names "
                          "(as model.named_modules() spells them).")
    return tuple(dict.fromkeys(value))


def parse_detect_overflow(value: Any) -> str | None:
    """None/False/"none" (off) or "forward" (hooks that find the first inf/NaN output)."""
    if value is None or value is False or value == "none":
        return None
    return parse_choice("detect_overflow", value, DETECT_OVERFLOW_CHOICES)
