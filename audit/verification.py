"""Proving the journal untampered: walking chains, and anchoring heads outside the database.

All checking of history is here (the hash it recomputes is audit.chain's); nothing here
writes history except `alert`, which appends the break it found through audit.journal.

A chain alone catches an edited, deleted, inserted or reordered entry. It cannot catch an
attacker who rewrites a stream's tail and recomputes every later hash, or who truncates the
tail: for those, stream heads are exported (signed) to a file kept outside the database, and
verification checks that every anchored head is still in its chain (Crosby–Wallach).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.core import signing
from django.db import DataError, IntegrityError, connection, transaction
from django.db.models import (
    DateTimeField,
    ExpressionWrapper,
    F,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
)
from django.db.models.expressions import Combinable
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from audit import journal
from audit.canonical import CanonicalError
from audit.chain import GENESIS, RULE, hashed_under, stored_payload_digests
from audit.models import JournalEntry, StreamHead

log = logging.getLogger("holdpoint.audit")
ANCHOR_SALT = "holdpoint.audit.anchor"


@dataclass(frozen=True)
class Break:
    """Where a stream's chain stops proving its history, and how."""

    stream: str
    seq: int
    problem: str


# What the retention purge (runtime.retention) journals in the tenant's stream for each batch
# of runs it purged, in the transaction that redacted their streams: payload {"runs": [id…]}.
PURGE_RECORD = "retention_purged"


class PurgedRuns:
    """The run streams a retention purge journalled as purged, by tenant: the only streams
    whose payloads may be redacted.

    A redacted entry verifies exactly as the original did (its hash covers the digest), so
    without this a payload wiped to its digest in a live run's stream passed every check.
    Each tenant's `retention_purged` entries (its own stream, chained and checked like the
    rest) are read once per check that meets a redacted entry of one of its runs, and kept
    for the streams after it: a full `audit_verify` holds a set of the purged runs' stream
    names — one string per purged run.
    """

    def __init__(self) -> None:
        self._by_tenant: dict[int, frozenset[str]] = {}

    def named(self, stream: str, tenant_id: int | None) -> bool:
        if tenant_id is None:
            return False
        if tenant_id not in self._by_tenant:
            self._by_tenant[tenant_id] = self._read(tenant_id)
        return stream in self._by_tenant[tenant_id]

    @staticmethod
    def _read(tenant_id: int) -> frozenset[str]:
        records = JournalEntry.objects.filter(
            tenant_id=tenant_id, type=PURGE_RECORD, stream=journal.tenant_stream(tenant_id)
        )
        streams: set[str] = set()
        for payload in records.values_list("payload", flat=True).iterator():
            runs = payload.get("runs") if isinstance(payload, dict) else None
            if isinstance(runs, list):
                streams.update(journal.run_stream(r) for r in runs if isinstance(r, str))
        return frozenset(streams)


