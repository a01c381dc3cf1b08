"""Notifications: email that only opens pages, signed webhooks with retries, never in the
request's transaction."""

from __future__ import annotations

import ast
import base64
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.core import mail
from django.utils import timezone
from django_q.models import Schedule

from approvals import notify
from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest, TenantWebhook, WebhookDelivery
from approvals.notify import deliver, send_webhook, verify_signature
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Membership, Role, Tenant
from tests.approvals.conftest import GOAL
from tests.conftest import Persona, make_persona
from tests.sandbox import Sandbox

URL = re.compile(r"https?://\S+")


def _email(persona: Persona, address: str) -> None:
    persona.user.email = address
    persona.user.save(update_fields=["email"])


# --- a real HTTP receiver on 127.0.0.1 -----------------------------------------------------


@dataclass
class Receiver:
    url: str
    statuses: list[int] = field(default_factory=list)  # answers in order; then 200
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found, stop = _receiver("127.0.0.1", 0)
    yield found
    stop()


def _receiver(host: str, port: int) -> tuple[Receiver, Callable[[], None]]:
    """A receiver on `host`:`port` (0: a free one) and what stops it."""
    box: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            rec = box["r"]
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            rec.received.append((dict(self.headers.items()), body))
            status = rec.statuses.pop(0) if rec.statuses else 200
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    box["r"] = Receiver(url=f"http://{host}:{server.server_address[1]}/hooks")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return box["r"], stop


@pytest.fixture
def local_hooks(settings: Any) -> None:
    """The receiver is on loopback, which production refuses (see the refusal test)."""
    settings.HOLDPOINT_WEBHOOK_ALLOW_PRIVATE = True


# --- email ---------------------------------------------------------------------------------


def test_request_emails_deciders_a_page_link_only(
    held: Any,
    reviewer_a: Persona,
    viewer_a: Persona,
    admin_a: Persona,
    outsider_b: Persona,
    mailoutbox: list[Any],
) -> None:
    run, request, _ = held
    _email(reviewer_a, "alice@acme.test")
    for persona, address in [(viewer_a, "v@acme.test"), (admin_a, "a@acme.test")]:
        _email(persona, address)
    _email(outsider_b, "bob@globex.test")
    assert mailoutbox == []  # nothing is sent inside the request's transaction

    assert deliver("requested", str(request.id)) == {"emails": 1, "webhooks": 0}

    [message] = mailoutbox
    assert message.to == ["alice@acme.test"]
    assert message.subject == f"[Holdpoint] Approval needed: {request.title}"
    page = f"http://127.0.0.1:8000/approvals/{request.id}/"
    assert page in message.body
    for shown in (str(run.run_id), "agent:agent-a", "api-review", "tasks need review"):
        assert shown in message.body
    assert request.shown["reason"] in message.body
    assert f"{request.expires_at:%Y-%m-%d %H:%M} UTC" in message.body
    assert "Opening this link decides nothing" in message.body
    # Every link opens a page; none carries a decision a mail scanner could trigger by GET.
    links = URL.findall(message.body)
    assert set(links) == {page, f"http://127.0.0.1:8000/runs/{run.run_id}/"}
    assert not any(re.search(r"approve|reject|decide|token|\?", link) for link in links)
    assert message.extra_headers["Auto-Submitted"] == "auto-generated"


def test_hooks_only_queue_after_commit(
    tenant_a: Tenant,
    policy: ApprovalPolicy,
    sandbox_factory: Callable[[str], Sandbox],
    reviewer_a: Persona,
    django_capture_on_commit_callbacks: Any,
    mailoutbox: list[Any],
) -> None:
    """Read from the real ORM broker's queue (django-q2's OrmQ rows, the package each one
    carries), not from a stand-in for `async_task`."""
    from django_q.models import OrmQ

    def queue() -> list[tuple[str, tuple[Any, ...]]]:
        rows = OrmQ.objects.order_by("id")
        return [(str(q.task["func"]), tuple(q.task["args"])) for q in rows]

    _email(reviewer_a, "alice@acme.test")
    sandbox_factory("key")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
        assert advance_run(run.run_id, "w1").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    assert queue() == [] and mailoutbox == []  # nothing left before the commit
    for callback in callbacks:
        callback()
    assert ("approvals.notify.deliver", ("requested", str(request.id))) in queue()
    assert mailoutbox == []  # the worker sends, not the web request
    with django_capture_on_commit_callbacks(execute=True):
        notify.notify_reminder(request)
        notify.notify_escalated(request)
        notify.notify_decided(request)
    assert queue()[-3:] == [
        ("approvals.notify.deliver", ("reminder", str(request.id))),
        ("approvals.notify.deliver", ("escalated", str(request.id))),
        ("approvals.notify.deliver", ("decided", str(request.id))),
    ]


