"""Notifications about hold points: email to the people who may decide, signed webhooks.

Two rules shape this module:

- Nothing here may break or slow the transaction that opened or decided a request. The
  hooks called from `approvals.decisions` and `approvals.expiry` only queue a django-q2
  task after commit; `deliver()` runs in a worker, re-reads the request and stays silent if
  it is no longer in the state the notification was about (decided in the meantime, say).
- A link in an email only opens a page. Corporate mail scanners open links before people
  do, so nothing reachable by GET from an email approves or rejects; the reviewer decides
  with a POST from the request page.

Webhooks follow Standard Webhooks (https://www.standardwebhooks.com/): `webhook-id`,
`webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256>` over
`{id}.{timestamp}.{body}`, keyed with the base64-decoded part of the `whsec_` secret, so a
receiver can verify with any Standard Webhooks library or with `verify_signature()` below.
A failed delivery is retried with backoff through a one-off django-q2 schedule, keeping the
same message id so receivers can deduplicate; every attempt is a `WebhookDelivery` row.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any

import httpx
from django.conf import settings
from django.core.mail import EmailMessage, get_connection
from django.db import transaction
from django.utils import timezone

from approvals.models import ApprovalRequest, ApprovalStatus, TenantWebhook, WebhookDelivery
from approvals.policies import deciders, shaped_by
from runtime import outbound, wire
from runtime.models.limits import NOTE_MAX
from runtime.queue import on_commit_task

if TYPE_CHECKING:
    from django.contrib.auth.models import User

log = logging.getLogger("holdpoint.notify")

DELIVER = "approvals.notify.deliver"
SEND_WEBHOOK = "approvals.notify.send_webhook"
# kind (what happened) -> webhook event type
EVENTS = {
    "requested": "approval.requested",
    "reminder": "approval.reminder",
    "escalated": "approval.escalated",
    "decided": "approval.decided",
}
# Seconds to wait before each retry of a failed webhook delivery: six attempts in all over
# about 75 minutes. Each retry is a one-off django-q2 schedule, picked up by the cluster's
# scheduler on its next pass, so short delays may stretch to that pass.
RETRY_DELAYS = (5, 30, 120, 600, 3600)
MAX_ATTEMPTS = 1 + len(RETRY_DELAYS)
WEBHOOK_TIMEOUT = 5.0
# A receiver's answer is read up to this much (only its status counts); past it the
# connection is dropped and the status still decides.
ANSWER_BYTES = 64 * 1024
SIGNATURE_TOLERANCE = 300  # seconds a receiver should accept between timestamp and now
_MESSAGE_NS = uuid.UUID("5b0c1a9e-6f0b-4a55-9a4e-6a1f3d2c7e10")


# --- hooks: called inside the request's transaction; they only queue ---------------------


def notify_requested(request: ApprovalRequest) -> None:
    """Tell eligible reviewers a request waits (email, webhook), once it is committed."""
    on_commit_task(DELIVER, "requested", str(request.pk))


def notify_reminder(request: ApprovalRequest) -> None:
    """Remind eligible reviewers before a request expires."""
    on_commit_task(DELIVER, "reminder", str(request.pk))


def notify_escalated(request: ApprovalRequest) -> None:
    """Tell the escalation group a request now waits for them too."""
    on_commit_task(DELIVER, "escalated", str(request.pk))


def notify_decided(request: ApprovalRequest) -> None:
    """Tell webhook receivers a request was decided (so dashboards and chat cards update)."""
    on_commit_task(DELIVER, "decided", str(request.pk))


# --- an operator's acts (the admin): journalled, then queued like the hooks above -------------


def renotify(request: ApprovalRequest, actor: str) -> None:
    """Remind who may decide a pending request now (email and the approval.reminder
    webhook), at an admin's word: journalled in the tenant's stream, sent by a worker."""
    from audit import journal
    from runtime.errors import AlreadyDecided

    with transaction.atomic():
        current = ApprovalRequest.objects.select_for_update().get(
            pk=request.pk, tenant_id=request.tenant_id
        )
        if current.status != ApprovalStatus.PENDING:
            raise AlreadyDecided(f"the request is {current.status}: nobody is waiting to decide")
        journal.append(
            journal.tenant_stream(current.tenant_id),
            "approval_renotified",
            tenant_id=current.tenant_id,
            actor=actor,
            object_ref=f"approvalrequest:{current.pk}",
            payload={"approval_id": str(current.pk), "run_id": str(current.run_id)},
        )
        notify_reminder(current)


def redeliver(delivery: WebhookDelivery, actor: str) -> int:
    """Send a delivered (or failed) webhook message again, at an admin's word: the same
    message id and body (receivers deduplicate on the id), the next attempt number, from a
    worker after commit. Journalled in the tenant's stream; returns the attempt number."""
    from django.db.models import Max

    from audit import journal
    from runtime.errors import InvalidParams

    if not delivery.body:  # recorded before bodies were kept
        raise InvalidParams("this delivery's body was not kept: it cannot be sent again")
    hook = TenantWebhook.objects.get(pk=delivery.webhook_id)
    with transaction.atomic():
        sent = WebhookDelivery.objects.filter(webhook=hook, message_id=delivery.message_id)
        attempt = int(sent.aggregate(top=Max("attempt"))["top"] or 0) + 1
        journal.append(
            journal.tenant_stream(hook.tenant_id),
            "webhook_redelivered",
            tenant_id=hook.tenant_id,
            actor=actor,
            object_ref=f"webhookdelivery:{delivery.pk}",
            payload={
                "message_id": delivery.message_id,
                "event_type": delivery.event_type,
                "url": hook.url,
                "attempt": attempt,
            },
        )
        args = (hook.pk, delivery.message_id, delivery.event_type, delivery.body, attempt)
        on_commit_task(SEND_WEBHOOK, *args)
    return attempt