class ChainWalk:
    """A stream's chain, checked entry by entry in seq order; resumable, so entries that a
    reader finds appended after it walked the stream are checked as the same chain's.

    `tenant_id` is the stream's owner by its head; without it, a tenant stream's owner is
    the one its name gives, a run stream's the first entry's. Every entry must belong to it:
    the hash of entries written under rule 1 does not cover their tenant (audit.chain).
    """

    def __init__(
        self, stream: str, tenant_id: int | None = None, purged: PurgedRuns | None = None
    ) -> None:
        self.stream = stream
        self.owner = tenant_id if tenant_id is not None else _named_owner(stream)
        self.purged = purged if purged is not None else PurgedRuns()
        self.prev, self.expected_seq, self.newer_rule_seen = GENESIS, 1, False
        self.last: JournalEntry | None = None

    def over(self, entries: Iterable[JournalEntry]) -> Break | None:
        """The first broken link among `entries` (the ones after those walked so far)."""
        for entry in entries:
            found = self._link(entry)
            if found is not None:
                return found
            self.prev, self.expected_seq, self.last = entry.hash, entry.seq + 1, entry
        return None

    def _link(self, entry: JournalEntry) -> Break | None:
        stream, prev = self.stream, self.prev
        if entry.seq != self.expected_seq:
            return Break(
                stream, self.expected_seq, f"missing or reordered entry (found seq {entry.seq})"
            )
        if entry.prev_hash != prev:
            return Break(stream, entry.seq, "prev_hash does not match the previous entry")
        self.owner = entry.tenant_id if self.owner is None else self.owner
        if entry.tenant_id != self.owner:
            return Break(stream, entry.seq, "tenant_id is not its stream's tenant")
        if entry.created_at is None:  # 'infinity' and the like: no writer stores one
            return Break(stream, entry.seq, "time cannot be read: no datetime holds it")
        try:
            digests = stored_payload_digests(entry)
            hashed = hashed_under(prev, entry, digests)
        except CanonicalError as exc:  # a value append refuses: it can only be tampering
            return Break(stream, entry.seq, f"entry content cannot have been appended ({exc})")
        if not digests:
            return Break(stream, entry.seq, "redaction flag does not match the payload")
        if entry.redacted and not stream.startswith("run:"):
            return Break(stream, entry.seq, "redacted, but only purged runs' entries are")
        if entry.redacted and not self.purged.named(stream, self.owner):
            return Break(stream, entry.seq, "redacted, but no purge of its run is journalled")
        if hashed is None:
            return Break(stream, entry.seq, "entry content does not match its hash")
        rule = hashed[0]
        if rule < RULE and self.newer_rule_seen:
            return Break(stream, entry.seq, "entry hashed under an older rule than earlier ones")
        self.newer_rule_seen = self.newer_rule_seen or rule == RULE
        return None

    def ended(self, entries: QuerySet[JournalEntry]) -> Break | None:
        """After the walk: the stream head, read now, must be the last entry walked.

        The walk and the head are two reads, and an append commits its entries and the head
        together: one committed between them moved the head past the last entry walked,
        which is no break. Those entries (`entries` of the stream up to the head read, all
        committed with it) are walked on, and the head compared with the last of them. A
        head behind the last entry walked cannot be an append's (a head read after the walk
        is at least as new): entries past the head, or a head moved back, are a break."""
        head = StreamHead.objects.filter(stream=self.stream).first()
        walked = self.last.seq if self.last is not None else 0
        if head is not None and head.seq > walked:
            appended = entries.filter(stream=self.stream, seq__gt=walked, seq__lte=head.seq)
            found = self.over(appended.order_by("seq").iterator())
            if found is not None:
                return found
        return _head_break(self.stream, head, self.last)


def verify_entries(
    stream: str, entries: Iterable[JournalEntry], tenant_id: int | None = None
) -> Break | None:
    """The first broken link of a stream's entries (in seq order), or None if intact (the
    stream head is not compared: `verify_stream` does, `ChainWalk.ended`)."""
    return ChainWalk(stream, tenant_id).over(entries)


def _named_owner(stream: str) -> int | None:
    """The tenant a stream's name gives (`tenant:<id>`); run streams name none."""
    kind, _, rest = stream.partition(":")
    return int(rest) if kind == "tenant" and rest.isascii() and rest.isdigit() else None


def verify_stream(stream: str, purged: PurgedRuns | None = None) -> Break | None:
    """The first break of a stream, its head included. `purged`: what the purges journalled,
    shared by the streams of one check (`verify_all`)."""
    head = StreamHead.objects.filter(stream=stream).first()
    named = _named_owner(stream)
    if head is not None and named is not None and head.tenant_id != named:
        return Break(stream, head.seq, "the stream head names another tenant")
    walk = ChainWalk(stream, head.tenant_id if head is not None else named, purged)
    entries = JournalEntry.objects.filter(stream=stream)
    found = walk.over(entries.order_by("seq").iterator())
    return found if found is not None else walk.ended(entries)


def _head_break(stream: str, head: StreamHead | None, last: JournalEntry | None) -> Break | None:
    last_seq, last_hash = (last.seq, last.hash) if last is not None else (0, GENESIS)
    if head is None:
        if last is None:
            return None
        return Break(stream, last_seq, "entries without a stream head")
    if (head.seq, head.hash) == (last_seq, last_hash):
        return None
    return Break(stream, last_seq + 1, "entries missing after the last one")


