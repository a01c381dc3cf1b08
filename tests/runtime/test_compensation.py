"""Compensation: a confirmed task is closed by its compensating tool, as a new action."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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


def test_asking_again_sends_a_compensation_its_first_send_could_not(
    tenant_a: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    django_capture_on_commit_callbacks: Any,
) -> None:
    """The undo tool's circuit was open when the compensation was first sent: the action
    stayed `prepared` (certainly not applied), and nothing ever rang it again — asking again
    answered the same, unsent compensation. Now asking again rings its dispatcher (on
    django-q2's real ORM broker); the worker's task sends it once."""
    from django_q.models import OrmQ

    from runtime import tasks
    from runtime.tools import get_tool

    box = sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    breaker = get_tool("tasks.close", tenant_a.pk).breaker
    try:
        for _ in range(breaker.threshold):
            breaker.record(False)  # the circuit opens (this process's breaker)
        undo = compensate(original, "created by mistake", actor="user:alice")
        assert dispatch_standalone(undo.action_id).status == ActionStatus.PREPARED  # not sent
    finally:
        breaker.record(True)  # closed again, whatever happened: other tests share it
    assert box.tasks()[0]["status"] != "closed"

    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        assert compensate(original, "again", actor="user:alice") == undo
    rung = [(q.task["func"], tuple(q.task["args"])) for q in OrmQ.objects.all()]
    assert rung == [("runtime.tasks.dispatch_standalone", (str(undo.action_id),))]

    tasks.dispatch_standalone(str(undo.action_id))  # what the worker runs for that ring
    original.refresh_from_db()
    assert Action.objects.get(pk=undo.pk).status == ActionStatus.CONFIRMED
    assert original.status == ActionStatus.COMPENSATED
    assert [t["status"] for t in box.tasks()] == ["closed"]


def test_the_undo_tool_gets_the_reason_the_compensation_keeps(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The action keeps up to REASON_MAX characters of the reason; the undo tool got only
    the first 2,000, whatever its schema accepts. Now it gets all of it, or as much as its
    schema's `maxLength` allows (tasks.close: 2,000)."""
    from runtime.compensation import REASON_MAX
    from runtime.tooldefs import define_many
    from runtime.tools import tracker_definitions

    box = sandbox_factory("key")
    long = "why " * (REASON_MAX // 4)
    assert len(long) == REASON_MAX

    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    undo = compensate(Action.objects.get(run=run), long, actor="user:alice")
    assert undo.reason == long
    assert json.loads(undo.params)["reason"] == long[:2000]  # tasks.close's maxLength

    # The tenant's own tasks.close, whose reason is unbounded: it gets the reason whole.
    close = next(d for d in tracker_definitions(box.url, "key") if d["name"] == "tasks.close")
    del close["schema"]["properties"]["reason"]["maxLength"]
    define_many(tenant_a, [close], "user:admin")
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    undo = compensate(Action.objects.get(run=run), long, actor="user:alice")
    assert undo.reason == long and json.loads(undo.params)["reason"] == long
