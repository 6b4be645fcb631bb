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

The public names are listed once, in the `TYPE_CHECKING` block below: type checkers read it as
imports, and `__getattr__` reads the same block (from this file's source, on first use) to know
which module defines each name.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # THE list of public names (see the module docstring)
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


@functools.cache
def _exports() -> dict[str, str]:
    """Public name -> the submodule defining it, read from the `TYPE_CHECKING` block above."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    found: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            found[alias.name] = node.module or alias.name  # `from . import amp`: a submodule
    return found


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule such as `ampx.amp`) on first access."""
    if name == "__all__":
        return sorted(_exports())
    module = _exports().get(name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value: Any = importlib.import_module(f"{__name__}.{name}")
    elif module == name:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_exports()})