def test_decided_request_is_skipped(held: Any, reviewer_a: Persona, mailoutbox: list[Any]) -> None:
    _, request, _ = held
    _email(reviewer_a, "alice@acme.test")
    decide(request.id, reviewer_a.user, "reject", request.action_hash, reason="Not needed")
    for kind in ("requested", "reminder", "escalated"):
        assert deliver(kind, str(request.id)) == {"skipped": "no longer pending (rejected)"}
    assert mailoutbox == []
    assert deliver("requested", "00000000-0000-0000-0000-000000000000") == {"skipped": "gone"}


def test_reminder_and_escalation_reach_the_right_people(
    held: Any, reviewer_a: Persona, tenant_a: Tenant, mailoutbox: list[Any]
) -> None:
    _, request, _ = held
    _email(reviewer_a, "alice@acme.test")
    oncall = Group.objects.create(name="acme-oncall")
    erin = make_persona(tenant_a, "erin", Role.VIEWER, email="erin@acme.test")
    Membership.objects.filter(user=erin.user).update(role=Role.REVIEWER)
    erin.user.groups.add(oncall)  # only on call: not in acme-reviewers
    ApprovalPolicy.objects.filter(pk=request.policy_id).update(
        escalation_group=oncall, escalate_after_seconds=60
    )

    deliver("reminder", str(request.id))
    assert [(m.to, m.subject.split(":")[0]) for m in mailoutbox] == [
        (["alice@acme.test"], "[Holdpoint] Reminder")
    ]
    mailoutbox.clear()
    ApprovalRequest.objects.filter(pk=request.pk).update(escalated=True)
    deliver("escalated", str(request.id))
    assert sorted(m.to[0] for m in mailoutbox) == ["alice@acme.test", "erin@acme.test"]
    assert all(m.subject.startswith("[Holdpoint] Escalated: approval needed: ") for m in mailoutbox)


def test_initiator_is_not_asked_to_approve_own_run(
    tenant_a: Tenant,
    policy: ApprovalPolicy,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    mailoutbox: list[Any],
) -> None:
    _email(reviewer_a, "alice@acme.test")
    sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="user:alice")
    advance_run(run.run_id, "w1")
    request = ApprovalRequest.objects.get(run=run)
    assert deliver("requested", str(request.id)) == {"emails": 0, "webhooks": 0}


def test_agent_text_carries_no_clickable_links(
    held: Any, reviewer_a: Persona, mailoutbox: list[Any]
) -> None:
    _, request, _ = held
    _email(reviewer_a, "alice@acme.test")
    shown = {**request.shown, "reason": "Approve fast: https://evil.example/approve?id=1"}
    ApprovalRequest.objects.filter(pk=request.pk).update(shown=shown)
    deliver("requested", str(request.id))
    [message] = mailoutbox
    assert "https[:]//evil.example/approve" in message.body
    assert not any("evil" in link for link in URL.findall(message.body))


def test_mail_failure_does_not_stop_webhooks(
    held: Any,
    reviewer_a: Persona,
    receiver: Receiver,
    local_hooks: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, request, _ = held
    _email(reviewer_a, "alice@acme.test")
    TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)

    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError("smtp down")

    monkeypatch.setattr(mail.backends.locmem.EmailBackend, "send_messages", broken)
    assert deliver("requested", str(request.id)) == {"emails": 0, "webhooks": 1}
    assert len(receiver.received) == 1


# --- webhooks ------------------------------------------------------------------------------


def test_webhook_is_signed_and_carries_the_event(
    held: Any, receiver: Receiver, local_hooks: None, tenant_b: Tenant
) -> None:
    run, request, _ = held
    hook = TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)
    TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url + "/off", active=False)
    TenantWebhook.objects.create(tenant=tenant_b, url=receiver.url + "/b")
    assert hook.secret.startswith("whsec_")
    assert len(base64.b64decode(hook.secret.removeprefix("whsec_"))) == 32

    assert deliver("requested", str(request.id)) == {"emails": 0, "webhooks": 1}

    [(headers, body)] = receiver.received  # not the inactive one, not tenant B's
    assert verify_signature(hook.secret, headers, body)
    assert headers["webhook-id"].startswith("msg_")
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 60
    assert headers["webhook-signature"].startswith("v1,")
    event = json.loads(body)
    assert event["type"] == "approval.requested"
    assert event["timestamp"].endswith("Z")
    assert event["data"] == {
        "approval_id": str(request.id),
        "run_id": str(run.run_id),
        "title": request.title,
        "status": "pending",
        "expires_at": request.expires_at.isoformat(),
        "url": f"http://127.0.0.1:8000/approvals/{request.id}/",
    }
    [row] = WebhookDelivery.objects.all()
    assert (row.webhook, row.event_type, row.attempt, row.status_code, row.error) == (
        hook,
        "approval.requested",
        1,
        200,
        "",
    )
    assert row.message_id == headers["webhook-id"] and row.next_attempt_at is None
    assert not Schedule.objects.filter(func="approvals.notify.send_webhook").exists()


