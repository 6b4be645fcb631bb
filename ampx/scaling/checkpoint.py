"""Loading amp checkpoints (ampx's and apex's `loss_scalerN` entries): validated, all or nothing.

`load` checks every entry before any is applied: the keys (only `loss_scalerN`, no index
twice), each entry's fields and types, that each value fits the scaler's device storage (the
scale is a float32, the counters are int32), and that the entry suits the scaler it goes to
(as apex, any scale for a dynamic scaler; a static scaler keeps its own scale, which is
configuration, with one warning when the entry's differs, and takes the counters). Then the new
state of every scaler is built as fresh tensors and installed with undoable assignments, so a
malformed checkpoint, or an interrupt, changes nothing.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from .. import _ext

__all__ = ["STATE_VERSION", "CheckpointError", "check_entry", "load", "new_state"]

logger = logging.getLogger("ampx")

STATE_VERSION = 1
# Saved for information and mismatch reports; the session's configuration stays in force.
POLICY_FIELDS = ("hysteresis", "growth_factor", "backoff_factor", "growth_interval",
                 "min_loss_scale", "max_loss_scale")
_INT32_MAX = 2**31 - 1
_SCALER_KEY = re.compile(r"loss_scaler([0-9]+)")
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23  # least subnormal


class CheckpointError(ValueError, RuntimeError):
    """A malformed or mismatched ampx/apex checkpoint (RuntimeError, as apex raised)."""


class ScalerLike(Protocol):
    """What loading needs of a loss scaler (`ampx.scaling.scaler.LossScaler` is one; it imports
    this module, so the type is described here rather than imported)."""

    dynamic: bool
    loss_id: int
    hysteresis: int

    @property
    def device(self) -> torch.device: ...  # noqa: D102

    def loss_scale(self) -> float: ...  # noqa: D102

    def commit(self, new: Mapping[str, torch.Tensor]) -> list[Any]: ...  # noqa: D102


def _fail(message: str) -> CheckpointError:
    return CheckpointError(f"ampx.load_state_dict: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scale_of(state: Mapping[str, Any], key: str) -> float:
    scale = state["loss_scale"]
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise _fail(f"{key}['loss_scale'] must be a number or a 1-element float tensor; "
                        f"got a {scale.dtype} tensor of shape {tuple(scale.shape)}.")
        scale = float(scale.item())
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
        math.isfinite(scale) and scale > 0
    ):
        raise _fail(f"{key}['loss_scale'] must be a positive finite number; "
                    f"got {state['loss_scale']!r}.")
    if not _F32_TINY <= scale <= _F32_MAX:
        raise _fail(f"{key}['loss_scale']={scale!r} does not fit the scaler's float32 "
                    f"storage (range {_F32_TINY:.3g} .. {_F32_MAX:.3g}).")
    return float(scale)


def _counter(state: Mapping[str, Any], key: str, name: str, required: bool) -> int | None:
    value = state.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _fail(f"{key}[{name!r}] must be a non-negative int; got {value!r}.")
    if value > _INT32_MAX:
        raise _fail(f"{key}[{name!r}]={value!r} does not fit the scaler's int32 storage "
                    f"(at most {_INT32_MAX}).")
    return int(value)


def validate_entry(state: Any, key: str) -> dict[str, Any]:
    """Check one `loss_scalerN` entry on its own; returns it as a dict (scale as a float)."""
    if not isinstance(state, Mapping):
        raise _fail(f"{key!r} must be a dict with 'loss_scale' and 'unskipped'; got "
                    f"{type(state).__name__}.")
    for name in ("loss_scale", "unskipped"):
        if name not in state:
            raise _fail(f"{key!r} has no {name!r} entry.")
    scale = _scale_of(state, key)
    _counter(state, key, "unskipped", True)
    version = state.get("version", 0)
    if not _is_int(version) or version < 0:
        raise _fail(f"{key}['version'] must be a non-negative int; got {version!r}.")
    if version > STATE_VERSION:
        raise _fail(f"{key}['version']={version!r} is newer than this ampx understands "
                    f"({STATE_VERSION}); upgrade ampx.")
    dynamic = state.get("dynamic")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise _fail(f"{key}['dynamic'] must be a bool; got {dynamic!r}.")
    _counter(state, key, "hysteresis_tracker", False)
    for name in POLICY_FIELDS:
        value = state.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _fail(f"{key}[{name!r}] must be a number; got {value!r}.")
    return dict(state, loss_scale=scale)


def check_entry(scaler: ScalerLike, state: Any, key: str) -> dict[str, Any]:
    """Validate an entry for `scaler` without applying it.

    Raises:
        CheckpointError: Naming the key, for a malformed entry (wrong types, a non-finite,
            zero or negative scale, negative counters) or one that does not fit the
            scaler's storage. A static scaler given another scale keeps its own (warning).
    """
    checked = validate_entry(state, key)
    dynamic = checked.get("dynamic")
    saved = "dynamic" if dynamic else "static" if dynamic is not None else "apex"
    if not scaler.dynamic and checked["loss_scale"] != scaler.loss_scale():
        # apex assigned any scale; a static scale is this session's configuration (bf16 runs
        # resuming an fp16 checkpoint land here): keep it, take the counters, say so once.
        warnings.warn(
            f"ampx.load_state_dict: {key} has loss_scale={checked['loss_scale']} ({saved} "
            f"checkpoint), but loss scaler {scaler.loss_id} of this session is static "
            f"(loss_scale={scaler.loss_scale()}); keeping {scaler.loss_scale()}. Pass "
            f"loss_scale={checked['loss_scale']} (or \"dynamic\") to initialize to use the "
            "checkpoint's scale.", stacklevel=_stacklevel())
        checked["loss_scale"] = scaler.loss_scale()
    elif scaler.dynamic and dynamic is False:
        logger.info("ampx.load_state_dict: %s was saved by a static loss scaler; this "
                    "session's dynamic scaler %d continues from its scale %s (as apex did).",
                    key, scaler.loss_id, checked["loss_scale"])
    differs = {f: checked[f] for f in POLICY_FIELDS
               if f in checked and checked[f] != getattr(scaler, f)}
    if differs and scaler.dynamic:
        logger.info("ampx.load_state_dict: %s was saved with %s; keeping this session's "
                    "settings.", key, differs)
    return checked


def _stacklevel() -> int:
    """The user's frame for warnings: the first frame outside ampx."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ampx"):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def new_state(scaler: ScalerLike, checked: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The scaler tensors a checked entry stands for, freshly made on the scaler's device."""
    device = scaler.device
    scale = torch.full((1,), checked["loss_scale"], dtype=torch.float32, device=device)
    tracker = checked.get("hysteresis_tracker")
    return {
        "_scale": scale,
        "_growth_tracker": torch.full((1,), checked["unskipped"], dtype=torch.int32,
                                      device=device),
        "_hysteresis_tracker": torch.full((1,), scaler.hysteresis if tracker is None
                                          else tracker, dtype=torch.int32, device=device),
        "_overflows_since_report": torch.zeros(1, dtype=torch.float32, device=device),
        "_scale_before_overflow": scale.clone(),
    }


def scaler_index(key: Any) -> int | None:
    """N of a `loss_scalerN` key, or None for any other key."""
    # ASCII digits only: str.isdigit() takes "١" (Arabic-Indic) or "²", which int() reads as
    # 1 or refuses with a bare ValueError
    match = _SCALER_KEY.fullmatch(key) if isinstance(key, str) else None
    return int(match.group(1)) if match is not None else None


def _indices(state_dict: Mapping[str, Any]) -> dict[int, str]:
    if not isinstance(state_dict, Mapping):
        raise _fail(f"expected a dict of loss_scalerN entries; got {type(state_dict).__name__}.")
    unexpected = [k for k in state_dict if scaler_index(k) is None]
    if unexpected:
        raise CheckpointError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(repr(k) for k in unexpected)
            + ". (ampx.load_state_dict expects only loss_scalerN keys, as saved by "
            "ampx.state_dict() or apex's amp.state_dict().)")
    keys: dict[int, str] = {}
    for key in state_dict:
        index = scaler_index(key)
        assert index is not None  # checked above
        if index in keys:
            raise _fail(f"{keys[index]!r} and {key!r} both name loss scaler {index}; keep one.")
        keys[index] = key
    return keys


def load(scalers: Sequence[ScalerLike], state_dict: Mapping[str, Any],
         names: Sequence[str] | None = None, stacklevel: int = 3) -> None:
    """Validate every entry, then install all of them at once (or none).

    Args:
        scalers: The session's loss scalers (entry N goes to `scalers[N]`).
        state_dict: `{"loss_scalerN": entry, ...}`.
        names: Keys to use in messages instead of the checkpoint's (one per scaler).
        stacklevel: Of the warnings, counted from the caller of `load`.

    Raises:
        CheckpointError: Naming the offending key; nothing is changed then.
    """
    keys = _indices(state_dict)
    new: list[tuple[ScalerLike, dict[str, torch.Tensor]]] = []
    for index, key in keys.items():
        label = names[index] if names is not None and index < len(names) else key
        if index >= len(scalers):
            validate_entry(state_dict[key], label)
            warnings.warn(f"ampx.load_state_dict: skipping {key}, since num_losses was set to "
                          f"{len(scalers)}.", stacklevel=stacklevel + 1)
            continue
        checked = check_entry(scalers[index], state_dict[key], label)
        new.append((scalers[index], new_state(scalers[index], checked)))
    if names is None and len(state_dict) != len(scalers):
        warnings.warn(f"ampx.load_state_dict: state_dict contains {len(state_dict)} entries, "
                      f"while {len(scalers)} loss_scalers are used.", stacklevel=stacklevel + 1)
    _ext.assign(tuple(item for scaler, tensors in new for item in scaler.commit(tensors)))
