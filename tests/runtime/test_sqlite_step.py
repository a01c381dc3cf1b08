"""SQLite: a step's commit as one INSERT into a view whose trigger writes the run's
compare-and-swap, the checkpoint, the stream head and the journal entry (runtime.sqlitestep).

What a user relies on is what the four statements gave: a stale executor's commit writes
nothing, a journal head that moved meanwhile is chained after (never forked), the checkpoint
and the journal verify — and the view never stands in the way of a migration.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management.sql import emit_post_migrate_signal, emit_pre_migrate_signal
from django.db import OperationalError, connection, models, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from audit import journal
from audit.models import JournalEntry
from audit.verification import verify_stream
from fastsql import statements
from runtime import sqlitestep, stepcommit
from runtime.checkverify import verify_checkpoints
from runtime.events import RunEvent
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Next, Outcome, register, registry
from runtime.leases import db_now, take_due
from runtime.lifecycle import create_run
from runtime.models import Checkpoint, Run, RunStatus, Tenant
from runtime.stepcommit import StepCommit
from tests.runtime.helpers import in_other_thread

pytestmark = pytest.mark.django_db(transaction=True)

# What each graph's step does before it returns, once per run (by step number).
AT_STEP: dict[int, Callable[[Any], None]] = {}


@pytest.fixture(autouse=True)
def _sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("the view is SQLite's (PostgreSQL sends one statement of its own)")


@pytest.fixture
def ticking() -> Iterator[Graph]:
    graph = Graph("sqlite-step-tick", version="1")

    @graph.step(start=True)
    def tick(ctx: Any) -> Outcome:
        i = ctx.state.get("i", 0) + 1
        if i in AT_STEP:
            AT_STEP.pop(i)(ctx)
        if i >= int(ctx.goal["steps"]):
            return Complete(update={"i": i})
        return Next("tick", update={"i": i})

    register(graph)
    yield graph
    AT_STEP.clear()
    registry.unregister(graph.name, "1")


def noting(stream: str, tenant: Tenant) -> Callable[[Any], None]:
    """A step's hook: someone else (a reviewer, from another connection) journals a note on
    the run's stream while the step runs."""

    def note(ctx: Any) -> None:
        def append() -> None:
            with transaction.atomic():
                journal.append(stream, "note", tenant_id=tenant.id, actor="user:rev")

        in_other_thread(append)

    return note


def sent_through_the_view(queries: list[dict[str, Any]]) -> int:
    return sum(1 for q in queries if q["sql"].startswith(f"INSERT INTO {sqlitestep.VIEW} "))


def verified(run: Run) -> None:
    """The run's journal chain and all its checkpoints verify (what `audit_verify` and
    `checkpoint_verify` would say of it)."""
    run.refresh_from_db()
    assert verify_stream(journal.run_stream(run.run_id)) is None
    runs, checked, broken = verify_checkpoints([Run.objects.get(pk=run.pk)], whole=False)
    assert (runs, checked, broken) == (1, run.checkpoint_rev, [])


def test_the_view_is_made_from_the_models_after_migrate() -> None:
    made = sqlitestep.installed(connection)
    assert set(made) == {sqlitestep.VIEW, sqlitestep.TRIGGER}
    with connection.cursor() as cur:
        cur.execute(f"PRAGMA table_info({sqlitestep.VIEW})")
        assert [row[1] for row in cur.fetchall()] == sqlitestep.columns()
    trigger = made[sqlitestep.TRIGGER]
    for model in (Checkpoint, JournalEntry):
        for field in model._meta.concrete_fields:
            if not isinstance(field, models.AutoField):
                assert f"NEW.{'c' if model is Checkpoint else 'j'}_{field.column}" in trigger


def test_each_step_is_one_insert_and_the_run_verifies(tenant_a: Tenant, ticking: Graph) -> None:
    run = create_run(tenant_a, ticking.name, {"steps": 6}, actor="t")
    with CaptureQueriesContext(connection) as seen:
        assert advance_run(run.run_id, "w1").outcome == "completed"
    assert sent_through_the_view(seen.captured_queries) == 6
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.checkpoint_rev == 6
    assert run.lease_owner == "" and run.lease_expires_at is None
    assert list(Checkpoint.objects.filter(run=run).values_list("rev", flat=True)) == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    verified(run)


