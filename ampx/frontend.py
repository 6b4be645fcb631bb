"""The module-level API (`ampx.initialize`, `ampx.scale_loss`, ...) on a default session.

apex's API is a set of module functions over process-wide state; these are the same functions
over one default `ampx.Amp`. Each module-level `initialize` makes a new session the default;
all of them share one list of loss scalers, as apex's did. This module holds that wiring only:
the session itself is `ampx.session.Amp`, options (and their defaults, read from
`ampx.options.levels.DEFAULTS`) are `ampx.options.levels`'; apex's private names are added by
`ampx.compat.apex` (`ampx.amp` is apex's `apex.amp` namespace over these functions).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch

from .o1 import patch
from .options.forced import ForcedOptions
from .options.levels import DEFAULTS, OptionError
from .registry import SESSIONS
from .scaling.checkpoint import CheckpointError
from .scaling.protocol import amp_state_of, master_params
from .session import Amp, _optimizer_list

__all__ = [
    "Amp",
    "CheckpointError",
    "deinitialize",
    "forced_options",
    "initialize",
    "load_state_dict",
    "master_params",
    "restore",
    "scale_loss",
    "set_forced_options",
    "state_dict",
    "step_was_skipped",
]

logger = logging.getLogger("ampx")



# -- the apex-style module functions (a default session) -----------------------------------------

def default_session() -> Amp | None:
    """The session made by the latest module-level `initialize` (None before, or after restore)."""
    return SESSIONS.default


def set_forced_options(options: Mapping[str, Any] | ForcedOptions | None) -> None:
    """Make every later `initialize` use these options instead of the caller's (`ampx run`).

    Args:
        options: Already parsed `ForcedOptions`, or initialize keyword values to parse (keys:
            `ampx.options.forced.FORCEABLE`); None or {} clears them.

    Raises:
        ValueError: For a key that cannot be forced (nothing changes).
        OptionError: For a bad value (nothing changes).
    """
    if not isinstance(options, ForcedOptions):
        options = ForcedOptions.parse(options)
    SESSIONS.forced = options


def forced_options() -> ForcedOptions:
    """The options `ampx run` forces on every `initialize` (empty when none)."""
    return SESSIONS.forced


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = DEFAULTS.enabled,
    opt_level: str = DEFAULTS.opt_level.value,
    cast_model_type: Any = DEFAULTS.cast_model_type,
    patch_torch_functions: Any = DEFAULTS.patch_torch_functions,
    keep_batchnorm_fp32: Any = DEFAULTS.keep_batchnorm_fp32,
    master_weights: Any = DEFAULTS.master_weights,
    loss_scale: Any = DEFAULTS.loss_scale,
    cast_model_outputs: torch.dtype | None = DEFAULTS.cast_model_outputs,
    num_losses: int = DEFAULTS.num_losses,
    verbosity: int = DEFAULTS.verbosity,
    min_loss_scale: float | None = DEFAULTS.min_loss_scale,
    max_loss_scale: float = DEFAULTS.max_loss_scale,
    **options: Any,
) -> Any:
    """apex's `amp.initialize`: same arguments, same return shapes, same option errors.

    Defaults are read from `ampx.options.levels.DEFAULTS` (`ampx.Properties`' field
    defaults); extra keyword options are those of `Amp` (`dtype`, `init_scale`,
    `skip_non_finite`, `sync_overflow`, ...).

    Calling it again starts a new default session, as in apex: the loss scalers are
    rebuilt, and `loss_id` then picks the fresh scalers for *every* optimizer a module-level
    `initialize` returned, the earlier ones too (apex's one list of loss scalers;
    `ampx.Amp` sessions keep scalers of their own). The previous session's O1 patches are
    replaced (or removed when the new level is not O1). A disabled `initialize` leaves the
    scalers as they were.

    Example::

        model, optimizer = ampx.initialize(model, optimizer, opt_level="O2", dtype="bf16")

    Raises:
        OptionError: (a ValueError and a RuntimeError) for options or inputs that don't fit.
        TypeError: For models/optimizers of the wrong type.
        RuntimeError: For a DataParallel-wrapped model or an optimizer passed twice.
    Nothing is changed when it raises.
    """
    amp = Amp(
        opt_level, enabled=enabled, cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights, loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs, num_losses=num_losses, verbosity=verbosity,
        min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale, **options,
    )
    result = amp.initialize(models, optimizers)
    # apex's one list of loss scalers, shared by every session the module-level `initialize`
    # made, refilled by each of them (so `loss_id` means the same scaler for all).
    if amp.enabled:
        SESSIONS.scalers[:] = amp.scalers
    amp.scalers = SESSIONS.scalers
    previous, SESSIONS.default = SESSIONS.default, amp
    if previous is not None and any(m is n for m in previous.models for n in amp.models):
        previous.remove_detector()  # the same model watched twice would double its hooks
    if previous is not None and not amp.properties.patch_torch_functions and previous.owns_patches:
        # A new default session replaces the old one cleanly: its O1 casts must not leak
        # into a model initialized at another level (an O2 bf16 model under O1 fp16 casts).
        logger.info("ampx.initialize: removing the previous session's O1 function patches; "
                    "its models now run without O1 casts.")
        previous.remove_patches()
    return result


def _session_for(optimizers: Any) -> Amp:
    for opt in _optimizer_list(optimizers):
        state = amp_state_of(opt)
        if state is not None and isinstance(state.owner, Amp):
            return state.owner
    if SESSIONS.default is None:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
            "before `with amp.scale_loss`."
        )
    return SESSIONS.default


def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> contextlib.AbstractContextManager[torch.Tensor]:
    """apex's `amp.scale_loss`; the session is found from the optimizers (see `Amp.scale_loss`).

    Example::

        with ampx.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
    """
    return _session_for(optimizers).scale_loss(
        loss, optimizers, loss_id=loss_id, model=model, delay_unscale=delay_unscale,
        delay_overflow_check=delay_overflow_check,
    )


def _require_default(api: str) -> Amp:
    if SESSIONS.default is None:
        raise RuntimeError(f"ampx.{api}: call ampx.initialize(...) first.")
    return SESSIONS.default


def state_dict(destination: dict | None = None) -> dict[str, Any]:
    """apex's `amp.state_dict()` for the default session (see `Amp.state_dict`)."""
    return _require_default("state_dict").state_dict(destination)


