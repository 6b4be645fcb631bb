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

The public names are listed as data, in `_EXPORTS` (name -> the module defining it), which
`__getattr__` reads; the `TYPE_CHECKING` block below names the same imports for type checkers
(tests/test_structure.py checks that the two agree). Before it hands out the first public name
the package installs the apex shell (`ampx.compat.apex.shell`: apex's private names, added
through the session's hooks), so scripts that reach into apex's internals work however they
got to ampx.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # the public names for type checkers (the same as `_EXPORTS`)
    from . import amp
    from .frontend import (
        deinitialize,
        initialize,
        load_state_dict,
        restore,
        scale_loss,
        state_dict,
        step_was_skipped,
    )
    from .o1.patch import (
        CastError,
        disable_casts,
        float_function,
        half_function,
        promote_function,
        register_float_function,
        register_half_function,
        register_promote_function,
    )
    from .options.flags import add_args
    from .options.levels import OptionError, OptLevel, Properties, UnknownOptionError
    from .overflow.policy import OverflowPersistsError
    from .overflow.report import OverflowReport
    from .overflow.watch import last_overflow, numerics_report
    from .scaling.checkpoint import CheckpointError
    from .scaling.protocol import master_params
    from .scaling.scaler import LossScaler
    from .session import Amp
    from .telemetry import log_metric


_EXPORTS: dict[str, str] = {
    "amp": "amp",  # a submodule: `from ampx import amp`
    **dict.fromkeys(["deinitialize", "initialize", "load_state_dict", "restore", "scale_loss",
                     "state_dict", "step_was_skipped"], "frontend"),
    **dict.fromkeys(["CastError", "disable_casts", "float_function", "half_function",
                     "promote_function", "register_float_function", "register_half_function",
                     "register_promote_function"], "o1.patch"),
    "add_args": "options.flags",
    **dict.fromkeys(["OptionError", "OptLevel", "Properties", "UnknownOptionError"],
                    "options.levels"),
    "OverflowPersistsError": "overflow.policy",
    "OverflowReport": "overflow.report",
    "last_overflow": "overflow.watch",
    "numerics_report": "overflow.watch",
    "CheckpointError": "scaling.checkpoint",
    "master_params": "scaling.protocol",
    "LossScaler": "scaling.scaler",
    "Amp": "session",
    "log_metric": "telemetry",
}

_NO_SHELL = frozenset({"log_metric"})
"""Public names that need no apex shell (and so no torch): `log_metric` must cost nothing."""


def _exports() -> dict[str, str]:
    """Public name -> the submodule (relative to the package) that defines it."""
    return dict(_EXPORTS)


@functools.cache
def _install_shell() -> None:
    """apex's private names, in place before any public name is used (see the docstring)."""
    importlib.import_module(f"{__name__}.compat.apex.shell").install()


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule such as `ampx.amp`) on first access."""
    if name == "__all__":
        return sorted(_EXPORTS)
    module = _EXPORTS.get(name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value: Any = importlib.import_module(f"{__name__}.{name}")
    elif module == name:
        _install_shell()
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        if name not in _NO_SHELL:
            _install_shell()
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
