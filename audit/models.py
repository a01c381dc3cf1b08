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

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime
from itertools import groupby
from operator import attrgetter
from typing import Any, TypeVar

from django.db import models
from django.db.models.expressions import Combinable

from audit.canonical import CanonicalError
from audit.chain import GENESIS, redacted_payload, stored_payload_digest


class StreamHead(models.Model):
    stream = models.CharField(max_length=80, primary_key=True)
    tenant_id = models.BigIntegerField(db_index=True)
    seq = models.BigIntegerField(default=0)
    hash = models.CharField(max_length=64, default=GENESIS)

    def __str__(self) -> str:
        return f"{self.stream}@{self.seq}"


class AppendOnly(Exception):
    """History is never updated or deleted, except by the retention purge."""


def gate_open() -> bool:
    """Whether the retention purge's gate is open in this transaction (`PurgeGate`): the one
    state in which history may change. Another transaction's gate is never seen (PostgreSQL:
    not committed; SQLite: one writer at a time)."""
    return PurgeGate.objects.exists()


_History = TypeVar("_History", bound=models.Model)


class HistoryQuerySet(models.QuerySet[_History]):
    """Rows of history (journal entries, checkpoints): inserted, never updated, deleted only
    by the retention purge inside its gate.

    PostgreSQL's triggers refuse the rest in the database; SQLite has none, so these are
    all that stand between the ORM and a rewritten history there."""

    def _refuse(self, what: str) -> AppendOnly:
        return AppendOnly(f"{self.model._meta.verbose_name_plural} are never {what}")

    def update(self, **kwargs: object) -> int:
        raise self._refuse("updated")  # bulk_update too: it updates through this

    def bulk_create(self, objs: Iterable[_History], *args: Any, **kwargs: Any) -> Any:
        """Inserts only: with update_conflicts it is an upsert, an UPDATE of the row that
        holds the id (or another unique key) already."""
        if kwargs.get("update_conflicts"):
            raise self._refuse("updated")
        return super().bulk_create(objs, *args, **kwargs)

    def delete(self) -> tuple[int, dict[str, int]]:
        if not gate_open():
            raise self._refuse("deleted outside the retention purge")
        return super().delete()

    def _raw_delete(self, using: str | None) -> int:
        """What Django's deletion collector runs for rows that go with a deleted parent (a
        run's checkpoints when the run is deleted) and for `delete()`, past the method
        above: the models' base manager is this queryset's, so it passes here. A parent
        with no such rows is deleted as before."""
        if not gate_open() and self.exists():
            raise self._refuse("deleted outside the retention purge")
        return super()._raw_delete(using)


class InsertOnly(models.Model):
    """A history row's own writes: `save()` only ever INSERTs, `delete()` only inside the
    purge's gate. An instance new to the ORM that carries a stored row's id is an UPDATE in
    Django's save (and so are force_update and update_fields): SQLite, whose history has no
    trigger, rewrote the row."""

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding or kwargs.get("force_update") or kwargs.get("update_fields"):
            raise AppendOnly(f"{self._meta.verbose_name_plural} are never updated")
        super().save(*args, **{**kwargs, "force_insert": True})

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        if not gate_open():
            raise AppendOnly(f"{self._meta.verbose_name_plural} are never deleted")
        return super().delete(*args, **kwargs)


class JournalQuerySet(HistoryQuerySet["JournalEntry"]):
    def delete(self) -> tuple[int, dict[str, int]]:
        raise AppendOnly("journal entries are never deleted (the purge redacts payloads)")

    def redact(self) -> Redaction:
        """Replace payloads by their digests (the retention purge, inside its open gate).

        The hash of each entry covers the payload's digest, not the payload, so the chain
        verifies after redaction exactly as before. A stream with an entry whose payload has
        no digest (not canonical JSON: no writer stores that, it was edited) is left whole,
        unredacted, and named in `refused`: the purge keeps its run and goes on with the
        others, and verification still names the entry — a redaction would put a made-up
        digest over the evidence. Done a stream at a time, so memory holds one stream's
        digests, never the whole purge's.
        """
        if not gate_open():
            raise AppendOnly("redaction needs the purge gate open in this transaction")
        return self._redaction(_redact)

    def redaction_preview(self) -> Redaction:
        """What `redact` would do, writing nothing (`purge --dry-run`): the same walk and the
        same verdicts, so a plan names the runs the purge will keep and does not count them."""
        return self._redaction(len)

    def _redaction(self, apply: Callable[[list[tuple[int, str]]], int]) -> Redaction:
        done, refused = 0, {}
        for stream, digests, why in self._redactions():
            if why:
                refused[stream] = why
            else:
                done += apply(digests)
        return Redaction(done, refused)

    def _redactions(self) -> Iterator[tuple[str, list[tuple[int, str]], str]]:
        """Each stream's unredacted entries with their payload digests, or why the stream
        cannot be redacted (the first entry whose payload has no digest)."""
        entries = self.filter(redacted=False).order_by("stream", "seq")
        # The payload and what its hash covers besides: an entry written before RFC 8785 may
        # have hashed its payload in the earlier form, which its hash tells (audit.chain).
        hashed = ("tenant_id", "type", "actor", "object_ref", "created_at", "prev_hash", "hash")
        rows = entries.only("pk", "stream", "seq", "payload", "redacted", *hashed).iterator()
        for stream, group in groupby(rows, key=attrgetter("stream")):
            digests: list[tuple[int, str]] = []
            why = ""
            for entry in group:
                try:
                    digest = stored_payload_digest(entry)
                    assert digest is not None  # an unredacted payload has its own
                    digests.append((entry.pk, digest))
                except CanonicalError as exc:
                    why = f"seq {entry.seq}: payload is not canonical JSON ({exc})"
                    break
            yield stream, digests, why


