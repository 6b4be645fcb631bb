"""O1's patch registry: what O1 keeps process-wide, in one object (`PATCHES`).

Beside the session registry (`ampx.registry`), this is the only process-wide state ampx keeps:

- `active`: the installed `O1Patches`, or None (written by `ampx.o1.patch.activate/deactivate`);
- `user`: the `register_*_function` registrations, kept across sessions;
- `compiler_ready`, `rule_map`, `cache_flags`: what a session did to torch's compiler
  (`ampx.o1.compiler`), once something imported it: `disable_casts`'s frames kept from
  dynamo, dynamo's rule map built from the originals, and the AOTAutograd cache flags held off
  during a session (the import hook, `ampx.o1.pristine`, is on `sys.meta_path` exactly while
  a session is installed);
- `native_class`: the native cast wrapper's Python subclass, once looked up (`[None]`: no
  extension, or the closures forced; `ampx.o1.wrappers.native_class`).

The `disable_casts()` regions (`ampx.o1.regions`) are per thread and per trace, not
process-wide: they live in thread-local and context-local objects there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["PATCHES", "PatchRegistry"]


@dataclasses.dataclass
class PatchRegistry:
    """O1's process-wide state (see the module docstring)."""

    active: Any = None  # ampx.o1.patch.O1Patches | None (that module imports this one)
    # (id(owner), name) -> (owner, name, rule)
    user: dict[tuple[int, str], tuple[Any, str, Any]] = dataclasses.field(default_factory=dict)
    compiler_ready: bool = False
    rule_map: Any = None
    cache_flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    native_class: list[Any] = dataclasses.field(default_factory=list)


PATCHES = PatchRegistry()
