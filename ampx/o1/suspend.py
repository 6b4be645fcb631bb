"""Run ampx's own optimizer work with O1's patches swapped out (no wrapper is entered).

apex ran `optimizer.step()` with its casts disabled. ampx goes further: for the duration of a
for-loop optimizer's step (one that calls Tensor methods per parameter), torch's original
functions are put back, so the step pays no per-op cost at all; the wrappers are reinstated
after it. Foreach and fused optimizers call no patched function, so nothing is swapped for
them. The swap touches every patched attribute twice per step, a fixed cost independent of
the number of parameters (benchmarks/bench_step.py shows `optimizer.step()` alone).
"""

from __future__ import annotations

from typing import Any

import torch

from . import patch

__all__ = ["for_loop", "resume", "suspend"]

# The suspended installation and, per swapped attribute, (owner, name, its wrapper).
_SUSPENDED: list[tuple[patch.O1Patches, list[tuple[Any, str, Any]]]] = []


def for_loop(optimizer: torch.optim.Optimizer) -> bool:
    """True unless every parameter group asks for the foreach or fused implementation."""
    return not all(group.get("foreach") or group.get("fused")
                   for group in optimizer.param_groups)


def suspend() -> None:
    """Put torch's originals back for the active O1 installation (no-op without one)."""
    o1 = patch.active()
    if o1 is None or _SUSPENDED:
        return
    swapped: list[tuple[Any, str, Any]] = []
    _SUSPENDED.append((o1, swapped))
    # An inherited original is set on the owner (not deleted), so that `ampx.restore()` while
    # suspended (after a step that raised) still finds each attribute it deletes.
    for owner, name, original in o1.patches.originals():
        swapped.append((owner, name, vars(owner)[name]))
        setattr(owner, name, original)


def resume() -> None:
    """Reinstate the wrappers `suspend` swapped out, if that installation is still active."""
    if not _SUSPENDED:
        return
    o1, swapped = _SUSPENDED.pop()
    if patch.active() is o1 and o1.live:
        for owner, name, wrapper in swapped:
            setattr(owner, name, wrapper)
