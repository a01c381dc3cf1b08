"""A worker's lease in two round trips (runtime.leases.take_due, `_take_at_once`): an unlocked
read, then one statement that swaps on everything the read's verdict was drawn from and
journals the lease. Whatever another connection does between the two — takes the lease,
renews a lapsed one, cancels the run, moves its timer, appends to its stream — the statement
writes nothing and the locked transaction decides, as if the fast path had not been there:
one lease per fence, the journal's chain whole."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit import journal
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime import leases
from runtime.errors import LeaseHeld, RunFinished
from runtime.executor import advance_run
from runtime.leases import take_due, take_lease
from runtime.lifecycle import cancel_run, create_run
from runtime.models import Run, Tenant
from runtime.models.runs import RUNNABLE
from tests.runtime.helpers import expire_lease, in_other_thread, make_due, payloads

pytestmark = pytest.mark.django_db(transaction=True)


def _between(monkeypatch: pytest.MonkeyPatch, work: Callable[[], Any]) -> list[int]:
    """Run `work` on another connection once, after the lease's read and before its write
    (the entry is built in between); returns a list counting the entries built."""
    built: list[int] = []
    done: list[bool] = []
    real = leases._record_taken

    def interleaved(run: Run, lease: leases.Lease, previous_owner: str) -> None:
        if not done:
            done.append(True)  # before: `work` may take a lease itself
            in_other_thread(work)
        built.append(lease.fence)
        real(run, lease, previous_owner)

    monkeypatch.setattr(leases, "_record_taken", interleaved)
    return built


def _row(run: Run) -> dict[str, Any]:
    fresh = Run.objects.get(pk=run.pk)
    return {f.attname: getattr(fresh, f.attname) for f in Run._meta.concrete_fields}


def test_the_run_a_lease_hands_on_is_the_row_as_stored(tenant_a: Tenant) -> None:
    """The executor starts from the run the lease read and changed (it no longer reads it
    again): every column equal to the stored row's, on either path."""
    run = create(tenant_a)
    lease, taken = take_due(run.run_id, "w1", 30)
    assert {f.attname: getattr(taken, f.attname) for f in Run._meta.concrete_fields} == _row(run)
    assert (taken.fence, taken.lease_owner, taken.status) == (lease.fence, "w1", "running")
    assert taken.lease_expires_at == lease.expires_at
    assert payloads(run, "lease_taken")[-1]["expires_at"] == lease.expires_at.isoformat()


