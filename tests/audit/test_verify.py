"""The journal is append-only and tamper-evident (invariant 8; TEST-MATRIX F1, F2, F4)."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import time_machine
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit import journal
from audit.chain import entry_hash
from audit.models import AppendOnly, JournalEntry, StreamHead
from audit.verification import anchor, check_anchor, verify_recent
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Checkpoint, Run, Tenant
from tests.audit.tamper import audit_verify, tampering
from tests.conftest import Persona


def _run(tenant: Tenant, steps: int = 4) -> Run:
    run = create_run(tenant, "chain", {"steps": steps}, actor="user:alice")
    advance_run(run.run_id, "w1")
    return run


def test_an_untouched_journal_verifies(tenant_a: Tenant) -> None:
    _run(tenant_a)
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert ok and "0 broken" in text


@pytest.mark.tampers_journal
@pytest.mark.parametrize("attack", ["payload", "actor", "delete", "reorder", "forge"])
def test_raw_sql_tampering_is_caught_naming_the_entry(tenant_a: Tenant, attack: str) -> None:
    run = _run(tenant_a)
    stream = journal.run_stream(run.run_id)
    rows = list(JournalEntry.objects.filter(stream=stream).order_by("seq"))
    victim = rows[3]
    with tampering() as cursor:
        if attack == "payload":
            cursor.execute(
                "UPDATE audit_journalentry SET payload = %s WHERE id = %s",
                ['{"status": "completed"}', victim.pk],
            )
        elif attack == "actor":
            cursor.execute(
                "UPDATE audit_journalentry SET actor = 'mallory' WHERE id = %s", [victim.pk]
            )
        elif attack == "delete":
            cursor.execute("DELETE FROM audit_journalentry WHERE id = %s", [victim.pk])
        elif attack == "reorder":
            other = rows[4]
            cursor.execute("UPDATE audit_journalentry SET seq = -1 WHERE id = %s", [victim.pk])
            cursor.execute(
                "UPDATE audit_journalentry SET seq = %s WHERE id = %s", [victim.seq, other.pk]
            )
            cursor.execute(
                "UPDATE audit_journalentry SET seq = %s WHERE id = %s", [other.seq, victim.pk]
            )
        else:  # a forged entry appended after the last, with a correctly computed hash
            last = rows[-1]
            forged = entry_hash(
                last.hash,
                stream=stream,
                seq=last.seq + 1,
                tenant_id=tenant_a.pk,
                type="step_committed",
                actor="mallory",
                object_ref="",
                payload={},
                created_at=last.created_at,
            )
            cursor.execute(
                "INSERT INTO audit_journalentry (stream, seq, tenant_id, type, actor, "
                "object_ref, payload, created_at, prev_hash, hash, redacted) VALUES "
                "(%s, %s, %s, 'step_committed', 'mallory', '', %s, %s, %s, %s, %s)",
                [
                    stream,
                    last.seq + 1,
                    tenant_a.pk,
                    "{}",
                    last.created_at,
                    last.hash,
                    forged,
                    False,
                ],
            )
    ok, text = audit_verify("--stream", stream)
    assert not ok
    expected_seq = {"forge": rows[-1].seq + 1}.get(attack, victim.seq)
    assert f"BROKEN {stream} at seq {expected_seq}" in text or (
        attack == "forge" and f"BROKEN {stream}" in text
    ), text


@pytest.mark.tampers_journal
def test_rewritten_or_truncated_tail_is_caught_only_with_an_anchor(
    tenant_a: Tenant, tmp_path: Path
) -> None:
    run = _run(tenant_a)
    stream = journal.run_stream(run.run_id)
    anchor_file = tmp_path / "heads.anchor"
    anchor(anchor_file)
    last = JournalEntry.objects.filter(stream=stream).order_by("-seq").first()
    assert last is not None
    # Truncate the tail and move the head back: the chain itself still verifies.
    with tampering() as cursor:
        cursor.execute("DELETE FROM audit_journalentry WHERE id = %s", [last.pk])
        cursor.execute(
            "UPDATE audit_streamhead SET seq = %s, hash = %s WHERE stream = %s",
            [last.seq - 1, last.prev_hash, stream],
        )
    assert audit_verify("--stream", stream)[0]  # without the anchor: undetectable
    ok, text = audit_verify("--stream", stream, "--anchor", str(anchor_file))
    assert not ok and f"ANCHOR {stream} seq {last.seq}: anchored entry is gone" in text
    assert check_anchor(anchor_file)


def test_a_forged_anchor_file_is_refused(tenant_a: Tenant, tmp_path: Path) -> None:
    _run(tenant_a)
    path = tmp_path / "heads.anchor"
    anchor(path)
    path.write_text(path.read_text()[:-3] + "abc")
    assert "signature is not valid" in check_anchor(path)[0].problem


def test_the_orm_refuses_to_change_history(tenant_a: Tenant) -> None:
    run = _run(tenant_a, steps=1)
    entry = JournalEntry.objects.filter(stream=journal.run_stream(run.run_id)).first()
    assert entry is not None
    with pytest.raises(AppendOnly):
        JournalEntry.objects.filter(pk=entry.pk).update(actor="x")
    with pytest.raises(AppendOnly):
        JournalEntry.objects.filter(pk=entry.pk).delete()
    entry.actor = "x"
    with pytest.raises(AppendOnly):
        entry.save()
    with pytest.raises(AppendOnly):
        entry.delete()
    with pytest.raises(AppendOnly):
        JournalEntry.objects.filter(pk=entry.pk).redact()  # only inside the purge gate


@pytest.mark.postgres
@pytest.mark.parametrize("table", ["audit_journalentry", "runtime_checkpoint"])
def test_postgresql_refuses_update_and_delete_of_history(tenant_a: Tenant, table: str) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("database triggers are PostgreSQL's")
    _run(tenant_a, steps=1)
    for sql in (f"UPDATE {table} SET created_at = created_at", f"DELETE FROM {table}"):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql)
    assert Checkpoint.objects.exists() and JournalEntry.objects.exists()


@pytest.mark.postgres
@pytest.mark.parametrize("table", ["audit_journalentry", "runtime_checkpoint"])
def test_a_temporary_table_named_like_the_purge_gate_does_not_open_it(
    tenant_a: Tenant, table: str
) -> None:
    """The trigger asked `audit_purgegate` by its bare name, and PostgreSQL looks a bare
    name up in the session's temporary schema first: any role that may create a temporary
    table (every role, by default) made one of that name, put a row in it and rewrote
    history — no grant on the real gate needed. The trigger now asks the gate beside its
    table, by schema."""
    if connection.vendor != "postgresql":
        pytest.skip("database triggers are PostgreSQL's")
    _run(tenant_a, steps=1)
    for sql in (f"UPDATE {table} SET created_at = created_at", f"DELETE FROM {table}"):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("CREATE TEMPORARY TABLE audit_purgegate (id int) ON COMMIT DROP")
                cursor.execute("INSERT INTO audit_purgegate VALUES (1)")
                cursor.execute(sql)
    assert Checkpoint.objects.exists() and JournalEntry.objects.exists()
    # The real gate, opened by the purge in its transaction, still opens it.
    with tampering() as cursor:
        cursor.execute(f"UPDATE {table} SET created_at = created_at")


def test_periodic_verification_alerts_into_the_tenant_stream(tenant_a: Tenant) -> None:
    run = _run(tenant_a)
    entry = JournalEntry.objects.filter(stream=journal.run_stream(run.run_id), seq=2).get()
    with tampering() as cursor:
        cursor.execute("UPDATE audit_journalentry SET actor = 'mallory' WHERE id = %s", [entry.pk])
    assert verify_recent() == 1
    alert = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="chain_break_detected"
    )
    assert alert.payload["stream"] == journal.run_stream(run.run_id) and alert.payload["seq"] == 2
    with tampering() as cursor:  # put it back so the suite's own chain check passes
        cursor.execute(
            "UPDATE audit_journalentry SET actor = %s WHERE id = %s", [entry.actor, entry.pk]
        )


def test_periodic_verification_reads_lately_by_the_databases_clock(tenant_a: Tenant) -> None:
    """The hourly check verifies the streams written in the last two hours — by the clock
    of the worker that ran it. A worker whose clock ran three hours ahead found no stream
    written lately, and passed over an entry edited just after it was written."""
    run = _run(tenant_a)
    entry = JournalEntry.objects.filter(stream=journal.run_stream(run.run_id), seq=2).get()
    with tampering() as cursor:
        cursor.execute("UPDATE audit_journalentry SET actor = 'mallory' WHERE id = %s", [entry.pk])
    with time_machine.travel(timezone.now() + timedelta(hours=3), tick=True):
        assert verify_recent() == 1
    with tampering() as cursor:  # put it back so the suite's own chain check passes
        cursor.execute(
            "UPDATE audit_journalentry SET actor = %s WHERE id = %s", [entry.actor, entry.pk]
        )


def test_stream_heads_match_their_chains(tenant_a: Tenant) -> None:
    _run(tenant_a)
    for head in StreamHead.objects.all():
        last: Any = JournalEntry.objects.filter(stream=head.stream).order_by("-seq").first()
        assert (head.seq, head.hash) == (last.seq, last.hash)


@pytest.mark.tampers_journal
@pytest.mark.parametrize("payload", ['{"n": 18014398509481984}', '{"n": 1e400}'])
def test_a_payload_no_append_could_write_is_a_break_not_a_crash(
    client: Client, reviewer_a: Persona, payload: str
) -> None:
    """A number outside ±2**53 (or past a float's range) is valid JSON to the database, but
    `append` refuses it, so it can only have come from tampering: every check must name the
    entry — the command, the hourly alert, the run's trail — not stop with a traceback
    (which also left every later stream unchecked and wrote no alert)."""
    tenant_a = reviewer_a.tenant
    run = _run(tenant_a)
    stream = journal.run_stream(run.run_id)
    victim = JournalEntry.objects.get(stream=stream, seq=3)
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET payload = %s WHERE id = %s", [payload, victim.pk]
        )
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream} at seq 3" in text, text
    assert verify_recent() == 1
    alert = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="chain_break_detected"
    )
    assert alert.payload["stream"] == stream and alert.payload["seq"] == 3
    client.force_login(reviewer_a.user)
    trail = client.get(reverse("run-trail", args=[run.run_id]))
    assert trail.status_code == 200 and trail.context["trail"].chain_break.seq == 3


@pytest.mark.tampers_journal
def test_periodic_verification_alerts_the_tenant_of_a_stream_whose_head_was_deleted(
    tenant_a: Tenant,
) -> None:
    """The break is found ("entries without a stream head"); its tenant is its entries'."""
    run = _run(tenant_a)
    stream = journal.run_stream(run.run_id)
    with tampering() as cursor:
        cursor.execute("DELETE FROM audit_streamhead WHERE stream = %s", [stream])
    assert verify_recent() == 1
    alert = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="chain_break_detected"
    )
    assert alert.payload["stream"] == stream
    tenant = journal.tenant_stream(tenant_a.pk)
    with tampering() as cursor:  # the tenant's own stream too: no alert can go there
        cursor.execute("DELETE FROM audit_streamhead WHERE stream = %s", [tenant])
    assert verify_recent() == 2


