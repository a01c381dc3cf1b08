"""Appending to and verifying the journal.

`append()` is the only writer. It must run inside the transaction of the change it records,
so the change and its record commit together or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.canonical import canonical_bytes, digest, sha256_hex
from audit.models import GENESIS, JournalEntry, StreamHead


class StreamMoved(Exception):
    """The stream head the caller expected is no longer the head: retry with a fresh one."""


@dataclass(frozen=True)
class Head:
    seq: int
    hash: str


def run_stream(run_id: object) -> str:
    return f"run:{run_id}"


def tenant_stream(tenant_id: int) -> str:
    return f"tenant:{tenant_id}"


def entry_hash(
    prev_hash: str,
    *,
    stream: str,
    seq: int,
    type: str,
    actor: str,
    object_ref: str,
    payload: Any,
    created_at: datetime,
) -> str:
    """sha256(prev_hash || canonical entry). Every stored field but `id` is covered; the
    payload through its own digest, so the retention purge can drop a payload and keep the
    digest, and the chain still verifies."""
    fields = {
        "stream": stream,
        "seq": seq,
        "type": type,
        "actor": actor,
        "object_ref": object_ref,
        "created_at": created_at.isoformat(),
    }
    return _link(prev_hash, fields, payload_digest(payload))


def _link(prev_hash: str, fields: dict[str, Any], payload_sha256: str) -> str:
    body = canonical_bytes({**fields, "payload_sha256": payload_sha256})
    return sha256_hex(prev_hash.encode("ascii") + body)


def payload_digest(payload: Any) -> str:
    return digest(payload)


def stored_payload_digest(entry: JournalEntry) -> str:
    """The digest the hash covers: recomputed, or kept by the purge when it redacted."""
    if entry.redacted:
        return str(entry.payload["sha256"])
    return payload_digest(entry.payload)


def open_stream(stream: str, tenant_id: int) -> Head:
    """Create a stream's head if missing (idempotent; safe against a concurrent creator)."""
    try:
        with transaction.atomic():
            head, _ = StreamHead.objects.get_or_create(
                stream=stream, defaults={"tenant_id": tenant_id}
            )
    except IntegrityError:
        head = StreamHead.objects.get(stream=stream)
    return Head(head.seq, head.hash)


def append(
    stream: str,
    type: str,
    *,
    tenant_id: int,
    actor: str,
    payload: dict[str, Any] | None = None,
    object_ref: str = "",
    expected_head: Head | None = None,
) -> JournalEntry:
    """Append one entry; returns it. Must be called inside the recorded change's transaction.

    With `expected_head` (a writer that already holds the stream, such as the executor
    holding a run's lease) the head row is not read first: the conditional update below
    proves nobody appended meanwhile, else StreamMoved. Without it the head row is locked.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("journal.append() must run inside the change's transaction")
    payload = payload or {}
    if expected_head is None:
        open_stream(stream, tenant_id)
        row = StreamHead.objects.select_for_update().get(stream=stream)
        expected_head = Head(row.seq, row.hash)
    seq = expected_head.seq + 1
    now = timezone.now()
    new_hash = entry_hash(
        expected_head.hash,
        stream=stream,
        seq=seq,
        type=type,
        actor=actor,
        object_ref=object_ref,
        payload=payload,
        created_at=now,
    )
    moved = StreamHead.objects.filter(stream=stream, seq=expected_head.seq).update(
        seq=seq, hash=new_hash
    )
    if moved != 1:
        raise StreamMoved(stream)
    return JournalEntry.objects.create(
        stream=stream,
        seq=seq,
        tenant_id=tenant_id,
        type=type,
        actor=actor,
        object_ref=object_ref,
        payload=payload,
        created_at=now,
        prev_hash=expected_head.hash,
        hash=new_hash,
    )


def entry_hash_from_digest(prev_hash: str, entry: JournalEntry, payload_sha256: str) -> str:
    fields = {
        "stream": entry.stream,
        "seq": entry.seq,
        "type": entry.type,
        "actor": entry.actor,
        "object_ref": entry.object_ref,
        "created_at": entry.created_at.isoformat(),
    }
    return _link(prev_hash, fields, payload_sha256)


@dataclass(frozen=True)
class Break:
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