@dataclass(frozen=True)
class Redaction:
    """What `redact` did: how many payloads it replaced, and the streams it left whole
    (stream → why)."""

    done: int
    refused: dict[str, str]


def _redact(digests: list[tuple[int, str]]) -> int:
    done = 0
    for pk, digest in digests:
        done += models.QuerySet.update(
            JournalEntry.objects.filter(pk=pk), payload=redacted_payload(digest), redacted=True
        )
    return done


class JournalTime(models.DateTimeField[datetime | str | date | Combinable, datetime | None]):
    """An entry's time, read as None when no datetime can hold what is stored.

    No writer stores such a value; someone with database access can: PostgreSQL keeps
    'infinity' and '-infinity' (psycopg refuses to read them: DataError), SQLite any text
    (Django's converter fails on it). Either made every read of the row fail — the audit
    log, its exports, a run's trail and page answered 500. Only *selecting* the column is
    guarded, in SQL, wherever the ORM selects it (values() and subqueries too): filters and
    ordering still compare what is stored, so such an entry sorts and pages where the
    database puts it ('infinity' after every time, '-infinity' before). Readers show it as
    unreadable and verification names it (audit.verification). `stored_time()` is the
    unguarded column, for a subquery compared in the database.

    Deconstructs as a plain DateTimeField: the column is the same, no migration.
    """

    def select_format(self, compiler: Any, sql: str, params: Any) -> tuple[str, Any]:
        vendor = compiler.connection.vendor
        if vendor == "postgresql":
            return f"CASE WHEN isfinite({sql}) THEN {sql} END", (*params, *params)
        if vendor == "sqlite":  # what datetime() reads back as itself, to the second
            guard = f"datetime({sql}) = substr({sql}, 1, 19)"
            return f"CASE WHEN {guard} THEN {sql} END", (*params, *params, *params)
        return sql, params

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.DateTimeField", args, kwargs


def stored_time() -> models.ExpressionWrapper[models.F]:
    """An entry's created_at as stored (unguarded), to compare in the database."""
    return models.ExpressionWrapper(models.F("created_at"), output_field=models.DateTimeField())


class JournalEntry(InsertOnly):
    stream = models.CharField(max_length=80)
    seq = models.BigIntegerField()
    tenant_id = models.BigIntegerField()
    type = models.CharField(max_length=64)
    actor = models.CharField(max_length=200)
    object_ref = models.CharField(max_length=120, blank=True, default="")
    payload = models.JSONField(default=dict)
    created_at = JournalTime()  # None: stored, but no datetime (edited; see JournalTime)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)
    # Set by the retention purge: the payload was replaced by {"redacted": sha256}, and the
    # entry's hash was computed over the original, which the digest stands for.
    redacted = models.BooleanField(default=False)

    objects = JournalQuerySet.as_manager()

    class Meta:
        verbose_name_plural = "journal entries"
        constraints = [
            models.UniqueConstraint(fields=["stream", "seq"], name="audit_journalentry_one_seq"),
        ]
        indexes = [
            # The tenant audit log: newest first within a tenant, keyset-paged by id, and the
            # same for each filter the page offers, so a filtered page on millions of
            # entries is an index range scan, never a sort. Ascending in id (read backwards
            # for newest first): a new entry goes at the end of its group, where a B-tree
            # page split leaves the old page full (PostgreSQL's split-after-new-item); in
            # descending order it goes at the front and every split leaves two half-empty
            # pages — a third of the journal's bytes per step (issue 22).
            models.Index(fields=["tenant_id", "id"], name="audit_journal_tenant_recent"),
            models.Index(fields=["tenant_id", "type", "id"], name="audit_journal_by_type"),
            models.Index(fields=["tenant_id", "actor", "id"], name="audit_journal_by_actor"),
            # Only the entries about something other than their own stream: an object's
            # entries in its own stream (a run's events, every step of every run) are read
            # by (stream, seq) instead — runtime.pages.audit.filtered.
            models.Index(
                fields=["tenant_id", "object_ref", "id"],
                name="audit_journal_by_object",
                condition=~models.Q(object_ref=models.F("stream")),
            ),
            models.Index(fields=["tenant_id", "created_at"], name="audit_journal_by_time"),
        ]

    def __str__(self) -> str:
        return f"{self.stream}#{self.seq} {self.type}"

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnly("journal entries are never deleted")


class PurgeGate(models.Model):
    """A row here, inside the purge's own transaction, is what lets the database triggers
    allow a change to history. Nothing else ever writes it."""

    opened_at = models.DateTimeField(auto_now_add=True)
    reason = models.CharField(max_length=200)

    def __str__(self) -> str:
        return f"purge gate {self.opened_at:%Y-%m-%d %H:%M}"
