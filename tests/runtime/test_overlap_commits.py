"""PostgreSQL: a step's commit is sent and the next step runs while it is on its way
(runtime.executor, HOLDPOINT_OVERLAP_COMMITS). What must hold: nothing of the next step
leaves the worker — no recorded call, no commit — before that answer is in; a step that ran
on a commit that did not land is dropped whole; a step's own query waits for the answer; a
step that reaches the database otherwise while the connection is busy runs again, no failure
counted for it, and the commits before it are waited for from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from psycopg import pq

from runtime.context import StepContext
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Next, Outcome, registry
from runtime.lifecycle import cancel_run, create_run
from runtime.models import Checkpoint, RecordedCall, Run, RunStatus, Tenant
from tests.runtime.helpers import payloads

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# What the steps saw and did, by run id (in this process: the executor runs in-process here).
SEEN: dict[str, list[Any]] = {}

overlap = Graph("overlap", version="1", max_failures=3, retry_base=0.05, retry_max=0.2)


def _busy() -> bool:
    """The worker's connection has a statement on its way (its answer not taken yet)."""
    raw = connection.connection
    return raw is not None and raw.pgconn.transaction_status == pq.TransactionStatus.ACTIVE


@overlap.step(start=True)
def first(ctx: StepContext) -> Outcome:
    # The run's recorded calls are read here, once: the second step's `record` then asks
    # the database nothing before it decides to call.
    ctx.record("warm", lambda: "up")
    if ctx.goal.get("cancel"):  # someone cancels the run while this step runs
        run = Run.objects.get(pk=ctx.run_id)
        done = threading.Thread(target=_cancel, args=(run,))
        done.start()
        done.join()
    return Next("second", update={"first": True})


def _cancel(run: Run) -> None:
    try:
        cancel_run(run, "changed my mind", actor="user:test")
    finally:
        connection.close()


@overlap.step()
def second(ctx: StepContext) -> Outcome:
    seen = SEEN.setdefault(str(ctx.run_id), [])
    seen.append(("busy", _busy()))
    how = ctx.goal.get("second")
    if how == "record":
        ctx.record("paid", lambda: seen.append("paid") or "answer")
    elif how == "orm":  # reaches the database itself, not through ctx
        seen.append(("runs", Run.objects.filter(pk=ctx.run_id).count()))
    elif how == "raise":
        raise RuntimeError("the tracker said no")
    return Next("third", update={"second": True})


@overlap.step()
def third(ctx: StepContext) -> Outcome:
    SEEN.setdefault(str(ctx.run_id), []).append("third")
    return Complete(update={"third": True})


looping = Graph("overlap-loop", version="1")

# A step that opens its own transaction: that cannot wait for the answer the way a query does
# (the connection refuses to leave autocommit while a statement is on its way).
own_tx = Graph("overlap-own-tx", version="1", max_failures=3, retry_base=0.05)


@own_tx.step(start=True)
def in_its_own_transaction(ctx: StepContext) -> Outcome:
    from django.db import transaction

    seen = SEEN.setdefault(str(ctx.run_id), [])
    seen.append(("busy", _busy()))
    with transaction.atomic():
        Run.objects.filter(pk=ctx.run_id).count()
    i = ctx.state.get("i", 0) + 1
    if i >= 4:
        return Complete(update={"i": i})
    return Next("in_its_own_transaction", update={"i": i})


# A step's clock (SIGALRM) may go off while the step waits for the commit before it.
slow = Graph("overlap-slow", version="1", step_timeout=1, max_failures=3, retry_base=0.05)
HELD = threading.Event()


@slow.step(start=True)
def locked_out(ctx: StepContext) -> Outcome:
    # Another transaction holds the run's row for 2.5 s: this step's commit waits for it.
    HELD.clear()
    threading.Thread(target=_hold_run_row, args=(ctx.run_id, 2.5), daemon=True).start()
    HELD.wait(10)
    return Next("after")


