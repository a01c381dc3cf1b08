"""What an action comes to when its hold point expires for the last time (the re-request
policy's second expiry): every way of waiting for it gets a final answer.

Before, the action stayed `awaiting_approval` with no open request — nothing a reviewer could
decide, nothing the expirer would look at again — so an external executor's dispatch was
409 `approval_required` for ever, the MCP gateway answered PENDING for ever, and a person
resuming a hosted run could only have it wait again.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.expiry import sweep_approvals
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from gateway import calls
from runtime.artifacts import resolve as load_state
from runtime.executor import advance_run
from runtime.lifecycle import resume_run
from runtime.models import Action, Checkpoint, Run, RunStatus, Tenant
from tests.api import (
    fresh_throttle,  # noqa: F401
    get,
    grant_policy,
    new_run,
    ok,
    post,
    prepare,
    problem,
    session,
    take_lease,
)
from tests.conftest import Persona
from tests.tooldefs import define_tickets

A = ApprovalStatus


def _state(run: Run) -> dict[str, Any]:
    run.refresh_from_db()
    return load_state(run.tenant_id, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)


def _let_the_open_request_expire(action_id: Any) -> None:
    """The open request's window has passed (the data moved, not the database's clock),
    and the sweeper runs."""
    moved = ApprovalRequest.objects.filter(action_id=action_id, status=A.PENDING).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert moved == 1
    sweep_approvals()


@pytest.mark.django_db
def test_an_external_executors_action_expired_twice_is_cancelled_not_held_for_ever(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = ok(prepare(client, run_id, fence), 201)
    _let_the_open_request_expire(action["action_id"])  # asked again, once
    _let_the_open_request_expire(action["action_id"])
    refused = problem(
        post(client, f"actions/{action['action_id']}/dispatch/", {"fence": fence}),
        409,
        "action_cancelled",
    )
    assert "cancelled" in refused["detail"]
    shown = ok(get(client, f"runs/{run_id}/actions/"))["results"][0]
    assert shown["status"] == "cancelled"
    stored = Action.objects.get(pk=action["action_id"])
    assert stored.last_error.startswith("rejected at expiry") and "expired twice" in (
        stored.last_error
    )
    reviewer = session(reviewer_a.user)
    assert ok(get(reviewer, "approvals/?status=pending"))["results"] == []
    run = ok(get(client, f"runs/{run_id}/"))
    assert run["status"] == "needs_attention" and "expired twice" in run["attention_reason"]
    assert run["waiting_for"] is None  # nothing to approve is left


@pytest.mark.django_db
def test_a_hosted_run_whose_approval_expired_twice_goes_on_without_the_action_once_resumed(
    held: Any, reviewer_a: Persona
) -> None:
    run, request, box = held
    action = Action.objects.get(run=run)
    _let_the_open_request_expire(action.pk)
    _let_the_open_request_expire(action.pk)
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_ATTENTION and "expired twice" in run.attention_reason
    resume_run(run, actor="user:alice")  # a person looked and lets it go on
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert "expired twice" in _state(run)["review_task"]["rejected"]
    assert box.tasks() == []  # never sent, never auto-approved
    assert not ApprovalRequest.objects.filter(run=run, status=A.PENDING).exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_mcp_call_whose_approval_expired_twice_gets_a_final_answer_not_pending(
    serve: Callable[..., Any], tenant_a: Tenant, agent_a: Persona
) -> None:
    from tests.httpservers import answer_with

    service = serve(answer_with(201, b'{"id": "T-1"}'))
    define_tickets(tenant_a, service.url, mode="key")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="tickets wait", tool="tickets.create")
    assert agent_a.token
    caller = calls.authenticate(f"Bearer {agent_a.token}", tenant_a.slug)
    session_id = calls.open_session(caller, {})
    call = calls.parse(caller, session_id, "tickets.create", {"title": "Printer on fire"})
    first = calls.answer(calls.drive(caller, call))
    assert first.text.startswith("PENDING:") and first.waiting
    action = Action.objects.get(tenant=tenant_a, tool="tickets.create")
    _let_the_open_request_expire(action.pk)
    assert calls.answer(calls.drive(caller, call)).text.startswith("PENDING:")  # asked again
    _let_the_open_request_expire(action.pk)
    said = calls.answer(calls.drive(caller, call))
    assert said.final and said.is_error and not said.waiting, said.text
    assert said.text.startswith("REJECTED:") and "expired twice" in said.text
    assert service.requests == []  # nothing was sent
    # The rejection is the host's answer, as a reviewer's would be: the session's run goes
    # on between calls; nobody is asked to look at it (it needed no person before either).
    run = Run.objects.get(pk=session_id)
    assert run.status == RunStatus.QUEUED and run.attention_reason == "", run.attention_reason
    assert run.waiting_for is None
    # The client has its answer; the same call again is a new action, asked for afresh.
    calls.settle_delivery(caller, call, Action.objects.get(pk=action.pk))
    retry = calls.parse(caller, session_id, "tickets.create", {"title": "Printer on fire"})
    again = calls.answer(calls.drive(caller, retry))
    assert again.text.startswith("PENDING:") and "approval" in again.text
    assert ApprovalRequest.objects.filter(tenant=tenant_a, status=A.PENDING).count() == 1


@pytest.mark.django_db
def test_expiring_a_request_that_is_gone_expires_nothing() -> None:
    """The sweep lists what is due, then expires each in its own transaction: a request gone
    meanwhile (its run purged) is nothing to expire, not an error that stops the sweep's
    batch."""
    import uuid

    from approvals.expiry import expire

    assert expire(uuid.uuid4()) == 0
