"""Compensation: a confirmed task is closed by its compensating tool, as a new action."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.compensation import compensate, dispatch_standalone
from runtime.errors import InvalidTransition
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Tenant
from tests.runtime.helpers import events
from tests.sandbox import Sandbox

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/users"],
    "create_review_task": True,
}


def test_compensation_closes_the_task_and_marks_the_original(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)

    undo = compensate(original, "created by mistake", actor="user:alice")
    assert compensate(original, "again", actor="user:alice") == undo  # once
    assert undo.tool == "tasks.close" and undo.compensates == original
    assert undo.idempotency_key != original.idempotency_key

    done = dispatch_standalone(undo.action_id)
    original.refresh_from_db()
    assert done.status == ActionStatus.CONFIRMED
    assert original.status == ActionStatus.COMPENSATED
    tasks = box.tasks()
    assert len(tasks) == 1 and tasks[0]["status"] == "closed"
    assert dispatch_standalone(undo.action_id).status == ActionStatus.CONFIRMED  # no resend
    assert "action_prepared" in events(run)


def test_only_confirmed_actions_are_compensated(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    sandbox_factory("none").faults(drop_after=1)
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.MANUAL_REVIEW
    with pytest.raises(InvalidTransition):
        compensate(action, "not proven yet", actor="user:alice")
