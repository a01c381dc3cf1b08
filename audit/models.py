"""The append-only, hash-chained journal.

One table, many streams (`run:<id>`, `tenant:<id>`). Each entry's hash covers the previous
entry's hash and the canonical bytes of the entry, so editing, deleting, inserting or
reordering any entry breaks every later link. `StreamHead` holds each stream's last seq and
hash: appends lock (or compare-and-swap) that row, so two writers cannot fork a chain, and
the unique (stream, seq) constraint refuses a fork even if the locking were wrong.

This app imports neither `runtime` nor `approvals` (DESIGN.md layering): tenants are referred
to by id only.
"""

from __future__ import annotations

from django.db import models

GENESIS = "0" * 64


class StreamHead(models.Model):
    stream = models.CharField(max_length=80, primary_key=True)
    tenant_id = models.BigIntegerField(db_index=True)
    seq = models.BigIntegerField(default=0)
    hash = models.CharField(max_length=64, default=GENESIS)

    def __str__(self) -> str:
        return f"{self.stream}@{self.seq}"


class JournalEntry(models.Model):
    stream = models.CharField(max_length=80)
    seq = models.BigIntegerField()
    tenant_id = models.BigIntegerField()
    type = models.CharField(max_length=64)
    actor = models.CharField(max_length=200)
    object_ref = models.CharField(max_length=120, blank=True, default="")
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["stream", "seq"], name="audit_journalentry_one_seq"),
        ]
        indexes = [
            # Tenant audit log pages: newest first within a tenant.
            models.Index(fields=["tenant_id", "-id"], name="audit_journal_tenant_recent"),
        ]

    def __str__(self) -> str:
        return f"{self.stream}#{self.seq} {self.type}"
