"""argparse integration: `add_args(parser)` and the keyword arguments built from its flags.

`add_args` adds ampx's flags to a parser in an argument group. Flags the parser already has are
not added again: fairseq defines `--min-loss-scale` and `--threshold-loss-scale` itself, and
apex-era scripts often define `--opt-level`, `--loss-scale` or `--keep-batchnorm-fp32`. ampx then
reads the value from the existing option's destination, so one `--min-loss-scale` serves both
(with the existing option's default). `amp_kwargs_from_args(args)` turns the parsed flags into
`ampx.Amp` keyword arguments (`ampx.Amp.from_args(args)` calls it), and
`optimizer_kwargs_from_args(args)` into those of the fairseq-style wrapper
(`ampx.compat.fairseq.optimizer.AmpOptimizer`).

Example::

    parser = argparse.ArgumentParser()
    ampx.options.flags.add_args(parser)
    args = parser.parse_args(["--opt-level", "O2", "--amp-dtype", "bf16"])
    amp = ampx.Amp.from_args(args)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .levels import DEFAULTS
from .values import DTYPE_CHOICES, OPT_LEVELS, OptionError, parse_bool, parse_loss_scale

__all__ = [
    "AMPX_OPTIONS",
    "FAIRSEQ_PRECISION_FLAGS",
    "GROUP_TITLE",
    "add_args",
    "amp_kwargs_from_args",
    "optimizer_kwargs_from_args",
]

GROUP_TITLE = "ampx mixed precision"

# fairseq's own precision switches (dest names): they cast the model and build fairseq's own
# FP16Optimizer/AMPOptimizer, so they cannot be combined with an ampx opt level.
FAIRSEQ_PRECISION_FLAGS = ("fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16", "amp")

# Namespace attribute that records destinations of options reused from the parser when they
# differ from ampx's own (set with parser.set_defaults).
_DESTS_ATTR = "ampx_option_dests"


def _argtype(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse `type` from one of ampx's option parsers (its message, as argparse's)."""

    def convert(value: str) -> Any:
        try:
            return parse(value)
        except OptionError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None

    convert.__name__ = name  # argparse names the type in its messages
    return convert


_loss_scale_arg = _argtype(lambda v: parse_loss_scale(v, api="--loss-scale"), "loss scale")
_keep_bn = _argtype(lambda v: parse_bool("keep_batchnorm_fp32", v, api="--keep-batchnorm-fp32"),
                    "True/False")
_masters = _argtype(lambda v: parse_bool("master_weights", v, api="--master-weights"),
                    "True/False")


# (option string, dest, add_argument keywords). Defaults: --opt-level None keeps ampx off (a
# pass-through session) until a level is chosen; the others are `ampx.Properties`' defaults,
# except --min-loss-scale, which uses fairseq's 1e-4 so that a parser with and one without
# fairseq's flags behave alike.
AMPX_OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--opt-level", "opt_level", dict(
        default=None, choices=OPT_LEVELS,
        help="ampx optimization level: O0 fp32, O1 casts around torch functions, O2 half "
             "model with fp32 master weights, O3 pure half precision (the letter O). "
             "Default: ampx off")),
    ("--amp-dtype", "amp_dtype", dict(
        default=DTYPE_CHOICES[0], choices=DTYPE_CHOICES,
        help="half-precision dtype of the ampx session (default: %(default)s)")),
    ("--loss-scale", "loss_scale", dict(
        default=None, type=_loss_scale_arg, metavar="{dynamic,N}",
        help="'dynamic' or a static loss scale (default: the opt level's: dynamic for fp16 "
             "O1/O2, 1.0 for O0/O3 and for bf16)")),
    ("--init-scale", "init_scale", dict(
        default=DEFAULTS.init_scale, type=float, metavar="S",
        help="initial dynamic loss scale (default: %(default)s)")),
    ("--scale-window", "scale_window", dict(
        default=DEFAULTS.growth_interval, type=int, metavar="N",
        help="clean updates between two growths of the dynamic loss scale "
             "(default: %(default)s)")),
    ("--scale-tolerance", "scale_tolerance", dict(
        default=0.0, type=float, metavar="F",
        help="fairseq's tolerance: on an overflow, back off only when at least this fraction "
             "of the updates since the last rescale overflowed; applied by the fairseq-style "
             "optimizer wrapper (default: %(default)s)")),
    ("--hysteresis", "hysteresis", dict(
        default=DEFAULTS.hysteresis, type=int, metavar="N",
        help="consecutive overflows tolerated before the dynamic scale backs off "
             "(default: %(default)s)")),
    ("--min-loss-scale", "min_loss_scale", dict(
        default=1e-4, type=float, metavar="S",
        help="minimum loss scale: the fairseq-style wrapper raises FloatingPointError when an "
             "overflow takes the scale there (default: %(default)s)")),
    ("--threshold-loss-scale", "threshold_loss_scale", dict(
        default=None, type=float, metavar="S",
        help="floor of the dynamic loss scale: it never backs off below this and keeps "
             "skipping there instead of raising (default: no threshold)")),
    ("--keep-batchnorm-fp32", "keep_batchnorm_fp32", dict(
        default=DEFAULTS.keep_batchnorm_fp32, type=_keep_bn, metavar="{True,False}",
        help="keep batchnorm in fp32 when the model is cast (default: the opt level's)")),
    ("--master-weights", "master_weights", dict(
        default=DEFAULTS.master_weights, type=_masters, metavar="{True,False}",
        help="keep fp32 master weights in the optimizer (default: the opt level's)")),
)


