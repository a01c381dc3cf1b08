"""The reviewer's card: who asked, what happens, where it lands, why, and what it costs.

Driven with the Django test client against a real api-review run at its hold point (a real
sandbox behind tasks.create, whose definition says where the task lands), and checked as a
reviewer reads the page: the host and path the definition resolves to, each risk the run
found as its own list item, reversibility and the compensating tool, who asked and for
whom, the params against the last approved tasks.create, the policy, expiry and what then.
"""

from __future__ import annotations

import re
from html import unescape
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse

from approvals.card import param_diff, safe_markdown
from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from approvals.policies import grant
from runtime import ledger
from runtime.agents.api_review.diff import find_risks, load_spec
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Role, Tenant
from runtime.tools import get_tool
from tests.approvals.conftest import GOAL
from tests.approvals.test_pages import decide_url, login, page_url, raise_request
from tests.conftest import Persona, make_persona

A = ApprovalStatus


def section(html: str, id_: str) -> str:
    """The HTML of the part of the card with that id: a card section, or one fact of the
    card's list (`card-*`), so an assertion reads only what the reviewer reads there."""
    start = html.index(">", html.index(f'id="{id_}"')) + 1
    end = html.find("</dd></div>" if id_.startswith("card-") else "</section>", start)
    return html[start:end]


@pytest.fixture
def close_policy(tenant_a: Tenant, reviewer_a: Persona) -> ApprovalPolicy:
    """tasks.close under its own policy (a tool with no compensation)."""
    policy = ApprovalPolicy.objects.create(tenant=tenant_a, name="closing", tool="tasks.close")
    grant(policy, Group.objects.get(name="acme-reviewers"))
    return policy


