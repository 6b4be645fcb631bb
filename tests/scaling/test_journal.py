"""The one rollback idiom: `Journal` steps undo newest first, under any BaseException."""

from __future__ import annotations

import types

import pytest

from ampx.scaling.journal import Journal


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_atomic_undoes_every_kind_of_step_newest_first(exc: type[BaseException]) -> None:
    obj = types.SimpleNamespace(a=1)
    table = {"kept": 1}
    order: list[str] = []
    with pytest.raises(exc):
        with Journal().atomic() as journal:
            journal.set(obj, "a", 2)
            journal.setitem(table, "kept", 2)
            journal.setitem(table, "new", 3)
            journal.record(lambda: order.append("first"))
            journal.record(lambda: order.append("second"))
            assert (obj.a, table, len(journal)) == (2, {"kept": 2, "new": 3}, 5)
            raise exc("boom")
    assert obj.a == 1 and table == {"kept": 1} and order == ["second", "first"]


def test_forget_commits_and_rollback_is_idempotent() -> None:
    obj = types.SimpleNamespace(a=1)
    journal = Journal()
    journal.set(obj, "a", 2)
    journal.forget()
    journal.rollback()
    assert obj.a == 2 and len(journal) == 0
    journal.set(obj, "a", 3)
    journal.rollback()
    journal.rollback()
    assert obj.a == 2
