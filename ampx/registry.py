"""The session registry: ampx's process-wide state besides O1's patch registry (`ampx.o1.registry`).

What must be process-wide lives in one object, `SESSIONS`, so every piece of it has a name and a
single writer:

- `default` and `scalers`: the session the module-level `initialize` made last, and the one list
  of loss scalers that every such session shares (written by `ampx.frontend`);
- `forced`: the options `ampx run` forces on every `initialize` (an `ForcedOptions` parsed once at
  the command line; written by `ampx.frontend.set_forced_options`);
- `extensions`: what every session adds to the optimizers it initializes besides ampx's own
  state (`OptimizerExtension`; apex's private optimizer names are one, added by
  `ampx.compat.apex.shell`; written by `ampx.session.add_extension`);
- `telemetry`: the JSON-lines writer for `AMPX_TELEMETRY` and the path it writes to (written by
  `ampx.telemetry.sink`);
- `log_filter`: the rank-0 logging filter, added to the "ampx" logger once, the first time a
  multi-rank run is seen (written by `ampx.distributed.install_log_filter`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from .options.forced import ForcedOptions

__all__ = ["SESSIONS", "OptimizerExtension", "SessionRegistry"]


class OptimizerExtension(Protocol):
    """Something every session adds to each optimizer it initializes (see `SESSIONS.extensions`).

    The engine calls it at three points and knows nothing else about it.
    """

    def check(self, optimizer: Any) -> None:
        """Refuse an optimizer before `initialize` changes anything (raise to refuse)."""

    def attach(self, optimizer: Any, journal: Any) -> None:
        """Add to an optimizer inside `initialize`'s transaction, after ampx's state is on it.

        Every change must be undoable through `journal` (an `ampx.scaling.journal.Journal`):
        when a later part of `initialize` fails, the journal rolls it back.
        """

    def detach_all(self) -> None:
        """Take it off every optimizer it was added to (the module-level `ampx.restore()`)."""


@dataclasses.dataclass
class SessionRegistry:
    """What ampx's sessions share in one process (see the module docstring)."""

    default: Any = None  # ampx.Amp | None (typed loosely: the session module imports this one)
    scalers: list[Any] = dataclasses.field(default_factory=list)
    forced: ForcedOptions = dataclasses.field(default_factory=ForcedOptions)
    extensions: list[OptimizerExtension] = dataclasses.field(default_factory=list)
    telemetry: Any = None  # ampx.telemetry.Telemetry | None
    telemetry_path: str | None = None
    log_filter: Any = None  # ampx.distributed.RankZeroFilter | None


SESSIONS = SessionRegistry()
