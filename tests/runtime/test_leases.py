"""Leases with fences: one executor at a time, a stale one refused and stopped (invariant 4)."""

from __future__ import annotations

import pytest

from runtime.errors import AlreadyCompleted, LeaseHeld, StaleFence
from runtime.executor import Executor, advance_run
from runtime.leases import heartbeat, release, take_lease
from runtime.lifecycle import create_run
from runtime.models import Checkpoint, Run, RunStatus, Tenant
from tests.runtime.helpers import events, expire_lease, payloads


def test_take_lease_bumps_fence_and_refuses_a_second_taker(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 3}, actor="test")
    first = take_lease(run.run_id, "w1", ttl=30)
    assert first.fence == 1
    with pytest.raises(LeaseHeld):
        take_lease(run.run_id, "w2", ttl=30)
    run.refresh_from_db()
    assert (run.lease_owner, run.fence, run.status) == ("w1", 1, RunStatus.RUNNING)


def test_expired_lease_is_taken_over_with_a_higher_fence(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 3}, actor="test")
    first = take_lease(run.run_id, "w1", ttl=30)
    expire_lease(run)
    second = take_lease(run.run_id, "w2", ttl=30)
    assert second.fence == first.fence + 1
    taken = payloads(run, "lease_taken")
    assert taken[-1]["takeover"] is True and taken[-1]["previous_owner"] == "w1"


def test_heartbeat_and_release_refuse_a_stale_fence(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 3}, actor="test")
    old = take_lease(run.run_id, "w1", ttl=30)
    assert heartbeat(old) >= old.expires_at
    expire_lease(run)
    new = take_lease(run.run_id, "w2", ttl=30)
    with pytest.raises(StaleFence):
        heartbeat(old)
    with pytest.raises(StaleFence):
        release(old)
    run.refresh_from_db()
    assert run.lease_owner == "w2" and run.fence == new.fence
    assert events(run).count("stale_write_refused") == 2


def test_stale_executor_is_refused_and_stops(tenant_a: Tenant) -> None:
    """A paused executor wakes after a takeover: its next write is refused, nothing of it lands."""
    run = create_run(tenant_a, "chain", {"steps": 4}, actor="test")
    stale_lease = take_lease(run.run_id, "paused-worker", ttl=30)
    stale = Executor(stale_lease)  # loaded its view of the run, then "paused"
    expire_lease(run)
    assert advance_run(run.run_id, "healthy-worker").outcome == "completed"

    with pytest.raises(StaleFence):
        stale.execute(slice_seconds=60)

    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.checkpoint_rev == 4
    assert not Checkpoint.objects.filter(run=run, fence=stale_lease.fence).exists()
    kinds = events(run)
    assert "stale_write_refused" in kinds
    assert payloads(run, "lease_taken")[-1]["takeover"] is True


def test_stale_executor_cannot_record_a_paid_call(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="test")
    stale = Executor(take_lease(run.run_id, "w1", ttl=30))
    expire_lease(run)
    take_lease(run.run_id, "w2", ttl=30)
    stale.load()
    ctx = stale.context("tick")
    with pytest.raises(StaleFence):
        ctx.record("model:x", lambda: "paid")
    assert not run.recorded_calls.exists()


def test_completed_run_is_never_leased_again(tenant_a: Tenant) -> None:
    run = create_run(tenant_a, "chain", {"steps": 1}, actor="test")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    with pytest.raises(AlreadyCompleted):
        take_lease(run.run_id, "w2", ttl=30)
    assert advance_run(run.run_id, "w2").outcome == "skipped"
    assert Run.objects.get(pk=run.pk).fence == 1
