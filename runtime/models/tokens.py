"""API tokens: how agent accounts authenticate to the API (people use the pages).

Only a hash of each key is stored. The key is `hpt_` + 43 url-safe characters from
`secrets.token_urlsafe(32)` (256 bits), so an unsalted sha256 is enough: nobody can guess
their way back from the hash, and looking a key up by its hash is one indexed read. The
first 12 characters (`hpt_` + 8) are kept in clear as the token's `prefix`, so people can
tell their tokens apart in lists and journal entries without anything that authenticates.

A token belongs to one user *in one tenant*: it acts in that tenant only and stops working
the moment the user is deactivated, their membership of that tenant is gone, the tenant is
deactivated, or the token is revoked or past `expires_at` — checked on every request, never
cached. Rotation issues a new token and gives the old ones an `expires_at` a window ahead,
so a fleet can switch keys without downtime (runtime/auth.py).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from runtime.models.tenancy import Membership, Role, Tenant

KEY_PREFIX = "hpt_"
PREFIX_LENGTH = len(KEY_PREFIX) + 8
# Keys longer than this are not ours; refused before hashing whatever a client sent.
MAX_KEY_LENGTH = 200
# last_used_at is written at most this often per token: a write per request would turn
# every API read into a write (and serialise SQLite writers).
TOUCH_EVERY = timedelta(seconds=60)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class TokenStatus(models.TextChoices):
    ACTIVE = "active", "active"
    EXPIRING = "expiring", "active, expires"
    EXPIRED = "expired", "expired"
    REVOKED = "revoked", "revoked"


class AgentTokenQuerySet(models.QuerySet["AgentToken"]):
    def usable(self, now: datetime) -> AgentTokenQuerySet:
        """Tokens that authenticate at `now`: not revoked, not expired, user active, tenant
        active, and the user still an agent account of the token's tenant (a person's token,
        issued before tokens were for agents only, never authenticates)."""
        member = Membership.objects.filter(
            user=OuterRef("user"), tenant=OuterRef("tenant"), role=Role.AGENT
        )
        return self.filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now),
            Exists(member),
            revoked_at__isnull=True,
            user__is_active=True,
            tenant__active=True,
        )

    def authenticate(self, key: str, now: datetime | None = None) -> AgentToken | None:
        """The usable token for a presented key, with its user and tenant; one query."""
        if not key or len(key) > MAX_KEY_LENGTH:
            return None
        now = now or timezone.now()
        return (
            self.usable(now).filter(key_hash=hash_key(key)).select_related("user", "tenant").first()
        )


class AgentToken(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_tokens")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(
        max_length=100, blank=True, help_text="What the token is for (a host, a deployment)."
    )
    prefix = models.CharField(max_length=16, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    created_by = models.CharField(max_length=200, blank=True, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    objects = AgentTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "agent token"
        indexes = [models.Index(fields=["user", "tenant"], name="runtime_agenttoken_owner")]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user.get_username()})"

    def status(self, now: datetime | None = None) -> str:
        now = now or timezone.now()
        if self.revoked_at is not None:
            return TokenStatus.REVOKED
        if self.expires_at is None:
            return TokenStatus.ACTIVE
        return TokenStatus.EXPIRING if self.expires_at > now else TokenStatus.EXPIRED

    def is_live(self, now: datetime | None = None) -> bool:
        """Not revoked and not expired (the user's and tenant's state aside)."""
        return self.status(now) in (TokenStatus.ACTIVE, TokenStatus.EXPIRING)

    def touch(self, now: datetime | None = None) -> None:
        """Record use, at most once per TOUCH_EVERY; a conditional update, so concurrent
        requests write once between them."""
        now = now or timezone.now()
        if self.last_used_at is not None and now - self.last_used_at < TOUCH_EVERY:
            return
        AgentToken.objects.filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lte=now - TOUCH_EVERY), pk=self.pk
        ).update(last_used_at=now)
        self.last_used_at = now
