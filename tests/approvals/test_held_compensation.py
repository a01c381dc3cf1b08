"""A compensation held by a policy: a real hold point, decided like any other.

A tenant policy holds `tasks.close`, the undo tool of `tasks.create`. The tenant admin asks
for the undo on the run page; the compensation waits with an approval request bound to its
action hash, in the reviewers' inbox. Approved (in the browser, over the API, or at expiry
when the policy says so), it is sent — by its own sender, rung after the decision commits,
on django-q2's real ORM queue — and closes the task on the real sandbox tracker once.
Rejected, nothing is sent and the original stays confirmed. Before, the compensation waited
as `awaiting_approval` with no request, and nothing would have sent it had it been approved.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.decisions import decide
from approvals.expiry import sweep_approvals
from approvals.hashing import action_hash
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, OnExpiry
from approvals.notify import body
from runtime import tasks
from runtime.compensation import dispatch_standalone
from runtime.errors import NotPermitted
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from runtime.sweeper import sweep_once
from tests.approvals.conftest import GOAL, reviewed_by_group
from tests.conftest import Persona, make_persona
from tests.sandbox import Sandbox

A = ApprovalStatus
S = ActionStatus
SENDER = "runtime.tasks.dispatch_standalone"


@pytest.fixture
def undo_policy(tenant_a: Tenant, reviewer_a: Persona) -> ApprovalPolicy:
    """tasks.close (the undo of tasks.create) waits for tenant A's reviewer group."""
    return reviewed_by_group(tenant_a, "undos need review", "tasks.close")


def user_of(persona: Persona) -> User:
    return cast(User, persona.user)


def page_of(persona: Persona) -> Client:
    client = Client()
    client.force_login(user_of(persona))
    return client


def rings() -> list[tuple[str, ...]]:
    """The sender's rings waiting on django-q2's ORM queue."""
    from django_q.models import OrmQ

    return [tuple(q.task["args"]) for q in OrmQ.objects.all() if q.task["func"] == SENDER]


def run_rings() -> None:
    """What the worker runs for each ring on the queue (then the queue is empty)."""
    from django_q.models import OrmQ

    for queued in list(OrmQ.objects.all()):
        if queued.task["func"] == SENDER:
            tasks.dispatch_standalone(*queued.task["args"])
        queued.delete()


def closes(box: Sandbox) -> list[dict[str, Any]]:
    return [r for r in box.requests() if r["method"] == "POST" and r["path"].endswith("/close")]


def on_page(persona: Persona, request: ApprovalRequest, decision: str, **fields: str) -> Any:
    """The reviewer's decide form on the request page (followed to where it lands)."""
    form = {"decision": decision, "action_hash": request.action_hash, **fields}
    url = reverse("approval-page-decide", args=[request.pk])
    return page_of(persona).post(url, form, follow=True)


def by_api(persona: Persona, request: ApprovalRequest, seen_hash: str) -> Any:
    """`POST approvals/{id}/decision/`: an approval of the action as `seen_hash`."""
    url = reverse("api-decision", args=[request.pk])
    body = {"decision": "approve", "action_hash": seen_hash}
    return persona.api().post(url, body, format="json")


