"""The retention purge keeps a finished run whose compensation is still to be sent.

A compensation is an action of the (finished) run that no step drives: a person asked for it
after the run completed, and its sender is rung for it — or the sweeper tries it again when
its tool could not be reached. Asking for it does not touch the run, so the run's updated_at
can be past its tenant's retention while the compensation waits. The purge kept runs with an
action whose outcome is not known (`sent`, `unknown`, `manual_review`) and a pending approval,
not this one: it deleted the authorised undo with the run, the effect it was to undo stayed,
and nothing said so.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone

from runtime import retention
from runtime.compensation import compensate, dispatch_standalone
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, Tenant
from tests.sandbox import Sandbox

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/users"],
    "create_review_task": True,
}


def _aged(run: Run, days: int) -> None:
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(days=days))


def _purged(tenant: Tenant) -> list[str]:
    return retention.purge_tenant(Tenant.objects.get(pk=tenant.pk)).runs


def _finished_with_a_compensation(tenant: Tenant) -> tuple[Run, Action, Action]:
    Tenant.objects.filter(pk=tenant.pk).update(retention_days=30)
    run = create_run(tenant, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    undo = compensate(original, "created by mistake", actor="user:alice")
    assert undo.status == ActionStatus.PREPARED  # its sender is rung when this commits
    return run, original, undo


def test_a_compensation_waiting_for_its_send_keeps_its_run_until_it_is_settled(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    run, original, undo = _finished_with_a_compensation(tenant_a)
    _aged(run, 31)

    assert _purged(tenant_a) == []
    assert Action.objects.filter(pk=undo.pk, status=ActionStatus.PREPARED).exists()
    preview = retention.purge_tenant(Tenant.objects.get(pk=tenant_a.pk), dry_run=True)
    assert preview.runs == []  # the plan says the same

    # Its sender runs: the effect is undone, and the run is purged like any other after.
    assert dispatch_standalone(undo.action_id).status == ActionStatus.CONFIRMED
    original.refresh_from_db()
    assert original.status == ActionStatus.COMPENSATED
    assert [t["status"] for t in box.tasks()] == ["closed"]
    _aged(run, 31)
    assert _purged(tenant_a) == [str(run.run_id)]


@pytest.mark.parametrize("status", [ActionStatus.APPROVED, ActionStatus.AWAITING_APPROVAL])
def test_an_approved_or_held_compensation_keeps_its_run(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], status: ActionStatus
) -> None:
    """Approved: its sender is rung by the decision. Held: it waits for a reviewer — one
    held before compensations raised requests has none open, so no hold point keeps it."""
    sandbox_factory("key")
    run, _original, undo = _finished_with_a_compensation(tenant_a)
    Action.objects.filter(pk=undo.pk).update(status=status)
    _aged(run, 31)
    assert _purged(tenant_a) == []
    assert Action.objects.filter(pk=undo.pk).exists()


@pytest.mark.parametrize("status", [ActionStatus.CANCELLED, ActionStatus.FAILED])
def test_a_compensation_that_ended_unsent_does_not_keep_its_run(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], status: ActionStatus
) -> None:
    sandbox_factory("key")
    run, _original, undo = _finished_with_a_compensation(tenant_a)
    Action.objects.filter(pk=undo.pk).update(status=status)
    _aged(run, 31)
    assert _purged(tenant_a) == [str(run.run_id)]
