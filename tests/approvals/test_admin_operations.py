"""Admin operations on runs: resume, cancel, reassign or re-notify a request, redeliver a
webhook. Each calls the domain's writer, is journalled once, and a tenant admin's selection
never reaches another tenant's row (the changelist's queryset is scoped; a forged id in the
POST selects nothing).

What is queued is read from the real ORM broker's queue (django-q2's OrmQ rows).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django_q.models import OrmQ

from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    ApprovalStatus,
    TenantWebhook,
    WebhookDelivery,
)
from approvals.notify import deliver, send_webhook
from approvals.requests import reassign_request
from audit.models import JournalEntry
from runtime.errors import InvalidParams, NotPermitted
from runtime.lifecycle import create_run
from runtime.models import Run, RunStatus, Tenant
from tests.api import grant_policy, new_run, ok, prepare, take_lease
from tests.approvals import test_admin, test_notify
from tests.approvals.conftest import GOAL
from tests.approvals.test_notify import Receiver
from tests.conftest import Persona

# Fixtures of the neighbouring admin and notification tests: tenant B's objects, a real
# HTTP receiver on loopback and the setting that lets webhooks reach it.
foreign = test_admin.foreign
receiver = test_notify.receiver
local_hooks = test_notify.local_hooks

RUNS = "/admin/runtime/run/"
REQUESTS = "/admin/approvals/approvalrequest/"
DELIVERIES = "/admin/approvals/webhookdelivery/"


def act(
    client: Client, url: str, action: str, *pks: Any, follow: bool = False, **extra: Any
) -> Any:
    """The changelist's action form as the browser posts it."""
    data = {"action": action, "_selected_action": [str(p) for p in pks], **extra}
    return client.post(url, data, follow=follow)


def new_entries(since: int) -> list[tuple[str, str, str]]:
    rows = JournalEntry.objects.filter(id__gt=since).order_by("id")
    return [(row.stream, row.type, row.actor) for row in rows]


def last_entry() -> int:
    return JournalEntry.objects.order_by("-id").values_list("id", flat=True).first() or 0


def queued() -> list[tuple[str, tuple[Any, ...]]]:
    return [(str(q.task["func"]), tuple(q.task["args"])) for q in OrmQ.objects.order_by("id")]


@pytest.fixture
def ada(client: Client, admin_a: Persona) -> Client:
    client.force_login(admin_a.user)
    return client


def test_tenant_admin_lists_only_own_runs(ada: Client, held: Any, foreign: dict[str, Any]) -> None:
    run, _, _ = held
    page = ada.get(RUNS)
    assert page.status_code == 200
    assert str(run.run_id).encode() in page.content
    assert str(foreign["request"].run_id).encode() not in page.content
    response = ada.get(f"{RUNS}{foreign['request'].run_id}/change/")
    assert response.status_code == 302 and response["Location"] == "/admin/"


def test_resume_a_run_that_needs_attention(
    ada: Client, tenant_a: Tenant, foreign: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
    # As the executor leaves a run after repeated failures (the data moved, not the code).
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.NEEDS_ATTENTION, attention_reason="failed 5 times"
    )
    foreign_run = Run.objects.get(pk=foreign["request"].run_id)
    since = last_entry()
    with django_capture_on_commit_callbacks(execute=True):
        response = act(ada, RUNS, "resume_selected", run.pk, foreign_run.pk)
    assert response.status_code == 302
    run.refresh_from_db()
    assert (run.status, run.attention_reason) == (RunStatus.QUEUED, "")
    assert new_entries(since) == [(f"run:{run.pk}", "resumed", "user:ada")]
    foreign_run.refresh_from_db()
    assert foreign_run.status == RunStatus.WAITING_APPROVAL


def test_resume_says_when_there_is_nothing_to_resume(
    ada: Client, held: Any, django_capture_on_commit_callbacks: Any
) -> None:
    run, _, _ = held
    since = last_entry()
    response = act(ada, RUNS, "resume_selected", run.pk, follow=True)
    messages = [str(m) for m in response.context["messages"]]
    assert any("nothing to resume" in m for m in messages), messages
    assert new_entries(since) == []


