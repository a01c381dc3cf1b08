"""A tenant admin undoes a confirmed action from the run page.

`runtime.compensation.compensate` is the one writer; the run page's "Undo a confirmed action"
form is the tenant admin's way to call it. These tests drive the page with the Django test
client against the sandbox tracker: the admin's compensation closes the task and marks the
original compensated; nobody else — a reviewer, a viewer, another tenant — can ask for one;
asking twice is one compensation; the form is only offered where a compensation is declared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from audit.models import JournalEntry
from runtime.compensation import REASON_MAX, dispatch_standalone
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, Tenant
from runtime.tools import get_tool
from tests.conftest import Persona, make_persona
from tests.sandbox import Sandbox

pytestmark = pytest.mark.django_db
GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/users"],
    "create_review_task": True,
}


def page_of(persona: Persona) -> Client:
    client = Client()
    client.force_login(persona.user)
    return client


def form_of(action: Action) -> str:
    return f'action="/actions/{action.action_id}/compensate/"'


def completed_run(tenant: Tenant) -> tuple[Run, Action]:
    """A run whose one action (tasks.create, undone by tasks.close) is confirmed."""
    run = create_run(tenant, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED
    return run, action


def ask(client: Client, action: Action, reason: str = "created by mistake", **extra: Any) -> Any:
    url = reverse("action-compensate", args=[action.action_id])
    return client.post(url, {"reason": reason}, **extra)


def nothing_compensated(action: Action, box: Sandbox) -> None:
    action.refresh_from_db()
    assert action.status == ActionStatus.CONFIRMED
    assert not Action.objects.filter(compensates=action).exists()
    assert [t["status"] for t in box.tasks()] == ["open"]


def test_an_admin_compensates_and_the_run_page_shows_it(
    admin_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    run, original = completed_run(admin_a.tenant)
    admin = page_of(admin_a)
    page = admin.get(reverse("run", args=[run.run_id])).content.decode()
    assert form_of(original) in page and "→ tasks.close" in page
    assert f'maxlength="{REASON_MAX}"' in page

    answered = ask(admin, original, follow=True)
    assert answered.status_code == 200
    assert answered.redirect_chain[-1][0] == reverse("run", args=[run.run_id])
    shown = answered.content.decode()
    assert f"Compensating tasks.create {original.idempotency_key} with tasks.close" in shown
    undo = Action.objects.get(compensates=original)
    assert undo.tool == "tasks.close" and undo.status == ActionStatus.PREPARED
    assert undo.reason == "created by mistake"
    assert form_of(original) not in shown  # asked for: no second form
    assert undo.idempotency_key in shown  # the compensating action, listed with its status

    dispatch_standalone(undo.action_id)  # what the worker the doorbell rang does
    original.refresh_from_db()
    undo.refresh_from_db()
    assert undo.status == ActionStatus.CONFIRMED
    assert original.status == ActionStatus.COMPENSATED
    assert [t["status"] for t in box.tasks()] == ["closed"]
    prepared = JournalEntry.objects.get(
        stream=f"run:{run.run_id}", type="action_prepared", payload__compensates=str(original.pk)
    )
    assert prepared.actor == "user:ada" and prepared.payload["tool"] == "tasks.close"
    said = [
        (p["action_id"], p["action_status"])
        for p in JournalEntry.objects.filter(
            stream=f"run:{run.run_id}", type="action_outcome"
        ).values_list("payload", flat=True)
    ]
    assert said[-3:] == [
        (str(undo.pk), "sent"),
        (str(undo.pk), "confirmed"),
        (str(original.pk), "compensated"),
    ]

    page = admin.get(reverse("run", args=[run.run_id])).content.decode()
    assert 'badge compensated">compensated' in page and form_of(original) not in page


def test_a_second_post_is_the_same_compensation(
    admin_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    sandbox_factory("key")
    _, original = completed_run(admin_a.tenant)
    admin = page_of(admin_a)
    assert ask(admin, original).status_code == 302
    again = ask(admin, original, "again", follow=True)
    assert again.status_code == 200
    assert Action.objects.filter(compensates=original).count() == 1
    assert Action.objects.get(compensates=original).reason == "created by mistake"


@pytest.mark.parametrize("role", ["reviewer", "viewer"])
def test_a_reviewer_or_viewer_is_refused_and_nothing_happens(
    role: str, tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    person = make_persona(tenant_a, f"{role}-1", role)
    run, original = completed_run(tenant_a)
    client = page_of(person)
    assert form_of(original) not in client.get(reverse("run", args=[run.run_id])).content.decode()
    assert ask(client, original).status_code == 403
    nothing_compensated(original, box)


def test_another_tenants_admin_gets_the_404_of_a_missing_id(
    admin_a: Persona, tenant_b: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    _, original = completed_run(admin_a.tenant)
    intruder = page_of(make_persona(tenant_b, "bea", "admin", is_staff=True))
    foreign = ask(intruder, original)
    missing = intruder.post(reverse("action-compensate", args=[Run().run_id]), {"reason": "x"})
    assert foreign.status_code == missing.status_code == 404
    assert foreign.content == missing.content
    nothing_compensated(original, box)


def test_logged_out_and_agents_are_refused(
    agent_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    _, original = completed_run(agent_a.tenant)
    anonymous = ask(Client(), original)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/")
    assert ask(page_of(agent_a), original).status_code == 403
    nothing_compensated(original, box)


def test_a_reason_is_required_and_bounded(
    admin_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    _, original = completed_run(admin_a.tenant)
    admin = page_of(admin_a)
    for reason in ("", "   ", "x" * (REASON_MAX + 1), "a\x00b"):
        assert ask(admin, original, reason).status_code == 400, reason
    nothing_compensated(original, box)


def test_an_action_that_cannot_be_compensated_is_a_message(
    admin_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    sandbox_factory("none").faults(drop_after=1)
    run = create_run(admin_a.tenant, "api-review", GOAL, actor="t")
    advance_run(run.run_id, "w1")
    parked = Action.objects.get(run=run)
    assert parked.status == ActionStatus.MANUAL_REVIEW
    admin = page_of(admin_a)
    assert form_of(parked) not in admin.get(reverse("run", args=[run.run_id])).content.decode()
    answered = ask(admin, parked, follow=True)
    assert answered.status_code == 200
    assert "only a confirmed action can be compensated" in answered.content.decode()
    assert not Action.objects.filter(compensates=parked).exists()


# --- a compensation whose send could not reach its tool ---------------------------------------


def send_again_form(undo: Action) -> str:
    return f'action="/actions/{undo.action_id}/send-again/"'


def stuck_compensation(admin: Client, original: Action) -> Action:
    """The admin asks for the compensation while tasks.close's circuit is open: the worker's
    send (`dispatch_standalone`, what its ring runs) cannot reach the tool, and the
    compensation stays prepared — nothing sent, the failure kept on its row."""
    breaker = get_tool("tasks.close", original.tenant_id).breaker
    try:
        for _ in range(breaker.threshold):
            breaker.record(False)  # the circuit opens (this process's breaker)
        assert ask(admin, original).status_code == 302
        undo = Action.objects.get(compensates=original)
        assert dispatch_standalone(undo.action_id).status == ActionStatus.PREPARED
    finally:
        breaker.record(True)  # closed again: the tool is reachable from here on
    undo.refresh_from_db()
    return undo


def rings_of(undo: Action) -> int:
    from django_q.models import OrmQ

    return sum(
        1
        for q in OrmQ.objects.all()
        if q.task["func"] == "runtime.tasks.dispatch_standalone"
        and tuple(q.task["args"]) == (str(undo.action_id),)
    )


def nothing_sent(undo: Action, box: Sandbox) -> None:
    assert rings_of(undo) == 0
    undo.refresh_from_db()
    assert undo.status == ActionStatus.PREPARED
    assert [t["status"] for t in box.tasks()] == ["open"]


def send_again(client: Client, undo: Action, **extra: Any) -> Any:
    return client.post(reverse("action-send-again", args=[undo.action_id]), **extra)


def test_a_stuck_compensation_shows_why_and_is_sent_again_once(
    admin_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    django_capture_on_commit_callbacks: Any,
) -> None:
    """Its send met an open circuit: the run page tells the admin when and why, and offers
    "Send again"; pressed twice once the tool is back, the task is closed by one request and
    the compensation confirmed."""
    from django_q.models import OrmQ

    from runtime import tasks

    box = sandbox_factory("key")
    run, original = completed_run(admin_a.tenant)
    admin = page_of(admin_a)
    undo = stuck_compensation(admin, original)
    assert undo.send_failed_at is not None and undo.send_failures == 1
    assert undo.send_failure.startswith("tasks.close: circuit open")
    assert undo.send_retry_at is not None and undo.send_retry_at > undo.send_failed_at
    failed = JournalEntry.objects.get(stream=f"run:{run.run_id}", type="action_send_failed")
    assert failed.payload["action_id"] == str(undo.pk)
    assert failed.payload["reason"] == undo.send_failure

    page = admin.get(reverse("run", args=[run.run_id])).content.decode()
    assert "Compensations not sent" in page and send_again_form(undo) in page
    assert "tasks.close: circuit open" in page
    assert undo.send_failed_at.strftime("%Y-%m-%d %H:%M:%S") in page

    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        first = send_again(admin, undo, follow=True)
        assert send_again(admin, undo).status_code == 302  # a double click
    assert first.status_code == 200
    assert f"Sending tasks.close {undo.idempotency_key} again" in first.content.decode()
    assert rings_of(undo) == 2

    for queued in list(OrmQ.objects.all()):  # what the worker runs for each ring
        tasks.dispatch_standalone(*queued.task["args"])
    undo.refresh_from_db()
    original.refresh_from_db()
    assert undo.status == ActionStatus.CONFIRMED
    assert original.status == ActionStatus.COMPENSATED
    closes = [r for r in box.requests() if r["method"] == "POST" and r["path"].endswith("/close")]
    assert len(closes) == 1
    assert [t["status"] for t in box.tasks()] == ["closed"]
    page = admin.get(reverse("run", args=[run.run_id])).content.decode()
    assert "Compensations not sent" not in page and send_again_form(undo) not in page


@pytest.mark.parametrize("role", ["reviewer", "viewer"])
def test_only_an_admin_sees_a_stuck_compensation_or_sends_it_again(
    role: str,
    admin_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    django_capture_on_commit_callbacks: Any,
) -> None:
    from django_q.models import OrmQ

    box = sandbox_factory("key")
    run, original = completed_run(admin_a.tenant)
    undo = stuck_compensation(page_of(admin_a), original)
    client = page_of(make_persona(admin_a.tenant, f"{role}-1", role))
    page = client.get(reverse("run", args=[run.run_id])).content.decode()
    # (the failure is in the run's timeline, as every member sees the journal; no lever)
    assert "Compensations not sent" not in page and send_again_form(undo) not in page

    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        assert send_again(client, undo).status_code == 403
    nothing_sent(undo, box)


def test_a_queued_compensation_has_no_send_again(
    admin_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    django_capture_on_commit_callbacks: Any,
) -> None:
    """Asked for, its ring not run yet: nothing failed, so nothing is offered, and a forged
    "send again" is a message that rings nothing (the first ring is on its way)."""
    from django_q.models import OrmQ

    sandbox_factory("key")
    run, original = completed_run(admin_a.tenant)
    admin = page_of(admin_a)
    assert ask(admin, original).status_code == 302
    undo = Action.objects.get(compensates=original)
    assert undo.status == ActionStatus.PREPARED and undo.send_failed_at is None
    page = admin.get(reverse("run", args=[run.run_id])).content.decode()
    assert undo.idempotency_key in page  # listed with the run's actions
    assert "Compensations not sent" not in page and send_again_form(undo) not in page

    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        answered = send_again(admin, undo, follow=True)
    assert answered.status_code == 200
    assert "has not failed to send: it is on its way" in answered.content.decode()
    assert rings_of(undo) == 0


def test_another_tenants_admin_cannot_send_a_compensation_again(
    admin_a: Persona,
    tenant_b: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    django_capture_on_commit_callbacks: Any,
) -> None:
    from django_q.models import OrmQ

    box = sandbox_factory("key")
    _, original = completed_run(admin_a.tenant)
    undo = stuck_compensation(page_of(admin_a), original)
    intruder = page_of(make_persona(tenant_b, "bea", "admin", is_staff=True))
    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        foreign = send_again(intruder, undo)
    missing = intruder.post(reverse("action-send-again", args=[Run().run_id]))
    assert foreign.status_code == missing.status_code == 404
    assert foreign.content == missing.content
    nothing_sent(undo, box)