def test_a_commit_through_the_view_extends_the_lease_by_the_database_clock(
    tenant_a: Tenant, ticking: Graph
) -> None:
    """A commit is a heartbeat every TTL/3: the one after a slow step sets the lease's end to
    the database's clock plus the TTL, as the ORM's expression would."""
    run = create_run(tenant_a, ticking.name, {"steps": 4}, actor="t")
    seen: list[Any] = []

    def lease_end(ctx: Any) -> None:
        seen.append(Run.objects.values_list("lease_expires_at", flat=True).get(pk=run.pk))

    AT_STEP[2] = lambda ctx: (lease_end(ctx), time.sleep(0.5))
    AT_STEP[3] = lease_end
    with CaptureQueriesContext(connection) as sent:
        assert advance_run(run.run_id, "w1", ttl=1.2).outcome == "completed"
    assert sent_through_the_view(sent.captured_queries) == 4
    first, later = seen
    assert first is not None and later is not None
    assert timedelta(seconds=0.45) < later - first < timedelta(seconds=1.2)


def test_a_stale_executors_commit_writes_nothing(tenant_a: Tenant, ticking: Graph) -> None:
    """Another executor takes the run while step 3 runs (its fence moves on): the step's
    INSERT is refused by the trigger, and nothing of it is written — no checkpoint 3, no
    journal entry, the run's row as the other executor left it."""
    run = create_run(tenant_a, ticking.name, {"steps": 5}, actor="t")

    def taken_over(ctx: Any) -> None:
        Run.objects.filter(pk=run.pk).update(fence=F("fence") + 1, lease_owner="w2")

    AT_STEP[3] = taken_over
    with CaptureQueriesContext(connection) as seen:
        assert advance_run(run.run_id, "w1").outcome == "stale"
    assert sent_through_the_view(seen.captured_queries) == 3  # steps 1, 2 and the refused 3
    run.refresh_from_db()
    assert run.checkpoint_rev == 2 and run.lease_owner == "w2"
    assert list(Checkpoint.objects.filter(run=run).values_list("rev", flat=True)) == [1, 2]
    committed = JournalEntry.objects.filter(stream=journal.run_stream(run.run_id))
    assert [e.payload["rev"] for e in committed.filter(type="step_committed")] == [1, 2]
    verified(run)


def test_unwatched_a_stale_commit_is_refused_and_a_moved_head_chained_after(
    tenant_a: Tenant, ticking: Graph
) -> None:
    """As a worker runs, nobody capturing its statements (the other tests here count them),
    the trigger's refusals mean what they say: another executor's takeover stops this one
    with nothing written, and a note journalled meanwhile is chained after, not forked."""
    assert not connection.queries_logged and not connection.execute_wrappers
    noted = create_run(tenant_a, ticking.name, {"steps": 3}, actor="t")
    stream = journal.run_stream(noted.run_id)

    AT_STEP[2] = noting(stream, tenant_a)
    assert advance_run(noted.run_id, "w1").outcome == "completed"
    verified(noted)
    taken = create_run(tenant_a, ticking.name, {"steps": 5}, actor="t")
    AT_STEP[3] = lambda ctx: Run.objects.filter(pk=taken.pk).update(
        fence=F("fence") + 1, lease_owner="w2"
    )
    assert advance_run(taken.run_id, "w1").outcome == "stale"
    taken.refresh_from_db()
    assert taken.checkpoint_rev == 2 and taken.lease_owner == "w2"
    verified(taken)