def add_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add ampx's flags to `parser`, in an argument group titled "ampx mixed precision".

    An option string the parser already has (fairseq's `--min-loss-scale` and
    `--threshold-loss-scale`, an apex script's `--opt-level`) is not added again, so the
    parser never raises `argparse.ArgumentError`; its value is read from the existing option's
    destination instead (its default applies). Calling `add_args` twice is harmless.

    Args:
        parser: The parser to extend.

    Returns:
        The argument group holding the options that were added.

    Example::

        parser = argparse.ArgumentParser()
        add_args(parser)
        amp = ampx.Amp.from_args(parser.parse_args())
    """
    group = _find_group(parser) or parser.add_argument_group(
        GROUP_TITLE, "mixed precision with ampx (apex.amp's opt levels, fp16 and bf16)"
    )
    existing: dict[str, argparse.Action] = parser._option_string_actions
    reused: dict[str, str] = {}
    for option, dest, kwargs in AMPX_OPTIONS:
        action = existing.get(option)
        if action is None:
            group.add_argument(option, dest=dest, **kwargs)
        elif action.dest != dest:
            reused[dest] = action.dest
    if reused:
        known = dict(parser.get_default(_DESTS_ATTR) or {})
        known.update(reused)
        parser.set_defaults(**{_DESTS_ATTR: known})
    return group


def _find_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup | None:
    for group in parser._action_groups:
        if group.title == GROUP_TITLE:
            return group
    return None


_DEFAULTS = {dest: kwargs.get("default") for _, dest, kwargs in AMPX_OPTIONS}


def _get(args: Any, dest: str) -> Any:
    """The value of an ampx flag (from the reused option's dest if any; else the default)."""
    dests = getattr(args, _DESTS_ATTR, None) or {}
    return getattr(args, dests.get(dest, dest), _DEFAULTS[dest])


def amp_kwargs_from_args(args: Any) -> dict[str, Any]:
    """`ampx.Amp` keyword arguments from flags added by `add_args`.

    Missing attributes fall back to the flags' defaults, so any namespace-like object works
    (an `argparse.Namespace`, a fairseq config section). Without `--opt-level` the session is
    disabled (a pass-through). `--scale-window` becomes `growth_interval`; the scale's floor is
    the larger of `--min-loss-scale` and `--threshold-loss-scale`. `--scale-tolerance` is not
    an `Amp` option: it goes to the wrapper (`optimizer_kwargs_from_args`).

    Args:
        args: The parsed arguments.

    Returns:
        Keyword arguments for `ampx.Amp(...)`.

    Raises:
        ValueError: When an ampx opt level is combined with fairseq's own precision flags
            (`--fp16`, `--bf16`, `--memory-efficient-fp16/bf16`, `--amp`).

    Example::

        amp = ampx.Amp(**amp_kwargs_from_args(args))
    """
    opt_level = _get(args, "opt_level")
    if opt_level is None:
        return {"opt_level": "O0", "enabled": False}
    clashing = [f"--{name.replace('_', '-')}" for name in FAIRSEQ_PRECISION_FLAGS
                if getattr(args, name, False) is True]
    if clashing:
        raise ValueError(
            f"ampx.Amp.from_args: --opt-level {opt_level} cannot be combined with fairseq's "
            f"{', '.join(clashing)}: fairseq would cast the model and build its own fp16 "
            "optimizer. Use either fairseq's precision flags or ampx's, not both."
        )
    min_scale = _get(args, "min_loss_scale")
    threshold = _get(args, "threshold_loss_scale")
    floor = min_scale
    if threshold is not None:
        floor = threshold if min_scale is None else max(float(threshold), float(min_scale))
    return {
        "opt_level": opt_level,
        "dtype": _get(args, "amp_dtype"),
        "loss_scale": _get(args, "loss_scale"),
        "init_scale": float(_get(args, "init_scale")),
        "growth_interval": int(_get(args, "scale_window")),
        "hysteresis": int(_get(args, "hysteresis")),
        "min_loss_scale": None if floor is None else float(floor),
        "keep_batchnorm_fp32": _get(args, "keep_batchnorm_fp32"),
        "master_weights": _get(args, "master_weights"),
    }


def optimizer_kwargs_from_args(args: Any) -> dict[str, Any]:
    """Keyword arguments of `ampx.compat.fairseq.optimizer.AmpOptimizer` from `add_args`'s flags.

    Returns:
        `{"tolerance": --scale-tolerance, "min_loss_scale": --min-loss-scale}`: the wrapper
        raises `FloatingPointError` when an overflow takes the scale to `min_loss_scale`, which
        cannot happen when `--threshold-loss-scale` holds the scale above it (fairseq's rules).
    """
    min_scale = _get(args, "min_loss_scale")
    return {
        "tolerance": float(_get(args, "scale_tolerance")),
        "min_loss_scale": None if min_scale is None else float(min_scale),
    }



