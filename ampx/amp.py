"""`ampx.amp`: apex's `apex.amp` namespace, for `from ampx import amp` (and `ampx run`'s alias).

A real module holding apex's public names, so `amp.initialize(...)`, `amp.scale_loss(...)` and
`'state_dict' in amp.__dict__` behave as with apex. `_amp_state` is a compatibility view of
apex's private state that scripts reach into: `_amp_state.loss_scalers[i]` are the live
`LossScaler` objects of the default session (`loss_scale()`, `_loss_scale`, `_unskipped` and
`_scale_seq_len` can be read and written).
"""

from __future__ import annotations

from typing import Any

from .frontend import default_session, initialize, load_state_dict, scale_loss, state_dict
from .optimizer import master_params
from .patch import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

__all__ = [
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
    "scale_loss",
    "state_dict",
]

__version__ = "0.1.0"  # apex.amp's version string was 0.1.0 as well


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
        from . import patch

        return patch.active()


_amp_state = _AmpStateView()
