"""Undos whose outcome is not known, and undos a worker cannot send, are settled — never stuck.

An undo (a compensation: an action no step drives) that is `sent` or `unknown` is reconciled
by its tool's contract like any other action: a replay with its key, a lookup, or a person
(`manual_review`) for a tool with neither — and also after its run finished. Before, only the
run's executor reconciled a run's actions, so the undo of a finished run stayed `sent` or
`unknown` for good: the sweeper rang only undos never sent, a person may resolve only
`manual_review`, and the retention purge kept the run for ever.

An undo whose tool only an external executor performs (`client`) is never sent by a worker:
its sender marked it `sent` and then could not call it (the tool has no request), and it
stayed `sent` for good. It waits for the run's executor while the run has one; else (the run
finished: no executor may lease it again) it goes to a person, who undoes it in the service
and says so.

A person's "not applied" on an undo of a run still going put the undo back to `prepared`,
"for its step to send" — but no step drives an undo, so nothing ever sent it. Now its sender
is rung, and it is sent again with its key.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.utils import timezone

from runtime import ledger, retention, tasks
from runtime.compensation import compensate, dispatch_standalone
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, Tenant
from runtime.sweeper import sweep_once
from runtime.tools import get_tool
from tests.conftest import Persona
from tests.httpservers import Behaviour, Server
from tests.runtime.test_compensation_paths import (
    TICKET_THEN_ASK,
    _agent_tickets,
    _lossy,
    compensated_by,
    confirmed_task,
    resolved,
    ticket_then_ask,  # noqa: F401  (a fixture: a run still going, its graph registered)
    tickets_with_a_lossy_close,
    undo_answer_lost,
)
from tests.sandbox import Sandbox

S = ActionStatus
SENDER = "runtime.tasks.dispatch_standalone"


def rings() -> list[str]:
    """The action ids whose sender is rung, in django-q2's real ORM broker."""
    from django_q.models import OrmQ

    return [q.task["args"][0] for q in OrmQ.objects.all() if q.task["func"] == SENDER]


def forget_rings() -> None:
    from django_q.models import OrmQ

    OrmQ.objects.all().delete()


def sweep() -> None:
    sweep_once(ring=lambda run_id: None)


def due(action: Action) -> None:
    """Its sender can no longer be in flight and its last attempt is long past (the data
    moved, not the clock: the database's clock decides both)."""
    past = timezone.now() - timedelta(minutes=10)
    Action.objects.filter(pk=action.pk).update(updated_at=past, in_flight_until=past)


def purged_after_retention(run_id: Any, tenant: Tenant) -> list[str]:
    Tenant.objects.filter(pk=tenant.pk).update(retention_days=30)
    aged = timezone.now() - timedelta(days=31)
    Run.objects.filter(pk=run_id).update(updated_at=aged)
    return retention.purge_tenant(Tenant.objects.get(pk=tenant.pk)).runs


# --- 1. an undo left sent or unknown is reconciled, also after its run finished -------------


def test_an_unknown_undo_of_a_finished_run_is_replayed_with_its_key_by_the_sweeper(
    tenant_a: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
    settings: Any,
) -> None:
    box = sandbox_factory("key")
    original = confirmed_task(tenant_a)
    undo = undo_answer_lost(original, box, serve, settings)  # unknown; the run is completed
    settings.HOLDPOINT_TASKS_URL = box.url  # the tracker answers again
    forget_rings()

    sweep()
    assert rings() == []  # its last attempt was just now: not due yet
    due(undo)
    sweep()
    sweep()
    assert rings() == [str(undo.action_id)]  # rung once: the first tick claimed it

    tasks.dispatch_standalone(str(undo.action_id))  # what the worker runs for that ring
    undo.refresh_from_db()
    assert undo.status == S.CONFIRMED
    closes = [r for r in box.requests() if r["path"].endswith("/close")]
    assert {r["idempotency_key"] for r in closes} == {undo.idempotency_key}  # the same key
    compensated_by(original, undo)
    assert purged_after_retention(original.run_id, tenant_a) == [str(original.run_id)]