def test_cancel_a_run(ada: Client, held: Any, foreign: dict[str, Any]) -> None:
    run, request, _ = held
    foreign_run = Run.objects.get(pk=foreign["request"].run_id)
    since = last_entry()
    response = act(ada, RUNS, "cancel_selected", run.pk, foreign_run.pk)
    assert response.status_code == 302
    run.refresh_from_db()
    request.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert request.status == ApprovalStatus.CANCELLED  # its open request was withdrawn
    # cancel_run's own entries: the action it withdrew, the request it closed (and its
    # change in the tenant's approvals), the cancellation (once).
    assert new_entries(since) == [
        (f"run:{run.pk}", "action_cancelled", "user:ada"),
        (f"run:{run.pk}", "approval_closed", "user:ada"),
        (f"tenant:{run.tenant_id}", "approval_status", "user:ada"),
        (f"run:{run.pk}", "cancelled", "user:ada"),
    ]
    foreign_run.refresh_from_db()
    assert foreign_run.status == RunStatus.WAITING_APPROVAL


def test_renotify_a_pending_request(
    ada: Client,
    held: Any,
    foreign: dict[str, Any],
    django_capture_on_commit_callbacks: Any,
) -> None:
    _, request, _ = held
    OrmQ.objects.all().delete()
    since = last_entry()
    with django_capture_on_commit_callbacks(execute=True):
        response = act(ada, REQUESTS, "renotify_selected", request.pk, foreign["request"].pk)
    assert response.status_code == 302
    assert queued() == [("approvals.notify.deliver", ("reminder", str(request.pk)))]
    assert new_entries(since) == [
        (f"tenant:{request.tenant_id}", "approval_renotified", "user:ada")
    ]
    # The queued task, run as the worker would: the reminder reaches the deciders.
    assert deliver("reminder", str(request.pk)) == {"emails": 0, "webhooks": 0}


def test_renotify_refuses_a_decided_request(ada: Client, held: Any) -> None:
    _, request, _ = held
    ApprovalRequest.objects.filter(pk=request.pk).update(status=ApprovalStatus.EXPIRED)
    since = last_entry()
    response = act(ada, REQUESTS, "renotify_selected", request.pk, follow=True)
    assert any("nobody is waiting" in str(m) for m in response.context["messages"])
    assert new_entries(since) == []
    ApprovalRequest.objects.filter(pk=request.pk).update(status=ApprovalStatus.PENDING)


def test_reassign_a_pending_request(
    ada: Client,
    held: Any,
    foreign: dict[str, Any],
    django_capture_on_commit_callbacks: Any,
) -> None:
    _, request, _ = held
    oncall = ApprovalPolicy.objects.create(
        tenant=request.tenant, name="on-call decides", tool="tasks.create", quorum=2
    )
    page = act(ada, REQUESTS, "reassign_selected", request.pk)
    assert page.status_code == 200  # the page that asks for the policy
    assert b"on-call decides" in page.content and b"globex rule" not in page.content
    assert b"<code>tasks.create</code>, tasks need review" in page.content

    # A forged foreign policy is not a choice: the page comes back, nothing changes.
    since = last_entry()
    forged = act(
        ada, REQUESTS, "reassign_selected", request.pk, apply="1", policy=foreign["policy"].pk
    )
    assert forged.status_code == 200 and forged.context["form"].errors
    assert new_entries(since) == []

    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        done = act(
            ada,
            REQUESTS,
            "reassign_selected",
            request.pk,
            apply="1",
            policy=oncall.pk,
            reason="the reviewers are away",
        )
    assert done.status_code == 302
    request.refresh_from_db()
    assert (request.policy, request.quorum, request.status) == (oncall, 2, "pending")
    [entry] = JournalEntry.objects.filter(id__gt=since)
    assert (entry.type, entry.actor, entry.stream) == (
        "approval_reassigned",
        "user:ada",
        f"tenant:{request.tenant_id}",
    )
    assert entry.payload["from_policy"] == "tasks need review"
    assert entry.payload["to_policy"] == "on-call decides"
    assert queued() == [("approvals.notify.deliver", ("requested", str(request.pk)))]

    # Another tenant's request in the selection is not reached.
    before = foreign["request"].policy_id
    act(ada, REQUESTS, "reassign_selected", foreign["request"].pk, apply="1", policy=oncall.pk)
    foreign["request"].refresh_from_db()
    assert foreign["request"].policy_id == before


def test_reassign_refuses_another_tenants_policy(held: Any, foreign: dict[str, Any]) -> None:
    _, request, _ = held
    since = last_entry()
    with pytest.raises(NotPermitted):
        reassign_request(request, foreign["policy"], "user:root")
    request.refresh_from_db()
    assert request.policy.name == "tasks need review" and new_entries(since) == []


