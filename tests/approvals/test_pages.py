"""Reviewer pages for hold points: inbox, history, the request page and deciding from it.

The pages only translate HTTP: `decide` alone decides, and its refusals become messages on
the request page. These tests drive the pages with the Django test client against real
api-review runs at their hold point (a real sandbox behind tasks.create) or requests raised
through the ledger's real path, and check what the reviewer sees, what was stored, that GET
never decides, that the hash in the forms is the server's, and that another tenant's request
is indistinguishable from no request at all.
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.contrib.auth.models import Group
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from approvals.card import safe_markdown
from approvals.decisions import decide
from approvals.hashing import action_hash
from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    ApprovalStatus,
    ApprovalVote,
    OnExpiry,
)
from approvals.policies import grant
from approvals.wording import duration, expiry_of
from runtime import ledger
from runtime.executor import advance_run
from runtime.lifecycle import create_run, revise_goal
from runtime.models import Action, ActionStatus, Role, Run, RunStatus, Tenant
from runtime.tools import get_tool
from tests.approvals.conftest import GOAL
from tests.conftest import Persona, make_persona

A = ApprovalStatus
HX = {"HTTP_HX_REQUEST": "true"}


# --- helpers ----------------------------------------------------------------------------


def login(client: Client, persona: Persona) -> Client:
    client.force_login(persona.user)
    return client


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def page_url(request: ApprovalRequest) -> str:
    return reverse("approval-page", args=[request.pk])


def decide_url(request: ApprovalRequest) -> str:
    return reverse("approval-page-decide", args=[request.pk])


def hidden_hashes(html: str) -> list[str]:
    return re.findall(r'name="action_hash" value="([0-9a-f]*)"', html)


def raise_request(
    tenant: Tenant,
    *,
    tool: str = "tasks.create",
    params: dict[str, Any] | None = None,
    actor: str = "agent:agent-a",
    target: str = "shop-v2",
    expires_in: timedelta | None = None,
) -> ApprovalRequest:
    """A held action through the ledger's real path (prepare → gates.hold → request), on a
    run that is not advanced: quick enough to make thirty for a query budget."""
    run = create_run(tenant, "chain", {"steps": 1}, actor=actor)
    with transaction.atomic():
        action = ledger.create_action(
            run,
            run.fence,
            get_tool(tool),
            params if params is not None else {"title": f"Review {run.run_id}"},
            step="tick",
            call_index=0,
            reason="Because the **new** API breaks clients.",
            target=target,
            actor=actor,
            needs_approval=True,
        )
    request = ApprovalRequest.objects.get(action=action, status=A.PENDING)
    if expires_in is not None:
        request.expires_at = timezone.now() + expires_in
        ApprovalRequest.objects.filter(pk=request.pk).update(expires_at=request.expires_at)
    return request


@pytest.fixture
def close_policy(tenant_a: Tenant, reviewer_a: Persona) -> ApprovalPolicy:
    """tasks.close under its own policy: a tool with no reviewer-editable field."""
    policy = ApprovalPolicy.objects.create(
        tenant=tenant_a, name="closing needs review", tool="tasks.close", on_expiry="reject"
    )
    grant(policy, Group.objects.get(name="acme-reviewers"))
    return policy


# --- expiry in words --------------------------------------------------------------------

# What is left of a request's time when its pages are rendered in the tests that read the
# expiry text: a fixed clock, so the words are fixed ("23 h 59 min").
REMAINING = timedelta(hours=23, minutes=59, seconds=30)
AGENT, MCP = "api-review@1", "mcp-session@1"  # graphs as a request's `shown` names them


def test_duration_and_what_happens_at_expiry() -> None:
    assert duration(30) == "under a minute"
    assert duration(45 * 60) == "45 min"
    assert duration(3 * 3600 + 12 * 60 + 5) == "3 h 12 min"
    assert duration(2 * 86400 + 4 * 3600) == "2 d 4 h"
    now = timezone.now()
    in_3h = now + timedelta(hours=3, minutes=12, seconds=30)
    assert (
        expiry_of(in_3h, OnExpiry.REREQUEST, 0, now, graph=AGENT).text
        == "expires in 3 h 12 min — then re-requested once, then the run needs attention"
    )
    assert "then it is rejected and the run needs attention (it was already re-requested" in (
        expiry_of(in_3h, OnExpiry.REREQUEST, 1, now, graph=AGENT).text
    )
    assert (
        "then it is rejected automatically"
        in expiry_of(in_3h, OnExpiry.REJECT, 0, now, graph=AGENT).text
    )
    assert "approved automatically" in expiry_of(in_3h, OnExpiry.APPROVE, 0, now, graph=AGENT).text
    late = expiry_of(now - timedelta(minutes=5), OnExpiry.REJECT, 0, now, graph=AGENT)
    assert late.overdue and late.text.startswith("expired 5 min ago")
    assert expiry_of(now + timedelta(minutes=20), OnExpiry.REJECT, 0, now, graph=AGENT).soon
    # An MCP session's host is answered REJECTED at the last expiry and its run goes on
    # (approvals.expiry): nobody is asked to look at it, so its reviewers are not told so.
    assert (
        expiry_of(in_3h, OnExpiry.REREQUEST, 0, now, graph=MCP).text
        == "expires in 3 h 12 min — then re-requested once, then rejected: the run goes on"
        " without it"
    )
    assert expiry_of(in_3h, OnExpiry.REREQUEST, 1, now, graph=MCP).text == (
        "expires in 3 h 12 min — then it is rejected and the run goes on without it (it was"
        " already re-requested once)"
    )
    # A graph not registered here: the expirer asks a person, and the words say so.
    assert "the run needs attention" in expiry_of(in_3h, "rerequest", 0, now, graph="").text


# --- the inbox --------------------------------------------------------------------------


def test_inbox_shows_pending_soonest_first_with_everything_a_card_needs(
    client: Client, reviewer_a: Persona, policy: ApprovalPolicy, held: Any
) -> None:
    run, request, box = held
    # The clock frozen 30 s after the request's 24 hours began: its expiry reads "23 h 59
    # min" however long the set-up took (issue 16: the text was checked on the real clock).
    frozen = time_machine.travel(request.expires_at - REMAINING, tick=False)
    frozen.start()
    try:
        sooner = raise_request(
            reviewer_a.tenant, expires_in=timedelta(hours=3, minutes=12, seconds=30)
        )
        page = login(client, reviewer_a).get(reverse("inbox"))
    finally:
        frozen.stop()
    assert page.status_code == 200
    assert [c.request.pk for c in page.context["cards"]] == [sooner.pk, request.pk]
    assert all(c.mine for c in page.context["cards"])
    text = page.content.decode()
    assert page_url(request) in text and page_url(sooner) in text
    assert "Create task: Review 3 API compatibility risk(s)" in text  # verb-first title
    assert reverse("run", args=[run.run_id]) in text
    assert "agent:agent-a" in text and "tasks need review" in text
    assert 'class="badge impact-write"' in text
    assert "expires in 3 h 12 min — then re-requested once, then the run needs attention" in text
    assert "expires in 23 h 59 min" in text
    assert "<strong>2</strong> pending" in text and "<strong>2</strong> mine to decide" in text
    assert "Waiting for reconciliation" in text and "<strong>0</strong> waiting for" in text
    # Live: the list partial is re-fetched on each event of the approvals stream (live.js),
    # polled every 5 s without it.
    assert f'hx-get="{reverse("inbox-list")}"' in text and 'hx-trigger="every 5s, live"' in text
    assert f'data-live-stream="{reverse("api-approvals")}?stream=1"' in text
    assert f'data-next-url="{page_url(sooner)}"' in text
    assert 'src="/static/holdpoint/triage.js"' in text and "onclick" not in text


def test_inbox_lists_actions_waiting_for_reconciliation(
    client: Client, reviewer_a: Persona, tenant_b: Tenant
) -> None:
    ours = raise_request(reviewer_a.tenant)
    Action.objects.filter(pk=ours.action_id).update(status=ActionStatus.MANUAL_REVIEW)
    theirs = raise_request(tenant_b)
    Action.objects.filter(pk=theirs.action_id).update(status=ActionStatus.MANUAL_REVIEW)
    text = login(client, reviewer_a).get(reverse("inbox")).content.decode()
    assert reverse("reconcile-detail", args=[ours.action_id]) in text
    assert reverse("reconcile-detail", args=[theirs.action_id]) not in text
    assert "<strong>1</strong> waiting for reconciliation" in text


def test_inbox_is_scoped_to_the_tenant(
    client: Client, reviewer_a: Persona, outsider_b: Persona, policy: ApprovalPolicy
) -> None:
    ours = raise_request(reviewer_a.tenant)
    page = login(client, outsider_b).get(reverse("inbox"))
    assert page.context["cards"] == [] and page_url(ours) not in page.content.decode()
    assert b"Nothing is waiting for you" in page.content
    assert page.context["counts"]["total"] == 0


def test_inbox_filters_by_tool_policy_and_mine(
    client: Client,
    reviewer_a: Persona,
    viewer_a: Persona,
    policy: ApprovalPolicy,
    close_policy: ApprovalPolicy,
) -> None:
    create = raise_request(reviewer_a.tenant)
    close = raise_request(reviewer_a.tenant, tool="tasks.close", params={"task_id": "t-1"})
    own = raise_request(reviewer_a.tenant, actor="user:alice")  # separation of duties
    login(client, reviewer_a)

    def ids(query: dict[str, str]) -> list[Any]:
        return [c.request.pk for c in client.get(reverse("inbox"), query).context["cards"]]

    assert set(ids({})) == {create.pk, close.pk, own.pk}
    assert set(ids({"tool": "tasks.close"})) == {close.pk}
    assert set(ids({"policy": str(policy.pk)})) == {create.pk, own.pk}
    assert set(ids({"mine": "1"})) == {create.pk, close.pk}  # not the run alice started
    assert ids({"tool": "nope"}) == []
    # A policy that is not an id is a 400 naming the filter (issue 16, L1), not "any".
    refused = client.get(reverse("inbox"), {"policy": "x"})
    assert refused.status_code == 400 and b"policy" in refused.content
    filtered = client.get(reverse("inbox"), {"tool": "tasks.close", "mine": "1"})
    assert "tool=tasks.close&amp;mine=1" in filtered.content.decode()  # the poll keeps them
    assert b"<strong>1</strong> match the filters" in filtered.content
    viewer_page = login(Client(), viewer_a).get(reverse("inbox"), {"mine": "1"})
    assert viewer_page.context["cards"] == [] and viewer_page.context["counts"]["mine"] == 0
    assert viewer_page.context["counts"]["total"] == 3


def test_inbox_partial_for_htmx_and_the_whole_page_otherwise(
    client: Client, reviewer_a: Persona, policy: ApprovalPolicy
) -> None:
    request = raise_request(reviewer_a.tenant)
    login(client, reviewer_a)
    part = client.get(reverse("inbox-list"), **HX)
    assert part.status_code == 200 and b"<html" not in part.content
    assert page_url(request).encode() in part.content and b'id="inbox-live"' in part.content
    assert "HX-Request" in part["Vary"]
    direct = client.get(reverse("inbox-list"))
    assert direct.status_code == 200 and b"<html" in direct.content


@pytest.mark.parametrize("name", ["inbox", "inbox-list"])
def test_inbox_query_count_does_not_grow_with_pending(
    client: Client,
    reviewer_a: Persona,
    policy: ApprovalPolicy,
    close_policy: ApprovalPolicy,
    name: str,
) -> None:
    login(client, reviewer_a)
    for _ in range(2):
        raise_request(reviewer_a.tenant)
    raise_request(reviewer_a.tenant, tool="tasks.close", params={"task_id": "t"})
    parked = raise_request(reviewer_a.tenant)
    Action.objects.filter(pk=parked.action_id).update(status=ActionStatus.MANUAL_REVIEW)
    ApprovalRequest.objects.filter(pk=parked.pk).update(status=A.CANCELLED)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            page = client.get(reverse(name), {"mine": "1"}, **HX)
        assert page.status_code == 200
        return len(captured)

    few = queries()
    assert len(client.get(reverse("inbox")).context["cards"]) == 3
    for i in range(27):
        if i % 2:
            raise_request(reviewer_a.tenant, tool="tasks.close", params={"task_id": f"t{i}"})
        else:
            raise_request(reviewer_a.tenant)
    assert len(client.get(reverse("inbox")).context["cards"]) == 30
    assert queries() == few


def test_history_lists_decided_newest_first_with_decider_and_reason(
    client: Client, reviewer_a: Persona, tenant_b: Tenant, policy: ApprovalPolicy
) -> None:
    first = raise_request(reviewer_a.tenant)
    second = raise_request(reviewer_a.tenant)
    open_ = raise_request(reviewer_a.tenant)
    theirs = raise_request(tenant_b)
    ApprovalRequest.objects.filter(pk=theirs.pk).update(status=A.CANCELLED)
    decide(first.pk, reviewer_a.user, "approve", first.action_hash, reason="looks right")
    decide(second.pk, reviewer_a.user, "reject", second.action_hash, reason="Wrong target")
    page = login(client, reviewer_a).get(reverse("inbox-history"))
    assert page.status_code == 200
    assert [r.pk for r in page.context["page_obj"]] == [second.pk, first.pk]
    text = page.content.decode()
    assert "alice" in text and "looks right" in text and "Wrong target" in text
    assert 'class="badge rejected"' in text and 'class="badge approved"' in text
    assert page_url(open_) not in text and page_url(theirs) not in text


# --- the request page -------------------------------------------------------------------


def test_request_page_shows_everything_and_a_form_from_the_schema(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    with time_machine.travel(request.expires_at - REMAINING, tick=False):  # see the inbox test
        page = login(client, reviewer_a).get(page_url(request))
    assert page.status_code == 200
    text = page.content.decode()
    shown = request.shown
    for value in (shown["target"], shown["initiator"], shown["graph"], shown["policy"]):
        assert value in text
    assert str(safe_markdown(shown["reason"])) in text and "tasks.create@1" in text
    # An input per schema property, editable ones enabled, in the decide form.
    names = [f.name for f in page.context["fields"]]
    assert names == ["title", "body", "assignee"]
    assert all(f.editable for f in page.context["fields"])
    assert 'name="param-title"' in text and 'maxlength="200"' in text
    assert '<textarea id="param-body"' in text  # long text gets a textarea
    assert "Not set by the agent." in text  # assignee
    # The hash in every form is the server's, rendered from the stored request.
    assert hidden_hashes(text) == [request.action_hash] * 2  # approve (with the params), reject
    assert request.action_hash[:12] in text
    assert "expires in 23 h 59 min — then re-requested once, then the run needs attention" in text
    assert reverse("run", args=[run.run_id]) + "#timeline-title" in text
    assert reverse("approval-page-status", args=[request.pk]) in text
    for preset in ("Not needed", "Wrong target", "Parameters look wrong"):
        assert f'value="{preset}"' in text
    assert "approval_requested" in text  # the item's own timeline
    assert 'id="shortcut-help"' in text and "onclick" not in text and "<script>" not in text


def test_a_read_only_field_is_disabled_and_an_edit_of_it_is_refused(
    client: Client, reviewer_a: Persona, close_policy: ApprovalPolicy
) -> None:
    request = raise_request(reviewer_a.tenant, tool="tasks.close", params={"task_id": "t-1"})
    page = login(client, reviewer_a).get(page_url(request))
    field = page.context["fields"][0]
    assert field.name == "task_id" and not field.editable
    assert re.search(r'name="param-task_id"[^>]* disabled', page.content.decode())
    assert b"Approve with my edits" not in page.content  # nothing to edit
    forged = client.post(
        decide_url(request),
        {
            "decision": "approve",
            "mode": "edit",
            "action_hash": request.action_hash,
            "param-task_id": "t-2",
        },
    )
    assert forged.status_code == 422
    assert any("Not editable: task_id" in m for m in messages_of(forged))
    request.refresh_from_db()
    assert request.status == A.PENDING and not ApprovalVote.objects.exists()


def test_similar_decisions_and_the_next_pending_item(
    client: Client, reviewer_a: Persona, held: Any, tenant_b: Tenant
) -> None:
    run, request, box = held
    done = raise_request(reviewer_a.tenant, expires_in=timedelta(hours=1))
    decide(
        done.pk, reviewer_a.user, "reject", done.action_hash, reason="Duplicate of existing work"
    )
    theirs = raise_request(tenant_b)
    ApprovalRequest.objects.filter(pk=theirs.pk).update(
        status=A.REJECTED, decided_at=timezone.now()
    )
    after = raise_request(reviewer_a.tenant, expires_in=timedelta(days=2))
    before = raise_request(reviewer_a.tenant, expires_in=timedelta(hours=2))
    page = login(client, reviewer_a).get(page_url(request))
    assert [s.pk for s in page.context["similar"]] == [done.pk]
    assert "Duplicate of existing work" in page.content.decode()
    assert page.context["next_url"] == page_url(after)
    # From the last one it wraps round to the soonest.
    assert client.get(page_url(after)).context["next_url"] == page_url(before)


def test_a_viewer_sees_no_decision_forms_and_may_not_post(
    client: Client, viewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    page = login(client, viewer_a).get(page_url(request))
    assert page.status_code == 200
    text = page.content.decode()
    assert decide_url(request) not in text and hidden_hashes(text) == []
    assert "deciding needs a reviewer granted on its policy" in text
    assert all(not f.editable for f in page.context["fields"])
    response = client.post(
        decide_url(request), {"decision": "approve", "action_hash": request.action_hash}
    )
    assert response.status_code == 403
    request.refresh_from_db()
    assert request.status == A.PENDING and not ApprovalVote.objects.exists()


def _decided_state(request: ApprovalRequest) -> tuple[Any, ...]:
    """Everything a refused decision must leave alone: the request's decision, its votes,
    the action, every journal entry."""
    from audit.models import JournalEntry

    request.refresh_from_db()
    action = Action.objects.get(pk=request.action_id)
    return (
        (request.status, request.decision, request.decided_by_id, request.decided_at),
        (request.decision_reason, request.action_hash, request.edits, request.updated_at),
        list(ApprovalVote.objects.values_list("user_id", "decision", "action_hash")),
        (action.status, action.params, action.fence, action.last_error),
        list(JournalEntry.objects.order_by("id").values_list("id", "hash")),
    )


def test_a_viewer_deciding_an_already_decided_request_changes_nothing(
    client: Client, reviewer_a: Persona, viewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    decide(request.pk, reviewer_a.user, "approve", request.action_hash, reason="fine")
    login(client, viewer_a)
    before = _decided_state(request)
    for body in (
        {"decision": "reject", "action_hash": request.action_hash, "reason": "no"},
        {"decision": "approve", "action_hash": request.action_hash, "params-typed": "1"},
        {"decision": "approve", "action_hash": request.action_hash, "mode": "edit"},
    ):
        assert client.post(decide_url(request), body).status_code == 403
        assert _decided_state(request) == before
    assert request.status == A.APPROVED and request.decided_by == reviewer_a.user


def test_approve_over_changed_fields_is_refused_and_keeps_them(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    """Issue 15.4 without a browser: the approve form posts the params as typed. A plain
    Approve over a changed field decides nothing (409 unsent_edits, the draft kept);
    the same post as "Approve with my edits" sends the edit; unchanged fields approve."""
    run, request, box = held
    login(client, reviewer_a)
    page = client.get(page_url(request)).content.decode()
    assert re.search(r'name="param-title" form="approve-form"', page)
    assert 'name="params-typed" value="1"' in page
    typed = {
        "decision": "approve",
        "action_hash": request.action_hash,
        "params-typed": "1",
        "param-title": "Only the breaking changes",
    }
    before = _decided_state(request)
    refused = client.post(decide_url(request), typed)
    assert refused.status_code == 409
    assert any(m.startswith("You changed title: Approve would") for m in messages_of(refused))
    assert 'value="Only the breaking changes"' in refused.content.decode()
    assert _decided_state(request) == before
    approved = client.post(decide_url(request), {**typed, "mode": "edit"})
    assert approved.status_code == 302
    request.refresh_from_db()
    assert request.status == A.APPROVED and request.edits == {"title": "Only the breaking changes"}
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert [t["title"] for t in box.tasks()] == ["Only the breaking changes"]


def test_approve_with_the_fields_as_shown_approves_the_original(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    shown = request.shown["params"]
    login(client, reviewer_a)
    response = client.post(
        decide_url(request),
        {
            "decision": "approve",
            "action_hash": request.action_hash,
            "params-typed": "1",
            **{f"param-{k}": v for k, v in shown.items()},
        },
    )
    assert response.status_code == 302
    request.refresh_from_db()
    assert request.status == A.APPROVED and request.edits is None


def test_another_tenants_request_is_a_404_like_a_random_id(
    client: Client, outsider_b: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, outsider_b)
    missing = uuid.uuid4()
    for name in ("approval-page", "approval-page-status"):
        foreign = client.get(reverse(name, args=[request.pk]))
        absent = client.get(reverse(name, args=[missing]))
        assert foreign.status_code == absent.status_code == 404
        assert foreign.content == absent.content
    body = {"decision": "approve", "action_hash": request.action_hash}
    foreign = client.post(decide_url(request), body)
    absent = client.post(reverse("approval-page-decide", args=[missing]), body)
    assert foreign.status_code == absent.status_code == 404
    assert foreign.content == absent.content
    request.refresh_from_db()
    assert request.status == A.PENDING


def test_pages_need_a_login_and_agents_use_the_api(
    client: Client, agent_a: Persona, held: Any
) -> None:
    run, request, box = held
    for url in (reverse("inbox"), reverse("inbox-history"), page_url(request)):
        assert client.get(url).status_code == 302
    login(client, agent_a)
    assert client.get(page_url(request)).status_code == 403
    assert client.post(decide_url(request), {"decision": "approve"}).status_code == 403


def test_get_never_decides(client: Client, reviewer_a: Persona, held: Any) -> None:
    run, request, box = held
    login(client, reviewer_a)
    query = {"decision": "approve", "action_hash": request.action_hash}
    assert client.get(decide_url(request), query).status_code == 405
    assert client.head(decide_url(request)).status_code == 405
    assert client.get(page_url(request), query).status_code == 200
    request.refresh_from_db()
    assert request.status == A.PENDING and not ApprovalVote.objects.exists()


# --- deciding from the page -------------------------------------------------------------


def test_approve_then_on_to_the_next_pending_item(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    following = raise_request(reviewer_a.tenant, expires_in=timedelta(days=3))
    login(client, reviewer_a)
    response = client.post(
        decide_url(request), {"decision": "approve", "action_hash": request.action_hash}
    )
    assert response.status_code == 302 and response["Location"] == page_url(following)
    request.refresh_from_db()
    run.refresh_from_db()
    assert request.status == A.APPROVED and request.decided_by == reviewer_a.user
    assert run.status == RunStatus.QUEUED
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1
    page = client.get(response["Location"])
    assert any(m.startswith("Approved: Create task") for m in messages_of(page))
    # The decided request's page says who decided, with no forms left.
    done = client.get(page_url(request)).content.decode()
    assert "by <strong>alice</strong>" in done and hidden_hashes(done) == []


def test_the_last_approval_goes_back_to_the_inbox(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    response = client.post(
        decide_url(request), {"decision": "approve", "action_hash": request.action_hash}
    )
    assert response.status_code == 302 and response["Location"] == reverse("inbox")


def test_a_reject_stays_on_the_rejected_request(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    """Not on to the next item: a similar run's next request often has the same title, and
    the reviewer would see no sign that their reject happened (issue 20)."""
    run, request, box = held
    login(client, reviewer_a)
    response = client.post(
        decide_url(request),
        {"decision": "reject", "action_hash": request.action_hash, "preset": "Not needed"},
    )
    assert response.status_code == 302 and response["Location"] == page_url(request)


@pytest.mark.parametrize(
    ("preset", "note", "stored"),
    [
        ("Not needed", "", "Not needed"),
        ("Wrong target", "it is shop-v3", "Wrong target: it is shop-v3"),
        ("", "my own words", "my own words"),
        ("invented preset", "text", "text"),
    ],
)
def test_reject_with_a_preset_and_or_free_text(
    client: Client, reviewer_a: Persona, held: Any, preset: str, note: str, stored: str
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    client.post(
        decide_url(request),
        {
            "decision": "reject",
            "action_hash": request.action_hash,
            "preset": preset,
            "reason": note,
        },
    )
    request.refresh_from_db()
    assert request.status == A.REJECTED and request.decision_reason == stored
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert box.tasks() == []


def test_reject_without_a_reason_is_refused_and_keeps_the_page(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    response = client.post(
        decide_url(request), {"decision": "reject", "action_hash": request.action_hash}
    )
    assert response.status_code == 422
    assert "A rejection needs a reason" in response.content.decode()
    assert 'aria-invalid="true" aria-describedby="reject-reason-error"' in response.content.decode()
    request.refresh_from_db()
    assert request.status == A.PENDING and not ApprovalVote.objects.exists()


def test_edit_then_approve_sends_only_changed_fields(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    original = request.shown["params"]
    login(client, reviewer_a)
    response = client.post(
        decide_url(request),
        {
            "decision": "approve",
            "mode": "edit",
            "action_hash": request.action_hash,
            "param-title": "Review the shop-v2 breaking changes",
            # Browsers send textarea lines as CRLF: unchanged text is not an edit.
            "param-body": original["body"].replace("\n", "\r\n"),
            "param-assignee": "",
        },
    )
    assert response.status_code == 302
    request.refresh_from_db()
    assert request.status == A.APPROVED
    assert request.edits == {"title": "Review the shop-v2 breaking changes"}
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert [t["title"] for t in box.tasks()] == ["Review the shop-v2 breaking changes"]
    page = client.get(page_url(request))
    diff = {row.name: row for row in page.context["diff"]}
    assert diff["title"].changed and not diff["body"].changed
    assert diff["title"].before == original["title"]
    assert "<ins>Review the shop-v2 breaking changes</ins>" in page.content.decode()


def test_an_invalid_edit_keeps_the_draft_and_records_nothing(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    response = client.post(
        decide_url(request),
        {
            "decision": "approve",
            "mode": "edit",
            "action_hash": request.action_hash,
            "param-title": "x" * 201,
        },
    )
    assert response.status_code == 422
    title = next(f for f in response.context["fields"] if f.name == "title")
    assert title.value == "x" * 201 and "too long" in title.error
    request.refresh_from_db()
    assert request.status == A.PENDING and request.edits is None
    assert Action.objects.get(pk=request.action_id).params == request.params


def test_an_edit_with_no_change_is_a_plain_approval(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, reviewer_a).post(
        decide_url(request),
        {
            "decision": "approve",
            "mode": "edit",
            "action_hash": request.action_hash,
            "param-title": request.shown["params"]["title"],
        },
    )
    request.refresh_from_db()
    assert request.status == A.APPROVED and request.edits is None


# --- refusals become messages on the request page ---------------------------------------


def reverse_page(request: ApprovalRequest) -> str:
    return page_url(request)


def test_a_changed_action_is_a_hash_mismatch_and_nothing_is_sent(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    seen = hidden_hashes(client.get(page_url(request)).content.decode())[0]
    Action.objects.filter(pk=request.action_id).update(params='{"title":"something else"}')
    response = client.post(
        decide_url(request), {"decision": "approve", "action_hash": seen}, follow=True
    )
    assert response.redirect_chain == [(page_url(request), 302)]
    said = messages_of(response)
    assert any("changed since you opened it — here is the current version" in m for m in said)
    text = response.content.decode()
    assert 'class="hash_mismatch error"' in text
    # The stale request is closed and a new one raised for what the action is now.
    request.refresh_from_db()
    assert request.status == "superseded"
    fresh = ApprovalRequest.objects.get(run=run, status="pending")
    assert "something else" in fresh.params and reverse_page(fresh) in text
    assert not ApprovalVote.objects.exists() and box.tasks() == []
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL


def test_an_older_page_is_a_hash_mismatch(client: Client, reviewer_a: Persona, held: Any) -> None:
    run, request, box = held
    response = login(client, reviewer_a).post(
        decide_url(request), {"decision": "approve", "action_hash": "0" * 64}, follow=True
    )
    assert any("here is the current version" in m for m in messages_of(response))
    assert not ApprovalVote.objects.exists()


def test_already_decided_says_by_whom(
    client: Client, reviewer_a: Persona, held: Any, tenant_a: Tenant
) -> None:
    run, request, box = held
    beth = make_persona(tenant_a, "beth", Role.REVIEWER)
    decide(request.pk, beth.user, "approve", request.action_hash)
    response = login(client, reviewer_a).post(
        decide_url(request),
        {"decision": "reject", "action_hash": request.action_hash, "preset": "Not needed"},
        follow=True,
    )
    assert response.redirect_chain == [(page_url(request), 302)]
    assert any(
        "Nothing was recorded: already approved by beth at" in m for m in messages_of(response)
    )
    assert ApprovalVote.objects.count() == 1


def test_a_superseded_request_is_already_decided_and_points_to_the_new_one(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    revise_goal(run, {**GOAL, "scope": ["/orders"]}, expected_goal_rev=1, actor="user:victor")
    response = client.post(
        decide_url(request),
        {"decision": "approve", "action_hash": request.action_hash},
        follow=True,
    )
    assert any("already superseded by the system" in m for m in messages_of(response))
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    fresh = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    page = client.get(page_url(request))
    assert page.context["newer"] == fresh and page_url(fresh) in page.content.decode()
    assert not ApprovalVote.objects.exists() and box.tasks() == []


def test_an_expired_request_says_what_happens_next(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(minutes=2)
    )
    login(client, reviewer_a)
    page = client.get(page_url(request))
    assert hidden_hashes(page.content.decode()) == []  # no forms on an expired request
    assert "expired 2 min ago" in page.content.decode()
    response = client.post(
        decide_url(request),
        {"decision": "approve", "action_hash": request.action_hash},
        follow=True,
    )
    said = messages_of(response)
    assert any("this request expired at" in m and "then re-requested once" in m for m in said), said
    assert not ApprovalVote.objects.exists()


def test_a_request_that_expired_for_the_last_time_says_the_action_was_not_sent(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    """The re-request policy's second expiry rejects the action (approvals.expiry): its
    request page says so and that the run needs attention, not only "expired undecided"."""
    from approvals.expiry import sweep_approvals

    run, request, box = held
    for _ in range(2):
        ApprovalRequest.objects.filter(run=run, status=A.PENDING).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        sweep_approvals()
    last = ApprovalRequest.objects.filter(run=run).order_by("-created_at").first()
    assert last is not None and last.status == A.EXPIRED
    text = login(client, reviewer_a).get(page_url(last)).content.decode()
    assert "rejected at expiry" in text and "never sent" in text, text
    assert "needs attention" in text


def test_self_approval_is_not_permitted(
    client: Client, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    sam = make_persona(tenant_a, "sam", Role.REVIEWER)
    request = raise_request(tenant_a, actor="user:sam")
    login(client, sam)
    page = client.get(page_url(request))
    assert hidden_hashes(page.content.decode()) == []
    assert "You shaped this action" in page.content.decode()
    response = client.post(
        decide_url(request), {"decision": "approve", "action_hash": request.action_hash}
    )
    assert response.status_code == 403
    assert any(
        m.startswith("Not permitted: whoever shaped this action") for m in messages_of(response)
    )
    assert not ApprovalVote.objects.exists()


def test_a_repeated_post_records_one_decision(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    body = {"decision": "approve", "action_hash": request.action_hash}
    first = client.post(decide_url(request), body)
    second = client.post(decide_url(request), body)  # a double click without script
    assert first.status_code == second.status_code == 302
    assert ApprovalVote.objects.filter(request=request).count() == 1
    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1


def test_the_status_line_notices_a_decision_made_elsewhere(
    client: Client, reviewer_a: Persona, held: Any, tenant_a: Tenant
) -> None:
    run, request, box = held
    login(client, reviewer_a)
    page = client.get(page_url(request))
    status_url = page.context["status_url"]
    fresh = client.get(status_url, **HX)
    assert b"changed since you opened it" not in fresh.content
    assert b'hx-trigger="every 5s"' in fresh.content
    beth = make_persona(tenant_a, "beth", Role.REVIEWER)
    decide(request.pk, beth.user, "approve", request.action_hash)
    stale = client.get(status_url, **HX).content.decode()
    assert "changed since you opened it: it is now <strong>approved</strong> by beth" in stale
    assert "hx-trigger" not in stale  # polling stops once the request is closed
    assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
    assert action_hash(Action.objects.get(pk=request.action_id)) == request.action_hash