# --- the task ------------------------------------------------------------------------------


def deliver(kind: str, request_id: str) -> dict[str, Any]:
    """Send what `kind` calls for, from the request as it is now (a django-q2 task).

    The queue is at-least-once: a repeated run sends again, with the same webhook message
    id (receivers deduplicate on it). A request that moved on is skipped: no reminder for a
    decided request, no "decided" event for one still pending.
    """
    if kind not in EVENTS:
        raise ValueError(f"unknown notification kind {kind!r}")
    request = (
        ApprovalRequest.objects.select_related("policy", "run", "tenant")
        .filter(pk=request_id)
        .first()
    )
    if request is None:
        return {"skipped": "gone"}
    if not request.tenant.active:
        return {"skipped": "tenant inactive"}
    pending = request.status == ApprovalStatus.PENDING
    if kind == "decided":
        if pending:
            return {"skipped": "still pending"}
    elif not pending:
        return {"skipped": f"no longer pending ({request.status})"}
    elif request.expires_at <= timezone.now():
        return {"skipped": "expired"}
    emails = 0 if kind == "decided" else _email(kind, request)
    hooks = _webhooks(kind, request)
    return {"emails": emails, "webhooks": hooks}


# --- email ---------------------------------------------------------------------------------


def request_url(request: ApprovalRequest) -> str:
    """The request page: it shows the action and its Approve/Reject form (POST only)."""
    return f"{settings.HOLDPOINT_BASE_URL}/approvals/{request.pk}/"


def run_url(request: ApprovalRequest) -> str:
    return f"{settings.HOLDPOINT_BASE_URL}/runs/{request.run_id}/"


def recipients(kind: str, request: ApprovalRequest) -> list[User]:
    """Who may decide now and has an address: not whoever shaped the action when the policy
    separates duties (`shaped_by`), not whoever already voted. An escalation reaches the escalation
    group and, so nobody decides twice, the reviewers who were already asked."""
    escalated = request.escalated or kind == "escalated"
    voted = set(request.votes.values_list("user_id", flat=True))
    shapers = shaped_by(request, request.run) if request.policy.separation_of_duties else set()
    return [
        user
        for user in deciders(request.policy, escalated=escalated)
        if getattr(user, "email", "")
        and user.pk not in voted
        and f"user:{user.get_username()}" not in shapers
    ]


_URL_SCHEME = re.compile(r"(?i)\b(https?|ftp)://")


def _defang(text: str) -> str:
    """Agent-written text must not carry clickable links into our mail: only our own
    links (to pages, never to actions) are clickable."""
    return _URL_SCHEME.sub(r"\1[:]//", text)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def subject(kind: str, request: ApprovalRequest) -> str:
    prefix = {
        "requested": "Approval needed",
        "reminder": "Reminder: approval needed",
        "escalated": "Escalated: approval needed",
    }[kind]
    return _one_line(f"[Holdpoint] {prefix}: {_defang(request.title)}")[:250]


