"""SQLite: a journal append inside a transaction is one INSERT into a view (audit.sqliteappend)
where it was an UPDATE of the head and an INSERT of the entries — with the same chain, the
same refusal of a head that moved, and the same rows as the two statements write."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import time_machine
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from audit import journal, sqliteappend
from audit.models import JournalEntry, StreamHead
from audit.verification import verify_stream
from runtime.models import Tenant
from tests.runtime.helpers import in_other_thread

pytestmark = pytest.mark.django_db(transaction=True)

VIEW_INSERT = f"INSERT INTO {sqliteappend.VIEW} "


@pytest.fixture(autouse=True)
def sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("the view is SQLite's (PostgreSQL sends one statement of its own)")


@pytest.fixture
def without_the_view() -> Iterator[None]:
    sqliteappend.uninstall(connection)
    try:
        yield
    finally:
        sqliteappend.install(connection)


def notes(stream: str, tenant: Tenant, *texts: str) -> None:
    """One transaction appending `texts` to `stream` (written together at the batch's end)."""
    with transaction.atomic(), journal.batched(stream):
        for text in texts:
            journal.append(stream, "note", tenant_id=tenant.pk, actor="t", payload={"n": text})


def journal_statements(work: Callable[[], None]) -> list[str]:
    """The statements `work` sent that name a journal table or the view, shortened."""
    with CaptureQueriesContext(connection) as seen:
        work()
    sent = [q["sql"] for q in seen.captured_queries]
    return [s[:40] for s in sent if "audit_" in s]


def stored(stream: str) -> list[tuple[Any, ...]]:
    rows = JournalEntry.objects.filter(stream=stream).order_by("seq")
    return list(rows.values_list("seq", "type", "actor", "payload", "created_at", "redacted"))


def test_the_view_is_made_with_the_step_view_after_migrate() -> None:
    made = sqliteappend.installed(connection)
    assert set(made) == {sqliteappend.VIEW, sqliteappend.TRIGGER}
    assert "RAISE(ABORT" in made[sqliteappend.TRIGGER]


def test_an_owned_streams_append_is_one_statement_chained_and_verified(
    tenant_a: Tenant,
) -> None:
    stream = f"notes:{tenant_a.pk}"
    with journal.owning(stream):
        notes(stream, tenant_a, "a")  # the head is read (locked) once, then remembered
        sent = journal_statements(lambda: notes(stream, tenant_a, "b", "c", "d"))
    assert len(sent) == 1 and sent[0].startswith(VIEW_INSERT), sent
    assert [row[0] for row in stored(stream)] == [1, 2, 3, 4]
    assert [row[3]["n"] for row in stored(stream)] == ["a", "b", "c", "d"]
    assert StreamHead.objects.get(stream=stream).seq == 4
    assert verify_stream(stream) is None


def test_a_head_another_writer_moved_is_chained_after_and_the_transaction_goes_on(
    tenant_a: Tenant,
) -> None:
    """The remembered head is stale: the view's INSERT fails as a whole, SQLite undoes that
    statement only, and the append goes on from the locked head — after the other writer's
    entry, one chain — with the rest of the transaction kept."""
    stream, other = f"notes:{tenant_a.pk}", f"other:{tenant_a.pk}"
    with journal.owning(stream):
        notes(stream, tenant_a, "a")
        in_other_thread(lambda: notes(stream, tenant_a, "theirs"))

        def both() -> None:
            with transaction.atomic():
                notes(other, tenant_a, "kept")  # written before the refused statement
                notes(stream, tenant_a, "b", "c")

        sent = journal_statements(both)
    assert sum(s.startswith(VIEW_INSERT) for s in sent) == 3, sent  # other's, refused, again
    assert [row[3]["n"] for row in stored(stream)] == ["a", "theirs", "b", "c"]
    assert [row[3]["n"] for row in stored(other)] == ["kept"]
    assert verify_stream(stream) is None and verify_stream(other) is None


def test_an_expected_head_that_moved_is_refused_with_nothing_written(tenant_a: Tenant) -> None:
    stream = f"notes:{tenant_a.pk}"
    notes(stream, tenant_a, "a", "b")
    stale = journal.Head(1, JournalEntry.objects.get(stream=stream, seq=1).hash)
    with pytest.raises(journal.StreamMoved), transaction.atomic():
        journal.append(stream, "note", tenant_id=tenant_a.pk, actor="t", expected_head=stale)
    assert [row[0] for row in stored(stream)] == [1, 2]
    assert StreamHead.objects.get(stream=stream).seq == 2
    assert verify_stream(stream) is None


def test_without_the_view_the_two_statements_write_the_same_rows(
    tenant_a: Tenant, without_the_view: None
) -> None:
    with time_machine.travel("2026-12-07 12:00:00+00:00", tick=False):
        sqliteappend.install(connection)
        viewed = f"viewed:{tenant_a.pk}"
        with journal.owning(viewed):
            notes(viewed, tenant_a, "a")
            by_view = journal_statements(lambda: notes(viewed, tenant_a, "b", "c"))
        sqliteappend.uninstall(connection)
        plain = f"plain:{tenant_a.pk}"
        with journal.owning(plain):
            notes(plain, tenant_a, "a")
            by_two = journal_statements(lambda: notes(plain, tenant_a, "b", "c"))
    # The view's INSERT is tried (and finds no view: nothing written), then the two.
    assert [s.split(" SET")[0] for s in by_two] == [
        f"INSERT INTO {sqliteappend.VIEW} (stream"[:40],
        'UPDATE "audit_streamhead"',
        'INSERT INTO "audit_journalentry" ("strea',
    ], by_two
    assert len(by_view) == 1 and by_view[0].startswith(VIEW_INSERT)
    assert stored(viewed) == stored(plain)
    assert verify_stream(viewed) is None and verify_stream(plain) is None
