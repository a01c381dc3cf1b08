"""Hold points: approval policies, approval requests bound to an action hash, and votes.

Who may decide is an object permission on the policy (django-guardian, direct foreign-key
permission tables so a deleted policy's grants can never attach to a new row with the same
id), granted to reviewer groups — never a role-name check in a view.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from guardian.models import GroupObjectPermissionBase, UserObjectPermissionBase

from approvals.conditions import check
from runtime.models import Action, Run, Tenant


class OnExpiry(models.TextChoices):
    # The last expiry of a re-request rejects the action; who learns of it depends on the run
    # (approvals.expiry._needs_attention): a person, or an MCP session's host, whose run goes
    # on. The label names both, since it is all a tenant admin reads when choosing.
    REREQUEST = (
        "rerequest",
        "Re-request once, then reject: the run needs attention "
        "(MCP sessions: the host gets the rejection)",
    )
    REJECT = "reject", "Reject"
    APPROVE = "approve", "Approve (explicit auto-approval)"


class ApprovalPolicy(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="policies")
    name = models.CharField(max_length=120)
    tool = models.CharField(max_length=100, help_text="Tool name, e.g. tasks.create")
    # Optional condition on the action: {"param": "amount", "op": "gt", "value": 100} or
    # {"target_matches": "^prod-"}; empty means every action of the tool.
    condition = models.JSONField(null=True, blank=True)
    required = models.BooleanField(default=True)
    expiry_seconds = models.PositiveIntegerField(default=24 * 3600)
    on_expiry = models.CharField(
        max_length=16, choices=OnExpiry.choices, default=OnExpiry.REREQUEST
    )
    quorum = models.PositiveSmallIntegerField(default=1)
    separation_of_duties = models.BooleanField(
        default=True,
        help_text=(
            "Whoever shaped an action (started the run, revised its goal, or gave it input "
            "since its last decision) cannot decide it."
        ),
    )
    remind_before_seconds = models.PositiveIntegerField(default=3600)
    escalate_after_seconds = models.PositiveIntegerField(null=True, blank=True)
    escalation_group = models.ForeignKey(
        Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    priority = models.PositiveIntegerField(default=100, help_text="Lower wins.")
    active = models.BooleanField(default=True)
    any_reviewer = models.BooleanField(
        default=False,
        help_text=(
            "Every reviewer and admin of the tenant may decide, without a grant (the policy "
            "Holdpoint creates for a write tool that no policy named)."
        ),
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "priority", "name"]
        verbose_name_plural = "approval policies"
        permissions = [("decide_approvalpolicy", "May decide approvals under this policy")]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="approvals_policy_name"),
            models.CheckConstraint(condition=Q(quorum__gte=1), name="approvals_policy_quorum"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}: {self.name} ({self.tool})"

    def clean(self) -> None:
        """Refuse, when it is saved, a condition the hold-point code could not evaluate
        (it would hold every action of the tool) or a pattern RE2 cannot run."""
        if self.condition in ("", {}):
            self.condition = None
        problem = check(self.condition)
        if problem:
            raise ValidationError({"condition": problem})


class PolicyUserPermission(UserObjectPermissionBase):
    content_object = models.ForeignKey(ApprovalPolicy, on_delete=models.CASCADE)


class PolicyGroupPermission(GroupObjectPermissionBase):
    content_object = models.ForeignKey(ApprovalPolicy, on_delete=models.CASCADE)


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"
    CANCELLED = "cancelled"


class Decision(models.TextChoices):
    APPROVE = "approve"
    REJECT = "reject"


class ApprovalRequest(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="approvals")
    action = models.ForeignKey(Action, on_delete=models.CASCADE, related_name="approvals")
    policy = models.ForeignKey(ApprovalPolicy, on_delete=models.PROTECT)
    action_hash = models.CharField(max_length=64)
    status = models.CharField(
        max_length=16, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING
    )
    title = models.CharField(max_length=300)
    # What the reviewer is shown, frozen at request time (tool, params, target, reason,
    # impact, initiator, evidence): a later change of the action supersedes the request.
    shown = models.JSONField(default=dict)
    params = models.TextField()
    edits = models.JSONField(null=True, blank=True)
    edited_params = models.TextField(blank=True, default="")
    quorum = models.PositiveSmallIntegerField(default=1)
    expires_at = models.DateTimeField()
    checkpoint_rev = models.PositiveIntegerField()
    rerequest_count = models.PositiveSmallIntegerField(default=0)
    previous = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    escalated = models.BooleanField(default=False)
    reminded = models.BooleanField(default=False)
    decision = models.CharField(max_length=8, choices=Decision.choices, blank=True, default="")
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.TextField(blank=True, default="")
    # Why the request ended other than by its decision (expired, superseded, cancelled), in
    # words a reviewer reads: an approval that lapsed before its action was sent keeps its
    # reviewer's decision and reason, and says here why it no longer counts. The database
    # default lets a worker of the release before this column insert requests meanwhile.
    closed_reason = models.TextField(blank=True, default="", db_default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["expires_at"]
        constraints = [
            # One open hold point per action: the database refuses a second one.
            models.UniqueConstraint(
                fields=["action"],
                condition=Q(status="pending"),
                name="approvals_request_one_pending",
            ),
            models.CheckConstraint(
                condition=Q(status__in=ApprovalStatus.values), name="approvals_request_status"
            ),
        ]
        indexes = [
            # Inbox: a tenant's pending requests by expiry. Expirer: pending by expiry.
            models.Index(fields=["tenant", "status", "expires_at"], name="approvals_inbox"),
            models.Index(
                fields=["expires_at"],
                name="approvals_pending_expiry",
                condition=Q(status="pending"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.title} ({self.status})"


class ApprovalVote(models.Model):
    """One reviewer's decision; a quorum of approvals approves, any rejection rejects."""

    request = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="votes")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    decision = models.CharField(max_length=8, choices=Decision.choices)
    action_hash = models.CharField(max_length=64)
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.UniqueConstraint(fields=["request", "user"], name="approvals_vote_once"),
        ]

    def __str__(self) -> str:
        return f"{self.user} {self.decision}"


