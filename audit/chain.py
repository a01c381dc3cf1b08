"""The journal's hash chain: what each entry's hash covers, and how it links to the last.

Appending (audit.journal) and verifying (audit.verification) must compute the very same hash,
and so must the model's redaction (audit.models), which keeps a payload's digest in place of
the payload: the one definition lives here, below all three, and knows nothing of the
database — an entry is anything with the fields the hash covers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from audit.canonical import canonical, sha256_hex

# The previous hash of a stream's first entry, and the hash of a stream with none.
GENESIS = "0" * 64


class Linked(Protocol):
    """What the hash of a stored entry is computed from (a JournalEntry)."""

    stream: str
    seq: int
    type: str
    actor: str
    object_ref: str
    payload: Any
    created_at: datetime
    redacted: bool


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


def entry_hash_from_digest(prev_hash: str, entry: Linked, payload_sha256: str) -> str:
    """`entry_hash` of a stored entry, given its payload's digest (it may be redacted)."""
    fields = {
        "stream": entry.stream,
        "seq": entry.seq,
        "type": entry.type,
        "actor": entry.actor,
        "object_ref": entry.object_ref,
        "created_at": entry.created_at.isoformat(),
    }
    return _link(prev_hash, fields, payload_sha256)


def _link(prev_hash: str, fields: dict[str, Any], payload_sha256: str) -> str:
    body = canonical({**fields, "payload_sha256": payload_sha256})
    return sha256_hex(prev_hash.encode("ascii") + body)


def payload_digest(payload: Any) -> str:
    return sha256_hex(canonical(payload))


def stored_payload_digest(entry: Linked) -> str:
    """The digest the hash covers: recomputed, or kept by the purge when it redacted."""
    if entry.redacted:
        return str(entry.payload["sha256"])
    return payload_digest(entry.payload)