def _hold_run_row(run_id: Any, seconds: float) -> None:
    import time

    from django.db import transaction

    try:
        with transaction.atomic():
            Run.objects.select_for_update().get(pk=run_id)
            HELD.set()
            time.sleep(seconds)
    finally:
        connection.close()


@slow.step()
def after(ctx: StepContext) -> Outcome:
    seen = SEEN.setdefault(str(ctx.run_id), [])
    seen.append("after")
    ctx.record("paid", lambda: seen.append("paid") or "answer")  # waits for the commit first
    return Complete()


@looping.step(start=True)
def count(ctx: StepContext) -> Outcome:
    i = ctx.state.get("i", 0) + 1
    if i >= ctx.goal["steps"]:
        return Complete(update={"i": i})
    return Next("count", update={"i": i})


@pytest.fixture(autouse=True)
def graph() -> Iterator[None]:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's commit is in the worker's own process: nothing is on its way")
    registry.register(overlap)
    registry.register(looping)
    registry.register(slow)
    registry.register(own_tx)
    try:
        yield
    finally:
        registry.unregister("overlap-own-tx", "1")
        registry.unregister("overlap", "1")
        registry.unregister("overlap-loop", "1")
        registry.unregister("overlap-slow", "1")


def _run(tenant: Tenant, **goal: Any) -> tuple[Run, Any]:
    run = create_run(tenant, "overlap", goal, actor="user:test")
    result = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    return run, result


def test_the_next_step_runs_while_the_commit_before_it_is_on_its_way(tenant_a: Tenant) -> None:
    run, result = _run(tenant_a)
    assert result.outcome == "completed" and result.steps == 3
    assert SEEN[str(run.run_id)] == [("busy", True), "third"]
    assert run.checkpoint_rev == 3 and Checkpoint.objects.filter(run=run).count() == 3
    with override_settings(HOLDPOINT_OVERLAP_COMMITS=False):
        off, result = _run(tenant_a)
    assert result.outcome == "completed" and SEEN[str(off.run_id)] == [("busy", False), "third"]


@pytest.mark.parametrize("second", ["pure", "record", "orm"])
def test_a_step_that_ran_on_a_commit_that_did_not_land_is_dropped(
    tenant_a: Tenant, second: str
) -> None:
    """The run is cancelled while its first step runs: that step's commit is refused when it
    arrives. The second step ran meanwhile; its paid call is never made and nothing of it
    is committed."""
    run, result = _run(tenant_a, cancel=True, second=second)
    assert result.outcome == "stopped"
    assert run.status == RunStatus.CANCELLED and run.checkpoint_rev == 0
    assert not Checkpoint.objects.filter(run=run).exists()
    seen = SEEN[str(run.run_id)]
    assert seen[0] == ("busy", True)  # it did run, on the commit still on its way
    assert "paid" not in seen and "third" not in seen
    assert not [s for s in seen if s[0] == "runs"]  # its own query did not run either
    assert list(RecordedCall.objects.filter(run=run).values_list("key", flat=True)) == ["warm"]
    assert payloads(run, "step_committed") == []


def test_a_step_that_queries_the_database_itself_runs_once_its_query_after_the_commit(
    tenant_a: Tenant,
) -> None:
    run, result = _run(tenant_a, second="orm")
    assert result.outcome == "completed" and run.status == RunStatus.COMPLETED
    seen = SEEN[str(run.run_id)]
    # It began with the commit before it on its way; its query took that answer first, read
    # the database, and its outcome is the one committed. It ran once.
    assert seen == [("busy", True), ("runs", 1), "third"]
    assert run.consecutive_failures == 0 and run.attempts == 0
    assert payloads(run, "step_failed") == []
    assert [p["step"] for p in payloads(run, "step_committed")] == ["first", "second", "third"]


