"""Tenants and who belongs to them.

Every row of tenant data carries a tenant; a principal (user or agent account) sees only the
tenants it is a member of. Agent accounts belong to exactly one tenant: their token is the
whole of their identity, so it must not be ambiguous which tenant a call acts in.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import models


class Tenant(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    retention_days = models.PositiveIntegerField(
        default=365, help_text="How long run history is kept before the retention purge."
    )
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    ADMIN = "admin", "Admin"
    REVIEWER = "reviewer", "Reviewer"
    VIEWER = "viewer", "Viewer"
    AGENT = "agent", "Agent"


class Membership(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__slug", "user__username"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "user"], name="runtime_membership_one_per_tenant"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"

    def clean(self) -> None:
        """An agent account acts in exactly one tenant, and nobody is both agent and human."""
        others = Membership.objects.filter(user_id=self.user_id).exclude(pk=self.pk)
        if self.role == Role.AGENT and others.exists():
            raise ValidationError("An agent account belongs to exactly one tenant.")
        if self.role != Role.AGENT and others.filter(role=Role.AGENT).exists():
            raise ValidationError("This user is an agent account; it cannot have other roles.")


class AgentAccount(User):
    """Proxy of the user model: lets tenant admins manage agents without seeing all users."""

    class Meta:
        proxy = True
        verbose_name = "agent account"
