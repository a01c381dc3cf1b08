"""Goal revisions fence old work (invariant 6), and the api-review agent end to end."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.artifacts import resolve
from runtime.errors import (
    ActionCancelled,
    InvalidTransition,
    RunFinished,
    StaleGoalRev,
    VersionConflict,
)
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Next, register, registry
from runtime.ledger import check_dispatchable
from runtime.lifecycle import create_run, revise_goal
from runtime.models import Action, ActionStatus, Checkpoint, Tenant
from runtime.outcomes import record_late_result
from tests.runtime.helpers import payloads


def _state(run: Any) -> dict[str, Any]:
    run.refresh_from_db()
    return resolve(run.tenant_id, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)


def test_revision_cancels_an_old_revision_action_that_waits(tenant_a: Tenant) -> None:
    from django.db import transaction

    run = create_run(tenant_a, "proposer", {"title": "first"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    old = Action.objects.get(run=run)
    assert (old.status, old.goal_rev) == (ActionStatus.AWAITING_APPROVAL, 1)
    fence = run.__class__.objects.get(pk=run.pk).fence

    with pytest.raises(VersionConflict):
        revise_goal(run, {"title": "second"}, expected_goal_rev=2, actor="user:alice")
    revise_goal(run, {"title": "second"}, expected_goal_rev=1, actor="user:alice")
    old.refresh_from_db()
    assert run.goal_rev == 2 and old.status == ActionStatus.CANCELLED

    # The old action is never dispatched, whoever tries.
    with pytest.raises(ActionCancelled), transaction.atomic():
        check_dispatchable(old.action_id, fence)

    # A late answer for the old revision's action, never sent, takes nothing and moves nothing
    # (only an action that may have been sent takes an answer: runtime.outcomes).
    before = run.__class__.objects.get(pk=run.pk)
    with pytest.raises(InvalidTransition), transaction.atomic():
        record_late_result(
            old,
            ActionStatus.CONFIRMED,
            "agent:x",
            fence=fence,
            outcome="confirmed",
            result={"external_id": "T-1"},
            external_id="T-1",
        )
    after = run.__class__.objects.get(pk=run.pk)
    assert (after.checkpoint_rev, after.status, after.goal_rev) == (
        before.checkpoint_rev,
        before.status,
        2,
    )
    old.refresh_from_db()
    assert old.status == ActionStatus.CANCELLED and old.result is None

    assert advance_run(run.run_id, "w1").outcome == "waiting"
    new = Action.objects.get(run=run, goal_rev=2)
    assert new.idempotency_key != old.idempotency_key and "second" in new.params
    assert new.status == ActionStatus.AWAITING_APPROVAL
    assert payloads(run, "revision_applied")[0]["to_rev"] == 2


def test_old_revision_action_cannot_be_dispatched_after_a_bump(tenant_a: Tenant) -> None:
    """An action prepared under rev 1 but not cancelled (e.g. raced) is refused as stale."""
    from django.db import transaction

    run = create_run(tenant_a, "proposer", {"title": "first"}, actor="t")
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    revise_goal(run, {"title": "second"}, expected_goal_rev=1, actor="t")
    Action.objects.filter(pk=action.pk).update(status=ActionStatus.PREPARED)  # simulate the race
    with pytest.raises(StaleGoalRev), transaction.atomic():
        check_dispatchable(action.action_id, run.fence)


def test_in_flight_step_result_of_old_revision_never_advances_the_new_one(
    tenant_a: Tenant,
) -> None:
    """The goal is revised while a step runs: its result is dropped, the step re-runs."""
    seen: list[tuple[int, str]] = []
    racing = Graph("racing", version="1")

    @racing.step(start=True)
    def work(ctx: Any) -> Any:
        seen.append((ctx.goal_rev, ctx.goal["topic"]))
        if ctx.goal_rev == 1:  # a user revises the goal while this step is in flight
            from runtime.models import Run

            revise_goal(Run.objects.get(pk=ctx.run_id), {"topic": "new"}, 1, actor="user:u")
        return Next("finish", update={"answer_for": ctx.goal["topic"]})

    @racing.step
    def finish(ctx: Any) -> Any:
        return Complete()

    register(racing)
    try:
        run = create_run(tenant_a, "racing", {"topic": "old"}, actor="t")
        assert advance_run(run.run_id, "w1").outcome == "completed"
        assert seen == [(1, "old"), (2, "new")]
        assert _state(run)["answer_for"] == "new"
        goal_revs = set(Checkpoint.objects.filter(run=run).values_list("goal_rev", flat=True))
        assert goal_revs == {2}
    finally:
        registry.unregister("racing", "1")


def test_revision_of_a_finished_run_is_refused(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    advance_run(run.run_id, "w1")
    with pytest.raises(RunFinished):
        revise_goal(run, {"steps": 2}, expected_goal_rev=1, actor="t")