def test_a_journal_head_that_moved_is_chained_after_not_forked(
    tenant_a: Tenant, ticking: Graph
) -> None:
    """Someone else journals on the run's stream while step 2 runs (a reviewer's note): the
    step's INSERT finds the head moved and writes nothing; the step's commit then goes by
    its transaction, from the head as it is — after the note, one chain."""
    run = create_run(tenant_a, ticking.name, {"steps": 3}, actor="t")
    stream = journal.run_stream(run.run_id)

    AT_STEP[2] = noting(stream, tenant_a)
    with CaptureQueriesContext(connection) as seen:
        assert advance_run(run.run_id, "w1").outcome == "completed"
    assert sent_through_the_view(seen.captured_queries) == 3  # the second one wrote nothing
    types = list(
        JournalEntry.objects.filter(stream=stream).order_by("seq").values_list("type", flat=True)
    )
    assert types[-4:] == ["step_committed", "note", "step_committed", "step_committed"]
    run.refresh_from_db()
    assert run.checkpoint_rev == 3 and run.status == RunStatus.COMPLETED
    verified(run)


def test_without_the_view_steps_commit_by_their_transaction(
    tenant_a: Tenant, ticking: Graph
) -> None:
    """A database without the view (another process is migrating it right now) is no
    error: each commit takes the transaction."""
    sqlitestep.uninstall(connection)
    try:
        run = create_run(tenant_a, ticking.name, {"steps": 3}, actor="t")
        with CaptureQueriesContext(connection) as seen:
            assert advance_run(run.run_id, "w1").outcome == "completed"
        assert sum('INSERT INTO "runtime_checkpoint"' in q["sql"] for q in seen) == 3
        verified(run)
    finally:
        sqlitestep.install(connection)
    assert set(sqlitestep.installed(connection)) == {sqlitestep.VIEW, sqlitestep.TRIGGER}


def wal_pages(work: Callable[[], Any]) -> tuple[int, Counter[str]]:
    """The commits `work` makes and the pages each table and index had written to the WAL
    by them (read from the frames' headers after a checkpoint emptied the log)."""
    with connection.cursor() as cur:
        cur.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert cur.fetchone()[0] == 0  # not busy: the log starts empty
        work()
        cur.execute("SELECT name, pageno FROM dbstat")
        owner = {page: name for name, page in cur.fetchall()}
        cur.execute("PRAGMA page_size")
        page_size = cur.fetchone()[0]
    data = Path(f"{connection.settings_dict['NAME']}-wal").read_bytes()
    commits, pages, at = 0, Counter[str](), 32  # the log's header, then frames
    while at + 24 <= len(data):
        page, size_after_commit = struct.unpack(">II", data[at : at + 8])
        pages[owner.get(page, "?")] += 1
        commits += size_after_commit != 0
        at += 24 + page_size
    return commits, pages


def test_a_step_that_keeps_status_and_lease_writes_no_page_of_their_indexes(
    tenant_a: Tenant, ticking: Graph
) -> None:
    """The runs list's index (by status) and the sweeper's (by lease expiry) change only
    when a commit changes those columns: a plain step writes neither — two WAL pages of a
    step's ~11 (SQLite rewrites an index entry whenever its UPDATE names the column)."""
    run = create_run(tenant_a, ticking.name, {"steps": 12}, actor="t")
    commits, pages = wal_pages(lambda: advance_run(run.run_id, "w1"))
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and commits >= 12
    # The only commits that move status or lease: the lease taken and the run ended (a
    # commit is a heartbeat only once TTL/3 has passed since the lease was taken or last
    # extended: runtime.executor run_changes — the first step's commit is not one).
    assert pages["runtime_run_list"] <= 2 and pages["runtime_run_sweep_lease"] <= 2, pages
    assert pages["runtime_run"] >= 12 and pages["runtime_checkpoint"] >= 12
    verified(run)


# A commit's run columns: none of the indexed ones, the lease moved, the run ended (status
# and lease together), the status alone, the owner alone.
SHAPES = {
    "next step only": {"next_step": "tock"},
    "lease extended": {"lease_expires_at": statements.DbNow(120)},
    "run ended": {"status": RunStatus.COMPLETED, "lease_owner": "", "lease_expires_at": None},
    "status only": {"status": RunStatus.RETRYING},
    "owner only": {"lease_owner": "w9"},
}


