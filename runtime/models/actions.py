"""The side-effect ledger: one row per intended external action.

`prepared` always means "certainly not sent": `sent` is committed before a request leaves.
The idempotency key is derived from (run, goal_rev, step, call index) — never from a process
or a clock — so a re-executed step finds its own earlier action instead of minting a new one.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q

from runtime.models.runs import Run
from runtime.models.tenancy import Tenant


class ActionStatus(models.TextChoices):
    PREPARED = "prepared"
    AWAITING_APPROVAL = "awaiting_approval"
    APPROVED = "approved"
    SENT = "sent"
    CONFIRMED = "confirmed"
    UNKNOWN = "unknown"
    FAILED = "failed"
    MANUAL_REVIEW = "manual_review"
    CANCELLED = "cancelled"
    COMPENSATED = "compensated"


# Before anything left: a goal revision, a rejection or a cancel may still withdraw these.
UNSENT = frozenset({ActionStatus.PREPARED, ActionStatus.AWAITING_APPROVAL, ActionStatus.APPROVED})
# What a send may start from: not held (or a send that could not reach its tool), or approved.
# One `awaiting_approval` is sent by nobody until its request is decided.
SENDABLE = (ActionStatus.PREPARED, ActionStatus.APPROVED)
# The `step` of an action no step drives (a compensation): no run waits for it, and it may
# follow a finished run.
STANDALONE = "standalone"


class Action(models.Model):
    action_id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="actions")
    idempotency_key = models.CharField(max_length=255)
    tool = models.CharField(max_length=100)
    tool_version = models.CharField(max_length=40, default="1")
    # Canonical JSON text (RFC 8785; an action prepared before Holdpoint wrote RFC 8785 keeps
    # the earlier form, audit.canonical): hashes cover exactly these stored bytes and the
    # executor sends only them.
    params = models.TextField()
    fingerprint = models.CharField(max_length=64)
    # What the step asked for, before any reviewer edit: a re-executed step is matched on it.
    requested_fingerprint = models.CharField(max_length=64, blank=True, default="")
    status = models.CharField(
        max_length=24, choices=ActionStatus.choices, default=ActionStatus.PREPARED
    )
    goal_rev = models.PositiveIntegerField()
    fence = models.BigIntegerField()
    step = models.CharField(max_length=100)
    call_index = models.PositiveIntegerField()
    reason = models.TextField(blank=True, default="")
    target = models.CharField(max_length=300, blank=True, default="")
    external_id = models.CharField(max_length=300, blank=True, default="")
    result = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    reconcile_attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    # Who sent it and until when that sender could still be in flight (its lease expiry plus
    # the tool's timeout, database time): the reconciler concludes nothing before that.
    sent_fence = models.BigIntegerField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    in_flight_until = models.DateTimeField(null=True, blank=True)
    # A standalone action's (a compensation's: no step drives it) last send that met a tool
    # it could not reach — the circuit open, the service down, its MCP server inactive — so
    # nothing applied and, for some of those, nothing else was written: when (database time),
    # why, how many such attempts in all, and when the sweeper tries again (None: it does
    # not). Written only by `runtime.unsent.note_unsent`; the run page shows them to a tenant admin.
    send_failed_at = models.DateTimeField(null=True, blank=True)
    send_failure = models.CharField(max_length=500, blank=True, default="")
    send_failures = models.PositiveIntegerField(default=0)
    send_retry_at = models.DateTimeField(null=True, blank=True)
    compensates = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.RESTRICT, related_name="compensations"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["created_at"]
        indexes = [
            # The reconciler and the sweeper: actions whose outcome is not known yet.
            models.Index(
                fields=["run"],
                name="runtime_action_unsettled",
                condition=Q(status__in=["sent", "unknown", "manual_review"]),
            ),
            # The sweeper: unsent standalone actions whose send failed, by when to try again.
            models.Index(
                fields=["send_retry_at"],
                name="runtime_action_send_retry",
                condition=Q(send_retry_at__isnull=False, status__in=["prepared", "approved"]),
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"], name="runtime_action_one_key"
            ),
            models.CheckConstraint(
                condition=Q(status__in=ActionStatus.values), name="runtime_action_status_valid"
            ),
            # `confirmed` only on a verifiable result: the service's id for the effect.
            models.CheckConstraint(
                condition=~Q(status="confirmed") | ~Q(external_id=""),
                name="runtime_action_confirmed_has_proof",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tool} {self.idempotency_key} ({self.status})"

    @property
    def standalone(self) -> bool:
        """No step drives it (a compensation): its sender is rung for it, no run waits on
        its outcome, and it may be sent after its run finished."""
        return self.step == STANDALONE
