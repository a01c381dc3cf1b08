"""Verification beside the writers: a stream appended to while it is checked is intact.

Every reader of a chain walks the stream's entries and then compares the last one with the
stream head. Appends commit their entries and the head together, but the walk and the head
are two reads: an append committed between them moved the head past the last entry walked,
and the hourly check alerted "entries missing after the last one" into the tenant's stream
(`chain_break_detected`), the run page and trail said "broken" — for any stream written while
it was read (a running run, a busy tenant). The seam between the two reads is where another
writer's commit lands here; on PostgreSQL a real writer thread does the same.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test import Client
from django.urls import reverse

from audit import journal
from audit.models import JournalEntry, JournalQuerySet
from audit.verification import verify_all, verify_recent, verify_stream
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Tenant
from runtime.pages.audit import walk_trail
from runtime.tenancy import Principal
from tests.conftest import Persona


def _act(stream: str, tenant_id: int, n: int = 1) -> None:
    for k in range(n):
        with transaction.atomic():
            journal.append(
                stream, "policy_changed", tenant_id=tenant_id, actor="user:ada", payload={"k": k}
            )


def _another_writer_commits_after_each_walk(
    monkeypatch: pytest.MonkeyPatch, stream: str, tenant_id: int
) -> list[int]:
    """When a reader has walked the stream's entries to the end, another writer appends to
    it and commits, before the reader's next statement. Returns the list of appends made."""
    real = JournalQuerySet.iterator
    made: list[int] = []

    def walked_then_appended(self: JournalQuerySet, *args: Any, **kwargs: Any) -> Iterator[Any]:
        yield from real(self, *args, **kwargs)
        if not made:  # once: the writer's commit lands between the walk and the head
            made.append(1)
            _act(stream, tenant_id)

    monkeypatch.setattr(JournalQuerySet, "iterator", walked_then_appended)
    return made


def test_a_tenant_stream_appended_to_while_it_is_verified_is_not_a_break(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = journal.tenant_stream(tenant_a.pk)
    _act(stream, tenant_a.pk, 5)
    made = _another_writer_commits_after_each_walk(monkeypatch, stream, tenant_a.pk)
    assert verify_stream(stream) is None
    assert made  # the writer did commit between the reads
    assert verify_stream(stream) is None  # and the stream, read again, is whole


def test_the_hourly_check_writes_no_alert_for_a_stream_written_while_it_checks(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = journal.tenant_stream(tenant_a.pk)
    _act(stream, tenant_a.pk, 5)
    _another_writer_commits_after_each_walk(monkeypatch, stream, tenant_a.pk)
    assert verify_recent() == 0
    assert not JournalEntry.objects.filter(type="chain_break_detected").exists()
    checked, breaks = verify_all(tenant_a.pk)
    assert checked == 1 and breaks == []


def test_a_run_trail_read_while_the_run_writes_is_verified(
    tenant_a: Tenant, reviewer_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = create_run(tenant_a, "chain", {"steps": 3}, actor="user:alice")
    advance_run(run.run_id, "w1")
    stream = journal.run_stream(run.run_id)
    made = _another_writer_commits_after_each_walk(monkeypatch, stream, tenant_a.pk)
    trail = walk_trail(Principal(reviewer_a.user, tenant_a, reviewer_a.role), run.run_id)
    assert made and trail.chain_break is None
    assert {row.verdict for row in trail.rows} == {"verified"}


def test_the_run_pages_say_nothing_is_broken_for_a_run_written_while_they_are_read(
    tenant_a: Tenant, reviewer_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = create_run(tenant_a, "chain", {"steps": 3}, actor="user:alice")
    advance_run(run.run_id, "w1")
    stream = journal.run_stream(run.run_id)
    client = Client()
    client.force_login(reviewer_a.user)
    for name in ("run", "run-trail"):
        made = _another_writer_commits_after_each_walk(monkeypatch, stream, tenant_a.pk)
        page = client.get(reverse(name, args=[run.run_id]))
        assert made and page.status_code == 200, name
        assert "broken" not in page.content.decode().lower(), name


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_verifying_streams_beside_real_writers_finds_no_break(tenant_a: Tenant) -> None:
    """Writer threads append to a tenant stream and a run-like stream, each on its own
    connection, while the main thread verifies both again and again."""
    if connection.vendor != "postgresql":
        pytest.skip("writers on their own connections beside the verifier: PostgreSQL")
    streams = [journal.tenant_stream(tenant_a.pk), "run:00000000-0000-4000-8000-000000000001"]
    for stream in streams:
        _act(stream, tenant_a.pk, 200)
    stop = threading.Event()
    errors: list[BaseException] = []

    def write(stream: str) -> None:
        try:
            while not stop.is_set():
                _act(stream, tenant_a.pk)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)
        finally:
            connections.close_all()

    writers = [threading.Thread(target=write, args=(s,)) for s in streams]
    for writer in writers:
        writer.start()
    breaks = []
    try:
        for _ in range(30):
            for stream in streams:
                found = verify_stream(stream)
                if found is not None:
                    breaks.append(found)
    finally:
        stop.set()
        for writer in writers:
            writer.join(timeout=30)
    assert not errors
    assert breaks == []
    for stream in streams:  # and the streams are whole once the writers are done
        assert verify_stream(stream) is None