@pytest.mark.postgres
def test_postgresql_takes_a_workers_lease_in_two_statements_outside_a_transaction(
    tenant_a: Tenant,
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("one-statement writes are PostgreSQL's")
    run = create(tenant_a)
    with CaptureQueriesContext(connection) as seen:
        take_due(run.run_id, "w1", 30)
    sql = [q["sql"] for q in seen.captured_queries]
    assert len(sql) == 2, sql
    assert sql[0].startswith("SELECT") and "FOR UPDATE" not in sql[0]
    assert sql[1].startswith('WITH changed AS (UPDATE "runtime_run"')
    assert "audit_journalentry" in sql[1]  # the lease and its entry: one statement
    assert verify_stream(journal.run_stream(run.run_id)) is None


def create(tenant: Tenant) -> Run:
    return create_run(tenant, "chain", {"steps": 3}, actor="test")


@pytest.mark.postgres
def test_another_worker_taking_it_in_between_leaves_one_lease(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the two-round-trip lease is PostgreSQL's")
    run = create(tenant_a)
    built = _between(monkeypatch, lambda: take_lease(run.run_id, "w2", ttl=30))
    with pytest.raises(LeaseHeld):
        take_due(run.run_id, "w1", 30)
    stored = Run.objects.get(pk=run.pk)
    assert (stored.lease_owner, stored.fence) == ("w2", 1)
    assert [p["owner"] for p in payloads(run, "lease_taken")] == ["w2"]
    assert built[:1] == [1]  # w1 had built its entry for fence 1: it never landed
    assert verify_stream(journal.run_stream(run.run_id)) is None


@pytest.mark.postgres
def test_a_lapsed_lease_renewed_in_between_is_not_taken_over(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old holder's lease had lapsed when the read judged it free; its heartbeat lands
    before the swap (a paused worker waking up). The swap names the lease's end as read, so
    it changes nothing and the locked read then sees a live lease."""
    if connection.vendor != "postgresql":
        pytest.skip("the two-round-trip lease is PostgreSQL's")
    run = create(tenant_a)
    old = take_lease(run.run_id, "w0", ttl=30)
    expire_lease(run)

    def renew() -> None:  # what leases.heartbeat writes, on the old holder's fence
        later = timezone.now() + timedelta(seconds=60)
        assert Run.objects.filter(pk=run.pk, fence=old.fence).update(lease_expires_at=later)

    _between(monkeypatch, renew)
    with pytest.raises(LeaseHeld):
        take_due(run.run_id, "w1", 30)
    stored = Run.objects.get(pk=run.pk)
    assert (stored.lease_owner, stored.fence) == ("w0", old.fence)
    assert len(payloads(run, "lease_taken")) == 1


@pytest.mark.postgres
def test_a_run_cancelled_in_between_is_not_leased(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the two-round-trip lease is PostgreSQL's")
    run = create(tenant_a)
    _between(monkeypatch, lambda: cancel_run(Run.objects.get(pk=run.pk), "stop", actor="user:a"))
    with pytest.raises(RunFinished):
        take_due(run.run_id, "w1", 30)
    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.lease_owner, stored.fence) == ("cancelled", "", 0)
    assert payloads(run, "lease_taken") == []


@pytest.mark.postgres
def test_a_timer_moved_later_in_between_is_waited_for(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retrying run whose wake time had come; it is moved an hour on before the swap."""
    if connection.vendor != "postgresql":
        pytest.skip("the two-round-trip lease is PostgreSQL's")
    run = create_run(tenant_a, "flaky", {"fail_times": 1}, actor="t")
    assert advance_run(run.run_id, "w0").outcome == "retrying"  # wakes in 15 s or more
    make_due(run)
    later = timezone.now() + timedelta(hours=1)
    _between(monkeypatch, lambda: Run.objects.filter(pk=run.pk).update(wake_at=later))
    with pytest.raises(LeaseHeld):
        take_due(run.run_id, "w1", 30)
    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.wake_at, stored.fence) == ("retrying", later, 1)


@pytest.mark.postgres
def test_an_entry_appended_in_between_is_chained_after(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone journals on the run's stream between the read (which read its head) and the
    swap: the statement writes nothing, and the transaction takes the lease after that entry."""
    if connection.vendor != "postgresql":
        pytest.skip("the two-round-trip lease is PostgreSQL's")
    run = create(tenant_a)
    stream = journal.run_stream(run.run_id)

    def note() -> None:
        with transaction.atomic():
            journal.append(stream, "note", tenant_id=tenant_a.pk, actor="user:r", payload={})

    built = _between(monkeypatch, note)
    lease, _ = take_due(run.run_id, "w1", 30)
    assert lease.fence == 1 and built == [1, 1]  # built twice: the second one landed
    types = JournalEntry.objects.filter(stream=stream).order_by("seq").values_list("type")
    assert [t for (t,) in types][-2:] == ["note", "lease_taken"]
    assert verify_stream(stream) is None
    assert advance_run(run.run_id, "w1").outcome == "skipped"  # w1 holds it: one lease


@pytest.mark.postgres
def test_many_workers_racing_for_one_run_take_it_once(tenant_a: Tenant) -> None:
    """Eight connections take the same due run at once, over and over: each round exactly
    one lease per fence, the others refused, and the journal says the same."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrent connections: PostgreSQL")
    run = create(tenant_a)
    rounds, takers = 12, 8
    for r in range(rounds):
        if r:
            expire_lease(run)
        won: list[int] = []
        start = threading.Barrier(takers)

        def take(n: int, start: threading.Barrier = start, won: list[int] = won) -> None:
            try:
                start.wait(10)
                won.append(take_due(run.run_id, f"w{n}", 30)[0].fence)
            except LeaseHeld:
                pass
            finally:
                connection.close()

        threads = [threading.Thread(target=take, args=(n,)) for n in range(takers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert won == [r + 1], (r, won)
    taken = payloads(run, "lease_taken")
    assert [p["fence"] for p in taken] == list(range(1, rounds + 1))
    assert Run.objects.get(pk=run.pk).status in RUNNABLE
    assert verify_stream(journal.run_stream(run.run_id)) is None
