"""The executor protocol's functions (runtime.protocol) on their own: they are the workers'
writers behind a validation layer, so they refuse what the workers' writers refuse, and each
change commits with its journal entry or not at all."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import ApprovalRequest
from audit.models import JournalEntry
from runtime import holds, protocol
from runtime.errors import StaleFence
from runtime.events import RunEvent, rebuild_status
from runtime.leases import take_lease
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from tests.api import get, grant_policy, ok, post, session
from tests.conftest import Persona
from tests.runtime.helpers import events

pytestmark = pytest.mark.django_db


def _leased(tenant: Tenant, owner: str = "p1") -> tuple[Run, int]:
    run = create_run(tenant, "chain", {"steps": 3}, actor="agent:t", external=True)
    lease = take_lease(run.run_id, owner, 30, runnable_only=False)
    return Run.objects.get(pk=run.pk), lease.fence


def test_release_of_another_tenants_run_is_refused(tenant_a: Tenant, tenant_b: Tenant) -> None:
    """A run handed in under another tenant (a confused or forged caller) is not released:
    every statement names the tenant, as a worker's do."""
    run, fence = _leased(tenant_a)
    intruder = Run.objects.get(pk=run.pk)
    intruder.tenant_id = tenant_b.id
    with pytest.raises(StaleFence):
        protocol.release(intruder, fence, "agent:b")
    stored = Run.objects.get(pk=run.pk)
    assert (stored.lease_owner, stored.lease_expires_at) == ("p1", run.lease_expires_at)
    assert "lease_released" not in events(run)
    assert not JournalEntry.objects.filter(tenant_id=tenant_b.id).exists()


def test_heartbeat_of_another_tenants_run_is_refused(tenant_a: Tenant, tenant_b: Tenant) -> None:
    run, fence = _leased(tenant_a)
    intruder = Run.objects.get(pk=run.pk)
    intruder.tenant_id = tenant_b.id
    with pytest.raises(StaleFence):
        protocol.heartbeat(intruder, fence, 60, who="agent:b")
    assert Run.objects.get(pk=run.pk).lease_expires_at == run.lease_expires_at


def test_heartbeat_and_release_naming_another_owner_are_refused(tenant_a: Tenant) -> None:
    run, fence = _leased(tenant_a, owner="p1")
    with pytest.raises(StaleFence):
        protocol.heartbeat(run, fence, 60, who="agent:a", owner="p2")
    with pytest.raises(StaleFence):
        protocol.release(run, fence, "agent:a", owner="p2")
    stored = Run.objects.get(pk=run.pk)
    assert (stored.lease_owner, stored.lease_expires_at) == ("p1", run.lease_expires_at)
    assert events(run).count("stale_write_refused") == 2
    protocol.release(run, fence, "agent:a", owner="p1")
    assert Run.objects.get(pk=run.pk).lease_owner == ""


def test_a_released_lease_is_not_revived_by_a_heartbeat(tenant_a: Tenant) -> None:
    run, fence = _leased(tenant_a)
    protocol.release(run, fence, "agent:a")
    released = Run.objects.get(pk=run.pk)
    with pytest.raises(StaleFence):
        protocol.heartbeat(released, fence, 30, who="agent:a")
    stored = Run.objects.get(pk=run.pk)
    assert (stored.lease_owner, stored.lease_expires_at) == ("", None)


def test_a_release_queues_a_running_run_as_a_workers_does(tenant_a: Tenant) -> None:
    """The next `lease` takes it from queued (an external run stays out of the workers')."""
    run, fence = _leased(tenant_a)
    assert run.status == RunStatus.RUNNING
    protocol.release(run, fence, "agent:a")
    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.lease_owner) == (RunStatus.QUEUED, "")
    released = JournalEntry.objects.get(stream=f"run:{run.pk}", type="lease_released")
    assert released.actor == f"agent:a#{fence}"
    assert released.payload == {"fence": fence, "status": RunStatus.QUEUED}
    again = take_lease(run.run_id, "p2", 30, runnable_only=False)
    assert again.fence == fence + 2  # the release moved it on; the take once more
    assert Run.objects.get(pk=run.pk).status == RunStatus.RUNNING


def _approved_action(agent: Persona, reviewer: Persona) -> tuple[Run, int, Action]:
    """An external run parked for an approval that has just been given: the run is woken,
    the action approved, and the next dispatch resumes the run."""
    grant_policy(agent.tenant, tool="agent.tasks.create")
    run, fence = _leased(agent.tenant)
    action, created = protocol.prepare(
        run, fence, "agent.tasks.create", {"title": "Ship"}, reason="r", who="agent:a"
    )
    assert created and action.status == ActionStatus.AWAITING_APPROVAL
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL
    request = ApprovalRequest.objects.get(action=action)
    alice = session(reviewer.user)  # a reviewer's decision, as the web makes it
    shown = ok(get(alice, f"approvals/{request.pk}/"))
    body = {"decision": "approve", "action_hash": shown["action_hash"], "reason": "ok"}
    ok(post(alice, f"approvals/{request.pk}/decision/", body))
    return run, fence, Action.objects.get(pk=action.pk)


def test_a_dispatch_resumes_the_parked_run_with_its_journal_entry(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    run, fence, action = _approved_action(agent_a, reviewer_a)
    parked = Run.objects.get(pk=run.pk).status
    assert parked in (RunStatus.QUEUED, RunStatus.WAITING_APPROVAL)
    sent = protocol.dispatch(action, fence, "agent:a")
    assert sent.status == ActionStatus.SENT
    assert Run.objects.get(pk=run.pk).status == RunStatus.RUNNING
    resumed = JournalEntry.objects.filter(stream=f"run:{run.pk}", type="resumed").get()
    assert resumed.payload == {"previous_status": parked, "status": RunStatus.RUNNING}


def test_a_crash_between_the_resume_and_its_journal_entry_leaves_neither(
    agent_a: Persona, reviewer_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seam: the journal write of the resume fails after the run row was changed. The
    change and its record commit together, so the run is where its journal says it is —
    and, the resume being part of the dispatch, nothing was marked sent either."""
    run, fence, action = _approved_action(agent_a, reviewer_a)
    parked = Run.objects.get(pk=run.pk).status
    real = holds.record  # the resume is written by runtime.holds.align

    def crash_at_resumed(run: Any, type: RunEvent, *args: Any, **kwargs: Any) -> Any:
        if type == RunEvent.RESUMED:
            raise RuntimeError("crash: the journal entry of the resume was never written")
        return real(run, type, *args, **kwargs)

    monkeypatch.setattr(holds, "record", crash_at_resumed)
    with pytest.raises(RuntimeError, match="crash"):
        protocol.dispatch(action, fence, "agent:a")
    monkeypatch.undo()
    stored = Run.objects.get(pk=run.pk)
    assert stored.status == parked == rebuild_status(run.pk)
    assert "resumed" not in events(run)
    assert Action.objects.get(pk=action.pk).status == ActionStatus.APPROVED
    # Nothing half-done is left behind: the retry goes through whole.
    assert protocol.dispatch(action, fence, "agent:a").status == ActionStatus.SENT
    assert Run.objects.get(pk=run.pk).status == RunStatus.RUNNING == rebuild_status(run.pk)
