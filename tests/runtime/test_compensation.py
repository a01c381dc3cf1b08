"""Compensation: a confirmed task is closed by its compensating tool, as a new action."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

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


def closed_port() -> int:
    """A port nothing listens on (taken from the system, then let go)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_send_the_tracker_refused_is_kept_and_the_sweeper_sends_it_later(
    tenant_a: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    settings: Any,
) -> None:
    """The tracker is down when the compensation is sent: nothing applied, the action stays
    prepared with the failure on its row (when, why, the sweeper's next try, journalled).
    Not due yet, the sweeper leaves it; due, it rings it once (a second tick finds it
    claimed); the worker's send, the tracker back, closes the task once."""
    from django_q.models import OrmQ

    from runtime import tasks
    from runtime.compensation import RESEND_FIRST, resend_delay
    from runtime.sweeper import sweep_once

    box = sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    settings.HOLDPOINT_TASKS_URL = f"http://127.0.0.1:{closed_port()}"  # the tracker is down
    undo = compensate(original, "created by mistake", actor="user:alice")
    stuck = dispatch_standalone(undo.action_id)
    assert stuck.status == ActionStatus.PREPARED
    assert stuck.send_failure.startswith("tasks.close: connect failed")
    assert stuck.send_failures == 1 and stuck.send_failed_at is not None
    assert stuck.send_retry_at is not None
    waited = (stuck.send_retry_at - stuck.send_failed_at).total_seconds()
    assert abs(waited - RESEND_FIRST) < 1
    assert "action_send_failed" in events(run)

    # Down again: one more failure, the next try twice as far off.
    stuck = dispatch_standalone(undo.action_id)
    assert stuck.send_failures == 2 and stuck.send_retry_at is not None
    assert stuck.send_failed_at is not None
    waited = (stuck.send_retry_at - stuck.send_failed_at).total_seconds()
    assert abs(waited - resend_delay(2)) < 1 and resend_delay(2) == 2 * RESEND_FIRST
    settings.HOLDPOINT_TASKS_URL = box.url  # the tracker is back

    def rings() -> list[tuple[str, ...]]:
        return [
            tuple(q.task["args"])
            for q in OrmQ.objects.all()
            if q.task["func"] == "runtime.tasks.dispatch_standalone"
        ]

    OrmQ.objects.all().delete()
    sweep_once(ring=lambda run_id: None)
    assert rings() == []  # its back-off is not over
    # The back-off passes (database time: the row's next try is moved into the past).
    Action.objects.filter(pk=undo.pk).update(send_retry_at=timezone.now() - timedelta(seconds=1))
    sweep_once(ring=lambda run_id: None)
    sweep_once(ring=lambda run_id: None)
    assert rings() == [(str(undo.action_id),)]  # rung once: the first tick claimed it

    tasks.dispatch_standalone(str(undo.action_id))  # what the worker runs for that ring
    original.refresh_from_db()
    assert Action.objects.get(pk=undo.pk).status == ActionStatus.CONFIRMED
    assert original.status == ActionStatus.COMPENSATED
    assert [t["status"] for t in box.tasks()] == ["closed"]
    Action.objects.filter(pk=undo.pk).update(send_retry_at=timezone.now() - timedelta(seconds=1))
    OrmQ.objects.all().delete()
    sweep_once(ring=lambda run_id: None)
    assert rings() == []  # sent: the sweeper has nothing more to do with it


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
