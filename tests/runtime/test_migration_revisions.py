"""A graph migration and a goal revision meet: the revision is ordinary, the run goes on.

A migration turns the checkpointed state of an old goal revision into the new graph's shape;
it does not make that state belong to a newer goal. Whether the revision landed before the
worker took the lease or between the migration's read and its commit, the run ends on the
new graph *and* the new revision — the graph's revision hook decides what evidence stays —
and neither the checkpoints nor the journal claim otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from audit.journal import run_stream
from audit.verification import verify_stream
from runtime.executor import advance_run
from runtime.graphs import registry
from runtime.lifecycle import create_run, provide_input, revise_goal
from runtime.models import Checkpoint, Run, RunStatus, Tenant
from tests.graphs import evolving
from tests.runtime.helpers import payloads

# Outside a test transaction: each commit is the product's own (on PostgreSQL the one-statement
# step commit, which a test transaction would turn into the transaction path).
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def evolving_v1() -> Iterator[None]:
    registry.register(evolving("1"))
    yield
    registry.unregister("evolving", "1")
    registry.unregister("evolving", "2")
    registry.migrations.pop(("evolving", "1"), None)


def _waiting_on_v1_then_given_input(tenant: Tenant) -> Run:
    """A run that checkpointed on version 1 under goal_rev 1 and is runnable again."""
    run = create_run(tenant, "evolving", {"title": "first"}, actor="user:alice")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    return provide_input(run, {"ok": True}, expected_rev=1, actor="user:alice")


def _deploy_v2(migrate: Any) -> None:
    registry.unregister("evolving", "1")
    registry.register(evolving("2"))
    registry.register_migration("evolving", "1", "2", migrate)


def _assert_migrated_then_revised(run: Run) -> None:
    """Version 2, goal_rev 2, and the default revision hook's restart (nothing kept, back to
    the first step, which waits for input again) — with checkpoints and journal to match."""
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING_INPUT, (run.status, run.attention_reason)
    assert (run.graph_version, run.goal_rev, run.next_step) == ("2", 2, "second")
    assert run.attention_reason == ""
    assert run.lease_owner == "" and run.lease_expires_at is None
    # The migration's checkpoint holds goal_rev 1's state (migrated), and says so; the
    # revision's checkpoint is the first under goal_rev 2.
    checkpoints = list(
        Checkpoint.objects.filter(run=run).order_by("rev").values_list("step", "goal_rev")
    )
    assert checkpoints == [
        ("first", 1),
        ("(migration)", 1),
        ("(revision)", 2),
        ("first", 2),
    ]
    migrated = payloads(run, "migrated")
    assert [(m["from_version"], m["to_version"]) for m in migrated] == [("1", "2")]
    applied = payloads(run, "revision_applied")
    assert [(a["from_rev"], a["to_rev"]) for a in applied] == [(1, 2)]
    assert payloads(run, "escalated") == [] and payloads(run, "incompatible_version") == []
    assert verify_stream(run_stream(run.run_id)) is None


def test_a_revision_made_before_the_migration_is_still_applied(
    tenant_a: Tenant, evolving_v1: None
) -> None:
    """The goal was revised while the run waited for a deploy: the migration must not stamp
    goal_rev 1's state as goal_rev 2's, or the revision hook never runs for it and the run
    finishes the old goal."""
    run = _waiting_on_v1_then_given_input(tenant_a)
    revise_goal(run, {"title": "second"}, expected_goal_rev=1, actor="user:alice")
    _deploy_v2(lambda state: {**state, "shape": "2"})

    assert advance_run(run.run_id, "w1").outcome == "waiting"
    _assert_migrated_then_revised(run)


def test_a_revision_landing_during_the_migration_is_ordinary(
    tenant_a: Tenant, evolving_v1: None
) -> None:
    """The seam between the migration's read and its commit: the goal is revised there (the
    registered migration is the code that runs in that window). The commit is refused — the
    run moved — but the run is still running under this worker's lease: it is not
    `needs_attention`; the worker reads it again, migrates it and applies the revision."""
    run = _waiting_on_v1_then_given_input(tenant_a)
    calls: list[int] = []

    def migrate_while_revised(state: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:  # the revision lands in the window, once
            revise_goal(run, {"title": "second"}, expected_goal_rev=1, actor="user:alice")
        return {**state, "shape": "2"}

    _deploy_v2(migrate_while_revised)

    result = advance_run(run.run_id, "w1")
    assert result.outcome == "waiting", result
    assert len(calls) == 2  # migrated again from what was read again
    _assert_migrated_then_revised(run)
    assert payloads(run, "goal_revised")[0]["status"] == RunStatus.RUNNING


def test_a_cancel_landing_during_the_migration_stops_the_worker(
    tenant_a: Tenant, evolving_v1: None
) -> None:
    """Not every move is a revision: a run cancelled in the window stays cancelled, on its
    old version, and the worker says it stopped (not that the run needs attention)."""
    from runtime.lifecycle import cancel_run

    run = _waiting_on_v1_then_given_input(tenant_a)

    def migrate_while_cancelled(state: dict[str, Any]) -> dict[str, Any]:
        cancel_run(run, "changed my mind", actor="user:alice")
        return {**state, "shape": "2"}

    _deploy_v2(migrate_while_cancelled)

    result = advance_run(run.run_id, "w1")
    run.refresh_from_db()
    assert result.outcome == "stopped", result
    assert run.status == RunStatus.CANCELLED and run.graph_version == "1"
    assert payloads(run, "migrated") == [] and payloads(run, "escalated") == []
