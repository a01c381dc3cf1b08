"""The sweeper does not flood the queue with doorbells for runs that already wait in it
(issue 8's storm: 2,000 due runs were rung 6,718 times), yet still re-rings a run whose
doorbell was lost and a crashed worker's run as soon as its lease ends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from runtime import sweeper
from runtime.leases import take_lease
from runtime.lifecycle import create_run
from runtime.models import Tenant
from runtime.sweeper import sweep_once
from tests.runtime.helpers import expire_lease


class Rings:
    """Time passing for the sweeper, told by moving its data, not its clock (NOTES.md:
    tests move the data). The sweeper remembers when it rang each run on its own monotonic
    clock, which time-machine cannot move; `pass_(s)` makes every remembered ring `s`
    seconds older — what `s` seconds of waiting would have done."""

    def pass_(self, seconds: float) -> None:
        for run_id, (at, seen) in list(sweeper._rung.items()):
            sweeper._rung[run_id] = (at - seconds, seen)


def fill_queue(messages: int) -> None:
    """Real messages in the real ORM broker: a queue backed up as in a storm."""
    from django_q.brokers import get_broker

    broker = get_broker()
    for i in range(messages):
        broker.enqueue(f"doorbell-{i}")


@pytest.fixture
def clock(settings: Any) -> Iterator[Rings]:
    """No ring remembered from another test; the broker's queue holds more than a batch."""
    sweeper._rung.clear()
    fill_queue(settings.HOLDPOINT_SWEEP_BATCH)
    assert sweeper.backlog() >= settings.HOLDPOINT_SWEEP_BATCH
    yield Rings()
    sweeper._rung.clear()


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_a_rung_run_nobody_took_is_not_rung_again_within_the_window(
    tenant_a: Tenant, clock: Rings
) -> None:
    runs = {str(create_run(tenant_a, "chain", {"steps": 2}, actor="t").run_id) for _ in range(3)}
    rung: list[str] = []
    sweep_once(ring=rung.append)
    assert set(rung) == runs
    for _ in range(4):  # a storm's queue is still full: four more ticks ring nothing
        clock.pass_(2)
        sweep_once(ring=rung.append)
    assert len(rung) == 3
    clock.pass_(2.5)  # 10.5 s after the ring: the doorbell may have been lost, ring again
    sweep_once(ring=rung.append)
    assert len(rung) == 6 and set(rung[3:]) == runs


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_a_crashed_workers_run_is_rung_as_soon_as_its_lease_ends(
    tenant_a: Tenant, clock: Rings
) -> None:
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    rung: list[str] = []
    sweep_once(ring=rung.append)
    assert rung == [str(run.run_id)]
    take_lease(run.run_id, "worker-that-dies", ttl=30)  # the doorbell was answered
    clock.pass_(1)
    sweep_once(ring=rung.append)
    assert len(rung) == 1  # leased: not due
    expire_lease(run)  # the worker died; its lease ran out well inside the window
    clock.pass_(1)
    sweep_once(ring=rung.append)
    assert rung == [str(run.run_id)] * 2


@override_settings(HOLDPOINT_SWEEP_REDRIVE=0)
def test_a_zero_window_rings_every_tick(tenant_a: Tenant, clock: Rings) -> None:
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    rung: list[str] = []
    for _ in range(3):
        sweep_once(ring=rung.append)
        clock.pass_(0.5)
    assert rung == [str(run.run_id)] * 3


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_skipped_runs_do_not_crowd_out_the_rest(tenant_a: Tenant, clock: Rings) -> None:
    """Rung runs are the oldest due ones; leaving them out must reach the next ones."""
    first = [str(create_run(tenant_a, "chain", {"steps": 2}, actor="t").run_id) for _ in range(4)]
    rung: list[str] = []
    sweep_once(batch=4, per_tenant=4, ring=rung.append)
    assert set(rung) == set(first)
    later = [str(create_run(tenant_a, "chain", {"steps": 2}, actor="t").run_id) for _ in range(4)]
    clock.pass_(2)
    sweep_once(batch=4, per_tenant=4, ring=rung.append)
    assert set(rung[4:]) == set(later)


@override_settings(HOLDPOINT_SWEEP_REDRIVE=10)
def test_with_a_short_queue_every_tick_rings_again(tenant_a: Tenant) -> None:
    """A short queue means the doorbell was taken, maybe by a hung cluster that will never
    run it: ringing again each tick is what rescues the run."""
    from django.conf import settings

    sweeper._rung.clear()
    assert sweeper.backlog() < settings.HOLDPOINT_SWEEP_BATCH  # the real queue is short
    clock = Rings()
    run = create_run(tenant_a, "chain", {"steps": 2}, actor="t")
    rung: list[str] = []
    for _ in range(3):
        sweep_once(ring=rung.append)
        clock.pass_(2)
    assert rung == [str(run.run_id)] * 3


def test_the_backlog_is_the_brokers_waiting_messages(tenant_a: Tenant) -> None:
    from django_q.brokers import get_broker

    broker = get_broker()
    before = sweeper.queue_backlog()
    broker.enqueue("doorbell-1")
    broker.enqueue("doorbell-2")
    assert sweeper.queue_backlog() == before + 2
