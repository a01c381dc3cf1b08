"""Retention purge keeps chains verifiable and never touches what is still open."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
import time_machine
from django.core.management import CommandError, call_command
from django.db.models.functions import Now
from django.test import Client
from django.utils import timezone

from audit import journal
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Artifact, Checkpoint, RecordedCall, Run, Tenant
from tests.audit.tamper import tampering
from tests.conftest import Persona


def _aged(run: Run, days: int) -> None:
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(days=days))


def _edited_past_canonical_json(run: Run, seq: int) -> str:
    """Edit one of the run's entries to a payload no writer stores (an integer past
    ±2**53): it has no digest, so its stream cannot be redacted. Returns the stream."""
    stream = journal.run_stream(run.run_id)
    victim = JournalEntry.objects.get(stream=stream, seq=seq)
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET payload = %s WHERE id = %s",
            ['{"n": 1152921504606846976}', victim.pk],
        )
    return stream


def _purge(*args: str) -> str:
    out = StringIO()
    call_command("purge", *args, stdout=out)
    return out.getvalue()


def test_purge_removes_expired_runs_and_chains_still_verify(tenant_a: Tenant) -> None:
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    old = create_run(tenant_a, "grower", {"steps": 40}, actor="user:alice")
    fresh = create_run(tenant_a, "grower", {"steps": 40}, actor="user:alice")
    for run in (old, fresh):
        advance_run(run.run_id, "w1")
    _aged(old, 31)
    artifacts_before = Artifact.objects.count()

    assert "would purge 1 run(s)" in _purge("--dry-run")
    assert Run.objects.filter(pk=old.pk).exists()
    assert "purged 1 run(s)" in _purge()

    assert not Run.objects.filter(pk=old.pk).exists()
    assert not Checkpoint.objects.filter(run_id=old.pk).exists()
    assert Run.objects.filter(pk=fresh.pk).exists()
    # Artifacts the fresh run still needs are kept (both runs stored the same notes).
    assert 0 < Artifact.objects.count() <= artifacts_before
    from runtime.artifacts import resolve

    last = Checkpoint.objects.get(run=fresh, rev=40)
    assert len(resolve(tenant_a.pk, last.state)["notes"]) == 40
    stream = journal.run_stream(old.run_id)
    entries = JournalEntry.objects.filter(stream=stream)
    assert entries.exists() and all(e.redacted for e in entries)
    assert verify_stream(stream) is None
    purged = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="retention_purged"
    )
    assert purged.payload["runs"] == [str(old.run_id)]
    ok = StringIO()
    call_command("audit_verify", stdout=ok)
    assert "0 broken" in ok.getvalue()


def test_purge_never_takes_an_open_run_or_an_unsettled_action(tenant_a: Tenant) -> None:
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=1)
    waiting = create_run(tenant_a, "asker", {}, actor="t")
    advance_run(waiting.run_id, "w1")
    done = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    advance_run(done.run_id, "w1")
    Action.objects.create(
        tenant=tenant_a,
        run=done,
        idempotency_key="k-open",
        tool="tasks.create",
        params="{}",
        fingerprint="f",
        goal_rev=1,
        fence=1,
        step="tick",
        call_index=1,
        status=ActionStatus.MANUAL_REVIEW,
    )
    for run in (waiting, done):
        _aged(run, 10)
    assert "purged 0 run(s)" in _purge()
    assert Run.objects.filter(pk__in=[waiting.pk, done.pk]).count() == 2


def test_a_retention_longer_than_the_calendar_keeps_everything_and_purges_the_others(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    """`retention_days` 999999 ("keep for ever") put the cutoff before year 1: the date
    arithmetic raised OverflowError, and `purge` stopped there — every tenant after it in
    slug order kept its expired runs too."""
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=999_999)
    Tenant.objects.filter(pk=tenant_b.pk).update(retention_days=30)
    kept = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    expired = create_run(tenant_b, "chain", {"steps": 1}, actor="t")
    for run in (kept, expired):
        advance_run(run.run_id, "w1")
        _aged(run, 400)
    out = _purge()
    assert "acme: purged 0 run(s)" in out and "globex: purged 1 run(s)" in out, out
    assert Run.objects.filter(pk=kept.pk).exists()
    assert not Run.objects.filter(pk=expired.pk).exists()


def test_the_retention_cutoff_is_the_databases_clock_not_the_purging_process(
    tenant_a: Tenant,
) -> None:
    """A finished run's updated_at is the database's time (every status change writes
    Now()); the cutoff was `timezone.now()` of the process running the purge. A purger whose
    clock ran ten minutes behind kept a run five minutes past its retention; one ten minutes
    ahead purged a run five minutes before its retention was up."""
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    past, almost = (create_run(tenant_a, "chain", {"steps": 1}, actor="t") for _ in range(2))
    for run in (past, almost):
        advance_run(run.run_id, "w1")
    retention = timedelta(days=30)
    Run.objects.filter(pk=past.pk).update(updated_at=Now() - retention - timedelta(minutes=5))
    Run.objects.filter(pk=almost.pk).update(updated_at=Now() - retention + timedelta(minutes=5))

    with time_machine.travel(timezone.now() - timedelta(minutes=10), tick=True):
        assert "acme: purged 1 run(s)" in _purge("--tenant", tenant_a.slug)
    assert not Run.objects.filter(pk=past.pk).exists()
    with time_machine.travel(timezone.now() + timedelta(minutes=10), tick=True):
        assert "acme: purged 0 run(s)" in _purge("--tenant", tenant_a.slug)
    assert Run.objects.filter(pk=almost.pk).exists()


def test_deleting_one_threads_data_on_request(tenant_a: Tenant) -> None:
    mine = create_run(tenant_a, "chain", {"steps": 2}, actor="t", thread_id="customer-42")
    other = create_run(tenant_a, "chain", {"steps": 2}, actor="t", thread_id="customer-7")
    for run in (mine, other):
        advance_run(run.run_id, "w1")
    assert "purged 1 run(s)" in _purge("--tenant", tenant_a.slug, "--thread", "customer-42")
    assert not Run.objects.filter(pk=mine.pk).exists()
    assert not RecordedCall.objects.filter(run_id=mine.pk).exists()
    assert Run.objects.filter(pk=other.pk).exists()
    entry = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="retention_purged"
    )
    assert entry.payload["thread_id"] == "customer-42"


def test_tenant_stream_records_human_and_admin_acts(
    client: Client, reviewer_a: Persona, admin_a: Persona, agent_a: Persona
) -> None:
    tenant_stream = journal.tenant_stream(reviewer_a.tenant.pk)

    def kinds() -> list[str]:
        return list(
            JournalEntry.objects.filter(stream=tenant_stream)
            .order_by("seq")
            .values_list("type", flat=True)
        )

    client.post("/login/", {"username": "alice", "password": "wrong"})
    client.post("/login/", {"username": "alice", "password": "pw-alice"})
    assert kinds()[-2:] == ["login_failed", "login"]
    client.force_login(admin_a.user)
    response = client.post(
        "/admin/runtime/agentaccount/add/",
        {"username": "bot-9", "is_active": "on", "tenant": reviewer_a.tenant.pk},
    )
    assert response.status_code == 302
    from django.contrib.auth import get_user_model

    from runtime.auth import issue_token, revoke_token

    bot = get_user_model().objects.get(username="bot-9")
    revoke_token(issue_token(bot, actor="user:ada").token, actor="user:ada")
    assert kinds()[-3:] == ["admin_added", "token_created", "token_revoked"]
    added: Any = JournalEntry.objects.filter(stream=tenant_stream, type="admin_added").last()
    assert added.actor == "user:ada" and added.payload["model"] == "runtime.AgentAccount"
    assert verify_stream(tenant_stream) is None


@pytest.mark.tampers_journal
def test_a_payload_edited_past_canonical_json_keeps_its_run_and_the_purge_goes_on(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    """An entry of an expired run edited to a payload no writer stores (an integer past
    ±2**53) made redaction raise CanonicalError: the purge stopped at that tenant with a
    traceback, and every tenant after it (slug order) kept its expired runs. Now the run
    whose journal cannot be redacted is kept and named, the rest is purged, the command
    exits non-zero, and audit_verify still names the edited entry."""
    for tenant in (tenant_a, tenant_b):
        Tenant.objects.filter(pk=tenant.pk).update(retention_days=30)
    edited = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    other = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    later = create_run(tenant_b, "chain", {"steps": 1}, actor="t")
    for run in (edited, other, later):
        advance_run(run.run_id, "w1")
        _aged(run, 31)
    stream = _edited_past_canonical_json(edited, seq=2)

    out = StringIO()
    with pytest.raises(CommandError, match="1 due run"):
        call_command("purge", stdout=out)
    text = out.getvalue()
    assert "acme: purged 1 run(s)" in text and "globex: purged 1 run(s)" in text, text
    assert f"acme: KEPT run {edited.run_id}" in text and "seq 2" in text, text
    assert not Run.objects.filter(pk__in=[other.pk, later.pk]).exists()
    assert Run.objects.filter(pk=edited.pk).exists()
    assert not JournalEntry.objects.filter(stream=stream, redacted=True).exists()
    purged = JournalEntry.objects.get(
        stream=journal.tenant_stream(tenant_a.pk), type="retention_purged"
    )
    assert purged.payload["runs"] == [str(other.run_id)]
    assert list(purged.payload["held"]) == [str(edited.run_id)]
    verified = StringIO()
    with pytest.raises(CommandError):
        call_command("audit_verify", stdout=verified)
    assert f"BROKEN {stream} at seq 2" in verified.getvalue()
    assert "1 broken" in verified.getvalue()


def test_purging_an_unknown_tenant_is_refused(tenant_a: Tenant) -> None:
    """`purge --tenant <mistyped>` said nothing and exited 0, as if the tenant had nothing
    due (audit_verify --tenant already refused an unknown slug)."""
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=1)
    run = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    advance_run(run.run_id, "w1")
    _aged(run, 10)
    for extra in ([], ["--dry-run"], ["--thread", "customer-42"]):
        with pytest.raises(CommandError, match="no tenant 'acmee'"):
            _purge("--tenant", "acmee", *extra)
    assert Run.objects.filter(pk=run.pk).exists()


def test_purging_an_empty_thread_id_is_refused_not_taken_for_every_tenant(
    tenant_a: Tenant,
) -> None:
    """`purge --tenant acme --thread ""` (a deletion request whose id came out empty) was
    taken for no --thread at all: it ran the retention purge of the tenant instead of
    refusing, deleting runs nobody asked to delete now."""
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=1)
    run = create_run(tenant_a, "chain", {"steps": 1}, actor="t")
    advance_run(run.run_id, "w1")
    _aged(run, 10)
    for empty in ("", "  "):
        with pytest.raises(CommandError, match="--thread needs a thread id"):
            _purge("--tenant", tenant_a.slug, "--thread", empty)
    assert Run.objects.filter(pk=run.pk).exists()


def test_a_dry_run_counts_what_the_purge_then_removes(tenant_a: Tenant) -> None:
    """`purge --dry-run` said "would purge 1 run(s), 0 checkpoint(s), 0 artifact(s), 0
    journal payload(s) redacted" for a run with 40 checkpoints: only the runs were counted,
    the rest was left at zero."""
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    old = create_run(tenant_a, "grower", {"steps": 40}, actor="t")
    fresh = create_run(tenant_a, "grower", {"steps": 20}, actor="t")
    for run in (old, fresh):
        advance_run(run.run_id, "w1")
    _aged(old, 31)
    planned = _purge("--dry-run", "--tenant", tenant_a.slug)
    done = _purge("--tenant", tenant_a.slug)
    line = next(x for x in done.splitlines() if x.startswith("acme:"))
    assert "40 checkpoint(s)" in line and " 0 artifact(s)" not in line, line
    assert line.replace("purged", "would purge") in planned, (planned, done)


def test_a_purge_of_several_batches_removes_everything_due_and_keeps_everything_live(
    tenant_a: Tenant,
) -> None:
    """Five expired runs sharing artifacts with each other and with a live one, purged two
    runs per transaction: every expired run and every artifact only they used is gone,
    everything the live run refers to is kept, each batch journalled once, and the counts
    add up."""
    from runtime import retention
    from runtime.artifacts import resolve

    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    expired = [create_run(tenant_a, "grower", {"steps": n}, actor="t") for n in (6, 9, 3, 12, 8)]
    live = create_run(tenant_a, "grower", {"steps": 5}, actor="t")
    for run in (*expired, live):
        advance_run(run.run_id, "w1")
    for run in expired:
        _aged(run, 31)
    doomed = Checkpoint.objects.filter(run__in=expired).count()
    out = _purge("--tenant", tenant_a.slug, "--batch-size", "2")

    assert f"purged 5 run(s), {doomed} checkpoint(s)" in out, out
    assert not Run.objects.filter(pk__in=[r.pk for r in expired]).exists()
    kept = retention._refs(tenant_a.pk, Checkpoint.objects.filter(tenant=tenant_a))
    assert kept and set(Artifact.objects.values_list("digest", flat=True)) == kept
    last = Checkpoint.objects.get(run=live, rev=5)
    assert len(resolve(tenant_a.pk, last.state)["notes"]) == 5
    batches = JournalEntry.objects.filter(
        stream=journal.tenant_stream(tenant_a.pk), type="retention_purged"
    )
    assert [len(e.payload["runs"]) for e in batches.order_by("seq")] == [2, 2, 1]
    assert sum(e.payload["checkpoints"] for e in batches) == doomed
    assert {r for e in batches for r in e.payload["runs"]} == {str(r.run_id) for r in expired}
    for run in expired:
        assert verify_stream(journal.run_stream(run.run_id)) is None


def test_a_purge_of_many_batches_reads_each_checkpoint_once_not_once_a_batch(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each batch deletes the artifacts no kept checkpoint reaches, and read the state of
    every checkpoint the tenant keeps to know which: a purge of N batches read each kept
    checkpoint N times (and each due one once per batch before its own) — for a tenant with
    millions of checkpoints and a backlog of due runs, hours spent under the artifact lock.
    Now a purge reads each checkpoint's state at most twice (kept, then doomed), and deletes
    and keeps the same artifacts as before."""
    from runtime import retention

    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    expired = [create_run(tenant_a, "grower", {"steps": n}, actor="t") for n in (3, 5, 4, 6)]
    live = create_run(tenant_a, "grower", {"steps": 8}, actor="t")
    for run in (*expired, live):
        advance_run(run.run_id, "w1")
    for run in expired:
        _aged(run, 31)
    reads: Counter[int] = Counter()
    real_refs = retention._refs

    def counting(tenant_id: int, checkpoints: Any) -> Any:
        reads.update(checkpoints.values_list("pk", flat=True))
        return real_refs(tenant_id, checkpoints)

    monkeypatch.setattr(retention, "_refs", counting)
    live_checkpoints = set(Checkpoint.objects.filter(run=live).values_list("pk", flat=True))

    assert "purged 4 run(s)" in _purge("--tenant", tenant_a.slug, "--batch-size", "1")
    assert {reads[pk] for pk in live_checkpoints} == {1}, reads
    assert max(reads.values()) == 2, reads
    kept = real_refs(tenant_a.pk, Checkpoint.objects.filter(tenant=tenant_a))
    assert kept and set(Artifact.objects.values_list("digest", flat=True)) == kept


