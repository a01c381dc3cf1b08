"""An approval that lapses before its action is sent follows the policy's expiry setting.

Under `reject` expiry ends the action: a request nobody decided in time is rejected at expiry
(`approvals.expiry`), and so is an approved action still unsent when its approval's window
passed — before, the dispatch re-check asked again whatever the policy said, so a tenant that
chose "Reject" got a fresh request (and, approved again, the late send it meant to rule out).
The re-request policy still asks again, carrying the count (test_lapsed_approval_words).
Every way of waiting learns it: a hosted step gets the rejection and goes on without the
action, an external executor's dispatch is 409 `approval_expired` and the action `cancelled`,
the MCP gateway answers REJECTED, the run page says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from html import unescape
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, OnExpiry
from gateway import calls
from runtime.artifacts import resolve as load_state
from runtime.executor import advance_run
from runtime.models import Action, ActionStatus, Checkpoint, Run, RunStatus, Tenant
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
from tests.httpservers import answer_with
from tests.tooldefs import define_tickets

A = ApprovalStatus
S = ActionStatus


def _lapse(request_id: Any) -> None:
    """The approved request's window has passed (the data moves, not the database clock)."""
    lapsed = timezone.now() - timedelta(minutes=3)
    moved = ApprovalRequest.objects.filter(pk=request_id, status=A.APPROVED).update(
        decided_at=lapsed - timedelta(hours=1), expires_at=lapsed
    )
    assert moved == 1


def _approved_then_lapsed(client: Any, reviewer: Persona) -> tuple[int, dict[str, Any]]:
    """An external executor's held action, approved, whose approval then lapsed unsent:
    the lease's fence and the action as the API showed it."""
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = ok(prepare(client, run_id, fence), 201)
    request = ApprovalRequest.objects.get(action_id=action["action_id"])
    decide(request.id, reviewer.user, "approve", request.action_hash, reason="fine")
    _lapse(request.pk)
    return fence, action


def _text(html: str) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


@pytest.mark.django_db
def test_a_hosted_step_gets_the_rejection_when_its_approval_lapsed_under_reject(
    held: Any, reviewer_a: Persona, client: Client
) -> None:
    run, request, box = held
    ApprovalPolicy.objects.filter(pk=request.policy_id).update(on_expiry=OnExpiry.REJECT)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="looks right")
    _lapse(request.pk)

    assert advance_run(run.run_id, "w1").outcome == "completed"  # went on without it

    action = Action.objects.get(run=run)
    request.refresh_from_db()
    run.refresh_from_db()
    assert box.tasks() == []  # never sent
    assert action.status == S.CANCELLED
    assert action.last_error.startswith("rejected at expiry: ")
    assert "before it was sent" in action.last_error
    assert request.status == A.SUPERSEDED and "rejected at expiry" in request.closed_reason
    assert not ApprovalRequest.objects.filter(run=run, status=A.PENDING).exists()  # not re-asked
    state = load_state(run.tenant_id, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)
    assert "rejected at expiry" in state["review_task"]["rejected"]
    client.force_login(reviewer_a.user)
    page = _text(client.get(reverse("run", args=[run.run_id])).content.decode())
    assert "rejected at expiry" in page


@pytest.mark.django_db
def test_an_external_executors_dispatch_after_a_lapse_under_reject_cancels_the_action(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    policy = grant_policy(agent_a.tenant)
    ApprovalPolicy.objects.filter(pk=policy.pk).update(on_expiry=OnExpiry.REJECT)
    client = agent_a.api()
    fence, action = _approved_then_lapsed(client, reviewer_a)

    url = f"actions/{action['action_id']}/dispatch/"
    refused = problem(post(client, url, {"fence": fence}), 409, "approval_expired")

    assert "rejected at expiry" in refused["detail"]
    shown = ok(get(client, f"actions/{action['action_id']}/"))
    assert shown["status"] == "cancelled" and "rejected at expiry" in shown["last_error"]
    problem(post(client, url, {"fence": fence}), 409, "action_cancelled")  # final
    assert ok(get(session(reviewer_a.user), "approvals/?status=pending"))["results"] == []
    assert Run.objects.get(pk=action["run_id"]).status != RunStatus.WAITING_APPROVAL


@pytest.mark.django_db
def test_an_external_executors_dispatch_after_a_lapse_under_rerequest_asks_again(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)  # the default: re-request once
    client = agent_a.api()
    fence, action = _approved_then_lapsed(client, reviewer_a)

    url = f"actions/{action['action_id']}/dispatch/"
    problem(post(client, url, {"fence": fence}), 409, "approval_expired")

    shown = ok(get(client, f"actions/{action['action_id']}/"))
    assert shown["status"] == "awaiting_approval"
    assert ApprovalRequest.objects.filter(action_id=action["action_id"], status=A.PENDING).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("on_expiry", [OnExpiry.REJECT, OnExpiry.REREQUEST])
def test_an_mcp_call_whose_approval_lapsed_gets_the_policys_answer(
    serve: Callable[..., Any],
    tenant_a: Tenant,
    agent_a: Persona,
    reviewer_a: Persona,
    on_expiry: str,
) -> None:
    """Before, the gateway let the dispatch's ApprovalExpired escape the call."""
    from tests.approvals.conftest import reviewed_by_group

    service = serve(answer_with(201, b'{"id": "T-1"}'))
    define_tickets(tenant_a, service.url, mode="key")
    policy = reviewed_by_group(tenant_a, "tickets wait", "tickets.create")
    ApprovalPolicy.objects.filter(pk=policy.pk).update(on_expiry=on_expiry)
    assert agent_a.token
    caller = calls.authenticate(f"Bearer {agent_a.token}", tenant_a.slug)
    session_id = calls.open_session(caller, {})
    call = calls.parse(caller, session_id, "tickets.create", {"title": "Printer on fire"})
    assert calls.answer(calls.drive(caller, call)).text.startswith("PENDING:")
    request = ApprovalRequest.objects.get(tenant=tenant_a, status=A.PENDING)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")
    _lapse(request.pk)

    said = calls.answer(calls.drive(caller, call))

    assert service.requests == []  # nothing was sent
    if on_expiry == OnExpiry.REJECT:
        assert said.final and said.text.startswith("REJECTED:"), said.text
        assert "rejected at expiry" in said.text
    else:
        assert said.text.startswith("PENDING:") and said.waiting, said.text