def _server_commits() -> int:
    """Transactions this database's server committed (this backend's counts flushed first)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def _commits_for(tenant: Tenant, steps: int) -> int:
    """Server transactions around runs of `steps` steps, the fewest of three: another
    backend's counts (a closed connection's, flushed as it exits) can only add to them."""
    counts = []
    for _ in range(3):
        run = create_run(tenant, "overlap-loop", {"steps": steps}, actor="user:test")
        before = _server_commits()
        result = advance_run(run.run_id, "w1")
        after = _server_commits()
        assert result.outcome == "completed" and result.steps == steps
        counts.append(after - before - 2)  # the two reads of the counters are transactions
    return min(counts)


def test_a_step_sent_on_its_way_is_still_one_server_transaction(tenant_a: Tenant) -> None:
    """The statement that goes out while the next step runs is the step's one statement: the
    server commits one transaction per step, as when it is waited for (counted by the server,
    marginally: runs of 30 steps against runs of 10, so the lease's and the run's own
    statements cancel out)."""
    assert (_commits_for(tenant_a, 30) - _commits_for(tenant_a, 10)) / 20 == 1.0
    with override_settings(HOLDPOINT_OVERLAP_COMMITS=False):
        assert (_commits_for(tenant_a, 30) - _commits_for(tenant_a, 10)) / 20 == 1.0


def test_a_step_whose_clock_runs_out_while_it_waits_for_the_commit_runs_again(
    tenant_a: Tenant,
) -> None:
    """The first step's commit waits 2.5 s for a row lock; the second step (1 s allowed) waits
    for that commit before its paid call and its clock goes off meanwhile. The commit is still
    on its way: its answer is taken, and the step runs again on it — a step that ran before
    its commit landed does not count as failed. The connection is whole afterwards."""
    run = create_run(tenant_a, "overlap-slow", {}, actor="user:test")
    result = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert result.outcome == "completed" and run.status == RunStatus.COMPLETED
    assert SEEN[str(run.run_id)] == ["after", "after", "paid"]
    assert run.consecutive_failures == 0 and payloads(run, "step_failed") == []
    assert list(RecordedCall.objects.filter(run=run).values_list("key", flat=True)) == ["paid"]
    assert Run.objects.filter(pk=run.pk).count() == 1  # the worker's connection answers


@pytest.mark.parametrize("watched", [False, True])
def test_a_failing_step_runs_again_only_if_it_ran_before_the_commit_landed(
    tenant_a: Tenant, watched: bool
) -> None:
    """A step that raises while the commit before it is on its way runs again once it has
    landed, and only then counts. With the statements watched (Django's query log: DEBUG, a
    test capturing queries) the commit is not split — it is answered before the next step
    runs — so the step runs once per attempt, its failure counted at once."""
    run = create_run(tenant_a, "overlap", {"second": "raise"}, actor="user:test")
    if watched:
        with CaptureQueriesContext(connection):
            result = advance_run(run.run_id, "w1")
    else:
        result = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert result.outcome == "retrying" and run.consecutive_failures == 1
    assert "RuntimeError: the tracker said no" in run.last_error
    expected = [("busy", False)] if watched else [("busy", True), ("busy", False)]
    assert SEEN[str(run.run_id)] == expected


def test_a_step_that_opens_its_own_transaction_runs_twice_once_then_after_its_commit(
    tenant_a: Tenant,
) -> None:
    """Four visits of a step that opens a transaction of its own. The first runs on nothing in
    flight; the second begins with the first's commit on its way, cannot open its transaction,
    and runs again once that commit landed (no failure counted). From then on the commit
    before it is waited for: the third and fourth visits run once each, on an idle
    connection."""
    run = create_run(tenant_a, "overlap-own-tx", {}, actor="user:test")
    result = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert result.outcome == "completed" and run.status == RunStatus.COMPLETED
    assert run.checkpoint_rev == 4
    busy = [b for _, b in SEEN[str(run.run_id)]]
    assert busy == [False, True, False, False, False]
    assert run.consecutive_failures == 0 and payloads(run, "step_failed") == []
