"""`ampx.amp`: apex's `apex.amp` namespace, for `from ampx import amp` (and `ampx run`'s alias).

The names are apex's (`initialize`, `scale_loss`, `state_dict`, `master_params`, the O1
registration functions, `init`, and the `_amp_state` compatibility view); they are defined in
`ampx.compat.apex.amp`, the apex shell around the engine, and re-exported here so that the
module scripts import is `ampx.amp` (`apex.amp.__name__` under `ampx run`).
"""

from __future__ import annotations

from .compat.apex.amp import *  # noqa: F403  (apex's public names, the shell's `__all__`)
from .compat.apex.amp import __all__ as __all__
from .compat.apex.amp import _amp_state as _amp_state
from .compat.apex.amp import default_session as default_session
