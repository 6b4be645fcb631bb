"""apex as the outer shell of the engine: `install()` puts apex's private names in place.

The engine (`ampx.session` and everything below it) holds none of apex's private names. This
module adds them, through the hooks the engine offers:

- apex's per-optimizer names (`_amp_stash` and five methods, `ampx.compat.apex.stash`) are an
  `OptimizerExtension` registered with `ampx.session.add_extension`: every session's
  `initialize` binds them inside its transaction and `ampx.restore()` removes them;
- apex's private `LossScaler` members (`_loss_scale`, `update_scale`, ...,
  `ampx.compat.apex.scaler_members`) are set on the scaler class.

The public package runs `install()` before it hands out any public name (`ampx.initialize`,
`ampx.Amp`, `ampx.amp`, ...), and `ampx.amp` (`apex.amp` under `ampx run`) imports it, so a
script sees apex's names whichever way it reaches ampx; code that imports the engine's modules
directly (`ampx.session`) gets the engine alone until something calls `install()`.
"""

from __future__ import annotations

from ...session import add_extension
from . import scaler_members, stash

__all__ = ["install"]


def install() -> None:
    """Put apex's private names in place (idempotent; cheap after the first call)."""
    scaler_members.install()
    add_extension(stash.PRIVATES)
