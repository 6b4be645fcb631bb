"""The one rollback idiom: a journal of undo steps, played back newest first.

A transition first computes its results into tensors nobody holds yet, then commits them with
`Journal.set` (plain attribute assignments, remembered); a change that is not an attribute
assignment (a hook installed, a parameter swapped into a module, a dict entry added) registers
how to undo it with `Journal.record`. If anything raises before the commit is complete,
KeyboardInterrupt included, `rollback` undoes every step, newest first. `initialize`, the O2
model cast, the scaled pass, the fp32 fallback and checkpoint loading all use it.

Record an undo step *before* making the change when the undo is safe on an unchanged object
(restoring a saved value is): then an interrupt landing between the change and the record
cannot leave a change that the journal does not know about.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Journal"]

_MISSING = object()


class Journal:
    """Changes that can be undone.

    Example::

        journal = Journal()
        try:
            journal.set(param, "grad", new_grad)
            journal.set(state, "stage", Stage.UNSCALED)
            journal.record(handle.remove)  # after installing a hook
        except BaseException:
            journal.rollback()
            raise
    """

    def __init__(self) -> None:
        # (obj, name, old value) for `set` (the per-step hot path: no closure), else a callable
        self._undo: list[tuple[Any, str, Any] | Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def set(self, obj: Any, name: str, value: Any) -> None:
        """`setattr(obj, name, value)`, remembering the old value."""
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def setitem(self, mapping: Any, key: Any, value: Any) -> None:
        """`mapping[key] = value`, remembering the old entry (or its absence)."""
        old = mapping.get(key, _MISSING) if hasattr(mapping, "get") else mapping[key]

        def undo() -> None:
            if old is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        self._undo.append(undo)
        mapping[key] = value

    def record(self, undo: Callable[[], None]) -> None:
        """Register `undo` as the way back from a change made (or about to be made)."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo every recorded step, newest first (each step is dropped before it runs)."""
        while self._undo:
            step = self._undo.pop()
            if isinstance(step, tuple):
                setattr(*step)
            else:
                step()

    def forget(self) -> None:
        """Commit: drop every undo step (the changes stay)."""
        self._undo.clear()

    @contextmanager
    def atomic(self) -> Iterator[Journal]:
        """`with journal.atomic():` rolls back on any exception (KeyboardInterrupt included)."""
        try:
            yield self
        except BaseException:
            self.rollback()
            raise