@pytest.mark.tampers_journal
def test_verifying_a_stream_that_is_not_there_is_not_a_success(tenant_a: Tenant) -> None:
    """A whole stream deleted (head and entries), or a mistyped name: `--stream` checked
    nothing and exited 0 as if it verified — as `--tenant` with an unknown slug does not."""
    run = _run(tenant_a)
    stream = journal.run_stream(run.run_id)
    assert audit_verify("--stream", stream)[0]
    with tampering() as cursor:
        cursor.execute("DELETE FROM audit_journalentry WHERE stream = %s", [stream])
        cursor.execute("DELETE FROM audit_streamhead WHERE stream = %s", [stream])
    ok, text = audit_verify("--stream", stream)
    assert not ok and "0 stream(s) checked" in text, text


@pytest.mark.tampers_journal
def test_a_hash_with_a_non_ascii_character_is_a_break_not_a_crash(tenant_a: Tenant) -> None:
    """hmac.compare_digest refuses a str with a non-ASCII character (TypeError): a stored
    hash edited to one stopped the walk instead of naming the entry."""
    run = _run(tenant_a)
    stream = journal.run_stream(run.run_id)
    victim = JournalEntry.objects.get(stream=stream, seq=3)
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET hash = %s WHERE id = %s", ["é" * 64, victim.pk]
        )
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream} at seq 3" in text, text


