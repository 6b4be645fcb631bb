"""Options forced on every `initialize` (`ampx run -O O2 --dtype bf16 ...`): one parsed value.

`ForcedOptions.parse` is called once, at the command line's edge: it checks the keys, parses
each value with the parsers every entry point shares (`ampx.options.values`) and checks the
values against each other as `initialize` would. From then on the value travels as it is: in
this process through the session registry (`ampx.registry`), into child processes as the JSON
of `to_json` (decoded by `from_json`, which parses nothing again), and into each session as the
options `apply` puts over the script's own.
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .levels import Properties, resolve_properties
from .values import (
    OptLevel,
    dtype_name,
    parse_bool,
    parse_compensation,
    parse_count,
    parse_detect_overflow,
    parse_dtype,
    parse_flag,
    parse_loss_scale,
    parse_numerics,
    parse_opt_level,
    parse_positive,
)

__all__ = ["FORCEABLE", "ForcedOptions"]


def _min_scale(value: Any) -> float | None:
    return None if value is None else parse_positive("min_loss_scale", value)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    # a level or dtype the command line already parsed is taken as it is
    "opt_level": lambda v: v if isinstance(v, OptLevel) else parse_opt_level(v),
    "dtype": lambda v: v if isinstance(v, torch.dtype) else parse_dtype(v, api="ampx run --dtype"),
    "loss_scale": lambda v: parse_loss_scale(v, api="ampx run --loss-scale"),
    "keep_batchnorm_fp32": lambda v: parse_bool("keep_batchnorm_fp32", v),
    "master_weights": lambda v: parse_bool("master_weights", v),
    "min_loss_scale": _min_scale,
    "max_loss_scale": lambda v: parse_positive("max_loss_scale", v, finite=False),
    "enabled": lambda v: parse_flag("enabled", v),
    "detect_overflow": parse_detect_overflow,
    "numerics": parse_numerics,
    "numerics_every": lambda v: parse_count("numerics_every", v),
    "compensation": parse_compensation,
}
FORCEABLE: tuple[str, ...] = tuple(_PARSERS)
# Options that only make sense for one opt level: a forced level drops the script's values.
_LEVEL_SPECIFIC = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                   "master_weights", "compensation")


@dataclasses.dataclass(frozen=True)
class ForcedOptions:
    """The `initialize` options `ampx run` forces, already parsed (empty: nothing forced).

    Build it with `parse`; `options` maps each forced option to its parsed value (an
    `OptLevel`, a `torch.dtype`, a float, ...), read-only.
    """

    options: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> ForcedOptions:
        """Check and parse forced options (keys: those in `FORCEABLE`).

        Level-specific options are checked against a level only when one is forced too
        (otherwise only the script's level can tell whether they fit).

        Raises:
            ValueError: For a key that cannot be forced.
            OptionError: For a bad value, or values that contradict each other.
        """
        options = dict(options or {})
        unknown = sorted(set(options) - set(FORCEABLE))
        if unknown:
            raise ValueError(f"ampx.set_forced_options: cannot force {unknown}; "
                             f"forceable options are {list(FORCEABLE)}.")
        parsed = {key: _PARSERS[key](value) for key, value in options.items()}
        checked = {k: v for k, v in parsed.items() if k != "enabled"}
        if "opt_level" not in checked:
            for key in _LEVEL_SPECIFIC:
                checked.pop(key, None)
            checked["opt_level"] = OptLevel.O0
        resolve_properties(**checked)
        return cls(types.MappingProxyType(parsed))

    def __bool__(self) -> bool:
        return bool(self.options)

    def apply(self, requested: Mapping[str, Any]) -> dict[str, Any]:
        """The requested options with the forced ones put in (a forced level drops level
        options the script gave for its own level)."""
        options = dict(requested)
        level = self.options.get("opt_level")
        if level is not None and level != requested.get("opt_level"):
            for key in _LEVEL_SPECIFIC:
                if key not in self.options:
                    options.pop(key, None)
        options.update(self.options)
        if self._outputs_follow(requested):
            options["cast_model_outputs"] = self.options["dtype"]
        return options

    def _wanted(self, requested: Mapping[str, Any]) -> torch.dtype | None:
        """The dtype the script's own call trains in (None: its value is bad)."""
        asked = requested.get("dtype")
        try:
            return Properties.dtype if asked is None else parse_dtype(asked)
        except ValueError:  # the script's own value is bad: the forced one replaces it
            return None

    def _outputs_follow(self, requested: Mapping[str, Any]) -> bool:
        """Whether the script's `cast_model_outputs` is its own half dtype, which a forced
        dtype replaces: apex scripts wrote ``torch.float16`` to mean "the half dtype", and
        under ``--dtype bf16`` float16 outputs would overflow past 65504."""
        forced = self.options.get("dtype")
        wanted = self._wanted(requested)
        return forced is not None and wanted is not None and forced != wanted \
            and requested.get("cast_model_outputs") == wanted

    def dtype_note(self, requested: Mapping[str, Any]) -> str | None:
        """The warning to give when the forced dtype is not the one the script's own call
        trains in (None: no dtype forced, or the same one).

        A legacy script calls apex's `initialize` without a dtype and trains fp16; its own flags
        and logs (the HF Trainer's ``--fp16``) keep saying so under ``ampx run --dtype bf16``.
        """
        forced = self.options.get("dtype")
        asked = requested.get("dtype")
        wanted = self._wanted(requested)
        if forced is None or forced == wanted:
            return None
        default = dtype_name(Properties.dtype)
        how = (f"passed dtype={asked!r}" if asked is not None
               else f"passed no dtype (apex's API trains {default})")
        outputs = (f" Its cast_model_outputs=torch.{dtype_name(wanted)} is read as the half "
                   f"dtype: the model's outputs come back {dtype_name(forced)}."
                   if wanted is not None and self._outputs_follow(requested) else "")
        return (f"ampx run --dtype {dtype_name(forced)}: training in {dtype_name(forced)}. The "
                f"script's initialize {how}, so its own flags and logs that say "
                f"{dtype_name(wanted) if wanted is not None else default} (the HF Trainer's "
                f"--fp16, for one) do not describe this run.{outputs}")

    def jsonable(self) -> dict[str, Any]:
        """The options with JSON types: levels as "O2", dtypes as "bfloat16"."""
        return {key: _to_json(value) for key, value in self.options.items()}

    def describe(self) -> str:
        """``opt_level='O2', dtype='bfloat16'``: for log lines."""
        return ", ".join(f"{k}={v!r}" for k, v in self.jsonable().items())

    def to_json(self) -> str:
        """The value as one JSON string (what a child process of `ampx run` receives)."""
        return json.dumps(self.jsonable(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ForcedOptions:
        """The value `to_json` wrote: its types are restored, nothing is parsed or checked again."""
        raw = json.loads(text)
        decoded = {key: _from_json(key, value) for key, value in raw.items()}
        return cls(types.MappingProxyType(decoded))


def _to_json(value: Any) -> Any:
    if isinstance(value, OptLevel):
        return value.value
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return value


def _from_json(key: str, value: Any) -> Any:
    if key == "opt_level":
        return OptLevel(value)
    if key == "dtype":
        return getattr(torch, value)
    return value
