"""Stored responses of creating API requests, by Idempotency-Key (runtime.api.idempotency)."""

from __future__ import annotations

from django.db import models

from runtime.models.tenancy import Tenant


class IdempotencyRecord(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE)
    key = models.CharField(max_length=255)
    scope = models.CharField(max_length=300)  # method + path: a key is per endpoint
    fingerprint = models.CharField(max_length=64)
    status = models.PositiveSmallIntegerField(null=True, blank=True)  # null while in flight
    # The first response exactly as sent (rendered bytes, not jsonb: PostgreSQL would
    # reorder its keys and a replay would no longer be byte-identical).
    content = models.TextField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "key"], name="runtime_idempotency_once"),
        ]
        indexes = [models.Index(fields=["created_at"], name="runtime_idempotency_age")]

    def __str__(self) -> str:
        return self.key
