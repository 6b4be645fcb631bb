"""ampx: apex.amp's three-line mixed-precision API for current PyTorch, on every device.

Example::

    import ampx
    model, optimizer = ampx.initialize(model, optimizer, opt_level="O1")
    with ampx.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Importing ampx changes nothing in torch; patching happens in `initialize` and is undone by
`restore`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import amp  # the apex-compatible namespace: `from ampx import amp`
from .compat.options import add_args
from .frontend import (
    Amp,
    CheckpointError,
    deinitialize,
    initialize,
    load_state_dict,
    restore,
    scale_loss,
    state_dict,
    step_was_skipped,
)
from .opt_levels import OptionError, OptLevel, Properties, UnknownOptionError
from .optimizer import master_params
from .patch import (
    CastError,
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .scaler import LossScaler

__all__ = [
    # the object API and configuration
    "Amp",
    "CastError",
    "CheckpointError",
    "LossScaler",
    "OptLevel",
    "OptionError",
    "Properties",
    "UnknownOptionError",
    # apex's module functions (also in ampx.amp) and ampx's additions
    "add_args",
    "amp",
    "deinitialize",
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "restore",
    "scale_loss",
    "state_dict",
    "step_was_skipped",
]