def body(kind: str, request: ApprovalRequest) -> str:
    shown = request.shown or {}
    opening = {
        "requested": "An agent run is waiting at a hold point for a decision.",
        "reminder": "Reminder: this hold point is still waiting and expires soon.",
        "escalated": (
            "Nobody has decided this hold point yet, so it is escalated: you may now decide it too."
        ),
    }[kind]
    expires = request.expires_at.astimezone(UTC)
    undo = shown.get("compensates") if isinstance(shown.get("compensates"), dict) else None
    if undo:  # a compensation: asked for by a person, and no run waits for it
        opening = opening.replace("An agent run is waiting", "A compensation is waiting") + (
            f" {_defang(str(undo.get('asked_by')))} asked for it, to undo "
            f"{_defang(str(undo.get('tool')))} {_defang(str(undo.get('idempotency_key')))}."
        )
    lines = [
        opening,
        "",
        f"Action:    {_defang(_one_line(request.title))}",
        f"Tenant:    {request.tenant.name}",
        f"Run:       {request.run_id} ({_defang(str(shown.get('graph', '')))})",
        f"Initiator: {_defang(str(shown.get('initiator', '')))}",
        f"Target:    {_defang(str(shown.get('target', '') or '-'))}",
        f"Impact:    {shown.get('impact', '')}",
        f"Policy:    {_defang(request.policy.name)}",
        f"Expires:   {expires:%Y-%m-%d %H:%M} UTC (then: {request.policy.get_on_expiry_display()})",
        "",
        "Reason given:" if undo else "Reason given by the agent:",
        _defang(str(shown.get("reason", "") or "-"))[:NOTE_MAX],
        "",
        "Open the request to review it:",
        request_url(request),
        "",
        "Opening this link decides nothing. You approve or reject on that page, after you",
        "have seen the exact action; until then "
        + ("nothing is sent." if undo else "the run waits."),
        "",
        f"Run history: {run_url(request)}",
    ]
    return "\n".join(lines) + "\n"


def _email(kind: str, request: ApprovalRequest) -> int:
    """One message per recipient (nobody sees the others' addresses). A mail failure is
    logged and does not stop the webhooks."""
    messages = [
        EmailMessage(
            subject=subject(kind, request),
            body=body(kind, request),
            to=[user.email],
            # RFC 3834: out-of-office robots must not answer a notification.
            headers={"Auto-Submitted": "auto-generated"},
        )
        for user in recipients(kind, request)
    ]
    if not messages:
        return 0
    try:
        return get_connection().send_messages(messages) or 0
    except Exception:  # SMTP and socket errors come in many types
        log.exception("email for approval %s (%s) failed", request.pk, kind)
        return 0


# --- webhooks ------------------------------------------------------------------------------


def message_id(kind: str, request_id: Any) -> str:
    """Stable per (event, request): a re-run of the task sends the same id, so receivers
    deduplicate it as the same message (Standard Webhooks)."""
    return "msg_" + uuid.uuid5(_MESSAGE_NS, f"{kind}:{request_id}").hex


def payload(kind: str, request: ApprovalRequest) -> str:
    data = {
        "approval_id": str(request.pk),
        "run_id": str(request.run_id),
        "title": request.title,
        "status": request.status,
        "expires_at": request.expires_at.isoformat(),
        "url": request_url(request),
    }
    now = timezone.now().isoformat().replace("+00:00", "Z")
    return json.dumps({"type": EVENTS[kind], "timestamp": now, "data": data})


def _webhooks(kind: str, request: ApprovalRequest) -> int:
    event = EVENTS[kind]
    hooks = [
        hook
        for hook in TenantWebhook.objects.filter(tenant_id=request.tenant_id, active=True)
        if hook.wants(event)
    ]
    if not hooks:
        return 0
    text, msg = payload(kind, request), message_id(kind, request.pk)
    for hook in hooks:
        send_webhook(hook.pk, msg, event, text, 1)
    return len(hooks)


def _secret_bytes(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix("whsec_"), validate=True)


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode("utf-8") if isinstance(body, str) else body