@pytest.fixture
def committed(django_capture_on_commit_callbacks: Any) -> Callable[[], Any]:
    """`with committed():` runs the on-commit callbacks (the doorbells) as the commit would."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


@pytest.fixture
def held_undo(
    admin_a: Persona,
    undo_policy: ApprovalPolicy,
    sandbox_factory: Callable[[str], Sandbox],
    committed: Any,
) -> tuple[Run, Action, Action, Sandbox]:
    """A completed run whose task (tasks.create) is confirmed; the admin asked, on the run
    page, for its undo, which the policy holds. (run, original, compensation, tracker)"""
    from django_q.models import OrmQ

    box = sandbox_factory("key")
    run = create_run(admin_a.tenant, "api-review", GOAL, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    assert original.status == S.CONFIRMED
    OrmQ.objects.all().delete()
    with committed():
        asked = page_of(admin_a).post(
            reverse("action-compensate", args=[original.action_id]),
            {"reason": "created by mistake"},
            follow=True,
        )
    assert asked.status_code == 200
    assert "It waits for a reviewer&#x27;s approval." in asked.content.decode()
    undo = Action.objects.get(compensates=original)
    assert undo.status == S.AWAITING_APPROVAL
    return run, original, undo, box


def the_request(undo: Action) -> ApprovalRequest:
    return ApprovalRequest.objects.get(action=undo, status=A.PENDING)


def test_a_held_compensation_is_one_pending_request_in_the_reviewers_inbox(
    held_undo: Any,
    reviewer_a: Persona,
    admin_a: Persona,
    committed: Any,
) -> None:
    run, original, undo, box = held_undo
    requests = list(ApprovalRequest.objects.filter(action=undo))
    assert [r.status for r in requests] == [A.PENDING]
    request = requests[0]
    assert request.action_hash == action_hash(undo) and request.run_id == run.pk
    assert request.policy.name == "undos need review"
    assert request.shown["compensates"] == {
        "action_id": str(original.action_id),
        "tool": "tasks.create",
        "idempotency_key": original.idempotency_key,
        "asked_by": "user:ada",
    }
    assert rings() == [] and closes(box) == []  # held: nobody rings its sender

    inbox = page_of(reviewer_a).get(reverse("inbox")).content.decode()
    assert reverse("approval-page", args=[request.pk]) in inbox
    assert original.idempotency_key in inbox  # "Undoes …": which action it undoes
    assert "then re-requested once, then rejected: the compensation is not sent" in inbox

    page = page_of(reviewer_a).get(reverse("approval-page", args=[request.pk]))
    assert page.status_code == 200
    shown = page.content.decode()
    assert f"user:ada, to undo tasks.create {original.idempotency_key}" in shown
    assert "in its step" not in shown  # no step asked for it
    assert request.action_hash in shown  # the decide form binds the hash it shows
    told = body("requested", request)  # what the reviewers' notice says
    assert f"asked for it, to undo tasks.create {original.idempotency_key}" in told
    assert "nothing is sent" in told and "the run waits" not in told

    # Asking again is the same compensation and the same request; it rings nothing, and
    # neither does the sweeper (it is not unsent: it waits for its decision).
    with committed():
        again = page_of(admin_a).post(
            reverse("action-compensate", args=[original.action_id]), {"reason": "again"}
        )
    assert again.status_code == 302
    Action.objects.filter(pk=undo.pk).update(send_retry_at=timezone.now() - timedelta(seconds=1))
    sweep_once(ring=lambda run_id: None)
    assert rings() == []
    assert ApprovalRequest.objects.filter(action=undo).count() == 1
    assert Action.objects.get(pk=undo.pk).status == S.AWAITING_APPROVAL
    assert closes(box) == []


@pytest.mark.parametrize("door", ["browser", "api"])
def test_an_approval_sends_the_compensation_once(
    door: str,
    held_undo: Any,
    reviewer_a: Persona,
    committed: Any,
) -> None:
    run, original, undo, box = held_undo
    request = the_request(undo)
    with committed():
        if door == "browser":
            answered = on_page(reviewer_a, request, "approve")
            assert answered.status_code == 200
            assert "The compensation is queued to send." in answered.content.decode()
        else:
            api = by_api(reviewer_a, request, request.action_hash)
            assert api.status_code == 200, api.content
            assert api.json()["status"] == "approved"
    assert Action.objects.get(pk=undo.pk).status == S.APPROVED
    assert rings() == [(str(undo.action_id),)]  # rung by the decision, after it committed

    run_rings()
    undo.refresh_from_db()
    original.refresh_from_db()
    assert undo.status == S.CONFIRMED and original.status == S.COMPENSATED
    assert len(closes(box)) == 1 and [t["status"] for t in box.tasks()] == ["closed"]
    assert dispatch_standalone(undo.action_id).status == S.CONFIRMED  # a late ring: no resend
    assert len(closes(box)) == 1
    page = page_of(reviewer_a).get(reverse("approval-page", args=[request.pk])).content.decode()
    assert f"tasks.create {original.idempotency_key} is compensated" in page


def test_a_rejection_sends_nothing_and_the_original_stays_confirmed(
    held_undo: Any,
    reviewer_a: Persona,
    admin_a: Persona,
    committed: Any,
) -> None:
    run, original, undo, box = held_undo
    request = the_request(undo)
    with committed():
        answered = on_page(reviewer_a, request, "reject", reason="keep it")
    assert answered.status_code == 200
    shown = answered.content.decode()
    assert f"tasks.create {original.idempotency_key} stays confirmed" in shown
    assert "ActionRejected" not in shown  # no step is told anything
    undo.refresh_from_db()
    original.refresh_from_db()
    assert undo.status == S.CANCELLED and undo.last_error == "rejected by alice: keep it"
    assert original.status == S.CONFIRMED
    assert rings() == [] and closes(box) == []
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED

    # The effect is still in place: the page offers the undo again, saying what became of
    # the first; asking again (a new reason) is a new compensation under its own key, held
    # by the same policy with a new request; approved, it closes the task once.
    admin = page_of(admin_a)
    page = admin.get(reverse("run", args=[run.run_id])).content.decode()
    assert f'action="/actions/{original.action_id}/compensate/"' in page
    assert "An earlier undo did not take effect (cancelled: rejected by alice: keep it)" in page
    with committed():
        again = admin.post(
            reverse("action-compensate", args=[original.action_id]),
            {"reason": "it was a mistake after all"},
            follow=True,
        )
    assert "It waits for a reviewer&#x27;s approval." in again.content.decode()
    second = Action.objects.exclude(pk=undo.pk).get(compensates=original)
    assert second.idempotency_key == f"{original.idempotency_key}:undo:2"
    assert (second.status, second.reason) == (S.AWAITING_APPROVAL, "it was a mistake after all")
    assert rings() == [] and closes(box) == []
    # Asking a third time while the second is under way answers the second.
    with committed():
        admin.post(
            reverse("action-compensate", args=[original.action_id]), {"reason": "x"}, follow=True
        )
    assert Action.objects.filter(compensates=original).count() == 2
    assert (
        f'action="/actions/{original.action_id}/compensate/"'
        not in admin.get(reverse("run", args=[run.run_id])).content.decode()
    )
    with committed():
        assert on_page(reviewer_a, the_request(second), "approve").status_code == 200
    run_rings()
    second.refresh_from_db()
    original.refresh_from_db()
    assert (second.status, original.status) == (S.CONFIRMED, S.COMPENSATED)
    assert len(closes(box)) == 1 and box.tasks()[0]["status"] == "closed"
    assert Action.objects.get(pk=undo.pk).status == S.CANCELLED  # the first stays as decided


def test_a_changed_compensation_cannot_be_approved_as_shown(
    held_undo: Any, reviewer_a: Persona, committed: Any
) -> None:
    """The decision API's stale-hash check: a page older than the action, or an action that
    changed under its request, is refused (409 hash_mismatch) and nothing is sent."""
    run, original, undo, box = held_undo
    request = the_request(undo)
    with committed():
        stale = by_api(reviewer_a, request, "0" * 64)
    assert stale.status_code == 409 and stale.json()["code"] == "hash_mismatch"

    Action.objects.filter(pk=undo.pk).update(params='{"task_id":"someone-elses"}')
    with committed():
        changed = by_api(reviewer_a, request, request.action_hash)
    assert changed.status_code == 409 and changed.json()["code"] == "hash_mismatch"
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED
    fresh = the_request(undo)  # raised for what the action is now
    assert fresh.action_hash == action_hash(Action.objects.get(pk=undo.pk)) != request.action_hash
    assert fresh.shown["compensates"]["asked_by"] == "user:ada"
    assert Action.objects.get(pk=undo.pk).status == S.AWAITING_APPROVAL
    assert rings() == [] and closes(box) == []


def test_another_tenant_cannot_see_or_decide_it(
    held_undo: Any,
    outsider_b: Persona,
    tenant_b: Tenant,
    committed: Any,
) -> None:
    run, original, undo, box = held_undo
    request = the_request(undo)
    intruder = page_of(outsider_b)
    assert (
        reverse("approval-page", args=[request.pk])
        not in intruder.get(reverse("inbox")).content.decode()
    )
    assert intruder.get(reverse("approval-page", args=[request.pk])).status_code == 404
    admin_b = make_persona(tenant_b, "bea", "admin", is_staff=True)
    with committed():
        foreign_page = on_page(outsider_b, request, "approve")
        foreign_api = by_api(admin_b, request, request.action_hash)
    assert foreign_page.status_code == 404 and foreign_api.status_code == 404
    listed = outsider_b.api().get(reverse("api-approvals")).json()
    assert str(request.pk) not in str(listed)
    with pytest.raises(NotPermitted):
        decide(request.pk, user_of(outsider_b), "approve", request.action_hash)
    assert the_request(undo).pk == request.pk
    assert Action.objects.get(pk=undo.pk).status == S.AWAITING_APPROVAL
    assert rings() == [] and closes(box) == []


@pytest.mark.parametrize("on_expiry", [OnExpiry.APPROVE, OnExpiry.REJECT, OnExpiry.REREQUEST])
def test_expiry_follows_the_policy(
    on_expiry: str,
    held_undo: Any,
    undo_policy: ApprovalPolicy,
    committed: Any,
) -> None:
    """Approve at expiry: sent, as an approval is. Reject: cancelled, never sent. Re-request
    (the default): asked once more, then rejected — and its run, which waits for nothing,
    is not sent to needs_attention."""
    run, original, undo, box = held_undo
    ApprovalPolicy.objects.filter(pk=undo_policy.pk).update(on_expiry=on_expiry)

    def expire_now() -> None:
        ApprovalRequest.objects.filter(action=undo, status=A.PENDING).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        with committed():
            sweep_approvals()

    expire_now()
    if on_expiry == OnExpiry.REREQUEST:
        assert the_request(undo).rerequest_count == 1
        assert the_request(undo).shown["compensates"]["asked_by"] == "user:ada"
        expire_now()
    run_rings()
    undo.refresh_from_db()
    original.refresh_from_db()
    if on_expiry == OnExpiry.APPROVE:
        assert undo.status == S.CONFIRMED and original.status == S.COMPENSATED
        assert len(closes(box)) == 1
    else:
        assert undo.status == S.CANCELLED and original.status == S.CONFIRMED
        assert "rejected at expiry" in undo.last_error
        assert closes(box) == []
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def test_an_approved_compensation_the_tracker_refused_is_sent_again_later(
    held_undo: Any,
    reviewer_a: Persona,
    settings: Any,
    committed: Any,
) -> None:
    """Approved, but the tracker is down when its sender runs: nothing applied, the failure
    kept on its row, and the sweeper's resend sends it once the tracker is back — under the
    same approval, re-checked before `sent`."""
    from tests.runtime.test_compensation import closed_port

    run, original, undo, box = held_undo
    request = the_request(undo)
    with committed():
        decide(request.pk, user_of(reviewer_a), "approve", request.action_hash)
    settings.HOLDPOINT_TASKS_URL = f"http://127.0.0.1:{closed_port()}"  # the tracker is down
    run_rings()
    stuck = Action.objects.get(pk=undo.pk)
    assert stuck.status in (S.PREPARED, S.APPROVED) and stuck.send_failures == 1
    assert stuck.send_retry_at is not None

    settings.HOLDPOINT_TASKS_URL = box.url  # back
    Action.objects.filter(pk=undo.pk).update(send_retry_at=timezone.now() - timedelta(seconds=1))
    sweep_once(ring=lambda run_id: None)
    assert rings() == [(str(undo.action_id),)]
    run_rings()
    undo.refresh_from_db()
    original.refresh_from_db()
    assert undo.status == S.CONFIRMED and original.status == S.COMPENSATED
    assert len(closes(box)) == 1
    assert ApprovalRequest.objects.get(pk=request.pk).status == A.APPROVED
