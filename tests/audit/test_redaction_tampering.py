"""A redaction the retention purge did not make is a break (invariant 8; TEST-MATRIX F1).

The purge replaces a purged run's payloads by their digests, and every hash covers the
digest: a redacted entry verifies exactly as the original did. So someone with database
access could wipe what a live run's entries say — the params an action sent, who decided,
why — by writing the digest over them, and every check still passed: the run's trail, its
page, `audit_verify`, all "verified". The purge journals every run it redacts in its
tenant's own stream (`retention_purged` with the runs), in the same transaction; a redacted
entry of a run that no purge names is wiped by someone else.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit import journal
from audit.models import JournalEntry
from audit.verification import verify_all, verify_stream
from runtime import retention
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, Tenant
from tests.audit.tamper import audit_verify, tampering
from tests.conftest import Persona

pytestmark = pytest.mark.tampers_journal


def _run(tenant: Tenant) -> Run:
    run = create_run(tenant, "chain", {"steps": 3}, actor="user:alice")
    advance_run(run.run_id, "w1")
    return run


def _wiped(run: Run, *seqs: int) -> str:
    """The payloads of these entries of the run replaced by their digests, as the purge
    would — with the run kept and no purge journalled."""
    stream = journal.run_stream(run.run_id)
    with tampering():
        JournalEntry.objects.filter(stream=stream, seq__in=seqs).redact()
    return stream


@pytest.mark.parametrize("seqs", [(3,), (1, 2, 3), "all"])
def test_a_live_runs_entries_wiped_to_their_digests_are_a_break(
    tenant_a: Tenant, seqs: tuple[int, ...] | str
) -> None:
    run = _run(tenant_a)
    stream = journal.run_stream(run.run_id)
    if seqs == "all":
        seqs = tuple(JournalEntry.objects.filter(stream=stream).values_list("seq", flat=True))
    _wiped(run, *seqs)
    found = verify_stream(stream)
    assert found is not None and found.seq == min(seqs), found
    assert "redacted" in found.problem
    ok, text = audit_verify("--tenant", tenant_a.slug)
    assert not ok and f"BROKEN {stream} at seq {min(seqs)}" in text, text


def test_the_run_pages_say_a_wiped_entry_is_broken(client: Client, reviewer_a: Persona) -> None:
    run = _run(reviewer_a.tenant)
    _wiped(run, 2)
    client.force_login(reviewer_a.user)
    for name in ("run", "run-trail"):
        page = client.get(reverse(name, args=[run.run_id]))
        assert page.status_code == 200, name
        assert "broken" in page.content.decode().lower(), name


def test_another_tenants_purge_does_not_vouch_for_a_run(tenant_a: Tenant, tenant_b: Tenant) -> None:
    """A `retention_purged` naming the run in another tenant's stream is not its purge."""
    run = _run(tenant_a)
    stream = _wiped(run, 1, 2)
    from django.db import transaction

    with transaction.atomic():
        journal.append(
            journal.tenant_stream(tenant_b.pk),
            "retention_purged",
            tenant_id=tenant_b.pk,
            actor="system:retention",
            payload={"runs": [str(run.run_id)]},
        )
    found = verify_stream(stream)
    assert found is not None and found.seq == 1


def test_the_purges_own_redactions_still_verify(tenant_a: Tenant, tenant_b: Tenant) -> None:
    """Legitimate history: runs purged over several batches and purges, of two tenants, each
    stream verifies (the full run and each tenant's), and the runs kept are untouched."""
    for tenant in (tenant_a, tenant_b):
        Tenant.objects.filter(pk=tenant.pk).update(retention_days=30)
    old = {t.pk: [_run(t) for _ in range(3)] for t in (tenant_a, tenant_b)}
    kept = _run(tenant_a)
    for runs in old.values():
        Run.objects.filter(pk__in=[r.pk for r in runs]).update(
            updated_at=timezone.now() - timedelta(days=31)
        )
    for tenant in (tenant_a, tenant_b):
        report = retention.purge_tenant(Tenant.objects.get(pk=tenant.pk), batch_size=2)
        assert len(report.runs) == 3
    for runs in old.values():
        for run in runs:
            stream = journal.run_stream(run.run_id)
            assert JournalEntry.objects.filter(stream=stream, redacted=True).exists()
            assert verify_stream(stream) is None
    assert verify_stream(journal.run_stream(kept.run_id)) is None
    checked, breaks = verify_all()
    assert breaks == [] and checked >= 9
    for tenant in (tenant_a, tenant_b):
        assert audit_verify("--tenant", tenant.slug)[0]