def test_reassign_refuses_a_policy_written_for_another_tool(
    ada: Client, held: Any, tenant_a: Tenant
) -> None:
    """A policy's deciders, quorum and condition are chosen for its tool: a request of
    tasks.create handed to a policy of tickets.create would be decided by people picked for
    another kind of action. The admin's page says so and nothing changes."""
    _, request, _ = held
    tickets = ApprovalPolicy.objects.create(
        tenant=tenant_a, name="ticket triage", tool="tickets.create"
    )
    since = last_entry()
    refused = act(ada, REQUESTS, "reassign_selected", request.pk, apply="1", policy=tickets.pk)
    assert refused.status_code == 200  # the page again, with the error on the policy field
    assert refused.context["form"].errors == {
        "policy": [
            "The policy 'ticket triage' is written for tickets.create; this request's action "
            "is tasks.create. Choose a policy of tasks.create."
        ]
    }
    assert b"is written for tickets.create" in refused.content
    request.refresh_from_db()
    assert (request.policy.name, request.status) == ("tasks need review", "pending")
    assert new_entries(since) == []


def test_reassign_of_requests_of_two_tools_to_one_tools_policy_changes_neither(
    ada: Client, held: Any, tenant_a: Tenant, agent_a: Persona
) -> None:
    _, request, _ = held
    other = _client_tool_request(tenant_a, agent_a)
    oncall = ApprovalPolicy.objects.create(tenant=tenant_a, name="on-call", tool="tasks.create")
    since = last_entry()
    refused = act(
        ada, REQUESTS, "reassign_selected", request.pk, other.pk, apply="1", policy=oncall.pk
    )
    assert refused.status_code == 200
    assert refused.context["form"].errors == {
        "policy": [
            "The policy 'on-call' is written for tasks.create; a selected request's action "
            "is agent.tasks.create. Choose a policy of agent.tasks.create."
        ]
    }
    assert set(ApprovalRequest.objects.values_list("policy__name", flat=True)) == {
        "tasks need review",
        "agent.tasks.create needs review",
    }
    assert new_entries(since) == []


def test_the_writer_refuses_a_policy_for_another_tool_as_invalid_params(
    held: Any, tenant_a: Tenant
) -> None:
    """Every path that reassigns goes through `reassign_request`: 422 invalid_params."""
    _, request, _ = held
    tickets = ApprovalPolicy.objects.create(
        tenant=tenant_a, name="ticket triage", tool="tickets.create"
    )
    since = last_entry()
    with pytest.raises(InvalidParams) as refused:
        reassign_request(request, tickets, "user:root")
    assert (refused.value.code, refused.value.status) == ("invalid_params", 422)
    assert refused.value.extra["errors"] == {"policy": [str(refused.value)]}
    request.refresh_from_db()
    assert request.policy.name == "tasks need review" and new_entries(since) == []


def _client_tool_request(tenant: Tenant, agent: Persona) -> ApprovalRequest:
    """A pending request of another tool: agent.tasks.create, an external run's action."""
    grant_policy(tenant)
    client = agent.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    held = ok(prepare(client, run_id, fence), 201)
    return ApprovalRequest.objects.get(pk=held["approval"])


def test_redeliver_a_webhook_message(
    ada: Client,
    held: Any,
    foreign: dict[str, Any],
    receiver: Receiver,
    local_hooks: None,
    django_capture_on_commit_callbacks: Any,
) -> None:
    _, request, _ = held
    hook = TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)
    receiver.statuses = [503]
    assert deliver("requested", str(request.pk)) == {"emails": 0, "webhooks": 1}
    [failed] = WebhookDelivery.objects.filter(webhook=hook)
    assert failed.status_code == 503 and failed.body

    OrmQ.objects.all().delete()
    since = last_entry()
    with django_capture_on_commit_callbacks(execute=True):
        response = act(ada, DELIVERIES, "redeliver_selected", failed.pk, foreign["delivery"].pk)
    assert response.status_code == 302
    args = (hook.pk, failed.message_id, "approval.requested", failed.body, 2)
    assert queued() == [("approvals.notify.send_webhook", args)]
    assert new_entries(since) == [
        (f"tenant:{request.tenant_id}", "webhook_redelivered", "user:ada")
    ]
    # The queued task, run as the worker would: the same message arrives again.
    assert send_webhook(*args) == 200
    latest = WebhookDelivery.objects.filter(webhook=hook).order_by("-attempt").first()
    assert latest is not None and (latest.attempt, latest.status_code) == (2, 200)
    (_, first), (headers, second) = receiver.received
    assert first == second and headers["webhook-id"] == failed.message_id
    # Tenant B's delivery was not reached (its hook got nothing queued).
    assert WebhookDelivery.objects.filter(webhook=foreign["webhook"]).count() == 1
