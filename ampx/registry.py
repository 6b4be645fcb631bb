"""The session registry: ampx's process-wide state besides O1's patch registry (`ampx.o1.patch`).

apex kept its state in one module global (`_amp_state`); ampx keeps what must be process-wide in
one object, `SESSIONS`, so every piece of it has a name and a single writer:

- `default` and `scalers`: the session the module-level `initialize` made last, and apex's one
  list of loss scalers that every such session shares (written by `ampx.frontend`);
- `forced`: the options `ampx run` forces on every `initialize` (an `ForcedOptions` parsed once at
  the command line; written by `ampx.frontend.set_forced_options`);
- `telemetry`: the JSON-lines writer for `AMPX_TELEMETRY` and the path it writes to (written by
  `ampx.telemetry.sink`);
- `apex_stashes`: the optimizers that carry apex's private names (`_amp_stash`, ...), so that
  `restore()` removes them all (written by `ampx.scaling.apex_stash`);
- `log_filter`: the rank-0 logging filter, added to the "ampx" logger once, the first time a
  multi-rank run is seen (written by `ampx.distributed.install_log_filter`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from .options.forced import ForcedOptions

__all__ = ["SESSIONS", "SessionRegistry"]


@dataclasses.dataclass
class SessionRegistry:
    """What ampx's sessions share in one process (see the module docstring)."""

    default: Any = None  # ampx.Amp | None (typed loosely: the session module imports this one)
    scalers: list[Any] = dataclasses.field(default_factory=list)
    forced: ForcedOptions = dataclasses.field(default_factory=ForcedOptions)
    telemetry: Any = None  # ampx.telemetry.Telemetry | None
    telemetry_path: str | None = None
    log_filter: Any = None  # ampx.distributed.RankZeroFilter | None
    apex_stashes: weakref.WeakSet[Any] = dataclasses.field(default_factory=weakref.WeakSet)


SESSIONS = SessionRegistry()
