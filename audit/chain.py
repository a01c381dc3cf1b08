"""The journal's hash chain: what each entry's hash covers, and how it links to the last.

Appending (audit.journal) and verifying (audit.verification) must compute the very same hash,
and so must the model's redaction (audit.models), which keeps a payload's digest in place of
the payload: the one definition lives here, below all three, and knows nothing of the
database — an entry is anything with the fields the hash covers.

Two rules exist. Rule 1 (entries written before issue 16) left `tenant_id` out, so a row
could be moved to another tenant's log without breaking its hash. Rule 2 covers it. Old
entries were not re-hashed: rewriting history would need the append-only triggers switched
off, would make every anchor exported outside the database stale, and a migration that
re-hashes would also launder any tampering done before it. So an entry verifies under rule 2,
or under rule 1 only if no rule-2 entry came before it in its stream; and every entry's
tenant is checked against its stream head as well, which covers rule-1 entries too.

The redaction flag is not hashed (the purge sets it long after the hash was made), but it
cannot be flipped unnoticed: it says where the payload's digest comes from, and no payload
can both be hashed as itself and carry its own digest, so the flipped entry never matches.
And the purge redacts only purged runs' streams, and journals those runs in their tenant's
stream: a redacted entry of a tenant's stream (its human acts), or of a run no purge names,
is a payload wiped by someone else, and verification names it (audit.verification).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Protocol

from audit.canonical import CanonicalError, canonical, sha256_hex

# The previous hash of a stream's first entry, and the hash of a stream with none.
GENESIS = "0" * 64
# The rule new entries are hashed under (see above).
RULE = 2
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class Linked(Protocol):
    """What the hash of a stored entry is computed from (a JournalEntry)."""

    stream: str
    seq: int
    tenant_id: int
    type: str
    actor: str
    object_ref: str
    payload: Any
    created_at: datetime | None  # None: stored, but no datetime holds it (audit.models)
    redacted: bool


def entry_hash(
    prev_hash: str,
    *,
    stream: str,
    seq: int,
    tenant_id: int,
    type: str,
    actor: str,
    object_ref: str,
    payload: Any,
    created_at: datetime,
) -> str:
    """sha256(prev_hash || canonical entry), rule 2. Every stored field but `id` and the
    redaction flag is covered; the payload through its own digest, so the retention purge
    can drop a payload and keep the digest, and the chain still verifies."""
    fields = _fields(stream, seq, type, actor, object_ref, created_at)
    return _link(prev_hash, {**fields, "tenant_id": tenant_id}, payload_digest(payload))


def entry_hash_from_digest(
    prev_hash: str, entry: Linked, payload_sha256: str, *, rule: int = RULE
) -> str:
    """The hash of a stored entry under `rule`, given its payload's digest (it may be
    redacted). An entry whose time cannot be read has no hash to compute: CanonicalError."""
    if entry.created_at is None:
        raise CanonicalError("created_at: time cannot be read")
    fields = _fields(
        entry.stream, entry.seq, entry.type, entry.actor, entry.object_ref, entry.created_at
    )
    if rule >= 2:
        fields["tenant_id"] = entry.tenant_id
    return _link(prev_hash, fields, payload_sha256)


def _fields(
    stream: str, seq: int, type: str, actor: str, object_ref: str, created_at: datetime
) -> dict[str, Any]:
    return {
        "stream": stream,
        "seq": seq,
        "type": type,
        "actor": actor,
        "object_ref": object_ref,
        "created_at": created_at.isoformat(),
    }


def _link(prev_hash: str, fields: dict[str, Any], payload_sha256: str) -> str:
    body = canonical({**fields, "payload_sha256": payload_sha256})
    return sha256_hex(prev_hash.encode("ascii") + body)


def payload_digest(payload: Any) -> str:
    return sha256_hex(canonical(payload))


def redacted_payload(digest: str) -> dict[str, Any]:
    """What the purge leaves in place of a payload: only its digest."""
    return {"redacted": True, "sha256": digest}


def stored_payload_digest(entry: Linked) -> str | None:
    """The digest the hash covers: recomputed, or kept by the purge when it redacted. None
    when the redaction flag and the payload disagree (a flag flipped on an intact payload):
    there is then no digest to check, and the caller reports the entry as broken."""
    if not entry.redacted:
        return payload_digest(entry.payload)
    payload = entry.payload
    if not isinstance(payload, dict) or set(payload) != {"redacted", "sha256"}:
        return None
    digest = payload["sha256"]
    if payload["redacted"] is not True or not isinstance(digest, str) or not _DIGEST.match(digest):
        return None
    return digest
