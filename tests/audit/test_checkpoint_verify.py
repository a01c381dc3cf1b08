"""`manage.py checkpoint_verify`: a checkpoint edited, forged, deleted, or an artifact it
reaches changed or lost, is named — as an operator would see it, by the command's output and
exit status. The edits are an attacker's with database access (tests/audit/tamper.py: the
triggers bypassed), through a plain QuerySet that the models' guards do not see."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.models import QuerySet

from runtime.artifacts import collect_refs
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Artifact, Checkpoint, Run, Tenant
from runtime.stepcommit import checkpoint_digest, stored_fields
from tests.audit.tamper import tampering

# The suite's own after-test check would name these edits too.
pytestmark = pytest.mark.tampers_journal


def checkpoint_verify(*args: str) -> tuple[bool, str]:
    out = StringIO()
    try:
        call_command("checkpoint_verify", *args, stdout=out)
    except CommandError as exc:
        return False, out.getvalue() + str(exc)
    return True, out.getvalue()


def _chain(tenant: Tenant, steps: int = 3) -> Run:
    run = create_run(tenant, "chain", {"steps": steps}, actor="user:alice")
    advance_run(run.run_id, "w1")
    return run


def _grown(tenant: Tenant, steps: int = 40) -> Run:
    """A run whose state lives mostly in artifacts: chunks, links, the chunks' list."""
    run = create_run(tenant, "grower", {"steps": steps}, actor="user:alice")
    advance_run(run.run_id, "w1")
    return run


def _rows(model: Any) -> QuerySet[Any]:
    return QuerySet(model=model)


def test_runs_as_written_verify(tenant_a: Tenant, tenant_b: Tenant) -> None:
    chain, grown = _chain(tenant_a), _grown(tenant_a)
    _chain(tenant_b)
    assert Artifact.objects.filter(tenant=tenant_a).count() > 5

    ok, text = checkpoint_verify()
    assert ok, text
    assert "3 run(s), 46 checkpoint(s) checked, 0 broken" in text
    ok, text = checkpoint_verify("--tenant", tenant_a.slug)
    assert ok and "2 run(s), 43 checkpoint(s) checked, 0 broken" in text
    for run, count in ((chain, 3), (grown, 40)):
        ok, text = checkpoint_verify("--run", str(run.run_id))
        assert ok and f"1 run(s), {count} checkpoint(s) checked" in text


@pytest.mark.parametrize("edit", ["state", "status", "forged_digest"])
def test_an_edited_checkpoint_is_named(tenant_a: Tenant, edit: str) -> None:
    run = _chain(tenant_a)
    row = Checkpoint.objects.get(run=run, rev=2)
    with tampering():
        if edit == "state":
            _rows(Checkpoint).filter(pk=row.pk).update(state={**row.state, "forged": True})
        elif edit == "status":
            _rows(Checkpoint).filter(pk=row.pk).update(status="completed")
        else:  # the forger recomputes the digest too: the journal still has the real one
            forged = {**stored_fields(row), "state": {**row.state, "forged": True}}
            _rows(Checkpoint).filter(pk=row.pk).update(
                state=forged["state"], digest=checkpoint_digest(run.run_id, forged)
            )

    ok, text = checkpoint_verify("--tenant", tenant_a.slug)
    assert not ok
    expected = (
        "its digest is not the one its step journalled"
        if edit == "forged_digest"
        else "its fields do not hash to its digest"
    )
    assert f"BROKEN run {run.run_id} checkpoint 2: {expected}" in text
    assert "1 broken" in text  # the others are not named


def test_a_deleted_checkpoint_is_named(tenant_a: Tenant) -> None:
    run = _chain(tenant_a, steps=4)
    with tampering():
        _rows(Checkpoint).filter(run=run, rev__in=[2, 3]).delete()

    ok, text = checkpoint_verify("--run", str(run.run_id))
    assert not ok
    assert f"BROKEN run {run.run_id} checkpoint 2: missing" in text
    assert f"BROKEN run {run.run_id} checkpoint 3: missing" in text
    assert "2 checkpoint(s) checked, 2 broken" in text


def _reached(run: Run) -> list[str]:
    last = Checkpoint.objects.filter(run=run).order_by("rev").last()
    assert last is not None
    return sorted(collect_refs(last.state, set()))