def test_tampering_fails_verification(held: Any, receiver: Receiver, local_hooks: None) -> None:
    _, request, _ = held
    hook = TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)
    deliver("requested", str(request.id))
    [(headers, body)] = receiver.received
    assert verify_signature(hook.secret, headers, body)
    assert not verify_signature(hook.secret, headers, body.replace(b"pending", b"approved"))
    assert not verify_signature(hook.secret, {**headers, "webhook-id": "msg_other"}, body)
    old = {**headers, "webhook-timestamp": str(int(headers["webhook-timestamp"]) - 3600)}
    assert not verify_signature(hook.secret, old, body)  # a replay of an old message
    other = TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url, active=False)
    assert not verify_signature(other.secret, headers, body)
    assert not verify_signature(hook.secret, {}, body)
    upper = {key.upper(): value for key, value in headers.items()}
    assert verify_signature(hook.secret, upper, body.decode())  # any header case, str body
    rotating = {**headers, "webhook-signature": "v1,bm9wZQ== " + headers["webhook-signature"]}
    assert verify_signature(hook.secret, rotating, body)


def test_failed_delivery_is_retried_with_the_same_message(
    held: Any, receiver: Receiver, local_hooks: None
) -> None:
    _, request, _ = held
    hook = TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)
    receiver.statuses = [500]
    before = timezone.now()

    deliver("requested", str(request.id))

    first = WebhookDelivery.objects.get()
    assert (first.attempt, first.status_code) == (1, 500)
    [retry] = Schedule.objects.filter(func="approvals.notify.send_webhook")
    assert retry.schedule_type == Schedule.ONCE
    assert 4 <= (retry.next_run - before).total_seconds() <= 60
    assert first.next_attempt_at == retry.next_run
    args = ast.literal_eval(retry.args)  # what django-q2's scheduler will call it with
    assert args[0] == hook.pk and args[1] == first.message_id and args[4] == 2

    assert send_webhook(*args) == 200  # the scheduled retry, run as the worker would

    attempts = list(WebhookDelivery.objects.order_by("attempt"))
    assert [(d.attempt, d.status_code) for d in attempts] == [(1, 500), (2, 200)]
    assert {d.message_id for d in attempts} == {first.message_id}
    assert Schedule.objects.filter(func="approvals.notify.send_webhook").count() == 1
    (h1, b1), (h2, b2) = receiver.received
    assert h1["webhook-id"] == h2["webhook-id"] and b1 == b2
    assert verify_signature(hook.secret, h2, b2)


def test_retries_stop_after_the_last_attempt_and_errors_are_recorded(
    held: Any, receiver: Receiver, local_hooks: None
) -> None:
    _, request, _ = held
    dead = TenantWebhook.objects.create(tenant=request.tenant, url="http://127.0.0.1:9/x")
    msg = notify.message_id("requested", request.id)
    assert send_webhook(dead.pk, msg, "approval.requested", "{}", 1) is None
    row = WebhookDelivery.objects.get()
    assert row.status_code is None and "ConnectError" in row.error and row.next_attempt_at
    assert Schedule.objects.filter(func="approvals.notify.send_webhook").count() == 1

    hook = TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)
    receiver.statuses = [503]
    last = notify.MAX_ATTEMPTS
    assert send_webhook(hook.pk, msg, "approval.requested", "{}", last) == 503
    final = WebhookDelivery.objects.get(webhook=hook)
    assert (final.attempt, final.next_attempt_at) == (last, None)
    assert Schedule.objects.filter(func="approvals.notify.send_webhook").count() == 1
    hook.delete()  # a retry for a deleted webhook is a no-op
    assert send_webhook(hook.pk, msg, "approval.requested", "{}", 2) is None


def test_private_addresses_are_refused_by_default(
    held: Any, receiver: Receiver, settings: Any
) -> None:
    settings.HOLDPOINT_WEBHOOK_ALLOW_PRIVATE = False
    _, request, _ = held
    TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)
    deliver("requested", str(request.id))
    assert receiver.received == []
    row = WebhookDelivery.objects.get()
    assert row.error.startswith("refused:") and "127.0.0.1" in row.error
    assert row.next_attempt_at is None  # not retried: it would be refused again


