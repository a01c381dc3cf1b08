"""The retention purge against the writers running beside it (real connections, threads).

A step commit stores its artifacts by content: one that another run stored already is not
inserted again (`ON CONFLICT DO NOTHING`), the commit only refers to it. The purge finds the
artifacts no kept checkpoint refers to and deletes them; a commit that refers to one of them
between the two must not lose it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from runtime import retention, stepcommit
from runtime.artifacts import resolve
from runtime.executor import advance_run
from runtime.lifecycle import create_run, provide_input
from runtime.models import Checkpoint, Run, RunStatus, Tenant


def _lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


def _blocked_or_done(worker: threading.Thread) -> None:
    """Until the worker has finished or (PostgreSQL) waits for a lock; SQLite serialises
    writers, so there the worker waits for the purge's write lock (bounded)."""
    if connection.vendor != "postgresql":
        worker.join(timeout=3)
        return
    deadline = time.monotonic() + 20
    while worker.is_alive() and time.monotonic() < deadline:
        if _lock_waiters() >= 1:
            return
        time.sleep(0.02)


def _expired_and_live(tenant: Tenant) -> tuple[Run, Run]:
    """A run past retention and a new one that will store the same notes (so the same
    artifacts), then wait for input."""
    Tenant.objects.filter(pk=tenant.pk).update(retention_days=30)
    old = create_run(tenant, "grower", {"steps": 40}, actor="t")
    assert advance_run(old.run_id, "w1").outcome == "completed"
    Run.objects.filter(pk=old.pk).update(updated_at=timezone.now() - timedelta(days=31))
    return old, create_run(tenant, "patient_grower", {"steps": 40}, actor="t")


def _purge_into(outcome: dict[str, Any], tenant: Tenant) -> None:
    try:
        outcome["purge"] = retention.purge_tenant(Tenant.objects.get(pk=tenant.pk))
    except Exception as exc:  # noqa: BLE001  (reported by the assertions)
        outcome["purge"] = exc
    finally:
        connections.close_all()


