"""A journal written before Holdpoint wrote RFC 8785 still verifies (audit.chain), on SQLite
and PostgreSQL; what is written after it is RFC 8785's, which an independent library checks.

"Before" is made as tests/audit/test_columns.py makes its rule-1 streams: entries appended
now, then rewritten with raw SQL as the earlier version wrote them — each payload stored and
digested in the earlier form (`legacy_bytes`), the chain re-linked over those digests and the
head moved. The payloads hold what the two forms write differently: floats below 1e-4 and
keys beyond U+FFFF beside keys in U+E000-U+FFFF.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import rfc8785
from django.db import transaction

from audit import journal
from audit.canonical import legacy_bytes, sha256_hex
from audit.chain import GENESIS, entry_hash_from_digest, payload_digest
from audit.models import JournalEntry, StreamHead
from audit.verification import verify_stream
from runtime import retention
from runtime.accounts import record_tenant_act
from runtime.events import RunEvent, record
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, Tenant
from tests.audit.tamper import audit_verify, tampering

pytestmark = pytest.mark.tampers_journal

# What the earlier form wrote otherwise: `1e-07`, `2.5e-05` (RFC 8785: `1e-7`, `0.000025`),
# and the emoji's key after U+FB33's (UTF-16 puts it before).
NUMBERS: dict[str, Any] = {"threshold": 1e-7, "ratio": 2.5e-5, "score": 0.75}
KEYS: dict[str, Any] = {"\U0001f600": "grinning", "\ufb33": "dalet", "a": 1}


def rewritten_as_before_rfc8785(stream: str) -> list[int]:
    """Rewrite `stream` as the version before RFC 8785 wrote it; the seqs of the payloads
    the two forms write differently (none: the test would prove nothing)."""
    prev, changed = GENESIS, []
    with tampering() as cursor:
        for entry in JournalEntry.objects.filter(stream=stream).order_by("seq"):
            before = legacy_bytes(entry.payload)
            old = entry_hash_from_digest(prev, entry, sha256_hex(before), rule=2)
            if sha256_hex(before) != payload_digest(entry.payload):
                changed.append(entry.seq)
            cursor.execute(
                "UPDATE audit_journalentry SET payload = %s, prev_hash = %s, hash = %s "
                "WHERE id = %s",
                [before.decode(), prev, old, entry.pk],
            )
            prev = old
        cursor.execute("UPDATE audit_streamhead SET hash = %s WHERE stream = %s", [prev, stream])
    return changed


def as_an_outside_verifier_hashes(entry: JournalEntry) -> str:
    """An entry's hash by README's recipe ("Audit trail"), with an RFC 8785 library."""
    assert entry.created_at is not None
    body = {
        "stream": entry.stream,
        "seq": entry.seq,
        "tenant_id": entry.tenant_id,
        "type": entry.type,
        "actor": entry.actor,
        "object_ref": entry.object_ref,
        "created_at": entry.created_at.isoformat(),
        "payload_sha256": hashlib.sha256(rfc8785.dumps(entry.payload)).hexdigest(),
    }
    return hashlib.sha256(entry.prev_hash.encode() + rfc8785.dumps(body)).hexdigest()


def finished_run(tenant: Tenant) -> Run:
    run = create_run(tenant, "chain", {"steps": 2}, actor="user:alice")
    advance_run(run.run_id, "w1")
    return Run.objects.get(pk=run.pk)


def with_numbers_and_keys(run: Run) -> None:
    with transaction.atomic():
        record(run, RunEvent.INPUT_RECEIVED, "user:alice", input={**NUMBERS, "labels": KEYS})


def tenant_acts(tenant: Tenant) -> list[int]:
    """Three acts in the tenant's stream, the last plain; their seqs."""
    record_tenant_act(tenant.pk, "policy_changed", "user:ada", **NUMBERS)
    record_tenant_act(tenant.pk, "policy_changed", "user:ada", labels=KEYS)
    record_tenant_act(tenant.pk, "policy_changed", "user:ada", name="plain")
    entries = JournalEntry.objects.filter(stream=journal.tenant_stream(tenant.pk))
    return list(entries.order_by("-seq").values_list("seq", flat=True)[:3])[::-1]


def test_a_journal_written_before_rfc8785_still_verifies_and_goes_on_in_rfc8785(
    tenant_a: Tenant,
) -> None:
    run = finished_run(tenant_a)
    with_numbers_and_keys(run)
    acts = tenant_acts(tenant_a)
    run_stream, tenant_stream = journal.run_stream(run.run_id), journal.tenant_stream(tenant_a.pk)
    assert rewritten_as_before_rfc8785(run_stream) != []
    assert rewritten_as_before_rfc8785(tenant_stream) == acts[:2]  # not the plain one
    ok, text = audit_verify()
    assert ok and "0 broken" in text, text
    assert audit_verify("--tenant", tenant_a.slug)[0]

    # Written after the upgrade: RFC 8785, as an outside verifier recomputes it.
    heads = {s: StreamHead.objects.get(stream=s).seq for s in (run_stream, tenant_stream)}
    with_numbers_and_keys(run)
    tenant_acts(tenant_a)
    for stream, head in heads.items():
        after = JournalEntry.objects.filter(stream=stream, seq__gt=head)
        assert after.exists()
        for entry in after:
            assert entry.hash == as_an_outside_verifier_hashes(entry)
        assert verify_stream(stream) is None
    assert audit_verify()[0] and audit_verify("--tenant", tenant_a.slug)[0]


def test_an_edit_of_an_entry_written_before_rfc8785_is_still_named(tenant_a: Tenant) -> None:
    """Accepting the earlier form accepts the same payload only: a changed number (still
    below 1e-4, still in the earlier form) matches the hash in neither form."""
    seq = tenant_acts(tenant_a)[0]
    stream = journal.tenant_stream(tenant_a.pk)
    assert seq in rewritten_as_before_rfc8785(stream)
    victim = JournalEntry.objects.get(stream=stream, seq=seq)
    edited = legacy_bytes({**victim.payload, "threshold": 2e-7}).decode()
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET payload = %s WHERE id = %s", [edited, victim.pk]
        )
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream} at seq {seq}: entry content does not match" in text


def test_a_run_journalled_before_rfc8785_is_purged_and_its_stream_still_verifies(
    tenant_a: Tenant,
) -> None:
    """The purge keeps each payload's digest in its place: for an entry hashed in the earlier
    form, that form's digest — the one its hash covers."""
    run = finished_run(tenant_a)
    with_numbers_and_keys(run)
    stream = journal.run_stream(run.run_id)
    (seq,) = [s for s in rewritten_as_before_rfc8785(stream) if s > 1]
    before = JournalEntry.objects.get(stream=stream, seq=seq).payload

    assert retention.purge_tenant(tenant_a, thread_id=run.thread_id).runs == [str(run.run_id)]

    redacted = JournalEntry.objects.get(stream=stream, seq=seq)
    assert redacted.redacted
    assert redacted.payload == {"redacted": True, "sha256": sha256_hex(legacy_bytes(before))}
    assert verify_stream(stream) is None
    assert StreamHead.objects.get(stream=stream).seq == redacted.seq
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert ok and "0 broken" in text, text