@pytest.mark.tampers_journal
def test_an_entry_the_database_cannot_hand_back_is_a_break_not_a_crash(
    tenant_a: Tenant,
) -> None:
    """PostgreSQL stores a created_at of 'infinity', which no datetime holds (psycopg raises
    DataError reading it): the stream is named broken, and the other streams still checked
    and alerted on, instead of the walk stopping there."""
    if connection.vendor != "postgresql":
        pytest.skip("'infinity' is a PostgreSQL timestamp")
    run, other = _run(tenant_a), _run(tenant_a)
    stream, edited = journal.run_stream(run.run_id), journal.run_stream(other.run_id)
    victim = JournalEntry.objects.get(stream=stream, seq=3)
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET created_at = 'infinity' WHERE id = %s", [victim.pk]
        )
        cursor.execute(
            "UPDATE audit_journalentry SET actor = 'user:mallory' WHERE stream = %s AND seq = 2",
            [edited],
        )
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream}" in text and f"BROKEN {edited} at seq 2" in text, text
    assert verify_recent() == 2


@pytest.mark.tampers_journal
def test_periodic_verification_catches_a_stream_whose_recent_entries_were_deleted_whole(
    tenant_a: Tenant,
) -> None:
    """The hourly check verified only the streams with an entry written lately: a stream
    whose recent entries were all deleted had none, so it was not checked, and what was left
    of it is an intact chain — the full audit_verify named it (its head still says the last
    seq), the hourly check found nothing and wrote no alert."""
    with time_machine.travel(timezone.now() - timedelta(days=3)):
        run = create_run(tenant_a, "asker", {}, actor="user:alice")
    advance_run(run.run_id, "w1")  # waits for input: entries written now
    stream = journal.run_stream(run.run_id)
    assert JournalEntry.objects.filter(stream=stream).count() > 1
    with tampering() as cursor:
        cursor.execute("DELETE FROM audit_journalentry WHERE stream = %s AND seq > 1", [stream])
    ok, text = audit_verify()
    assert not ok and f"BROKEN {stream} at seq 2: entries missing" in text, text
    assert verify_recent() == 1
    alert = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="chain_break_detected"
    )
    assert alert.payload["stream"] == stream and alert.payload["seq"] == 2


