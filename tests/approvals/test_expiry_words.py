"""What reviewers are told the last expiry does is what the expirer does for that run.

At the re-request policy's last expiry the expirer asks a person to look at the run — unless
its graph hands the rejection to a client (approvals.expiry `final_expiry_needs_attention`):
an MCP session's host is answered REJECTED and the session's run goes back to `queued`.
The inbox card, the request page, its polled status line and the refusal of a late decision
all said "then the run needs attention" for an MCP call too, sending reviewers to look for a
run that never needed them.
"""

from __future__ import annotations

from datetime import timedelta
from html import unescape
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.expiry import sweep_approvals
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from approvals.policies import grant
from gateway import calls
from runtime.models import Action, Tenant
from tests.conftest import Persona
from tests.tooldefs import define_tickets

A = ApprovalStatus
GOES_ON = "then re-requested once, then rejected: the run goes on without it"
GOES_ON_AGAIN = "then it is rejected and the run goes on without it (it was already re-requested"


@pytest.fixture
def mcp_call(tenant_a: Tenant, agent_a: Persona) -> ApprovalRequest:
    """A tools/call of an MCP session held for A's reviewers (nothing is ever sent)."""
    define_tickets(tenant_a, "http://127.0.0.1:9/", mode="key")
    policy = ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tickets wait", tool="tickets.create"
    )
    grant(policy, Group.objects.get(name="acme-reviewers"))
    assert agent_a.token
    caller = calls.authenticate(f"Bearer {agent_a.token}", tenant_a.slug)
    session_id = calls.open_session(caller, {})
    call = calls.parse(caller, session_id, "tickets.create", {"title": "Printer on fire"})
    assert calls.answer(calls.drive(caller, call)).text.startswith("PENDING:")
    return ApprovalRequest.objects.get(tenant=tenant_a, status=A.PENDING)


def _words(response: Any) -> str:
    return " ".join(unescape(response.content.decode()).split())


def _expire(request: ApprovalRequest) -> ApprovalRequest:
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    sweep_approvals()
    return ApprovalRequest.objects.get(action_id=request.action_id, status=A.PENDING)


def test_an_mcp_calls_request_says_its_session_goes_on_after_the_last_expiry(
    client: Client, reviewer_a: Persona, mcp_call: ApprovalRequest
) -> None:
    assert mcp_call.shown["graph"] == "mcp-session@1"
    client.force_login(reviewer_a.user)
    inbox = _words(client.get(reverse("inbox")))
    assert GOES_ON in inbox and "needs attention" not in inbox
    page = _words(client.get(reverse("approval-page", args=[mcp_call.pk])))
    assert "if nobody decides by then, re-requested once, then rejected: the run goes on" in page
    assert "needs attention" not in page

    again = _expire(mcp_call)  # asked once more: the next expiry is the last
    inbox = _words(client.get(reverse("inbox-list")))
    assert GOES_ON_AGAIN in inbox and "needs attention" not in inbox
    status = client.get(reverse("approval-page-status", args=[again.pk]), HTTP_HX_REQUEST="true")
    assert GOES_ON_AGAIN in _words(status)

    # A reviewer who decides too late is told what happens instead.
    ApprovalRequest.objects.filter(pk=again.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    response = client.post(
        reverse("approval-page-decide", args=[again.pk]),
        {"decision": "approve", "action_hash": again.action_hash},
        follow=True,
    )
    said = [str(m) for m in response.context["messages"]]
    assert any("this request expired at" in m and GOES_ON_AGAIN in m for m in said), said
    assert Action.objects.get(pk=again.action_id).status == "awaiting_approval"