def test_an_artifact_changed_or_lost_is_named(tenant_a: Tenant) -> None:
    run = _grown(tenant_a)
    direct = _reached(run)
    assert direct, "the grown state refers to artifacts"
    # An artifact reached only through another (an older link or chunk): the walk follows it.
    nested = (
        Artifact.objects.filter(tenant=tenant_a)
        .exclude(digest__in=direct)
        .values_list("digest", flat=True)
        .first()
    )
    assert nested is not None
    changed, lost = direct[0], nested
    with tampering():
        row = Artifact.objects.get(tenant=tenant_a, digest=changed)
        _rows(Artifact).filter(pk=row.pk).update(content=row.content.replace("x", "y", 1))
        _rows(Artifact).filter(tenant=tenant_a, digest=lost).delete()

    ok, text = checkpoint_verify("--run", str(run.run_id))
    assert not ok
    assert f"artifact {changed[:12]} does not hash to its address" in text
    assert f"artifact {lost[:12]} is missing" in text


def test_another_tenants_artifact_with_the_same_address_does_not_stand_in(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    """Artifacts are per tenant: tenant b's copy of the same content does not make a's
    checkpoint readable."""
    run, _ = _grown(tenant_a), _grown(tenant_b)
    victim = _reached(run)[0]
    assert Artifact.objects.filter(tenant=tenant_b, digest=victim).exists()
    with tampering():
        _rows(Artifact).filter(tenant=tenant_a, digest=victim).delete()

    ok, text = checkpoint_verify("--tenant", tenant_a.slug)
    assert not ok and f"artifact {victim[:12]} is missing" in text
    ok, text = checkpoint_verify("--tenant", tenant_b.slug)
    assert ok, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tenant", " "), "--tenant needs a tenant slug"),
        (("--run", ""), "--run needs a run id"),
        (("--tenant", "nobody"), "no tenant 'nobody'"),
        (("--run", "not-a-uuid"), "is not a run id"),
        (("--run", "00000000-0000-0000-0000-000000000000"), "no run"),
    ],
)
def test_what_names_nothing_is_refused(
    tenant_a: Tenant, args: tuple[str, ...], message: str
) -> None:
    _chain(tenant_a, steps=1)
    ok, text = checkpoint_verify(*args)
    assert not ok and message in text


def test_another_tenants_run_is_not_checked_under_a_tenant(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    theirs = _chain(tenant_b)
    ok, text = checkpoint_verify("--tenant", tenant_a.slug, "--run", str(theirs.run_id))
    assert not ok and "no run" in text


def test_a_checkpoint_moved_to_another_tenant_is_named(tenant_a: Tenant, tenant_b: Tenant) -> None:
    """No database key ties a checkpoint's tenant to its run's (runtime migration 0035): the
    verifier does."""
    run = _chain(tenant_a)
    with tampering():
        _rows(Checkpoint).filter(run=run, rev=2).update(tenant=tenant_b)

    ok, text = checkpoint_verify("--run", str(run.run_id))
    assert not ok
    assert f"BROKEN run {run.run_id} checkpoint 2: its tenant is not its run's" in text
    assert "1 broken" in text


def test_checkpoints_left_without_their_run_are_named(tenant_a: Tenant, tenant_b: Tenant) -> None:
    """A run deleted under its checkpoints (no database key refuses it any more): the walk by
    runs cannot meet them, so they are looked for on their own — under the whole check and
    their tenant's, not another tenant's nor one run's."""
    run, kept = _chain(tenant_a), _chain(tenant_a)
    with tampering():  # the run and all else of it, but its checkpoints: no cascade to them
        for relation in Run._meta.related_objects:
            if relation.related_model is not Checkpoint:
                rows = _rows(relation.related_model).filter(**{relation.field.name: run})
                rows._raw_delete(connection.alias)
        Run.objects.filter(pk=run.pk)._raw_delete(connection.alias)

    for args in ((), ("--tenant", tenant_a.slug)):
        ok, text = checkpoint_verify(*args)
        assert not ok
        assert f"BROKEN run {run.run_id} checkpoint 1: its run is missing" in text
        assert "1 broken" in text  # once per run, not once per checkpoint
    ok, text = checkpoint_verify("--tenant", tenant_b.slug)
    assert ok, text
    ok, text = checkpoint_verify("--run", str(kept.run_id))
    assert ok, text

    with tampering():  # SQLite keeps its keys: the test's end checks them
        _rows(Checkpoint).filter(run_id=run.run_id)._raw_delete(connection.alias)
