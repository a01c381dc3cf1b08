"""The sweeper does not flood the queue with doorbells for runs that already wait in it
(issue 8's storm: 2,000 due runs were rung 6,718 times), yet still re-rings a run whose
doorbell was lost and a crashed worker's run as soon as its lease ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.test import override_settings

from runtime import sweeper
from runtime.leases import take_lease
from runtime.lifecycle import create_run
from runtime.models import Tenant
from runtime.sweeper import sweep_once
from tests.runtime.helpers import expire_lease


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The sweeper's monotonic clock, moved by the test; the queue backed up (a storm)."""
    now = [1000.0]
    monkeypatch.setattr(sweeper, "clock", lambda: now[0])
    monkeypatch.setattr(sweeper, "_rung", {})
    monkeypatch.setattr(sweeper, "backlog", lambda: 10_000)
    yield now


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_a_rung_run_nobody_took_is_not_rung_again_within_the_window(
    tenant_a: Tenant, clock: list[float]
) -> None:
    runs = {str(create_run(tenant_a, "chain", {"steps": 2}, actor="t").run_id) for _ in range(3)}
    rung: list[str] = []
    sweep_once(ring=rung.append)
    assert set(rung) == runs
    for _ in range(4):  # a storm's queue is still full: four more ticks ring nothing
        clock[0] += 2
        sweep_once(ring=rung.append)
    assert len(rung) == 3
    clock[0] += 2.5  # 10.5 s after the ring: the doorbell may have been lost, ring again
    sweep_once(ring=rung.append)
    assert len(rung) == 6 and set(rung[3:]) == runs


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_a_crashed_workers_run_is_rung_as_soon_as_its_lease_ends(
    tenant_a: Tenant, clock: list[float]
) -> None:
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    rung: list[str] = []
    sweep_once(ring=rung.append)
    assert rung == [str(run.run_id)]
    take_lease(run.run_id, "worker-that-dies", ttl=30)  # the doorbell was answered
    clock[0] += 1
    sweep_once(ring=rung.append)
    assert len(rung) == 1  # leased: not due
    expire_lease(run)  # the worker died; its lease ran out well inside the window
    clock[0] += 1
    sweep_once(ring=rung.append)
    assert rung == [str(run.run_id)] * 2


@override_settings(HOLDPOINT_SWEEP_REDRIVE=0)
def test_a_zero_window_rings_every_tick(tenant_a: Tenant, clock: list[float]) -> None:
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    rung: list[str] = []
    for _ in range(3):
        sweep_once(ring=rung.append)
        clock[0] += 0.5
    assert rung == [str(run.run_id)] * 3


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_skipped_runs_do_not_crowd_out_the_rest(tenant_a: Tenant, clock: list[float]) -> None:
    """Rung runs are the oldest due ones; leaving them out must reach the next ones."""
    first = [str(create_run(tenant_a, "chain", {"steps": 2}, actor="t").run_id) for _ in range(4)]
    rung: list[str] = []
    sweep_once(batch=4, per_tenant=4, ring=rung.append)
    assert set(rung) == set(first)
    later = [str(create_run(tenant_a, "chain", {"steps": 2}, actor="t").run_id) for _ in range(4)]
    clock[0] += 2
    sweep_once(batch=4, per_tenant=4, ring=rung.append)
    assert set(rung[4:]) == set(later)


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_with_a_short_queue_every_tick_rings_again(
    tenant_a: Tenant, clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short queue means the doorbell was taken, maybe by a hung cluster that will never
    run it: ringing again each tick is what rescues the run."""
    monkeypatch.setattr(sweeper, "backlog", lambda: 0)
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    rung: list[str] = []
    for _ in range(3):
        sweep_once(ring=rung.append)
        clock[0] += 2
    assert rung == [str(run.run_id)] * 3


def test_the_backlog_is_the_brokers_waiting_messages(tenant_a: Tenant) -> None:
    from django_q.brokers import get_broker

    broker = get_broker()
    before = sweeper.queue_backlog()
    broker.enqueue("doorbell-1")
    broker.enqueue("doorbell-2")
    assert sweeper.queue_backlog() == before + 2
