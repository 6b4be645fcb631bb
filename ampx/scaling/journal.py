"""Undoable attribute assignments: the commit step of every transactional state change.

A transition first computes its results into tensors nobody holds yet, then commits them with
`Journal.set` (plain attribute assignments, remembered); if anything raises before the commit
is complete, KeyboardInterrupt included, `rollback` puts every attribute back, newest first.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Journal"]


class Journal:
    """Assignments that can be undone.

    Example::

        journal = Journal()
        try:
            journal.set(param, "grad", new_grad)
            journal.set(state, "stage", Stage.UNSCALED)
        except BaseException:
            journal.rollback()
            raise
    """

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """`setattr(obj, name, value)`, remembering the old value."""
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def rollback(self) -> None:
        """Put every recorded attribute back, newest first."""
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)
