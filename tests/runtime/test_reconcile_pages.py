"""Reviewer pages for manual reconciliation, against the real sandbox in mode `none`.

A tool that can neither deduplicate nor be looked up leaves an unknown outcome to a human
(DESIGN.md, invariants 2–3). These tests get such an action through a real run — the sandbox
applies the task and drops the connection, or refuses before applying — and check what the
reviewer sees, that the page hands the answer to `resolve` (which alone decides), that the
run then finishes with exactly one task in the service, that viewers cannot answer and that
another tenant's action is indistinguishable from no action at all.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from audit.journal import run_stream
from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from tests.conftest import Persona
from tests.runtime.helpers import payloads
from tests.sandbox import Sandbox

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
Factory = Callable[[str], Sandbox]


def login(client: Client, persona: Persona) -> Client:
    client.force_login(persona.user)
    return client


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def parked_action(tenant: Tenant, box: Sandbox, **faults: float) -> tuple[Run, Action]:
    """A real api-review run whose task creation nobody can settle: manual_review."""
    box.faults(**faults)
    run = create_run(tenant, "api-review", GOAL, actor="user:alice")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    action = Action.objects.get(run=run)
    assert run.status == RunStatus.NEEDS_RECONCILIATION
    assert action.status == ActionStatus.MANUAL_REVIEW
    assert action.in_flight_until is not None and action.in_flight_until > timezone.now()
    return run, action


def inline_manual_review(tenant: Tenant, n: int = 1) -> list[Action]:
    """Parked actions made directly, for listing (isolation, query budget): no sandbox."""
    run = create_run(tenant, "chain", {"steps": 2}, actor="t")
    return [
        Action.objects.create(
            tenant=tenant,
            run=run,
            idempotency_key=f"{run.run_id}:1:s:{i}",
            tool="tasks.create",
            params='{"title":"inline"}',
            fingerprint="0" * 64,
            goal_rev=1,
            fence=1,
            step="s",
            call_index=i,
            target=f"target-of-{tenant.slug}-{i}",
            status=ActionStatus.MANUAL_REVIEW,
        )
        for i in range(n)
    ]


def resolve_url(action: Action) -> str:
    return reverse("reconcile-resolve", args=[action.action_id])


def detail_url(action: Action) -> str:
    return reverse("reconcile-detail", args=[action.action_id])


def journal_size(run: Run) -> int:
    return JournalEntry.objects.filter(stream=run_stream(run.run_id)).count()


@pytest.fixture
def box(sandbox_factory: Factory) -> Sandbox:
    return sandbox_factory("none")


# --- the list -------------------------------------------------------------------------------


def test_list_shows_the_parked_action_and_not_other_tenants(
    client: Client, reviewer_a: Persona, tenant_b: Tenant, box: Sandbox
) -> None:
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    (theirs,) = inline_manual_review(tenant_b)
    page = login(client, reviewer_a).get(reverse("reconcile"))
    assert page.status_code == 200
    assert [a.action_id for a in page.context["page_obj"]] == [action.action_id]
    text = page.content.decode()
    assert "1 waiting for a human" in text
    assert detail_url(action) in text and reverse("run", args=[run.run_id]) in text
    assert action.idempotency_key in text and "tasks.create" in text
    assert "1 sent · 1 reconciled" in text
    assert "cannot deduplicate or be looked up" in text  # the last error
    assert " ago</time>" in text
    assert detail_url(theirs) not in text and "globex" not in text.lower()


def test_list_is_empty_when_everything_is_known(client: Client, reviewer_a: Persona) -> None:
    page = login(client, reviewer_a).get(reverse("reconcile"))
    assert page.status_code == 200
    assert b"Nothing to reconcile" in page.content and b"0 waiting for a human" in page.content


def test_list_query_count_does_not_grow_with_actions(client: Client, reviewer_a: Persona) -> None:
    login(client, reviewer_a)
    inline_manual_review(reviewer_a.tenant, 2)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            page = client.get(reverse("reconcile"))
        assert page.status_code == 200
        return len(captured)

    few = queries()
    inline_manual_review(reviewer_a.tenant, 20)
    assert queries() == few


def test_run_page_links_only_parked_actions_to_reconcile(
    client: Client, reviewer_a: Persona, box: Sandbox
) -> None:
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    login(client, reviewer_a)
    page = client.get(reverse("run", args=[run.run_id]))
    assert detail_url(action).encode() in page.content and "resolve…".encode() in page.content
    Action.objects.filter(pk=action.pk).update(status=ActionStatus.CONFIRMED, external_id="x")
    page = client.get(reverse("run", args=[run.run_id]))
    assert detail_url(action).encode() not in page.content


# --- one action -----------------------------------------------------------------------------


def test_detail_shows_everything_known_and_the_in_flight_window(
    client: Client, reviewer_a: Persona, box: Sandbox
) -> None:
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    page = login(client, reviewer_a).get(detail_url(action))
    assert page.status_code == 200
    text = page.content.decode()
    assert '"title": ' in page.context["params_json"]  # pretty-printed, not the stored text
    assert "3 API compatibility risk(s)" in text
    assert action.fingerprint in text and action.idempotency_key in text
    assert "cannot deduplicate or be looked up" in text
    assert "the sender may still be in flight until" in text.lower()
    assert "is refused until then" in text
    assert f"run at {run.goal_rev}" in text and "needs_reconciliation" in text
    types = [row.entry.type for row in page.context["history"]]
    assert types[-1] == "action_prepared" and "action_outcome" in types
    assert all(
        row.entry.payload["action_id"] == str(action.action_id) for row in page.context["history"]
    )
    assert text.count(f'action="{resolve_url(action)}"') == 2
    assert 'name="csrfmiddlewaretoken"' in text
    assert 'value="applied"' in text and 'value="not_applied"' in text


def test_not_applied_while_in_flight_is_refused_and_changes_nothing(
    client: Client, reviewer_a: Persona, box: Sandbox
) -> None:
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    before = journal_size(run)
    login(client, reviewer_a)
    response = client.post(resolve_url(action), {"outcome": "not_applied"}, follow=True)
    assert response.redirect_chain == [(detail_url(action), 302)]
    assert any("may still be in flight" in m for m in messages_of(response))
    action.refresh_from_db()
    run.refresh_from_db()
    assert action.status == ActionStatus.MANUAL_REVIEW
    assert run.status == RunStatus.NEEDS_RECONCILIATION
    assert journal_size(run) == before and len(box.tasks()) == 1


def test_applied_without_the_id_is_refused_and_changes_nothing(
    client: Client, reviewer_a: Persona, box: Sandbox
) -> None:
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    before = journal_size(run)
    login(client, reviewer_a)
    response = client.post(
        resolve_url(action), {"outcome": "applied", "external_id": "  "}, follow=True
    )
    assert response.redirect_chain == [(detail_url(action), 302)]
    assert any("needs the external id" in m for m in messages_of(response))
    action.refresh_from_db()
    assert action.status == ActionStatus.MANUAL_REVIEW and action.external_id == ""
    assert journal_size(run) == before


def test_unknown_outcome_is_a_message_not_a_500(
    client: Client, reviewer_a: Persona, box: Sandbox
) -> None:
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    login(client, reviewer_a)
    response = client.post(resolve_url(action), {"outcome": "maybe"}, follow=True)
    assert response.status_code == 200
    assert any("outcome must be" in m for m in messages_of(response))
    action.refresh_from_db()
    assert action.status == ActionStatus.MANUAL_REVIEW


def test_applied_with_the_real_task_id_completes_the_run_with_one_task(
    client: Client, reviewer_a: Persona, box: Sandbox
) -> None:
    """The connection dropped after the task was created: a person saw it and says so."""
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    (task,) = box.tasks()
    login(client, reviewer_a)
    response = client.post(
        resolve_url(action),
        {"outcome": "applied", "external_id": task["id"], "note": "saw it in the tracker"},
        follow=True,
    )
    assert response.redirect_chain == [(reverse("run", args=[run.run_id]), 302)]
    assert any("was applied" in m for m in messages_of(response))
    action.refresh_from_db()
    run.refresh_from_db()
    assert action.status == ActionStatus.CONFIRMED and action.external_id == task["id"]
    assert run.status == RunStatus.QUEUED
    (resolved,) = JournalEntry.objects.filter(stream=run_stream(run.run_id), type="action_resolved")
    assert resolved.actor == "user:alice"
    assert resolved.payload["outcome"] == "applied"
    assert resolved.payload["note"] == "saw it in the tracker"

    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert [t["id"] for t in box.tasks()] == [task["id"]]

    again = client.post(resolve_url(action), {"outcome": "not_applied"}, follow=True)
    assert any("not manual_review" in m for m in messages_of(again))
    page = client.get(detail_url(action))
    assert b"nothing to reconcile" in page.content and resolve_url(action).encode() not in (
        page.content
    )


def test_not_applied_once_out_of_flight_sends_it_again_with_the_same_key(
    client: Client, reviewer_a: Persona, box: Sandbox
) -> None:
    """The service refused before applying: nothing happened, so it is sent again once."""
    run, action = parked_action(reviewer_a.tenant, box, fail_before=1)
    assert box.tasks() == []
    Action.objects.filter(pk=action.pk).update(in_flight_until=timezone.now())
    login(client, reviewer_a)
    response = client.post(
        resolve_url(action), {"outcome": "not_applied", "note": "not in the tracker"}
    )
    assert response.status_code == 302
    assert response["Location"] == reverse("run", args=[run.run_id])
    action.refresh_from_db()
    run.refresh_from_db()
    assert action.status == ActionStatus.PREPARED and run.status == RunStatus.QUEUED
    (resolved,) = payloads(run, "action_resolved")
    assert resolved["outcome"] == "not_applied" and resolved["note"] == "not in the tracker"

    assert advance_run(run.run_id, "w1").outcome == "completed"
    tasks = box.tasks()
    assert len(tasks) == 1 and tasks[0]["idempotency_key"] == action.idempotency_key


# --- who may -------------------------------------------------------------------------------


def test_viewer_sees_the_page_but_cannot_resolve(
    client: Client, viewer_a: Persona, box: Sandbox
) -> None:
    run, action = parked_action(viewer_a.tenant, box, drop_after=1)
    login(client, viewer_a)
    assert client.get(reverse("reconcile")).status_code == 200
    page = client.get(detail_url(action))
    assert page.status_code == 200
    assert resolve_url(action).encode() not in page.content
    assert b'name="outcome"' not in page.content and b"you may look" in page.content
    (task,) = box.tasks()
    response = client.post(resolve_url(action), {"outcome": "applied", "external_id": task["id"]})
    assert response.status_code == 403
    action.refresh_from_db()
    assert action.status == ActionStatus.MANUAL_REVIEW


def test_other_tenants_action_is_not_found_like_a_missing_one(
    client: Client, reviewer_a: Persona, outsider_b: Persona, box: Sandbox
) -> None:
    run, action = parked_action(reviewer_a.tenant, box, drop_after=1)
    (task,) = box.tasks()
    login(client, outsider_b)
    listed = client.get(reverse("reconcile"))
    assert list(listed.context["page_obj"]) == [] and detail_url(action).encode() not in (
        listed.content
    )
    missing = uuid.uuid4()
    foreign = client.get(detail_url(action))
    absent = client.get(reverse("reconcile-detail", args=[missing]))
    assert foreign.status_code == absent.status_code == 404
    assert foreign.content == absent.content
    for action_id in (action.action_id, missing):
        posted = client.post(
            reverse("reconcile-resolve", args=[action_id]),
            {"outcome": "applied", "external_id": task["id"]},
        )
        assert posted.status_code == 404
    action.refresh_from_db()
    assert action.status == ActionStatus.MANUAL_REVIEW


def test_pages_need_login_and_refuse_agents(client: Client, agent_a: Persona) -> None:
    (action,) = inline_manual_review(agent_a.tenant)
    for url in (reverse("reconcile"), detail_url(action)):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith(reverse("login"))
    login(client, agent_a)
    assert client.get(reverse("reconcile")).status_code == 403
    assert client.get(detail_url(action)).status_code == 403
    assert client.post(resolve_url(action), {"outcome": "not_applied"}).status_code == 403


def test_resolve_refuses_get_and_pages_refuse_post(client: Client, reviewer_a: Persona) -> None:
    (action,) = inline_manual_review(reviewer_a.tenant)
    login(client, reviewer_a)
    assert client.get(resolve_url(action)).status_code == 405
    assert client.post(reverse("reconcile")).status_code == 405
    assert client.post(detail_url(action)).status_code == 405
    action.refresh_from_db()
    assert action.status == ActionStatus.MANUAL_REVIEW


def test_pages_have_no_inline_scripts_or_handlers(client: Client, reviewer_a: Persona) -> None:
    (action,) = inline_manual_review(reviewer_a.tenant)
    login(client, reviewer_a)
    for url in (reverse("reconcile"), detail_url(action)):
        text = client.get(url).content.decode().lower()
        assert "<script>" not in text and " onclick=" not in text and " onsubmit=" not in text
        assert " style=" not in text


def test_nav_marks_the_reconcile_pages(client: Client, reviewer_a: Persona) -> None:
    (action,) = inline_manual_review(reviewer_a.tenant)
    login(client, reviewer_a)
    link = f'<a href="{reverse("reconcile")}" aria-current='
    assert f'{link}"page">Reconcile</a>' in client.get(reverse("reconcile")).content.decode()
    assert f'{link}"location">Reconcile</a>' in client.get(detail_url(action)).content.decode()
