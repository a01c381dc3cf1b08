"""The durable run engine, in-process: steps, waits, failures, versions, storage, sweeper."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from audit.journal import run_stream
from audit.verification import verify_stream
from runtime.artifacts import resolve
from runtime.errors import (
    AlreadyCompleted,
    InvalidParams,
    NotWaitingInput,
    RunFinished,
    UnknownGraph,
    VersionConflict,
)
from runtime.executor import advance_run, backoff_seconds
from runtime.graphs import registry
from runtime.lifecycle import cancel_run, create_run, provide_input, resume_run
from runtime.models import (
    Action,
    ActionStatus,
    Artifact,
    Checkpoint,
    RecordedCall,
    Run,
    RunStatus,
    Tenant,
)
from runtime.sweeper import sweep_once
from tests.graphs import evolving, flaky
from tests.runtime.helpers import events, expire_lease, make_due, payloads


def test_chain_checkpoints_every_step_and_completes(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 5}, actor="user:alice")
    result = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert result.outcome == "completed" and result.steps == 5
    assert run.status == RunStatus.COMPLETED and run.checkpoint_rev == 5
    revs = list(Checkpoint.objects.filter(run=run).values_list("rev", "step", "fence"))
    assert revs == [(1, "tick", 1), (2, "tick", 1), (3, "tick", 1), (4, "tick", 1), (5, "tick", 1)]
    last = Checkpoint.objects.get(run=run, rev=5)
    state = resolve(tenant_a.pk, last.state)
    assert state["i"] == 5 and state["answers"] == [f"thought {i}" for i in range(1, 6)]
    assert RecordedCall.objects.filter(run=run).count() == 5
    assert run.lease_owner == "" and run.lease_expires_at is None
    assert verify_stream(run_stream(run.run_id)) is None


def test_a_run_past_its_slice_gives_the_worker_up_and_rings_itself_again(
    tenant_a: Tenant, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    """HOLDPOINT_SLICE_SECONDS: a run that has used its slice stops after the step it is in
    (committed), gives its lease up as `queued` and rings its doorbell — on django-q2's real
    ORM broker — so other runs get the worker; the next execution goes on from the next
    step, no step done twice."""
    from django_q.models import OrmQ

    settings.HOLDPOINT_SLICE_SECONDS = 1e-6  # spent by the end of any step
    run = create_run(tenant_a, "chain", {"steps": 3}, actor="user:alice")
    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        result = advance_run(run.run_id, "w1")
    assert (result.outcome, result.steps) == ("yielded", 1)
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED and run.checkpoint_rev == 1
    assert run.lease_owner == "" and run.lease_expires_at is None
    assert payloads(run, "lease_released")[-1] == {"fence": 1, "status": "queued"}
    rung = [(q.task["func"], tuple(q.task["args"])) for q in OrmQ.objects.all()]
    assert rung == [("runtime.tasks.advance", (str(run.run_id),))]

    settings.HOLDPOINT_SLICE_SECONDS = 60
    result = advance_run(run.run_id, "w2")
    assert (result.outcome, result.steps) == ("completed", 2)
    revs = list(Checkpoint.objects.filter(run=run).order_by("rev").values_list("rev", "fence"))
    assert revs == [(1, 1), (2, 3), (3, 3)]  # the release moved the fence on, the take again
    assert verify_stream(run_stream(run.run_id)) is None


def test_unknown_graph_and_bad_goal_are_refused(tenant_a: Tenant) -> None:
    with pytest.raises(UnknownGraph):
        create_run(tenant_a, "no-such-graph", {}, actor="t")
    with pytest.raises(UnknownGraph):
        create_run(tenant_a, "chain", {}, actor="t", graph_version="99")
    with pytest.raises(InvalidParams):
        create_run(tenant_a, "chain", {"x": float("nan")}, actor="t")
    with pytest.raises(InvalidParams):
        create_run(tenant_a, "chain", {"x": "nul\x00"}, actor="t")
    assert Run.objects.count() == 0


def test_re_executed_step_reuses_recorded_calls(tenant_a: Tenant) -> None:
    """A step that crashed after its paid call (not committed) re-runs without paying again."""
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    from runtime.executor import Executor
    from runtime.leases import take_lease

    first = Executor(take_lease(run.run_id, "w1", ttl=30))
    first.load()
    ctx = first.context("tick")
    ctx.model("think", lambda: "thought 1", key="model:think@tick@0")  # paid, then "crash"
    expire_lease(run)
    second = Executor(take_lease(run.run_id, "w2", ttl=30))
    result = second.execute(slice_seconds=60)
    assert result.outcome == "completed"
    assert second.calls_reused == 1 and second.calls_made == 1  # step 2's call only
    assert RecordedCall.objects.filter(run=run).count() == 2


def test_three_consecutive_failures_escalate_then_resume_continues(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "flaky", {"fail_times": 3}, actor="t")
    first = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert first.outcome == "retrying" and run.status == RunStatus.RETRYING
    assert run.wake_at is not None and run.consecutive_failures == 1
    assert advance_run(run.run_id, "w1").outcome == "skipped"  # not due yet

    make_due(run)
    assert advance_run(run.run_id, "w1").outcome == "retrying"
    make_due(run)
    third = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert third.outcome == "needs_attention"
    assert run.status == RunStatus.NEEDS_ATTENTION
    assert "3 consecutive failure(s) at step attempt" in run.attention_reason
    assert "tool unavailable (attempt 3)" in run.last_error
    assert advance_run(run.run_id, "w1").outcome == "skipped"  # no execution after escalation

    resume_run(run, actor="user:alice")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.attempts == 3
    assert events(run).count("step_failed") == 3 and "escalated" in events(run)


def test_backoff_grows_with_jitter_and_a_ceiling() -> None:
    for failures in range(1, 12):
        ceiling = min(flaky.retry_max, flaky.retry_base * 2 ** (failures - 1))
        samples = [backoff_seconds(flaky, failures) for _ in range(50)]
        assert all(ceiling / 2 <= s <= ceiling for s in samples)
        assert len(set(samples)) > 1


def test_waiting_for_input_then_input_with_cas(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "asker", {}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING_INPUT
    assert run.waiting_for == {"kind": "input", "prompt": "What is the ticket title?"}
    assert run.lease_owner == ""
    with pytest.raises(VersionConflict):
        provide_input(run, {"title": "late"}, expected_rev=run.checkpoint_rev - 1, actor="t")
    provide_input(run, {"title": "Fix login"}, expected_rev=run.checkpoint_rev, actor="t")
    with pytest.raises(NotWaitingInput):
        provide_input(run, {"title": "twice"}, expected_rev=run.checkpoint_rev, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    run.refresh_from_db()
    final = Checkpoint.objects.get(run=run, rev=run.checkpoint_rev)
    assert final.state == {"title": "Fix login"} and run.pending_input is None


def test_cancel_stops_the_run_and_refuses_repeats(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "asker", {}, actor="t")
    advance_run(run.run_id, "w1")
    cancel_run(run, "not needed", actor="user:alice")
    assert run.status == RunStatus.CANCELLED
    with pytest.raises(RunFinished):
        cancel_run(run, "again", actor="user:alice")
    with pytest.raises(RunFinished):
        resume_run(run, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "skipped"


def test_cancel_withdraws_a_held_action_as_a_revision_does(tenant_a: Tenant) -> None:
    """The action a cancelled run leaves unsent is withdrawn by the ledger's one writer:
    its row says when, its own journal entry says why, and its approval request closes."""
    from approvals.models import ApprovalRequest

    run = create_run(tenant_a, "proposer", {"title": "first"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    held = Action.objects.get(run=run)
    assert held.status == ActionStatus.AWAITING_APPROVAL
    cancel_run(run, "not needed", actor="user:alice")
    held_then, held = held, Action.objects.get(pk=held.pk)
    assert (held.status, held.last_error) == (ActionStatus.CANCELLED, "run cancelled")
    assert held.updated_at > held_then.updated_at
    assert payloads(run, "action_cancelled") == [
        {"action_id": str(held.action_id), "reason": "run cancelled"}
    ]
    assert payloads(run, "cancelled")[0]["withdrawn_actions"] == [str(held.action_id)]
    assert not ApprovalRequest.objects.filter(action=held, status="pending").exists()


def test_resume_of_a_completed_run_answers_already_completed(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    advance_run(run.run_id, "w1")
    with pytest.raises(AlreadyCompleted):
        resume_run(run, actor="t")
    assert Checkpoint.objects.filter(run=run).count() == 1


def test_timer_wait_sleeps_until_due(tenant_a: Tenant) -> None:
    from runtime.graphs import Complete, Graph, Wait, register

    timed = Graph("timed", version="1")

    @timed.step(start=True)
    def nap(ctx: Any) -> Any:
        return Wait("timer", then="wake", until=timezone.now() + timedelta(hours=1))

    @timed.step
    def wake(ctx: Any) -> Any:
        return Complete(update={"woke": True})

    register(timed)
    try:
        run = create_run(tenant_a, "timed", {}, actor="t")
        assert advance_run(run.run_id, "w1").outcome == "waiting"
        assert advance_run(run.run_id, "w1").outcome == "skipped"
        make_due(run)
        assert advance_run(run.run_id, "w1").outcome == "completed"
    finally:
        registry.unregister("timed", "1")


@pytest.fixture
def evolving_v1() -> Iterator[None]:
    registry.register(evolving("1"))
    yield
    registry.unregister("evolving", "1")
    registry.unregister("evolving", "2")
    registry.migrations.pop(("evolving", "1"), None)


def test_removed_graph_version_goes_to_needs_attention(tenant_a: Tenant, evolving_v1: None) -> None:
    run = create_run(tenant_a, "evolving", {}, actor="t")
    advance_run(run.run_id, "w1")  # waits for input on v1
    registry.unregister("evolving", "1")
    registry.register(evolving("2"))
    provide_input(run, {}, expected_rev=1, actor="t")
    result = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert result.outcome == "needs_attention"
    assert run.status == RunStatus.NEEDS_ATTENTION
    assert "version 1 is not registered" in run.attention_reason
    assert run.graph_version == "1"  # nothing reinterpreted silently
    assert "incompatible_version" in events(run)


def test_registered_migration_resumes_and_is_journaled(tenant_a: Tenant, evolving_v1: None) -> None:
    run = create_run(tenant_a, "evolving", {}, actor="t")
    advance_run(run.run_id, "w1")
    registry.unregister("evolving", "1")
    registry.register(evolving("2"))
    provide_input(run, {}, expected_rev=1, actor="t")
    advance_run(run.run_id, "w1")  # escalates: no migration yet
    registry.register_migration("evolving", "1", "2", lambda s: {**s, "shape": "2"})
    resume_run(run, actor="user:alice")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    run.refresh_from_db()
    assert run.graph_version == "2"
    migrated = payloads(run, "migrated")
    assert len(migrated) == 1
    assert migrated[0]["from_version"] == "1" and migrated[0]["to_version"] == "2"
    assert migrated[0]["before_digest"] != migrated[0]["after_digest"]
    final = resolve(tenant_a.pk, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)
    assert final["finished_on"] == "2" and final["seen"]["shape"] == "2"


def _stored_bytes(run: Run) -> int:
    checkpoints = sum(
        len(str(c)) for c in Checkpoint.objects.filter(run=run).values_list("state", flat=True)
    )
    return checkpoints + sum(
        Artifact.objects.filter(tenant=run.tenant).values_list("size", flat=True)
    )


def test_state_growing_by_1kb_a_step_costs_linear_storage(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    small = create_run(tenant_a, "grower", {"steps": 50}, actor="t")
    big = create_run(tenant_b, "grower", {"steps": 200}, actor="t")
    advance_run(small.run_id, "w1")
    advance_run(big.run_id, "w1")
    final_state = 200 * 1003
    big_bytes, small_bytes = _stored_bytes(big), _stored_bytes(small)
    # O(n): 4x the steps costs about 4x the bytes (O(n²) would be 16x), and a small multiple
    # of the final state rather than LangGraph's ~100x.
    assert big_bytes / small_bytes < 6
    assert big_bytes < 4 * final_state
    state = resolve(tenant_b.pk, Checkpoint.objects.get(run=big, rev=200).state)
    assert len(state["notes"]) == 200 and state["notes"][199].endswith("199")


def test_sweeper_rings_due_runs_boundedly_per_tenant(tenant_a: Tenant, tenant_b: Tenant) -> None:
    from runtime.leases import take_lease

    a_runs = [create_run(tenant_a, "chain", {"steps": 2}, actor="t") for _ in range(5)]
    b_run = create_run(tenant_b, "chain", {"steps": 2}, actor="t")
    for run in a_runs[:2]:
        take_lease(run.run_id, "dead-worker", ttl=30)  # live lease: not due
    expire_lease(a_runs[0])  # the dead worker's lease ran out: due again
    rung: list[str] = []
    result = sweep_once(batch=10, per_tenant=2, ring=rung.append)
    assert result.due == 5  # 4 in A (one still leased) + 1 in B
    assert len(rung) == 3 and str(b_run.run_id) in rung  # A bounded to 2, B not starved
    assert str(a_runs[1].run_id) not in rung


def test_sweeper_finds_expired_lease_and_worker_finishes(tenant_a: Tenant) -> None:
    from runtime.leases import take_lease

    run = create_run(tenant_a, "chain", {"steps": 3}, actor="t")
    take_lease(run.run_id, "crashed", ttl=30)
    rung: list[str] = []
    sweep_once(ring=rung.append)
    assert rung == []
    expire_lease(run)
    sweep_once(ring=rung.append)
    assert rung == [str(run.run_id)]
    assert advance_run(rung[0], "w2").outcome == "completed"


def test_sqlite_or_postgres_clock_is_used_for_leases(tenant_a: Tenant) -> None:
    """The lease expiry is computed by the database (`now() + ttl`), not by Python.

    Python's clock is moved years away (time-machine moves Python's clock, never the
    database's): an expiry computed from Python's time would land near 2001, the database's
    lands between its own `now() + ttl` read just before and just after.
    """
    import time_machine
    from django.db.models.functions import Now

    from runtime.leases import take_lease

    run = create_run(tenant_a, "chain", {"steps": 1}, actor="t")

    def db_now() -> Any:
        return Run.objects.filter(pk=run.pk).annotate(now=Now()).values_list("now", flat=True)[0]

    with time_machine.travel("2001-01-01 00:00:00+00:00", tick=False):
        import datetime as dt

        assert dt.datetime.now(dt.UTC).year == 2001  # Python's clock moved
        before = db_now()
        lease = take_lease(run.run_id, "w1", ttl=30)
        after = db_now()
    assert before.year > 2001  # the database's did not
    ttl = timedelta(seconds=30)
    assert before + ttl <= lease.expires_at <= after + ttl


def test_external_runs_are_never_picked_up_by_workers(tenant_a: Tenant) -> None:
    """A run an agent executes through the API is its own: no worker, no sweeper doorbell."""
    from runtime.leases import take_lease

    run = create_run(tenant_a, "chain", {"steps": 2}, actor="agent:x", external=True)
    assert advance_run(run.run_id, "w1").outcome == "skipped"
    rung: list[str] = []
    sweep_once(ring=rung.append)
    assert rung == []
    lease = take_lease(run.run_id, "agent-loop", ttl=30, runnable_only=False)
    run.refresh_from_db()
    assert lease.fence == 1 and run.status == RunStatus.RUNNING and run.external