def test_an_empty_tenant_or_stream_is_refused_not_taken_for_the_whole_journal(
    tenant_a: Tenant,
) -> None:
    """`audit_verify --tenant ""` (or `--stream ""`) verified every stream of every tenant
    and exited 0: a script that meant one tenant's proof got a different one, and said so
    for a tenant it never named."""
    _run(tenant_a)
    for option in ("--tenant", "--stream"):
        for empty in ("", "  "):
            with pytest.raises(CommandError, match=f"{option} needs a"):
                call_command("audit_verify", option, empty, stdout=StringIO())


def _forged_over(entry: JournalEntry) -> JournalEntry:
    """A new instance carrying an existing entry's id, another actor, and the rest as it is."""
    fields = {f.attname: getattr(entry, f.attname) for f in JournalEntry._meta.concrete_fields}
    return JournalEntry(**{**fields, "actor": "user:mallory"})


@pytest.mark.parametrize("path", ["save", "force_update", "update_fields", "bulk_create"])
def test_the_orm_cannot_overwrite_an_entry_through_its_id(tenant_a: Tenant, path: str) -> None:
    """`save()` on an instance that is new to the ORM but carries an existing entry's id is
    an UPDATE in Django (and so is `bulk_create(update_conflicts=True)`, an upsert): the
    model's "never updated" let it through — SQLite, whose history has no trigger, rewrote
    the entry; PostgreSQL's trigger refused it. Refused by the model on both."""
    run = _run(tenant_a, steps=1)
    entry = JournalEntry.objects.filter(stream=journal.run_stream(run.run_id), seq=2).get()
    forged = _forged_over(entry)
    with pytest.raises((AppendOnly, DatabaseError)), transaction.atomic():
        if path == "save":
            forged.save()
        elif path == "force_update":
            forged.save(force_update=True)
        elif path == "update_fields":
            forged.save(update_fields=["actor"])
        else:
            JournalEntry.objects.bulk_create(
                [forged], update_conflicts=True, unique_fields=["id"], update_fields=["actor"]
            )
    assert JournalEntry.objects.get(pk=entry.pk).actor == entry.actor