def streams(
    tenant_id: int | None = None,
    stream: str | None = None,
    since: datetime | Combinable | None = None,
) -> Iterator[str]:
    """The streams to check: those whose head is the tenant's, then those holding an entry
    of the tenant under another tenant's head or none (a row moved between tenants, a head
    deleted) — so a moved row is named whichever tenant is checked. With `since`: those
    written to since then, and those whose head's last entry is gone or changed.

    With `since` (the hourly check) what is read grows with what was written since and with
    the number of streams, not with the history behind them: the entries written since, by
    an index range per tenant (`_written_since`), and one probe of (stream, seq) per head."""
    heads = StreamHead.objects.order_by("stream")
    entries: QuerySet[JournalEntry] = JournalEntry.objects.all()
    if tenant_id is not None:
        heads, entries = heads.filter(tenant_id=tenant_id), entries.filter(tenant_id=tenant_id)
    if stream:
        heads, entries = heads.filter(stream=stream), entries.filter(stream=stream)
    owned = heads  # every head of what is checked, written to lately or not
    if since is not None:
        entries = _written_since(entries, since, tenant_id)
        # Also every head whose last entry is not there as it recorded it: a stream whose
        # recent entries were deleted whole has none written lately, and the chain of what
        # is left is intact — only its head still knows. One index probe per head, asked as
        # a value, not as NOT EXISTS: PostgreSQL turned that into a hash of every entry's
        # (stream, seq, hash) — a sequential scan of the whole journal — whenever that hash
        # fitted in memory (tens of thousands of entries with the default work_mem), and
        # did it twice (for the strays below too).
        last_entry = JournalEntry.objects.filter(stream=OuterRef("stream"), seq=OuterRef("seq"))
        last_hash = Coalesce(Subquery(last_entry.values("hash")[:1]), Value(""))
        heads = heads.alias(last_hash=last_hash).filter(
            Q(stream__in=entries.values("stream")) | ~Q(last_hash=F("hash"))
        )
    yield from heads.values_list("stream", flat=True).iterator()
    # A stream written to lately with a head among `owned` is among `heads` already: the
    # strays are the others, found without asking every head again.
    strays = (
        entries.exclude(stream__in=owned.values("stream"))
        .order_by("stream")
        .values_list("stream", flat=True)
        .distinct()
    )
    yield from strays.iterator()


def _written_since(
    entries: QuerySet[JournalEntry], since: datetime | Combinable, tenant_id: int | None
) -> QuerySet[JournalEntry]:
    """`entries` written since `since`, read through audit_journal_by_time (tenant_id,
    created_at) — a range per tenant — rather than by a new index on created_at alone.

    The journal's hot path writes every index of it at each step (issue 22: few secondary
    indexes), and this read runs once an hour. But an index led by the tenant answers a time
    range only per tenant: asked for `created_at >= since` alone, PostgreSQL (15 has no skip
    scan) read all of that index, or the whole table — every entry ever written, each hour.
    So the tenants are listed first, from the journal itself (entries under a tenant no head
    names are checked too), by a loose index scan of audit_journal_tenant_recent: one
    descent per tenant. Then `tenant_id IN (…) AND created_at >= since` is one range per
    tenant in audit_journal_by_time. A tenant whose first entry ever is written between the
    two reads is not in the list: the next hourly check, whose window overlaps this one's,
    reads it."""
    if tenant_id is not None:  # `entries` are that tenant's already
        return entries.filter(created_at__gte=since)
    return entries.filter(tenant_id__in=_journal_tenants(), created_at__gte=since)