def _commit(tenant: Tenant, ticking: Graph, changes: dict[str, Any]) -> dict[str, Any]:
    """One step's commit with these run changes on a fresh leased run; the run's columns
    after it, and whether the view took it."""
    run = create_run(tenant, ticking.name, {"steps": 9}, actor="t")
    with journal.owning(journal.run_stream(run.run_id)):  # as an executor holds the stream
        lease, run = take_due(run.run_id, "w1", 60)
        commit = StepCommit(
            run=run,
            actor=lease.actor,
            fence=lease.fence,
            step="tick",
            next_step=changes.get("next_step", "tick"),
            status=changes.get("status", RunStatus.RUNNING),
            state={"i": 1},
            changes=changes,
            expect_status=RunStatus.RUNNING,
            event=RunEvent.STEP_COMMITTED,
        )
        with CaptureQueriesContext(connection) as seen:
            stepcommit.write(commit)
    after = Run.objects.get(pk=run.pk)
    due = after.lease_expires_at
    return {
        "through the view": not any(
            q["sql"].startswith('INSERT INTO "runtime_checkpoint"') for q in seen.captured_queries
        ),
        "columns": {
            "status": after.status,
            "next_step": after.next_step,
            "checkpoint_rev": after.checkpoint_rev,
            "lease_owner": after.lease_owner,
            "lease_left": None if due is None else round((due - db_now()).total_seconds(), -1),
        },
        # What the runs list and the sweeper find by their indexes.
        "listed": Run.objects.filter(tenant=tenant, status=after.status, pk=run.pk).exists(),
        "swept": Run.objects.filter(
            pk=run.pk,
            status__in=[RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.RETRYING],
            lease_expires_at__lt=db_now() + timedelta(seconds=300),
        ).exists(),
    }


@pytest.mark.parametrize("shape", SHAPES)
def test_a_commit_through_the_view_sets_what_the_transaction_sets(
    tenant_a: Tenant, ticking: Graph, shape: str
) -> None:
    """The trigger writes the run's status and lease (the columns the runs list and the
    sweeper index) by a statement of their own, only when a commit changes them — so a
    step that changes neither leaves those indexes unwritten. Whatever the commit sets, the
    run comes out as the four statements leave it."""
    by_view = _commit(tenant_a, ticking, SHAPES[shape])
    sqlitestep.uninstall(connection)
    try:
        by_transaction = _commit(tenant_a, ticking, SHAPES[shape])
    finally:
        sqlitestep.install(connection)
    assert by_view.pop("through the view") and not by_transaction.pop("through the view")
    assert by_view == by_transaction
    assert by_view["columns"]["checkpoint_rev"] == 1


def _rebuild_checkpoints(longer_by: int) -> None:
    """What most migrations of a table do on SQLite: rebuild it (copy, drop, rename)."""
    old = Checkpoint._meta.get_field("created_by")
    assert isinstance(old, models.CharField) and old.max_length is not None
    new = models.CharField(max_length=old.max_length + longer_by)
    new.set_attributes_from_name("created_by")
    new.model = Checkpoint
    before, after = (old, new) if longer_by > 0 else (new, old)
    with connection.schema_editor() as editor:
        editor.alter_field(Checkpoint, before, after)


def test_a_migration_that_rebuilds_a_table_is_not_stopped_by_the_view() -> None:
    """A trigger that names a table stops SQLite's rebuild of that table halfway ("no such
    table"), so `migrate` drops the view first and makes it again after (runtime.apps)."""
    with pytest.raises(OperationalError, match="no such table"):
        _rebuild_checkpoints(1)  # the trap, outside `migrate`: the view is in place
    emit_pre_migrate_signal(verbosity=0, interactive=False, db=connection.alias)
    assert sqlitestep.installed(connection) == {}
    _rebuild_checkpoints(1)
    _rebuild_checkpoints(-1)
    emit_post_migrate_signal(verbosity=0, interactive=False, db=connection.alias)
    assert set(sqlitestep.installed(connection)) == {sqlitestep.VIEW, sqlitestep.TRIGGER}