CHECKPOINT_PATHS = [
    "save",
    "forged_save",
    "force_update",
    "update_fields",
    "bulk_create",
    "bulk_update",
    "update",
    "delete",
    "queryset_delete",
    "run_delete",
]


def _overwrite_checkpoint(checkpoint: Checkpoint, path: str) -> None:
    """One way the ORM writes over (or removes) a stored checkpoint."""
    checkpoint.state = {"forged": True}
    fields = {f.attname: getattr(checkpoint, f.attname) for f in Checkpoint._meta.concrete_fields}
    forged = Checkpoint(**fields)  # new to the ORM, carrying the stored one's id
    rows = Checkpoint.objects.filter(pk=checkpoint.pk)
    if path == "save":
        checkpoint.save()
    elif path == "forged_save":
        forged.save()
    elif path == "force_update":
        checkpoint.save(force_update=True)
    elif path == "update_fields":
        checkpoint.save(update_fields=["state"])
    elif path == "bulk_create":
        Checkpoint.objects.bulk_create(
            [forged], update_conflicts=True, unique_fields=["id"], update_fields=["state"]
        )
    elif path == "bulk_update":
        Checkpoint.objects.bulk_update([checkpoint], ["state"])
    elif path == "update":
        rows.update(state={"forged": True})
    elif path == "delete":
        checkpoint.delete()
    elif path == "queryset_delete":
        rows.delete()
    else:  # its run deleted outside the retention purge: the rows cascade
        Run.objects.filter(pk=checkpoint.run_id).delete()


@pytest.mark.parametrize("path", CHECKPOINT_PATHS)
def test_the_orm_cannot_overwrite_or_delete_a_checkpoint(tenant_a: Tenant, path: str) -> None:
    """Checkpoints are history too (invariant 8: append-only, changed only by the retention
    purge). PostgreSQL's trigger refused every one of these writes; SQLite, which has no
    trigger, took them all — a checkpoint's state rewritten through save(), update(), an
    upsert or bulk_update, or deleted with its run — and the run resumed from the forgery.
    Refused by the model on both."""
    run = _run(tenant_a, steps=1)
    checkpoint = Checkpoint.objects.filter(run=run).order_by("rev").last()
    assert checkpoint is not None
    stored = (checkpoint.rev, checkpoint.state, checkpoint.digest)
    with pytest.raises((AppendOnly, DatabaseError)), transaction.atomic():
        _overwrite_checkpoint(checkpoint, path)
    again = Checkpoint.objects.get(pk=checkpoint.pk)
    assert (again.rev, again.state, again.digest) == stored
    assert Run.objects.filter(pk=run.pk).exists()


def test_a_new_checkpoint_is_still_inserted_and_the_purge_still_deletes_them(
    tenant_a: Tenant,
) -> None:
    """What the guard leaves: inserting a checkpoint through the ORM, and the retention
    purge deleting a run's checkpoints with the run, inside its gate."""
    from runtime import retention

    run = _run(tenant_a, steps=1)
    last = Checkpoint.objects.filter(run=run).order_by("rev").last()
    assert last is not None
    fields = {f.attname: getattr(last, f.attname) for f in Checkpoint._meta.concrete_fields}
    Checkpoint.objects.create(**{**fields, "id": None, "rev": last.rev + 1})
    assert Checkpoint.objects.filter(run=run).count() == last.rev + 1
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(days=400))
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    report = retention.purge_tenant(Tenant.objects.get(pk=tenant_a.pk))
    assert report.runs == [str(run.run_id)] and report.checkpoints == last.rev + 1
    assert not Checkpoint.objects.filter(run_id=run.pk).exists()