def sign(secret: str, msg_id: str, timestamp: int | str, body: bytes | str) -> str:
    """`v1,` + base64(HMAC-SHA256(secret bytes, f"{id}.{timestamp}.{body}"))."""
    signed = f"{msg_id}.{timestamp}.".encode() + _as_bytes(body)
    digest = hmac.new(_secret_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def verify_signature(
    secret: str,
    headers: Mapping[str, str],
    body: bytes | str,
    *,
    tolerance: int = SIGNATURE_TOLERANCE,
    now: float | None = None,
) -> bool:
    """True if the body is what we signed and the timestamp is recent (for receivers).

    Header names are matched case-insensitively; `webhook-signature` may hold several
    space-separated signatures (during a secret rotation) — one valid `v1` one suffices.
    The tolerance refuses a replay of an old, correctly signed message.
    """
    lowered = {str(key).lower(): str(value) for key, value in headers.items()}
    msg_id = lowered.get("webhook-id", "")
    stamp = lowered.get("webhook-timestamp", "")
    signatures = lowered.get("webhook-signature", "")
    if not (msg_id and stamp and signatures):
        return False
    try:
        sent_at = int(stamp)
        expected = sign(secret, msg_id, stamp, body)
    except (ValueError, binascii.Error):
        return False
    if abs((time.time() if now is None else now) - sent_at) > tolerance:
        return False
    return any(
        hmac.compare_digest(expected, candidate)
        for candidate in signatures.split()
        if candidate.startswith("v1,")
    )


def reach() -> outbound.Reach:
    """Where webhook receivers may be: any host whose every address is public, or inside
    HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS (anywhere with HOLDPOINT_WEBHOOK_ALLOW_PRIVATE).

    Tenant admins type these URLs; the worker must not become their probe into loopback,
    private or cloud-metadata addresses. So a delivery is sent as tools' requests are
    (runtime.outbound): the name resolved once, every address judged (IPv4 carried inside
    IPv6 too), the connection made to the address judged — never to a second DNS answer
    (rebinding) — and no redirect followed.
    """
    if settings.HOLDPOINT_WEBHOOK_ALLOW_PRIVATE:
        return outbound.Reach(hosts=None, networks=outbound.EVERYWHERE)
    networks = outbound.parse_networks(settings.HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS)
    return outbound.Reach(hosts=None, networks=networks)


def send_webhook(
    webhook_id: int, msg_id: str, event_type: str, body: str, attempt: int = 1
) -> int | None:
    """One delivery attempt (a django-q2 task for retries); returns the HTTP status.

    Signed afresh each attempt (new timestamp, same id and body). Anything but a 2xx is
    retried after the next delay in RETRY_DELAYS; a refused address is not retried.
    """
    hook = TenantWebhook.objects.filter(pk=webhook_id, active=True, tenant__active=True).first()
    if hook is None:  # deleted or switched off (or its tenant) since: nothing to do
        return None
    stamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": "Holdpoint-Webhooks/1",
        "webhook-id": msg_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(hook.secret, msg_id, stamp, body),
    }
    status: int | None = None
    error, retry = "", True
    try:
        response = wire.send(
            "POST",
            hook.url,
            content=body.encode("utf-8"),
            headers=headers,
            timeout=WEBHOOK_TIMEOUT,
            max_bytes=ANSWER_BYTES,
            reach=reach(),
        )
        status = response.status_code
    except outbound.OutboundRefused as exc:
        status = exc.status_code  # a redirect or an oversized answer: the receiver's answer
        if status is None:  # refused before sending: it would be refused again
            error, retry = f"refused: {exc.detail}", False
        else:
            error = f"{exc.code}: {exc.detail}"
    except httpx.HTTPError as exc:  # DNS, connect, timeout: worth another attempt
        error = f"{type(exc).__name__}: {exc}"
    if status is not None:
        retry = not 200 <= status < 300
    next_at = None
    if retry and attempt < MAX_ATTEMPTS:
        next_at = timezone.now() + timedelta(seconds=RETRY_DELAYS[attempt - 1])
    with transaction.atomic():
        WebhookDelivery.objects.create(
            webhook=hook,
            event_type=event_type,
            message_id=msg_id,
            attempt=attempt,
            body=body,
            status_code=status,
            error=error[:NOTE_MAX],
            next_attempt_at=next_at,
        )
        if next_at is not None:
            _schedule_retry(next_at, (webhook_id, msg_id, event_type, body, attempt + 1))
    if retry:
        log.warning(
            "webhook %s %s attempt %d/%d failed: %s",
            webhook_id,
            msg_id,
            attempt,
            MAX_ATTEMPTS,
            status or error,
        )
    return status


def _schedule_retry(when: Any, args: tuple[Any, ...]) -> None:
    """A one-off django-q2 schedule: the scheduler enqueues it once `when` has passed and
    then deletes it. Its args are stored as a Python literal (the scheduler evaluates them
    with ast.literal_eval), so they are plain ints and strings only."""
    from django_q.models import Schedule

    Schedule.objects.create(
        name=f"webhook {args[1]} #{args[4]} to {args[0]}"[:100],
        func=SEND_WEBHOOK,
        args=repr(args),
        schedule_type=Schedule.ONCE,
        repeats=-1,
        next_run=when,
    )