def text_of(fragment: str) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def test_the_card_says_where_the_task_lands_from_the_tools_definition(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    html = login(client, reviewer_a).get(page_url(request)).content.decode()
    where = text_of(section(html, "card-where"))
    sandbox = urlsplit(box.url).netloc
    # Not the agent's target ("shop-v2", a spec name): the tracker the definition sends to.
    assert f"POST {box.url}/tasks" in where
    assert f"host {sandbox}" in where and "path /tasks" in where
    assert "Holdpoint sends it over HTTP" in where
    assert "the tenant's tasks account" in where
    assert "shop-v2 (the agent's target)" in text_of(html)


def test_the_why_is_the_agents_markdown_with_each_risk_visible(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    old, new = load_spec(GOAL["old_spec"]), load_spec(GOAL["new_spec"])
    risks = [r for prefix in GOAL["scope"] for r in find_risks(old, new, [prefix])]
    assert len(risks) == 3  # the demo's three risks
    why = section(login(client, reviewer_a).get(page_url(request)).content.decode(), "why")
    items = [text_of(li) for li in re.findall(r"<li>(.*?)</li>", why, re.S)]
    assert len(items) == 3
    for risk, item in zip(risks, items, strict=True):
        assert f"{risk['method']} {risk['path']}" in item
        assert risk["kind"] in item and risk["detail"] in item
    assert "<code>shop-v2</code>" in why  # Markdown, rendered


def test_impact_says_reversible_and_names_the_compensation(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    impact = text_of(
        section(login(client, reviewer_a).get(page_url(request)).content.decode(), "card-impact")
    )
    assert "write" in impact and "reversible" in impact and "not reversible" not in impact
    assert "tasks.close undoes it" in impact
    assert "Compensation: tasks.close — Close a task in the team's tracker" in impact


def test_who_asked_for_whom_the_policy_and_what_happens_at_expiry(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    html = login(client, reviewer_a).get(page_url(request)).content.decode()
    assert "the api-review@1 agent, in its step 'propose_task'" in text_of(
        section(html, "card-who")
    )
    assert "agent:agent-a (who started the run)" in text_of(html)
    policy = text_of(section(html, "card-policy"))
    assert "tasks need review — holds every tasks.create action" in policy
    expiry = text_of(section(html, "card-expiry"))
    assert "if nobody decides by then, re-requested once, then the run needs attention" in expiry


def test_a_tool_without_compensation_is_not_reversible(
    client: Client, reviewer_a: Persona, tenant_a: Tenant, close_policy: Any
) -> None:
    request = raise_request(tenant_a, tool="tasks.close", params={"task_id": "T-1"})
    html = login(client, reviewer_a).get(page_url(request)).content.decode()
    impact = text_of(section(html, "card-impact"))
    assert "not reversible" in impact and "no compensating tool is defined" in impact
    assert "path /tasks/T-1/close" in text_of(section(html, "card-where"))


def test_params_are_diffed_against_the_last_approved_action_of_the_tool(
    client: Client, reviewer_a: Persona, tenant_a: Tenant, policy: Any
) -> None:
    first = raise_request(
        tenant_a, params={"title": "Old title", "body": "line one\nline two", "assignee": "bo"}
    )
    decide(first.pk, reviewer_a.user, "approve", first.action_hash)
    rejected = raise_request(tenant_a, params={"title": "Rejected one"})
    decide(rejected.pk, reviewer_a.user, "reject", rejected.action_hash, reason="no")
    now = raise_request(tenant_a, params={"title": "New title", "body": "line one\nline 2"})
    html = login(client, reviewer_a).get(page_url(now)).content.decode()
    baseline = section(html, "baseline")
    assert "Create task: Old title" in text_of(baseline)  # the approved one, not the reject
    assert "Rejected one" not in baseline
    assert "<del>Old title</del>" in baseline and "<ins>New title</ins>" in baseline
    assert '<span class="ins">+ line 2</span>' in baseline
    assert '<span class="del">- line two</span>' in baseline
    assert '<tr class="removed">' in baseline  # assignee: set before, not now


def test_no_baseline_says_so(client: Client, reviewer_a: Persona, held: Any) -> None:
    run, request, box = held
    html = login(client, reviewer_a).get(page_url(request)).content.decode()
    assert "No earlier approved tasks.create in this tenant" in section(html, "baseline")


def test_param_diff_key_by_key() -> None:
    rows = param_diff({"a": 1, "b": "x", "gone": True}, {"a": 1, "b": "y", "new": [1]})
    assert [(r.name, r.change) for r in rows] == [
        ("a", "same"),
        ("b", "changed"),
        ("new", "added"),
        ("gone", "removed"),
    ]


# --- the reason is untrusted text ---------------------------------------------------------

HOSTILE = (
    "Fine **really**.\n\n<script>alert('x')</script>\n\n"
    "[click](javascript:alert(1)) [also](JaVaScRiPt:alert(2)) [data](data:text/html,<b>x</b>)"
    ' <img src=x onerror="alert(3)"> [ok](https://example.com/a)'
)


def test_a_script_or_javascript_link_in_the_reason_does_not_survive() -> None:
    html = str(safe_markdown(HOSTILE))
    assert "<script" not in html and "<img" not in html
    assert "javascript:" not in re.sub(r">[^<]*<", "><", html).lower()  # only as text
    assert not re.search(r'href="(?!https://example.com/a")', html)
    assert '<a href="https://example.com/a" rel="nofollow noopener noreferrer">ok</a>' in html
    assert "<strong>really</strong>" in html


def test_the_page_shows_a_hostile_reason_as_text(
    client: Client, reviewer_a: Persona, tenant_a: Tenant, policy: Any
) -> None:
    run = create_run(tenant_a, "chain", {"steps": 1}, actor="agent:agent-a")
    from django.db import transaction

    with transaction.atomic():
        action = ledger.create_action(
            run,
            run.fence,
            get_tool("tasks.create"),
            {"title": "x"},
            step="tick",
            call_index=0,
            reason=HOSTILE,
            target="t",
            actor="agent:agent-a",
            needs_approval=True,
        )
    request = ApprovalRequest.objects.get(action=action)
    why = section(login(client, reviewer_a).get(page_url(request)).content.decode(), "why")
    assert "<script>" not in why and "&lt;script&gt;alert" in why
    assert 'href="javascript' not in why.lower() and "<img" not in why


# --- after a decision ---------------------------------------------------------------------


def test_a_reject_lands_on_the_rejected_request_with_what_happens_next(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    response = login(client, reviewer_a).post(
        decide_url(request),
        {"decision": "reject", "action_hash": request.action_hash, "preset": "Not needed"},
        follow=True,
    )
    assert response.redirect_chain == [(page_url(request), 302)]
    outcome = text_of(section(response.content.decode(), "outcome"))
    assert outcome.startswith("Rejected — next: the action is cancelled and never sent;")
    assert "step 'propose_task' is told it was rejected" in outcome
    assert "The run is now queued" in outcome
    assert "By alice" in outcome and "“Not needed”" in outcome
    # The run goes on as the page said; the page then says where the run is.
    assert advance_run(run.run_id, "w1").outcome == "completed"
    later = text_of(section(client.get(page_url(request)).content.decode(), "outcome"))
    assert "The run is now completed." in later


def test_an_edited_request_shows_its_new_title(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    decide(
        request.pk,
        reviewer_a.user,
        "approve",
        request.action_hash,
        edits={"title": "Review the shop-v2 breaking changes"},
    )
    request.refresh_from_db()
    assert request.title == "Create task: Review the shop-v2 breaking changes"
    html = login(client, reviewer_a).get(page_url(request)).content.decode()
    assert "<h1>Create task: Review the shop-v2 breaking changes</h1>" in html
    history = client.get(reverse("inbox-history")).content.decode()
    assert "Create task: Review the shop-v2 breaking changes" in history


def test_an_edit_under_a_quorum_retitles_the_pending_request(
    client: Client, reviewer_a: Persona, held: Any, policy: Any, tenant_a: Tenant
) -> None:
    """With a quorum of two the edited request stays pending: the inbox lists it by what
    will be sent."""
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(quorum=2)
    decide(request.pk, reviewer_a.user, "approve", request.action_hash, edits={"title": "Edited"})
    request.refresh_from_db()
    assert request.status == A.PENDING and request.title == "Create task: Edited"
    inbox = login(client, reviewer_a).get(reverse("inbox")).content.decode()
    assert "Create task: Edited" in inbox and "Review 3 API" not in inbox


def test_the_run_page_links_what_it_waits_for_to_the_approval_request(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    html = login(client, reviewer_a).get(reverse("run", args=[run.run_id])).content.decode()
    waiting = re.search(r'<p class="waiting-for" id="waiting-for">(.*?)</p>', html, re.S)
    assert waiting is not None
    assert "Waiting for a reviewer to approve or reject tasks.create." in text_of(waiting.group(1))
    link = re.search(r'href="([^"]+)" class="waiting-link">Open the approval request', html)
    assert link is not None
    assert client.get(link.group(1))["Location"] == page_url(request)
    assert '"kind": "approval"' not in unescape(html)


def test_the_approval_link_of_another_tenants_action_is_a_404(
    client: Client, held: Any, tenant_b: Tenant
) -> None:

    run, request, box = held
    outsider = make_persona(tenant_b, "olga", Role.REVIEWER)
    client.force_login(outsider.user)
    url = reverse("approval-for-action", args=[request.action_id])
    assert client.get(url).status_code == 404