# --- Notifications: per-tenant webhooks ------------------------------------------------------

WEBHOOK_EVENTS = (
    "approval.requested",
    "approval.decided",
    "approval.reminder",
    "approval.escalated",
)


def all_webhook_events() -> list[str]:
    """Default subscription: every event (a new endpoint should not miss anything)."""
    return list(WEBHOOK_EVENTS)


def new_webhook_secret() -> str:
    """`whsec_` + base64 of 32 random bytes, the Standard Webhooks secret format, so
    receivers can use any Standard Webhooks library to verify our signatures."""
    import base64
    import secrets

    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


class TenantWebhook(models.Model):
    """An endpoint of one tenant that receives signed approval events (optional)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=500)
    # Generated, never typed in: the admin shows it read-only after creation.
    secret = models.CharField(max_length=100, default=new_webhook_secret, editable=False)
    active = models.BooleanField(default=True)
    event_types = models.JSONField(default=all_webhook_events)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "url"]

    def __str__(self) -> str:
        return f"{self.tenant.slug}: {self.url}"

    def clean(self) -> None:

        if not isinstance(self.event_types, list) or not set(self.event_types) <= set(
            WEBHOOK_EVENTS
        ):
            raise ValidationError({"event_types": f"a list drawn from {', '.join(WEBHOOK_EVENTS)}"})

    def wants(self, event_type: str) -> bool:
        return self.active and event_type in (self.event_types or [])


class WebhookDelivery(models.Model):
    """One attempt to deliver one message: what operators read when a receiver complains."""

    webhook = models.ForeignKey(TenantWebhook, on_delete=models.CASCADE, related_name="deliveries")
    event_type = models.CharField(max_length=64)
    message_id = models.CharField(max_length=64)
    attempt = models.PositiveSmallIntegerField()
    # What was sent, so an operator can send the same message again (admin: redeliver).
    body = models.TextField(blank=True, default="")
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "webhook deliveries"
        indexes = [models.Index(fields=["message_id"], name="approvals_delivery_msg")]

    def __str__(self) -> str:
        outcome = self.status_code or self.error[:40] or "?"
        return f"{self.event_type} {self.message_id} #{self.attempt}: {outcome}"