def test_an_undo_whose_sender_died_after_its_sent_mark_is_reconciled_once_out_of_flight(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The worker marked the undo `sent` and died before its request left: the sweeper
    leaves it while the sender could still be in flight, then replays it with its key."""
    box = sandbox_factory("key")
    original = confirmed_task(tenant_a)
    undo = compensate(original, "by mistake", actor="user:ada")
    fence = Run.objects.values_list("fence", flat=True).get(pk=original.run_id)
    tool = get_tool("tasks.close", tenant_a.pk)
    ledger.mark_sent(undo, fence, 0.0, tool, "worker:standalone")  # ... and the worker died
    forget_rings()

    sweep()
    assert rings() == []  # in flight, as far as anyone can tell
    due(undo)
    sweep()
    assert rings() == [str(undo.action_id)]
    tasks.dispatch_standalone(str(undo.action_id))
    undo.refresh_from_db()
    assert undo.status == S.CONFIRMED and undo.reconcile_attempts == 1
    assert [t["status"] for t in box.tasks()] == ["closed"]
    compensated_by(original, undo)


def test_an_unknown_undo_of_a_tool_without_key_or_lookup_goes_to_a_person_who_settles_it(
    tenant_a: Tenant,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
) -> None:
    """A close that cannot deduplicate, its answer lost: nothing may replay it, so its
    sender hands it to a person at once (`manual_review`, on the Reconcile page) — before,
    it stayed `unknown` until the sweeper rang it again, up to 30 s later — who sees the
    ticket closed and says so. The sweeper has nothing left to ring for it."""
    box = sandbox_factory("key")
    tickets_with_a_lossy_close(tenant_a, box, serve, "none")
    run = create_run(tenant_a, "ticketing", {"title": "probe"}, actor="user:t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    forget_rings()
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").pk)
    assert undo.status == S.MANUAL_REVIEW and [t["status"] for t in box.tasks()] == ["closed"]
    assert "cannot deduplicate" in undo.last_error
    due(undo)
    forget_rings()
    sweep()
    assert rings() == []
    assert [r["path"].endswith("/close") for r in box.requests()].count(True) == 1  # no replay

    resolved(reviewer_a, undo, "applied", external_id=box.tasks()[0]["id"], note="closed")
    compensated_by(original, undo)
    assert purged_after_retention(run.run_id, tenant_a) == [str(run.run_id)]


# --- 2. an undo only an external executor performs ---------------------------------------


def _external_run_with_a_confirmed_client_action(
    tenant: Tenant, agent: Persona, box: Sandbox, close_mode: str = "key"
) -> tuple[Any, str, int, Action, dict[str, Any]]:
    """An external run whose executor performed agent.tickets.create itself (a task in the
    tracker) and reported it: (client, run id, fence, the action, the task). Its undo,
    agent.tickets.close, deduplicates by `close_mode`."""
    from approvals.models import ApprovalPolicy
    from runtime.tooldefs import define_many
    from tests.api import new_run, ok, post, take_lease

    close, create = _agent_tickets()
    close["dedup"] = {"mode": close_mode}
    define_many(tenant, [close, create], "user:admin")
    for tool in ("agent.tickets.create", "agent.tickets.close"):
        ApprovalPolicy.objects.create(tenant=tenant, name=tool, tool=tool, required=False)
    client = agent.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    body = {"fence": fence, "tool": "agent.tickets.create", "params": {"title": "t"}}
    created = ok(post(client, f"runs/{run_id}/actions/", {**body, "reason": "goal"}), 201)
    ok(post(client, f"actions/{created['action_id']}/dispatch/", {"fence": fence}))
    key = {"Idempotency-Key": created["idempotency_key"]}
    task = httpx.post(box.url + "/tasks", json={"title": "t"}, headers=key, timeout=10).json()
    said = {"fence": fence, "outcome": "confirmed", "external_id": task["id"]}
    ok(post(client, f"actions/{created['action_id']}/outcome/", said))
    return client, run_id, fence, Action.objects.get(pk=created["action_id"]), task


def test_a_client_tools_undo_waits_for_the_runs_executor_and_no_worker_sends_it(
    tenant_a: Tenant, agent_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The worker's ring leaves it `prepared` (nothing sent, nothing marked); the run's
    executor dispatches it, closes the task itself and reports it — the original is then
    compensated. While the executor has it `sent`, the sweeper leaves it to the executor
    (its `reconcile` says how), not to a worker that cannot call the tool."""
    from tests.api import ok, post

    box = sandbox_factory("key")
    client, run_id, fence, original, task = _external_run_with_a_confirmed_client_action(
        tenant_a, agent_a, box
    )
    undo = compensate(original, "by mistake", actor="user:ada")
    waiting = dispatch_standalone(undo.action_id)  # the worker's ring
    assert waiting.status == S.PREPARED and waiting.attempts == 0 and waiting.sent_at is None

    sent = ok(post(client, f"actions/{undo.action_id}/dispatch/", {"fence": fence}))
    assert sent["status"] == "sent"
    due(undo)
    forget_rings()
    sweep()
    assert rings() == []  # its executor's to reconcile, not a worker's
    assert dispatch_standalone(undo.action_id).status == S.SENT  # a stray ring changes nothing
    httpx.post(f"{box.url}/tasks/{task['id']}/close", timeout=10).raise_for_status()
    said = {"fence": fence, "outcome": "confirmed", "external_id": task["id"]}
    assert ok(post(client, f"actions/{undo.action_id}/outcome/", said))["status"] == "confirmed"
    compensated_by(original, undo)


def test_an_external_executors_unknown_undo_goes_to_a_person_and_the_run_goes_on(
    tenant_a: Tenant, agent_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The executor performs the undo of a tool that cannot deduplicate and does not know
    whether it happened: only a person can tell (`manual_review`), but the run it undoes for
    keeps its executor and its status — the executor's next checkpoint is accepted. Before,
    the report parked the run in `needs_reconciliation` on an action no step of it drives."""
    from runtime.models import RunStatus
    from tests.api import ok, post

    box = sandbox_factory("key")
    client, run_id, fence, original, _ = _external_run_with_a_confirmed_client_action(
        tenant_a, agent_a, box, close_mode="none"
    )
    undo = compensate(original, "by mistake", actor="user:ada")
    ok(post(client, f"actions/{undo.action_id}/dispatch/", {"fence": fence}))
    unknown = {"fence": fence, "outcome": "unknown"}
    assert ok(post(client, f"actions/{undo.action_id}/outcome/", unknown))["status"] == (
        "manual_review"
    )
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.RUNNING and run.waiting_for is None
    step = {"fence": fence, "expected_rev": 0, "state": {"n": 1}, "next_step": "more"}
    assert ok(post(client, f"runs/{run_id}/checkpoints/", step), 201)["status"] == "running"


def test_a_client_tools_undo_of_a_finished_run_goes_to_a_person_who_settles_it(
    tenant_a: Tenant,
    agent_a: Persona,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    """No executor may lease a finished run again, so nobody can send its undo: the worker's
    ring hands it to a person at once, who closes the task in the tracker and says so."""
    from tests.api import ok, post

    box = sandbox_factory("key")
    client, run_id, fence, original, task = _external_run_with_a_confirmed_client_action(
        tenant_a, agent_a, box
    )
    done = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "", "status": "completed"}
    ok(post(client, f"runs/{run_id}/checkpoints/", done), 201)
    undo = compensate(original, "by mistake", actor="user:ada")
    held = dispatch_standalone(undo.action_id)  # the worker's ring
    assert held.status == S.MANUAL_REVIEW and held.attempts == 0
    assert "external executor" in held.last_error
    assert [t["status"] for t in box.tasks()] == ["open"]

    httpx.post(f"{box.url}/tasks/{task['id']}/close", timeout=10).raise_for_status()
    resolved(reviewer_a, undo, "applied", external_id=task["id"], note="closed by hand")
    compensated_by(original, undo)
    assert purged_after_retention(run_id, tenant_a) == [run_id]


def test_not_applied_on_a_client_tools_undo_nobody_can_send_withdraws_it(
    tenant_a: Tenant,
    agent_a: Persona,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    """The person did not undo it: withdrawn (`cancelled`), the effect in place, and the undo
    may be asked for again — not put back for a send nobody can make."""
    from tests.api import ok, post

    box = sandbox_factory("key")
    client, run_id, fence, original, _task = _external_run_with_a_confirmed_client_action(
        tenant_a, agent_a, box
    )
    done = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "", "status": "completed"}
    ok(post(client, f"runs/{run_id}/checkpoints/", done), 201)
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").pk)
    assert undo.status == S.MANUAL_REVIEW
    assert resolved(reviewer_a, undo, "not_applied")["status"] == "cancelled"
    original.refresh_from_db()
    assert original.status == S.CONFIRMED
    assert compensate(original, "again", actor="user:ada").pk != undo.pk


# --- 3. a person's "not applied" on an undo of a live run --------------------------------


@pytest.mark.usefixtures("ticket_then_ask")
def test_not_applied_on_an_undo_of_a_live_run_rings_its_sender_which_sends_it_again(
    tenant_a: Tenant,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    """The undo's answers are lost until none is left to try: a person's. They say it did
    not apply (wrongly here: the tracker closed the task — the person's call): the undo is
    `prepared` and its sender rung; sent again with its key, the tracker answering now, it
    is confirmed and the original compensated. Before, it stayed `prepared` for good."""
    box = sandbox_factory("key")
    lose = tickets_with_a_lossy_close(tenant_a, box, serve, "key")
    run = create_run(tenant_a, TICKET_THEN_ASK, {"title": "probe"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    original = Action.objects.get(run=run)
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").pk)
    assert undo.status == S.UNKNOWN
    settings.HOLDPOINT_RECONCILE_ATTEMPTS = 1
    undo = dispatch_standalone(undo.action_id)
    assert undo.status == S.MANUAL_REVIEW
    due(undo)
    forget_rings()

    with django_capture_on_commit_callbacks(execute=True):
        assert resolved(reviewer_a, undo, "not_applied")["status"] == "prepared"
    assert rings() == [str(undo.action_id)]

    lose[0] = False
    tasks.dispatch_standalone(str(undo.action_id))  # what the worker runs for that ring
    undo.refresh_from_db()
    assert undo.status == S.CONFIRMED
    closes = [r for r in box.requests() if r["path"].endswith("/close")]
    assert {r["idempotency_key"] for r in closes} == {undo.idempotency_key}
    compensated_by(original, undo)
    assert Run.objects.get(pk=run.pk).status == "waiting_input"  # the run is not moved


@pytest.mark.usefixtures("ticket_then_ask")
def test_an_undo_of_a_live_run_a_lookup_proves_absent_is_sent_again_by_its_sender(
    tenant_a: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
    django_capture_on_commit_callbacks: Any,
) -> None:
    """The same for a reconciliation's proof: a close reconciled by lookup (which finds no
    task under the undo's key) goes back to `prepared` — and, the run still going, its
    sender is rung and sends it again with its key."""
    from runtime.tooldefs import define_many
    from tests.tooldefs import tickets

    box = sandbox_factory("key")
    lose = tickets_with_a_lossy_close(tenant_a, box, serve, "key")
    close = tickets(box.url, "key")[0]
    close["request"]["url"] = serve(_lossy(box, lose)).url + "/tasks/{ticket}/close"
    close["dedup"] = {"mode": "lookup"}
    close["lookup"] = {"url": f"{box.url}/tasks?key={{idempotency_key}}", "found": "$[0].id"}
    define_many(tenant_a, [close], "user:admin")
    run = create_run(tenant_a, TICKET_THEN_ASK, {"title": "probe"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    original = Action.objects.get(run=run)
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").pk)
    assert undo.status == S.UNKNOWN
    due(undo)
    forget_rings()

    lose[0] = False
    with django_capture_on_commit_callbacks(execute=True):
        assert dispatch_standalone(undo.action_id).status == S.PREPARED  # looked up: absent
    assert rings() == [str(undo.action_id)]
    tasks.dispatch_standalone(str(undo.action_id))
    undo.refresh_from_db()
    assert undo.status == S.CONFIRMED
    compensated_by(original, undo)


# --- a ring lost before the undo's first send ---------------------------------------------


def test_an_undo_whose_first_ring_was_lost_is_rung_by_the_sweeper_and_sent_once(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The ring that sends a new undo goes to the queue after its commit: a worker that
    dies between the two, or a broker that loses the message, left it `prepared` for ever
    — no step drives an undo, and the sweeper only rang one whose send had failed. Now it
    carries the sweeper's next try from the start, RESEND_HOLD on (database time): a ring
    on its way is not doubled while it waits, a lost one is rung again."""
    from django.db.models import F

    from runtime.compensation import RESEND_HOLD

    box = sandbox_factory("key")
    original = confirmed_task(tenant_a)
    undo = compensate(original, "created by mistake", actor="user:alice")
    forget_rings()  # its ring is lost (here: never sent, the test's transaction not committed)

    sweep()
    assert rings() == []  # its ring may still be on its way: not rung twice
    late = F("send_retry_at") - timedelta(seconds=RESEND_HOLD + 1)  # the data moved
    assert Action.objects.filter(pk=undo.pk, send_retry_at__isnull=False).update(send_retry_at=late)
    sweep()
    sweep()
    assert rings() == [str(undo.action_id)]  # rung once: the first tick claimed it

    tasks.dispatch_standalone(str(undo.action_id))  # what the worker runs for that ring
    tasks.dispatch_standalone(str(undo.action_id))  # a late first ring: nothing more
    undo.refresh_from_db()
    assert undo.status == S.CONFIRMED
    compensated_by(original, undo)
    closes = [r for r in box.requests() if r["path"].endswith("/close")]
    assert len(closes) == 1
    assert undo.send_failures == 0 and undo.send_failed_at is None  # not shown as failed