@pytest.mark.parametrize("size", ["0", "-3"])
def test_a_batch_size_below_one_is_refused(tenant_a: Tenant, size: str) -> None:
    with pytest.raises(CommandError, match="--batch-size must be at least 1"):
        _purge("--batch-size", size)


def test_an_empty_tenant_slug_is_refused_not_taken_for_every_tenant(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    """`purge --tenant ""` (a script whose slug variable came out empty) was taken for no
    --tenant at all: it purged every tenant's due runs, not one tenant's."""
    for tenant in (tenant_a, tenant_b):
        Tenant.objects.filter(pk=tenant.pk).update(retention_days=1)
    runs = [create_run(t, "chain", {"steps": 1}, actor="t") for t in (tenant_a, tenant_b)]
    for run in runs:
        advance_run(run.run_id, "w1")
        _aged(run, 10)
    for empty in ("", "  "):
        for extra in ([], ["--dry-run"]):
            with pytest.raises(CommandError, match="--tenant needs a tenant slug"):
                _purge("--tenant", empty, *extra)
    assert Run.objects.filter(pk__in=[r.pk for r in runs]).count() == 2


@pytest.mark.tampers_journal
def test_a_dry_run_names_the_run_the_purge_would_keep_and_does_not_count_it(
    tenant_a: Tenant,
) -> None:
    """A dry run counted a run whose journal cannot be redacted among the runs it "would
    purge", with its checkpoints and payloads, and said nothing of it; the purge then kept
    it and failed. The plan is only worth reading if it is what the purge does: the same
    runs, the same counts, the same run named as kept, the same non-zero exit — and
    nothing written."""
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=30)
    edited = create_run(tenant_a, "grower", {"steps": 7}, actor="t")
    other = create_run(tenant_a, "grower", {"steps": 5}, actor="t")
    for run in (edited, other):
        advance_run(run.run_id, "w1")
        _aged(run, 31)
    _edited_past_canonical_json(edited, seq=2)
    entries = JournalEntry.objects.count()

    planned = StringIO()
    with pytest.raises(CommandError, match="1 due run"):
        call_command("purge", "--dry-run", "--tenant", tenant_a.slug, stdout=planned)
    assert JournalEntry.objects.filter(redacted=True).count() == 0
    assert JournalEntry.objects.count() == entries
    assert Run.objects.filter(pk__in=[edited.pk, other.pk]).count() == 2
    done = StringIO()
    with pytest.raises(CommandError, match="1 due run"):
        call_command("purge", "--tenant", tenant_a.slug, stdout=done)

    plan, result = planned.getvalue(), done.getvalue()
    line = next(x for x in result.splitlines() if x.startswith("acme: purged"))
    assert "purged 1 run(s)" in line and " 0 checkpoint(s)" not in line, line
    assert line.replace("purged", "would purge") in plan, (plan, result)
    assert f"acme: would keep run {edited.run_id}: journal" in plan and "seq 2" in plan, plan
    assert f"acme: KEPT run {edited.run_id}" in result, result
