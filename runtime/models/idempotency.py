"""Stored responses of creating API requests, by Idempotency-Key (runtime.api.idempotency)."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from runtime.models.tenancy import Tenant


class IdempotencyRecord(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE)
    key = models.CharField(max_length=255)
    # Who made the request (the agent account of a token — any of its tokens, so a rotated
    # one still replays —, or the person of a session): the same key from anyone else of the
    # tenant is another request, refused as key reuse, never answered with this one's
    # response. Null: a record from before this column, replayed as it was then (to any
    # caller of the tenant) until HOLDPOINT_IDEMPOTENCY_HOURS forgets it. Only ever compared
    # on the row found by (tenant, key): no index of its own.
    principal = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        db_index=False,
    )
    scope = models.CharField(max_length=300)  # method + path: a key is per endpoint
    fingerprint = models.CharField(max_length=64)
    status = models.PositiveSmallIntegerField(null=True, blank=True)  # null while in flight
    # The first response exactly as sent (rendered bytes, not jsonb: PostgreSQL would
    # reorder its keys and a replay would no longer be byte-identical).
    content = models.TextField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The claim's fence: a retry that takes over a dead request's claim moves it on, and the
    # old request's effect and response writes are conditional on it, so they change nothing.
    claim = models.PositiveIntegerField(default=1)
    # Until when the request holding the claim may still be running (database time); past
    # it, a retry with the same key and body takes the claim over. Null: a claim older than
    # this column, taken over at once.
    claimed_until = models.DateTimeField(null=True, blank=True)
    # What the request did, written in the same transaction as the effect (its run, action,
    # checkpoint rev or tool definition): "effect committed" == "effect recorded here", so a
    # retry of a request that died before storing its response answers with it, never
    # doing it again. Empty: the effect has not committed.
    effect = models.CharField(max_length=64, blank=True, default="")
    effect_created = models.BooleanField(default=True)  # 201, or 200 when found (actions)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "key"], name="runtime_idempotency_once"),
        ]
        indexes = [models.Index(fields=["created_at"], name="runtime_idempotency_age")]

    def __str__(self) -> str:
        return self.key
