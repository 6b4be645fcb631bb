"""ampx: apex.amp's three-line mixed-precision API for current PyTorch, on every device.

Example::

    import ampx
    model, optimizer = ampx.initialize(model, optimizer, opt_level="O1")
    with ampx.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Importing ampx changes nothing in torch, and imports neither torch nor ampx's modules: each
public name is loaded on first use (PEP 562), so `ampx --help` starts fast. Patching happens
in `initialize` and is undone by `restore`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module defining it
_EXPORTS: dict[str, str] = {
    # the object API and configuration
    "Amp": "session",
    "CastError": "patch",
    "CheckpointError": "checkpoint",
    "LossScaler": "scaler",
    "OptLevel": "opt_levels",
    "OptionError": "opt_levels",
    "OverflowPersistsError": "overflow_policy",
    "OverflowReport": "overflow",
    "Properties": "opt_levels",
    "UnknownOptionError": "opt_levels",
    # apex's module functions (also in ampx.amp) and ampx's additions
    "add_args": "compat.options",
    "deinitialize": "frontend",
    "disable_casts": "patch",
    "float_function": "patch",
    "half_function": "patch",
    "initialize": "frontend",
    "last_overflow": "overflow_session",
    "load_state_dict": "frontend",
    "master_params": "optimizer",
    "promote_function": "patch",
    "register_float_function": "patch",
    "register_half_function": "patch",
    "register_promote_function": "patch",
    "restore": "frontend",
    "scale_loss": "frontend",
    "state_dict": "frontend",
    "step_was_skipped": "frontend",
}

__all__ = [
    "Amp",
    "CastError",
    "CheckpointError",
    "LossScaler",
    "OptLevel",
    "OptionError",
    "OverflowPersistsError",
    "OverflowReport",
    "Properties",
    "UnknownOptionError",
    "add_args",
    "amp",
    "deinitialize",
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "last_overflow",
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

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from . import amp
    from .checkpoint import CheckpointError
    from .compat.options import add_args
    from .frontend import (
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
    from .overflow import OverflowReport
    from .overflow_policy import OverflowPersistsError
    from .overflow_session import last_overflow
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
    from .session import Amp


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule such as `ampx.amp`) on first access."""
    module = _EXPORTS.get(name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value: Any = importlib.import_module(f"{__name__}.{name}")
    else:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