def _journal_tenants() -> list[int]:
    """Every tenant id the journal holds an entry of, one index descent each (a recursive
    query: the smallest id, then the smallest above it, …)."""
    table = connection.ops.quote_name(JournalEntry._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH RECURSIVE tenants(id) AS ("
            f" SELECT min(tenant_id) FROM {table}"
            f" UNION ALL SELECT (SELECT min(tenant_id) FROM {table} WHERE tenant_id > tenants.id)"
            " FROM tenants WHERE tenants.id IS NOT NULL"
            ") SELECT id FROM tenants WHERE id IS NOT NULL"
        )
        return [int(row[0]) for row in cursor.fetchall()]


def verify_all(
    tenant_id: int | None = None,
    stream: str | None = None,
    since: datetime | Combinable | None = None,
) -> tuple[int, list[Break]]:
    checked, breaks = 0, []
    purged = PurgedRuns()
    for name in streams(tenant_id, stream, since):
        checked += 1
        try:
            found = verify_stream(name, purged)
        except DataError as exc:  # a value no writer stores and no guard foresaw: edited
            found = Break(name, 0, f"an entry cannot be read ({exc})")
        if found is not None:
            breaks.append(found)
    return checked, breaks


def alert(found: Break) -> None:
    """Log it and write it into the tenant's own stream, where its reviewers will see it: the
    tenant of the stream's head or, its head deleted, of its first entry."""
    log.error("journal chain broken: %s at seq %s: %s", found.stream, found.seq, found.problem)
    head = StreamHead.objects.filter(stream=found.stream).first()
    if head is not None:
        tenant_id = head.tenant_id
    else:
        first = JournalEntry.objects.filter(stream=found.stream).order_by("seq")
        owner = first.values_list("tenant_id", flat=True).first()
        if owner is None:
            return
        tenant_id = owner
    try:
        with transaction.atomic():
            journal.append(
                journal.tenant_stream(tenant_id),
                "chain_break_detected",
                tenant_id=tenant_id,
                actor="system:verifier",
                payload=asdict(found),
            )
    except IntegrityError:  # the tenant's stream lost its head too: a new one starts at seq 1
        log.error("journal chain broken: no alert written, tenant:%s has no head", tenant_id)


def verify_recent(hours: int = 2) -> int:
    """The periodic check: streams written to lately (and heads whose last entry is gone or
    changed); alerts on every break. By design it does not re-walk quiet streams: an edit
    in the middle of one is the full audit_verify's to find (README, "Audit trail").

    "Lately" is by the database's clock, the one the app hosts are held to (the health
    check's clock skew): by the verifying worker's own, one whose clock ran more than an
    hour ahead (the check runs hourly over two hours) checked nothing written since the
    run before. An entry carries its writer's time: one whose clock lags the database's by
    less than the hour between runs is still checked by the next one."""
    lately = Now() - Value(timedelta(hours=hours))
    checked, breaks = verify_all(since=ExpressionWrapper(lately, output_field=DateTimeField()))
    for found in breaks:
        alert(found)
    return len(breaks)


@dataclass(frozen=True)
class AnchorBreak:
    stream: str
    seq: int
    problem: str


def anchor(path: Path) -> int:
    """Write every stream head, signed, to `path` (to be kept outside the database)."""
    heads = [
        {"stream": h.stream, "seq": h.seq, "hash": h.hash}
        for h in StreamHead.objects.order_by("stream").iterator()
    ]
    body = {"taken_at": timezone.now().isoformat(), "heads": heads}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(signing.dumps(body, salt=ANCHOR_SALT, compress=True))
    return len(heads)


def check_anchor(path: Path) -> list[AnchorBreak]:
    """Every anchored head must still be in its chain, with the same hash."""
    try:
        body: dict[str, Any] = signing.loads(path.read_text(), salt=ANCHOR_SALT)
    except signing.BadSignature:
        return [AnchorBreak(str(path), 0, "the anchor file's signature is not valid")]
    problems = []
    for head in body["heads"]:
        entry = JournalEntry.objects.filter(stream=head["stream"], seq=head["seq"]).first()
        if entry is None:
            problems.append(
                AnchorBreak(head["stream"], head["seq"], "anchored entry is gone (truncated)")
            )
        elif entry.hash != head["hash"]:
            problems.append(
                AnchorBreak(
                    head["stream"], head["seq"], "anchored entry's hash changed (rewritten)"
                )
            )
    return problems


def dumps(items: Iterable[Any]) -> str:
    return json.dumps([asdict(i) for i in items], indent=2)