def _step_into(outcome: dict[str, Any], run: Run) -> None:
    try:
        outcome["step"] = advance_run(run.run_id, "w2").outcome
    except Exception as exc:  # noqa: BLE001  (reported by the assertions)
        outcome["step"] = exc
    finally:
        connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_a_step_commit_reusing_an_artifact_during_the_purge_keeps_it(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An expired run and a live one stored the same notes. The purge took the references
    of the checkpoints it keeps (none of the live run's yet), then the live run committed
    its steps — referring to the expired run's artifacts, inserting none — then the purge
    deleted those artifacts as orphans: the live run, waiting for input, could not be read
    back nor resumed (LookupError: artifacts missing)."""
    old, live = _expired_and_live(tenant_a)
    paused, go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    real_refs, calls = retention._refs, []

    def refs_then_pause(tenant_id: int, checkpoints: Any) -> set[str]:
        found = real_refs(tenant_id, checkpoints)
        calls.append(checkpoints)
        if len(calls) == 2:  # the doomed runs' references, then the kept ones: hold it here
            paused.set()
            go.wait(timeout=30)
        return found

    monkeypatch.setattr(retention, "_refs", refs_then_pause)

    purger = threading.Thread(target=_purge_into, args=(outcome, tenant_a))
    purger.start()
    stepper = threading.Thread(target=_step_into, args=(outcome, live))
    try:
        assert paused.wait(timeout=30), "the purge never reached its kept references"
        stepper.start()
        _blocked_or_done(stepper)
    finally:
        go.set()
        purger.join(timeout=60)
        if stepper.is_alive() or stepper.ident is not None:
            stepper.join(timeout=60)

    _check_both(outcome, old, live)


def _check_both(outcome: dict[str, Any], old: Run, live: Run) -> None:
    """Both went through, and the live run reads back whole and can be resumed."""
    tenant_id = live.tenant_id
    assert outcome["step"] == "waiting", outcome
    report = outcome["purge"]
    assert isinstance(report, retention.PurgeReport), report
    assert report.runs == [str(old.run_id)]
    if connection.vendor == "postgresql":  # it did delete (SQLite: the live run may have
        assert report.artifacts > 0  # taken the write lock first and referred to them all)
    live.refresh_from_db()
    assert live.status == RunStatus.WAITING_INPUT
    last = Checkpoint.objects.get(run=live, rev=live.checkpoint_rev)
    assert len(resolve(tenant_id, last.state)["notes"]) == 40
    provide_input(live, {"more": "no"}, live.checkpoint_rev, actor="t")
    assert advance_run(live.run_id, "w3").outcome == "completed"
    done = Checkpoint.objects.filter(run=live).order_by("-rev").first()
    assert done is not None
    assert len(resolve(tenant_id, done.state)["notes"]) == 40


@pytest.mark.django_db(transaction=True)
def test_a_purge_during_a_step_commit_that_reuses_an_artifact_keeps_it(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: the live run's first commit has found the expired run's artifact
    stored (and inserted nothing) and not committed yet when the purge reads the kept
    references — which cannot see that checkpoint — and deletes the artifact."""
    old, live = _expired_and_live(tenant_a)
    paused, go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    real_record = stepcommit.record

    def record_then_pause(run: Run, *args: Any, **kwargs: Any) -> Any:
        # Inside the commit's transaction, its artifacts written: hold it here, once.
        if run.pk == live.pk and not paused.is_set():
            paused.set()
            go.wait(timeout=30)
        return real_record(run, *args, **kwargs)

    monkeypatch.setattr(stepcommit, "record", record_then_pause)
    stepper = threading.Thread(target=_step_into, args=(outcome, live))
    stepper.start()
    purger = threading.Thread(target=_purge_into, args=(outcome, tenant_a))
    try:
        assert paused.wait(timeout=30), "the step commit never got under way"
        purger.start()
        _blocked_or_done(purger)
    finally:
        go.set()
        stepper.join(timeout=60)
        if purger.ident is not None:
            purger.join(timeout=60)
    _check_both(outcome, old, live)


@pytest.mark.django_db(transaction=True)
def test_two_purges_at_once_purge_and_journal_a_run_once(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two purges of one tenant at once (a scheduled one and an operator's): both listed the
    due run before either began, and the second, once the first had committed, journalled a
    `retention_purged` of the run the first had already purged — the audit trail said the
    run was purged twice, with its counts twice."""
    from audit.models import JournalEntry

    old, _live = _expired_and_live(tenant_a)
    first_paused, go = threading.Event(), threading.Event()
    second_listed = threading.Event()
    outcomes: list[dict[str, Any]] = [{}, {}]
    real_refs, real_create = retention._refs, retention.PurgeReport
    holder: list[int] = []

    def refs_then_pause(tenant_id: int, checkpoints: Any) -> set[str]:
        if not holder:  # the first purge, inside its transaction: hold it
            holder.append(threading.get_ident())
            first_paused.set()
            go.wait(timeout=30)
        return real_refs(tenant_id, checkpoints)

    def report(*args: Any, **kwargs: Any) -> retention.PurgeReport:
        made = real_create(*args, **kwargs)
        if holder and threading.get_ident() != holder[0]:
            second_listed.set()  # the second purge has listed the due runs
        return made

    monkeypatch.setattr(retention, "_refs", refs_then_pause)
    monkeypatch.setattr(retention, "PurgeReport", report)
    first = threading.Thread(target=_purge_into, args=(outcomes[0], tenant_a))
    second = threading.Thread(target=_purge_into, args=(outcomes[1], tenant_a))
    first.start()
    try:
        assert first_paused.wait(timeout=30), "the first purge never got under way"
        second.start()
        assert second_listed.wait(timeout=30), "the second purge never listed the runs"
        _blocked_or_done(second)
    finally:
        go.set()
        first.join(timeout=60)
        if second.ident is not None:
            second.join(timeout=60)
    reports = [o["purge"] for o in outcomes]
    assert all(isinstance(r, real_create) for r in reports), reports
    assert sorted(len(r.runs) for r in reports) == [0, 1], [r.runs for r in reports]
    purged = JournalEntry.objects.filter(type="retention_purged", tenant_id=tenant_a.pk)
    assert [e.payload["runs"] for e in purged] == [[str(old.run_id)]]


@pytest.mark.django_db(transaction=True)
def test_step_commits_that_store_artifacts_go_on_between_the_purges_batches(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The purge held the artifact table (SHARE ROW EXCLUSIVE, PostgreSQL) from the reading
    of the kept references to its commit, for every due run of the tenant at once: a large
    purge stopped every step commit that stores an artifact until it ended. Batches each
    commit on their own: between two, a live run's step commits (which store artifacts) go
    through, and the purge still keeps what they refer to."""
    old, live = _expired_and_live(tenant_a)
    older = create_run(tenant_a, "grower", {"steps": 30}, actor="t")
    assert advance_run(older.run_id, "w1").outcome == "completed"
    Run.objects.filter(pk=older.pk).update(updated_at=timezone.now() - timedelta(days=40))
    paused, go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    real_batch = retention._purge_batch

    def batch_then_pause(*args: Any, **kwargs: Any) -> None:
        real_batch(*args, **kwargs)
        if not paused.is_set():  # the first batch has committed: hold the purge here
            paused.set()
            go.wait(timeout=60)

    monkeypatch.setattr(retention, "_purge_batch", batch_then_pause)

    def purge() -> None:
        try:
            tenant = Tenant.objects.get(pk=tenant_a.pk)
            outcome["purge"] = retention.purge_tenant(tenant, batch_size=1)
        except Exception as exc:  # noqa: BLE001  (reported by the assertions)
            outcome["purge"] = exc
        finally:
            connections.close_all()

    purger = threading.Thread(target=purge)
    purger.start()
    stepper = threading.Thread(target=_step_into, args=(outcome, live))
    try:
        assert paused.wait(timeout=30), "the purge never finished its first batch"
        stepper.start()
        stepper.join(timeout=30)
        assert not stepper.is_alive(), "the step commit waited for the rest of the purge"
    finally:
        go.set()
        purger.join(timeout=60)
        if stepper.ident is not None:
            stepper.join(timeout=60)
    assert outcome["step"] == "waiting", outcome
    report = outcome["purge"]
    assert isinstance(report, retention.PurgeReport), report
    assert sorted(report.runs) == sorted([str(old.run_id), str(older.run_id)])
    live.refresh_from_db()
    last = Checkpoint.objects.get(run=live, rev=live.checkpoint_rev)
    assert len(resolve(live.tenant_id, last.state)["notes"]) == 40


def _due_runs(tenant: Tenant, thread_id: str, bare: int, grown: int) -> set[str]:
    """`grown` finished runs with checkpoints and artifacts, and `bare` finished runs
    without (cheap to make by the hundred), all in one thread and past retention."""
    made = [
        create_run(tenant, "grower", {"steps": 4}, actor="t", thread_id=thread_id)
        for _ in range(grown)
    ]
    for run in made:
        assert advance_run(run.run_id, "w1").outcome == "completed"
    Run.objects.bulk_create(
        Run(
            tenant=tenant,
            thread_id=thread_id,
            graph="grower",
            graph_version="1",
            goal={},
            next_step="grow",
            status=RunStatus.COMPLETED,
        )
        for _ in range(bare)
    )
    due = Run.objects.filter(tenant=tenant, thread_id=thread_id)
    due.update(updated_at=timezone.now() - timedelta(days=31))
    return {str(r) for r in due.values_list("run_id", flat=True)}


def _purge_at(
    outcome: dict[str, Any],
    start: threading.Barrier,
    tenant: Tenant,
    batch_size: int,
    thread_id: str | None,
) -> None:
    """One purge, on its own connection, begun together with the other."""
    try:
        fresh = Tenant.objects.get(pk=tenant.pk)
        start.wait(timeout=30)
        outcome["purge"] = retention.purge_tenant(fresh, batch_size=batch_size, thread_id=thread_id)
    except Exception as exc:  # noqa: BLE001  (reported by the assertions)
        outcome["purge"] = exc
    finally:
        connections.close_all()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_purges_of_one_tenant_over_many_batches_never_deadlock(tenant_a: Tenant) -> None:
    """Two purges of one tenant at once — the scheduled one (500 runs a batch) and an
    operator's deletion request for the same thread (7 a batch) — each lock a batch of run
    rows and take the artifact lock and the tenant stream's head after. If they took the rows
    they share in different orders, each would end up waiting for a row the other holds and
    PostgreSQL would kill one ("deadlock detected"). Every due run is purged by exactly one of
    them, journalled once, and the run they keep still reads back whole."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks taken by two connections at once: PostgreSQL")
    from audit.models import JournalEntry

    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    live = create_run(tenant_a, "grower", {"steps": 4}, actor="t", thread_id="other")
    assert advance_run(live.run_id, "w1").outcome == "completed"
    for round in range(3):
        due = _due_runs(tenant_a, f"customer-{round}", bare=300, grown=3)
        outcomes: list[dict[str, Any]] = [{}, {}]
        start = threading.Barrier(2)
        workers = [
            threading.Thread(target=_purge_at, args=(outcomes[0], start, tenant_a, 500, None)),
            threading.Thread(
                target=_purge_at, args=(outcomes[1], start, tenant_a, 7, f"customer-{round}")
            ),
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        reports = [o.get("purge") for o in outcomes]
        assert all(isinstance(r, retention.PurgeReport) for r in reports), reports
        taken = [set(r.runs) for r in reports]
        assert not taken[0] & taken[1] and taken[0] | taken[1] == due, round
        assert not Run.objects.filter(run_id__in=due).exists()
    purged = JournalEntry.objects.filter(type="retention_purged", tenant_id=tenant_a.pk)
    journalled = [run for e in purged for run in e.payload["runs"]]
    assert len(journalled) == len(set(journalled)) == 3 * 303
    last = Checkpoint.objects.get(run=live, rev=4)
    assert len(resolve(tenant_a.pk, last.state)["notes"]) == 4


@pytest.mark.django_db(transaction=True)
def test_a_purge_beside_one_between_its_batches_leaves_no_orphaned_artifact(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge counts what the checkpoints it keeps refer to once, and carries the counts
    from batch to batch. Between two of its batches, a thread's deletion request purged a
    run whose checkpoints those counts include: had the next batch trusted them, it would
    have kept the artifacts that run shared with the batch's own — referred to by no
    checkpoint any more, and by no later purge's doomed runs either: never deleted."""
    from audit.models import JournalEntry
    from runtime.models import Artifact

    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    later, first = (create_run(tenant_a, "grower", {"steps": n}, actor="t") for n in (6, 2))
    shared = create_run(tenant_a, "grower", {"steps": 6}, actor="t", thread_id="customer-9")
    for run in (later, first, shared):
        assert advance_run(run.run_id, "w1").outcome == "completed"
    for run in (later, first):
        Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(days=31))
    paused, go = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    real_batch = retention._purge_batch

    def batch_then_pause(*args: Any, **kwargs: Any) -> None:
        real_batch(*args, **kwargs)
        if not paused.is_set():  # the first batch has committed: hold the purge here
            paused.set()
            go.wait(timeout=60)

    monkeypatch.setattr(retention, "_purge_batch", batch_then_pause)

    def purge() -> None:
        try:
            tenant = Tenant.objects.get(pk=tenant_a.pk)
            outcome["purge"] = retention.purge_tenant(tenant, batch_size=1)
        except Exception as exc:  # noqa: BLE001  (reported by the assertions)
            outcome["purge"] = exc
        finally:
            connections.close_all()

    purger = threading.Thread(target=purge)
    purger.start()
    try:
        assert paused.wait(timeout=30), "the purge never finished its first batch"
        request = retention.purge_tenant(tenant_a, thread_id="customer-9")
    finally:
        go.set()
        purger.join(timeout=60)
    report = outcome["purge"]
    assert isinstance(report, retention.PurgeReport), report
    assert report.runs == [str(first.run_id), str(later.run_id)]  # newest first
    assert request.runs == [str(shared.run_id)]
    assert not Run.objects.exists() and not Artifact.objects.exists()
    purged = JournalEntry.objects.filter(type="retention_purged", tenant_id=tenant_a.pk)
    assert sum(e.payload["artifacts"] for e in purged) == report.artifacts + request.artifacts
