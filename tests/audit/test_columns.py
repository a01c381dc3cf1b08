"""Every column that gives a journal entry meaning is chained (issue 16 M2, L2; TEST-MATRIX G9).

An attacker with database access changes one column of one row with raw SQL (the
append-only triggers bypassed, tests/audit/tamper.py); `audit_verify` — the full run and
`--tenant` for the tenant concerned — must name that stream and entry. Entries written under
the hash rule before the tenant was covered still verify; a run whose chain is broken still
has pages that render and say so.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse

from audit import journal
from audit.chain import entry_hash_from_digest, stored_payload_digest
from audit.models import JournalEntry, StreamHead
from audit.verification import verify_stream
from runtime import retention
from runtime.accounts import record_tenant_act
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, Tenant
from tests.audit.tamper import audit_verify, tampering
from tests.conftest import Persona

pytestmark = pytest.mark.tampers_journal


def make_run(tenant: Tenant) -> Run:
    run = create_run(tenant, "chain", {"steps": 3}, actor="user:alice")
    advance_run(run.run_id, "w1")
    return run


def tenant_acts(tenant: Tenant, n: int = 4) -> None:
    for k in range(n):
        record_tenant_act(tenant.pk, "membership_changed", "user:ada", step=k)


# Each column and the raw SQL that changes only it (one parameter: the row's id).
CHANGES = {
    "tenant": "tenant_id = %(other)s",
    "stream": "stream = 'run:00000000-0000-0000-0000-000000000000'",
    "seq": "seq = 1000",
    "type": "type = 'decision_recorded'",
    "actor": "actor = 'user:mallory'",
    "object": "object_ref = 'run:other'",
    "time": "created_at = %(later)s",
    "payload": "payload = %(payload)s",
    "redacted": "redacted = %(true)s",
}


def change_column(column: str, entry: JournalEntry, other_tenant: Tenant) -> None:
    assignment = CHANGES[column]
    params = {
        "other": other_tenant.pk,
        "later": entry.created_at + timedelta(seconds=1),
        "payload": '{"status": "completed"}',
        "true": True,
        "id": entry.pk,
    }
    with tampering() as cursor:
        cursor.execute(f"UPDATE audit_journalentry SET {assignment} WHERE id = %(id)s", params)


@pytest.mark.parametrize("kind", ["run", "tenant"])
@pytest.mark.parametrize("column", list(CHANGES))
def test_changing_any_one_column_of_an_entry_is_named_by_verify(
    tenant_a: Tenant, tenant_b: Tenant, column: str, kind: str
) -> None:
    run = make_run(tenant_a)
    make_run(tenant_b)
    tenant_acts(tenant_a)
    stream = journal.run_stream(run.run_id) if kind == "run" else journal.tenant_stream(tenant_a.pk)
    victim = JournalEntry.objects.get(stream=stream, seq=2)
    assert audit_verify()[0] and audit_verify("--tenant", tenant_a.slug)[0]

    change_column(column, victim, tenant_b)

    named = f"BROKEN {stream} at seq 2:"
    for args in [(), ("--tenant", tenant_a.slug)]:
        ok, text = audit_verify(*args)
        assert not ok and named in text, (args, text)
    if column == "tenant":  # the tenant the row was moved into is told too
        ok, text = audit_verify("--tenant", tenant_b.slug)
        assert not ok and named in text, text
    else:
        assert audit_verify("--tenant", tenant_b.slug)[0]


def test_a_stream_head_moved_to_another_tenant_is_named(tenant_a: Tenant, tenant_b: Tenant) -> None:
    """Moving a whole run stream — its head and every entry — to another tenant."""
    run = make_run(tenant_a)
    stream = journal.run_stream(run.run_id)
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET tenant_id = %s WHERE stream = %s", [tenant_b.pk, stream]
        )
        cursor.execute(
            "UPDATE audit_streamhead SET tenant_id = %s WHERE stream = %s", [tenant_b.pk, stream]
        )
    for args in [(), ("--tenant", tenant_b.slug)]:
        ok, text = audit_verify(*args)
        assert not ok and f"BROKEN {stream} at seq 1: entry content does not match" in text, text


def test_a_deleted_stream_head_is_named(tenant_a: Tenant) -> None:
    run = make_run(tenant_a)
    stream = journal.run_stream(run.run_id)
    with tampering() as cursor:
        cursor.execute("DELETE FROM audit_streamhead WHERE stream = %s", [stream])
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream}" in text and "without a stream head" in text


def test_a_flipped_redaction_flag_is_a_break_and_the_other_streams_are_still_checked(
    client: Client, reviewer_a: Persona
) -> None:
    """L2: the flag alone flipped on an intact payload used to end the walk with a KeyError."""
    tenant = reviewer_a.tenant
    flipped, edited, intact = make_run(tenant), make_run(tenant), make_run(tenant)
    first = JournalEntry.objects.get(stream=journal.run_stream(flipped.run_id), seq=2)
    second = JournalEntry.objects.get(stream=journal.run_stream(edited.run_id), seq=3)
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET redacted = %s WHERE id = %s", [True, first.pk]
        )
        cursor.execute(
            "UPDATE audit_journalentry SET actor = 'user:mallory' WHERE id = %s", [second.pk]
        )
    ok, text = audit_verify()
    assert not ok
    assert (
        f"BROKEN {journal.run_stream(flipped.run_id)} at seq 2: "
        "redaction flag does not match the payload" in text
    )
    assert f"BROKEN {journal.run_stream(edited.run_id)} at seq 3" in text
    assert journal.run_stream(intact.run_id) not in text and ", 2 broken" in text

    client.force_login(reviewer_a.user)
    for name in ("run", "run-trail"):
        page = client.get(reverse(name, args=[flipped.run_id]))
        assert page.status_code == 200, name
        assert "broken" in page.content.decode().lower(), name


def test_flipping_the_flag_back_on_a_redacted_entry_is_a_break(tenant_a: Tenant) -> None:
    run = make_run(tenant_a)
    stream = journal.run_stream(run.run_id)
    victim = JournalEntry.objects.get(stream=stream, seq=2)
    assert retention.purge_tenant(tenant_a, thread_id=run.thread_id).runs == [str(run.run_id)]
    assert JournalEntry.objects.get(pk=victim.pk).redacted
    assert verify_stream(stream) is None  # the purge's redaction verifies
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET redacted = %s WHERE id = %s", [False, victim.pk]
        )
    found = verify_stream(stream)
    assert found is not None and found.seq == 2


# --- entries hashed before the tenant was covered ---------------------------------------


def rehash_under_rule_1(stream: str) -> None:
    """Make a stream look as it did when written before the upgrade: every hash by rule 1."""
    prev = "0" * 64
    with tampering() as cursor:
        for entry in JournalEntry.objects.filter(stream=stream).order_by("seq"):
            digest = stored_payload_digest(entry)
            assert digest is not None
            old = entry_hash_from_digest(prev, entry, digest, rule=1)
            cursor.execute(
                "UPDATE audit_journalentry SET prev_hash = %s, hash = %s WHERE id = %s",
                [prev, old, entry.pk],
            )
            prev = old
        cursor.execute("UPDATE audit_streamhead SET hash = %s WHERE stream = %s", [prev, stream])


def test_entries_written_under_the_old_rule_still_verify_and_new_ones_follow_the_new(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    tenant_acts(tenant_a, 3)
    stream = journal.tenant_stream(tenant_a.pk)
    rehash_under_rule_1(stream)
    assert audit_verify()[0] and audit_verify("--tenant", tenant_a.slug)[0]

    tenant_acts(tenant_a, 2)  # written after the upgrade: rule 2
    assert verify_stream(stream) is None
    assert StreamHead.objects.get(stream=stream).seq == 5

    # An old entry's tenant is not in its hash, but the stream head still names it.
    old = JournalEntry.objects.get(stream=stream, seq=2)
    change_column("tenant", old, tenant_b)
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream} at seq 2: tenant_id is not its stream's tenant" in text


def test_an_old_rule_entry_after_a_new_one_is_a_break(tenant_a: Tenant) -> None:
    """A rewritten tail cannot fall back to the rule that ignores the tenant."""
    tenant_acts(tenant_a, 3)
    stream = journal.tenant_stream(tenant_a.pk)
    last = JournalEntry.objects.get(stream=stream, seq=3)
    digest = stored_payload_digest(last)
    assert digest is not None
    downgraded = entry_hash_from_digest(last.prev_hash, last, digest, rule=1)
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET hash = %s WHERE id = %s", [downgraded, last.pk]
        )
        cursor.execute(
            "UPDATE audit_streamhead SET hash = %s WHERE stream = %s", [downgraded, stream]
        )
    found = verify_stream(stream)
    assert found is not None and found.seq == 3 and "older rule" in found.problem


def test_the_hourly_check_alerts_on_a_row_moved_between_tenants(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    from audit.verification import verify_recent

    run = make_run(tenant_a)
    victim = JournalEntry.objects.get(stream=journal.run_stream(run.run_id), seq=2)
    change_column("tenant", victim, tenant_b)
    assert verify_recent() == 1
    alert = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="chain_break_detected"
    )
    assert alert.payload["stream"] == journal.run_stream(run.run_id) and alert.payload["seq"] == 2


def test_a_redacted_entry_in_a_tenant_stream_is_a_break(tenant_a: Tenant) -> None:
    """The purge redacts only purged runs' streams: a tenant's human acts are never redacted,
    so one that is had its payload wiped by someone else — the digest left in its place
    verifies as a redaction would, which must not pass for one there."""
    tenant_acts(tenant_a)
    stream = journal.tenant_stream(tenant_a.pk)
    victim = JournalEntry.objects.get(stream=stream, seq=2)
    with tampering():
        JournalEntry.objects.filter(pk=victim.pk).redact()
    found = verify_stream(stream)
    assert found is not None and found.seq == 2 and "redact" in found.problem
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream} at seq 2" in text
