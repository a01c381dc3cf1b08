"""The database refuses a run row its status does not allow (runtime/models/runs.py).

Direct writes, bypassing every writer's own care, so what is proved is the constraint
itself — on SQLite here and on PostgreSQL in CI — and that migration 0014 mends old rows
that break a rule before it adds the constraints.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from runtime import sqlitestep
from runtime.lifecycle import create_run
from runtime.models import Run, RunStatus, Tenant

SOON = timezone.now() + timedelta(minutes=5)
LEASE = {"lease_owner": "host:1", "lease_expires_at": SOON}

REFUSED = [
    ("runtime_run_finished_no_lease", {"status": RunStatus.COMPLETED, **LEASE}),
    ("runtime_run_finished_no_lease", {"status": RunStatus.FAILED, **LEASE}),
    ("runtime_run_finished_no_lease", {"status": RunStatus.CANCELLED, **LEASE}),
    ("runtime_run_lease_both_or_neither", {"lease_owner": "host:1"}),
    ("runtime_run_lease_both_or_neither", {"lease_expires_at": SOON}),
    ("runtime_run_attention_has_reason", {"status": RunStatus.NEEDS_ATTENTION}),
]
ALLOWED = [
    {"status": RunStatus.RUNNING, **LEASE},
    {"status": RunStatus.RUNNING, "lease_owner": "host:1", "lease_expires_at": timezone.now()},
    {"status": RunStatus.NEEDS_ATTENTION, "attention_reason": "3 consecutive failures"},
    {"status": RunStatus.NEEDS_ATTENTION, "attention_reason": "looked at", **LEASE},
    {"status": RunStatus.COMPLETED},
    {"status": RunStatus.QUEUED, "attention_reason": ""},
]


def _run(tenant: Tenant) -> Run:
    return create_run(tenant, "chain", {"steps": 1}, actor="t")


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "changes"), REFUSED, ids=lambda v: str(v)[:40])
def test_the_database_refuses_what_the_status_does_not_allow(
    name: str, changes: dict[str, Any], tenant_a: Tenant
) -> None:
    run = _run(tenant_a)
    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        Run.objects.filter(pk=run.pk).update(**changes)
    assert name in str(refused.value)
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.lease_expires_at) == (RunStatus.QUEUED, "", None)


@pytest.mark.django_db
@pytest.mark.parametrize("changes", ALLOWED, ids=lambda v: str(v)[:40])
def test_what_the_status_allows_is_written(changes: dict[str, Any], tenant_a: Tenant) -> None:
    run = _run(tenant_a)
    assert Run.objects.filter(pk=run.pk).update(**changes) == 1
    # Back to what its journal says (the suite rebuilds every run's status from it).
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.QUEUED, lease_owner="", lease_expires_at=None
    )


@pytest.mark.django_db(transaction=True)
def test_the_migration_mends_rows_that_break_a_rule_before_adding_the_constraints() -> None:
    with sqlitestep.set_aside(connection):  # a migration by hand: no migrate signals
        _migrate_then_mend()


def _migrate_then_mend() -> None:
    before, after = ("runtime", "0013_sweeper_turn"), ("runtime", "0014_run_status_constraints")
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([before])
        old = executor.loader.project_state([before]).apps
        tenant = old.get_model("runtime", "Tenant").objects.create(slug="old", name="Old")
        rows = {
            "finished_leased": {"status": "completed", **LEASE},
            "owner_only": {"status": "running", "lease_owner": "host:2"},
            "expiry_only": {"status": "queued", "lease_expires_at": SOON},
            "attention_no_reason": {"status": "needs_attention"},
            "sound": {"status": "running", **LEASE},
        }
        ids = {}
        for label, fields in rows.items():
            ids[label] = uuid.uuid4()
            old.get_model("runtime", "Run").objects.create(
                run_id=ids[label],
                tenant=tenant,
                thread_id=label,
                graph="chain",
                graph_version="1",
                goal={},
                next_step="step",
                **fields,
            )

        executor = MigrationExecutor(connection)
        executor.migrate([after])
        # The model as of 0014: today's Run has columns later migrations add.
        new_run = executor.loader.project_state([after]).apps.get_model("runtime", "Run")

        def lease(label: str) -> tuple[str, Any]:
            run = new_run.objects.get(pk=ids[label])
            return run.lease_owner, run.lease_expires_at

        for label in ("finished_leased", "owner_only", "expiry_only"):
            assert lease(label) == ("", None), label
        assert lease("sound") == ("host:1", SOON)
        reason = new_run.objects.get(pk=ids["attention_no_reason"]).attention_reason
        assert "no reason was recorded" in reason
        with pytest.raises(IntegrityError), transaction.atomic():
            new_run.objects.filter(pk=ids["sound"]).update(status=RunStatus.FAILED)
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
        # Rows made without a journal: gone before the suite rebuilds runs from theirs.
        Run.objects.filter(tenant__slug="old").delete()
        Tenant.objects.filter(slug="old").delete()