def load_state_dict(state_dict: Mapping[str, Any]) -> None:
    """apex's `amp.load_state_dict()` for the default session (see `Amp.load_state_dict`)."""
    _require_default("load_state_dict").load_state_dict(state_dict)


def step_was_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the last `optimizer.step()` was skipped for non-finite gradients (no sync).

    Example::

        optimizer.step()
        if not ampx.step_was_skipped(optimizer):
            scheduler.step()
    """
    state = amp_state_of(optimizer)
    if state is None:
        raise TypeError(
            "step_was_skipped() needs an optimizer passed through ampx.initialize(); got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        )
    return state.last_step_skipped


def restore() -> None:
    """Undo O1's patching: torch, torch.Tensor and torch.nn.functional get their original objects.

    Every hook the default session put on its models comes off (input/output casts, the
    state-dict hooks, the forward overflow detector); models keep their casts (an O2 model stays
    half, and its `state_dict()` saves its half values from now on), optimizers their state. The
    default session is forgotten (the optimizers it returned keep using the shared loss scalers
    until the next `initialize`). What the registered extensions added (apex's private
    optimizer names) is taken off too.
    """
    if SESSIONS.default is not None:
        SESSIONS.default.restore()
    patch.deactivate()
    for extension in SESSIONS.extensions:
        extension.detach_all()
    SESSIONS.default = None


deinitialize = restore

__all__ += ["OptionError", "default_session"]
