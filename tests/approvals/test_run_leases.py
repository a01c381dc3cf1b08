"""A run's lease where it meets a hold point: a worker that stops because the run moved under
it while it parked at one gives its lease up at once (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from runtime.executor import Executor, advance_run
from runtime.lifecycle import create_run, revise_goal
from runtime.models import Run, RunStatus, Tenant
from tests.approvals.conftest import GOAL
from tests.runtime.helpers import payloads

A = ApprovalStatus


def test_a_worker_stopped_by_a_revision_while_parking_releases_its_lease(
    tenant_a: Tenant,
    policy: ApprovalPolicy,
    sandbox_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The goal is revised between the action being held and the run parking at its hold
    point: the park's commit is refused (the run moved), the worker stops — and kept the
    run's lease until it expired, so no worker could apply the revision meanwhile (the
    revision's doorbell found the lease held: skipped)."""
    sandbox_factory("key")
    park = Executor.park

    def revised_first(self: Executor, parked: Any, step: str) -> Any:
        run = Run.objects.get(pk=self.run.run_id)
        revise_goal(run, {**GOAL, "scope": ["/orders"]}, expected_goal_rev=1, actor="user:bob")
        return park(self, parked, step)

    monkeypatch.setattr(Executor, "park", revised_first)
    run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "stopped"
    monkeypatch.setattr(Executor, "park", park)
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.lease_expires_at) == (RunStatus.QUEUED, "", None)
    assert payloads(run, "lease_released")[-1] == {"fence": 1, "status": RunStatus.QUEUED}
    # The next worker takes it at once and holds the new revision's action.
    assert advance_run(run.run_id, "w2").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert request.action.goal_rev == 2
