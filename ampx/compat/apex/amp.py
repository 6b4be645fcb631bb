"""apex's `apex.amp` namespace, published as `ampx.amp` (and as `apex.amp` by `ampx run`'s alias).

A real module holding apex's public names, so `amp.initialize(...)`, `amp.scale_loss(...)` and
`'state_dict' in amp.__dict__` behave as with apex. `_amp_state` is a compatibility view of
apex's private state that scripts reach into: `_amp_state.loss_scalers[i]` are the live
`LossScaler` objects of the default session (`loss_scale()`, `_loss_scale`, `_unskipped` and
`_scale_seq_len` can be read and written). Importing it installs the apex shell
(`ampx.compat.apex.shell`), so apex's private names are in place before a script uses them.
"""

from __future__ import annotations

import logging
from typing import Any

from ...frontend import default_session, initialize, load_state_dict, scale_loss, state_dict
from ...o1.patch import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ...scaling.protocol import master_params
from . import shell

logger = logging.getLogger("ampx")

__all__ = [
    "disable_casts",
    "init",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]



def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True,
         verbose: bool = False, allow_banned: bool = False) -> Any:
    """apex's old entry point `amp.init()`: install O1's float16 function patches only.

    No model or optimizer is prepared (use `initialize` for that); casts apply to tensors on
    the accelerator torch reports (CUDA, ...), or on CPU when there is none. Returns the
    installed patch handle (None when `enabled` is False). `loss_scale` and
    `enable_caching` are accepted for compatibility; the weight cache is always on.

    Under ``ampx run``, the forced ``dtype`` is the patches' dtype, and a forced
    ``enabled=False`` or ``-O O0`` installs nothing; other forced options need
    `initialize` (a warning names them).
    """
    import torch

    from ...frontend import forced_options
    from ...o1 import patch
    from ...options.values import OptLevel

    del loss_scale, enable_caching
    forced = dict(forced_options().options)
    level = forced.pop("opt_level", None)
    if forced.pop("enabled", True) is False or level == OptLevel.O0:
        enabled = False
    dtype = forced.pop("dtype", torch.float16)
    if level not in (None, OptLevel.O0, OptLevel.O1):
        forced["opt_level"] = level.value
    if forced and enabled:
        logger.warning("ampx run: amp.init() installs O1's casts only; the forced %s need "
                       "amp.initialize(model, optimizer) and are not applied.",
                       ", ".join(f"{k}={v!r}" for k, v in forced.items()))
    if not enabled:
        return None
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \
        else None
    device = accelerator.type if accelerator is not None else "cpu"
    return patch.activate(patch.CastConfig(dtype=dtype, device_types=frozenset({device}),
                                           allow_banned=allow_banned, verbose=verbose))


class _AmpStateView:
    """Read-through view of apex's `_amp_state` header object."""

    hard_override = False
    allow_incoming_model_not_fp32 = False

    @property
    def loss_scalers(self) -> list[Any]:
        session = default_session()
        return session.scalers if session is not None else []

    @property
    def opt_properties(self) -> Any:
        session = default_session()
        if session is None:
            raise AttributeError("_amp_state.opt_properties: amp.initialize has not been called")
        return session.properties

    @property
    def verbosity(self) -> int:
        session = default_session()
        return session.properties.verbosity if session is not None else 1

    @property
    def handle(self) -> Any:
        from ...o1 import patch

        return patch.active()


_amp_state = _AmpStateView()

shell.install()