def test_a_delivery_goes_to_the_address_that_was_checked(
    held: Any, receiver: Receiver, settings: Any, dns: dict[str, list[list[str]]]
) -> None:
    """The receiver's name is resolved once, judged, and the connection goes to the address
    judged: a second DNS answer (rebinding: public when checked, then an internal address)
    is never used. The check and the connection each resolved the name before, so an answer
    that changed in between was where the request went."""
    settings.HOLDPOINT_WEBHOOK_ALLOW_PRIVATE = False
    settings.HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS = ["127.0.0.1/32"]  # the receiver's only
    port = int(receiver.url.split(":")[2].split("/")[0])
    elsewhere, stop = _receiver("127.0.0.2", port)  # the same port, an address not allowed
    _, request, _ = held
    TenantWebhook.objects.create(tenant=request.tenant, url=f"http://hooks.test:{port}/hooks")
    dns["hooks.test"] = [["127.0.0.1"], ["127.0.0.2"]]
    try:
        assert deliver("requested", str(request.id)) == {"emails": 0, "webhooks": 1}
    finally:
        stop()
    [(headers, _)] = receiver.received
    assert headers["Host"] == f"hooks.test:{port}" and elsewhere.received == []
    assert WebhookDelivery.objects.get().status_code == 200


@pytest.mark.parametrize(
    "address",
    ["64:ff9b::a9fe:a9fe", "2002:7f00:1::1", "::ffff:10.0.0.1", "169.254.169.254"],
    ids=["nat64-metadata", "6to4-loopback", "mapped-private", "metadata"],
)
def test_addresses_that_carry_a_private_one_are_refused(
    held: Any, settings: Any, dns: dict[str, list[list[str]]], address: str
) -> None:
    """IPv4 carried inside IPv6 (NAT64, 6to4, mapped) is judged as the IPv4 it reaches —
    NAT64's and 6to4's forms of the metadata service and loopback passed `is_global` — and
    a refusal is not retried."""
    settings.HOLDPOINT_WEBHOOK_ALLOW_PRIVATE = False
    _, request, _ = held
    TenantWebhook.objects.create(tenant=request.tenant, url="http://inside.test/hooks")
    dns["inside.test"] = [[address]]
    deliver("requested", str(request.id))
    row = WebhookDelivery.objects.get()
    assert row.error.startswith("refused:") and address in row.error, row.error
    assert row.status_code is None and row.next_attempt_at is None


def test_a_redirect_is_an_answer_not_followed(held: Any, serve: Any, local_hooks: None) -> None:
    """A 3xx is the receiver's answer, retried like any non-2xx; nothing goes to its
    Location (an internal address, say)."""
    from tests.httpservers import answer_with

    target = serve(answer_with(200, b"{}"))
    bounce = serve(answer_with(307, b"", ("Location", target.url + "/inside")))
    _, request, _ = held
    TenantWebhook.objects.create(tenant=request.tenant, url=bounce.url + "/hooks")
    deliver("requested", str(request.id))
    row = WebhookDelivery.objects.get()
    assert row.status_code == 307 and row.next_attempt_at is not None
    assert len(bounce.requests) == 1 and target.requests == []


def test_subscriptions_and_decided_event(
    held: Any, reviewer_a: Persona, receiver: Receiver, local_hooks: None
) -> None:
    _, request, _ = held
    hook = TenantWebhook.objects.create(
        tenant=request.tenant, url=receiver.url, event_types=["approval.decided"]
    )
    assert deliver("requested", str(request.id)) == {"emails": 0, "webhooks": 0}
    assert deliver("decided", str(request.id)) == {"skipped": "still pending"}
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    assert deliver("decided", str(request.id)) == {"emails": 0, "webhooks": 1}
    [(headers, body)] = receiver.received
    assert verify_signature(hook.secret, headers, body)
    event = json.loads(body)
    assert (event["type"], event["data"]["status"]) == ("approval.decided", "approved")


def test_inactive_tenant_is_not_notified(
    held: Any, reviewer_a: Persona, receiver: Receiver, local_hooks: None, mailoutbox: list[Any]
) -> None:
    _, request, _ = held
    _email(reviewer_a, "alice@acme.test")
    hook = TenantWebhook.objects.create(tenant=request.tenant, url=receiver.url)
    Tenant.objects.filter(pk=request.tenant_id).update(active=False)
    assert deliver("requested", str(request.id)) == {"skipped": "tenant inactive"}
    assert send_webhook(hook.pk, "msg_x", "approval.requested", "{}", 2) is None
    assert mailoutbox == [] and receiver.received == []
