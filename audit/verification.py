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
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.core import signing
from django.db import transaction
from django.utils import timezone

from audit import journal
from audit.chain import GENESIS, entry_hash_from_digest, stored_payload_digest
from audit.models import JournalEntry, StreamHead

log = logging.getLogger("holdpoint.audit")
ANCHOR_SALT = "holdpoint.audit.anchor"


@dataclass(frozen=True)
class Break:
    """Where a stream's chain stops proving its history, and how."""

    stream: str
    seq: int
    problem: str


def verify_entries(stream: str, entries: Iterable[JournalEntry]) -> Break | None:
    """The first broken link of a stream's entries (in seq order), or None if intact."""
    prev, expected_seq = GENESIS, 1
    for entry in entries:
        if entry.seq != expected_seq:
            return Break(
                stream, expected_seq, f"missing or reordered entry (found seq {entry.seq})"
            )
        if entry.prev_hash != prev:
            return Break(stream, entry.seq, "prev_hash does not match the previous entry")
        recomputed = entry_hash_from_digest(prev, entry, stored_payload_digest(entry))
        if recomputed != entry.hash:
            return Break(stream, entry.seq, "entry content does not match its hash")
        prev, expected_seq = entry.hash, expected_seq + 1
    return None


def verify_stream(stream: str) -> Break | None:
    entries = JournalEntry.objects.filter(stream=stream).order_by("seq").iterator()
    found = verify_entries(stream, entries)
    if found is not None:
        return found
    last = JournalEntry.objects.filter(stream=stream).order_by("-seq").first()
    return head_break(stream, last)


def head_break(stream: str, last: JournalEntry | None) -> Break | None:
    """Entries cut off at the end leave an intact chain; the stream head still knows."""
    head = StreamHead.objects.filter(stream=stream).first()
    last_seq, last_hash = (last.seq, last.hash) if last is not None else (0, GENESIS)
    if head is None or (head.seq, head.hash) == (last_seq, last_hash):
        return None
    return Break(stream, last_seq + 1, "entries missing after the last one")


def streams(
    tenant_id: int | None = None, stream: str | None = None, since: datetime | None = None
) -> Iterable[str]:
    heads = StreamHead.objects.order_by("stream")
    if tenant_id is not None:
        heads = heads.filter(tenant_id=tenant_id)
    if stream:
        heads = heads.filter(stream=stream)
    if since is not None:
        recent = JournalEntry.objects.filter(created_at__gte=since).values("stream")
        heads = heads.filter(stream__in=recent)
    return heads.values_list("stream", flat=True).iterator()


def verify_all(
    tenant_id: int | None = None, stream: str | None = None, since: datetime | None = None
) -> tuple[int, list[Break]]:
    checked, breaks = 0, []
    for name in streams(tenant_id, stream, since):
        checked += 1
        found = verify_stream(name)
        if found is not None:
            breaks.append(found)
    return checked, breaks


def alert(found: Break) -> None:
    """Log it and write it into the tenant's own stream, where its reviewers will see it."""
    log.error("journal chain broken: %s at seq %s: %s", found.stream, found.seq, found.problem)
    head = StreamHead.objects.filter(stream=found.stream).first()
    if head is None:
        return
    tenant_id = head.tenant_id
    with transaction.atomic():
        journal.append(
            journal.tenant_stream(tenant_id),
            "chain_break_detected",
            tenant_id=tenant_id,
            actor="system:verifier",
            payload=asdict(found),
        )


def verify_recent(hours: int = 2) -> int:
    """The periodic check: streams written to lately; alerts on every break."""
    checked, breaks = verify_all(since=timezone.now() - timedelta(hours=hours))
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
