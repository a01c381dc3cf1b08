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

The payload's digest is of its canonical bytes, RFC 8785's (audit.canonical). An entry
written before Holdpoint wrote RFC 8785 was digested in the form it wrote then, which differs
only for a payload holding a float below 1e-4 or a key beyond U+FFFF. Such an entry
verifies as it was written: its payload's digest is tried in both forms (RFC 8785's first).
Nothing stored says which form an entry used, nor needs to: both forms parse back to the
very same value, so whichever the hash matches, it proves the same payload — an attacker
gains nothing by a form, and a writer of the earlier version still appending during a
rolling deploy breaks nothing. The hash rules and their order are not concerned: every
other field hashed is a string or an integer, written alike in both forms.
"""

from __future__ import annotations

import hmac
import re
from datetime import datetime
from typing import Any, Protocol

from audit.canonical import CanonicalError, canonical, digests, sha256_hex

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
    prev_hash: str
    hash: str


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
    """The digest a new entry's hash covers: of the payload's RFC 8785 bytes."""
    return sha256_hex(canonical(payload))


def redacted_payload(digest: str) -> dict[str, Any]:
    """What the purge leaves in place of a payload: only its digest."""
    return {"redacted": True, "sha256": digest}


def stored_payload_digests(entry: Linked) -> tuple[str, ...]:
    """The digests the hash may cover: the payload's, in each form it may have been hashed
    in (RFC 8785's first: see the module docstring), or the one the purge kept when it
    redacted. Empty when the redaction flag and the payload disagree (a flag flipped on an
    intact payload): there is then no digest to check, and the caller reports the entry as
    broken."""
    if not entry.redacted:
        return digests(entry.payload)
    payload = entry.payload
    if not isinstance(payload, dict) or set(payload) != {"redacted", "sha256"}:
        return ()
    digest = payload["sha256"]
    if payload["redacted"] is not True or not isinstance(digest, str) or not _DIGEST.match(digest):
        return ()
    return (digest,)


def hashed_under(
    prev_hash: str, entry: Linked, candidates: tuple[str, ...]
) -> tuple[int, str] | None:
    """The (rule, payload digest) the entry's stored hash was made under, given the digests
    it may cover (`stored_payload_digests`); the current rule and form are tried first. None:
    it matches none (nor can it, if its time cannot be read). Compared as bytes:
    compare_digest refuses a str with a non-ASCII character, which an edited hash column may
    hold."""
    if entry.created_at is None:
        return None
    stored = entry.hash.encode("utf-8")
    for digest in candidates:
        for rule in range(RULE, 0, -1):
            computed = entry_hash_from_digest(prev_hash, entry, digest, rule=rule)
            if hmac.compare_digest(computed.encode("ascii"), stored):
                return rule, digest
    return None


def stored_payload_digest(entry: Linked) -> str | None:
    """The one digest the entry's stored hash covers (what the purge keeps in place of the
    payload): of the form its hash was made of, RFC 8785's if it matches none (the entry is
    broken either way, and verification says so). None when `stored_payload_digests` is
    empty."""
    found = stored_payload_digests(entry)
    if len(found) > 1:
        hashed = hashed_under(entry.prev_hash, entry, found)
        if hashed is not None:
            return hashed[1]
    return found[0] if found else None
