"""The fleet sweeps about once per interval however many worker processes tick (they take
turns on the database clock), and a crashed worker's run resumes with nothing but a fresh
cluster running — within seconds, not when django-q2's scheduler first fires (30 s after a
cluster starts; issue 8 measured 30.8 s "as deployed" before each worker process ran its
own sweeper loop)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone
from django_q.models import Schedule, Success

from runtime.faults import FaultPoint
from runtime.models import Run, RunStatus, SweeperTurn, Tenant
from runtime.sweeper import (
    TURN,
    next_due_in,
    pause,
    prune_task_history,
    sweep_once,
    sweep_turn,
    take_turn,
)
from tests import procs
from tests.runtime.helpers import overlaps_commits
from tests.runtime.test_workers import _crash_at, _lines

pytestmark = pytest.mark.django_db(transaction=True)


def _turn_is_free() -> None:
    """As if the interval had passed."""
    SweeperTurn.objects.filter(name=TURN).update(next_at=datetime(2000, 1, 1, tzinfo=UTC))


def test_one_turn_per_interval_until_it_comes_round_again() -> None:
    assert not SweeperTurn.objects.exists()
    assert take_turn(60, "a") is True  # the first tick creates the slot and takes it
    assert take_turn(60, "b") is False  # within the interval: somebody already swept
    assert take_turn(60, "a") is False
    turn = SweeperTurn.objects.get(name=TURN)
    assert turn.holder == "a"
    _turn_is_free()  # the interval has passed
    assert take_turn(60, "b") is True
    assert SweeperTurn.objects.get(name=TURN).holder == "b"


def test_of_many_processes_ticking_at_once_exactly_one_sweeps() -> None:
    take_turn(60, "warm-up")  # the row exists: the race is on the compare-and-swap itself
    for round_no in range(5):
        _turn_is_free()
        barrier = threading.Barrier(8)
        won: list[str] = []

        def tick(name: str, barrier: threading.Barrier, won: list[str]) -> None:
            try:
                barrier.wait()
                if take_turn(60, name):
                    won.append(name)
            finally:
                connection.close()

        threads = [threading.Thread(target=tick, args=(f"p{i}", barrier, won)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1, f"round {round_no}: {won}"
        assert SweeperTurn.objects.get(name=TURN).holder == won[0]


@pytest.mark.slow
def test_a_fresh_cluster_alone_resumes_a_crashed_workers_run(
    tenant_a: Tenant, tmp_path: Path
) -> None:
    # Nobody but the new cluster: no scheduled sweep task at all, no sweep from the test.
    Schedule.objects.filter(func="runtime.tasks.sweep").delete()
    run, counter = _crash_at(FaultPoint.AFTER_CHECKPOINT, tenant_a, tmp_path)
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING and run.lease_owner  # died holding its lease
    before = SweeperTurn.objects.filter(name=TURN).values_list("holder", flat=True).first()
    worker = procs.start(["qcluster"], procs.child_env(), log=tmp_path / "fresh.log")
    try:
        procs.wait_for(
            lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED,
            timeout=60,
            every=0.25,
        )
    finally:
        procs.kill(worker)
    run.refresh_from_db()
    assert run.checkpoint_rev == 5 and run.fence == 2  # taken over once, finished
    # Who rang it, by the records rather than by how long it took: django-q2's scheduler had
    # nothing to fire (no sweep schedule, before or after), and the fleet's sweep slot was
    # taken by a sweeper loop of the new cluster — the only process that could sweep.
    assert not Schedule.objects.filter(func="runtime.tasks.sweep").exists()
    turn = SweeperTurn.objects.get(name=TURN)
    assert turn.holder and turn.holder != before, (before, turn.holder)
    assert SweeperTurn.objects.get(name=TURN).holder.startswith("sweeper:")
    rid = str(run.run_id)
    again = 2 if overlaps_commits() else 1  # step 2 had begun: test_workers.py says why
    assert _lines(counter) == {  # step 1 committed before the crash: no paid call twice
        **{(rid, f"step {i}"): again if i == 2 else 1 for i in range(1, 6)},
        **{(rid, f"call {i}"): 1 for i in range(1, 6)},
    }


def test_the_queue_keeps_only_the_newest_successful_tasks() -> None:
    """django-q2's own pruning is off (it reads every kept result per task); the sweeper's
    turn prunes instead, keeping failures and the newest successes."""
    from django_q.models import Task

    now = timezone.now()

    def task(n: int, success: bool) -> Task:
        at = now - timedelta(seconds=1000 - n)
        return Task(
            id=f"{n:032x}",
            name=f"t{n}",
            func="runtime.tasks.advance",
            started=at,
            stopped=at,
            success=success,
        )

    Task.objects.bulk_create([task(n, success=n % 10 != 0) for n in range(300)])
    assert prune_task_history(100) == 270 - 100
    kept = set(Success.objects.values_list("name", flat=True))
    assert kept == {f"t{n}" for n in range(300) if n % 10 and n >= 300 - 111}
    assert len(kept) == 100
    assert Task.objects.filter(success=False).count() == 30  # failures are all kept
    assert prune_task_history(100) == 0


def _leased(tenant: Tenant, seconds: float) -> Run:
    """A run a worker took, its lease ending `seconds` from now (a dead holder's lease is
    simply one nobody extends)."""
    from runtime.leases import take_lease
    from runtime.lifecycle import create_run

    run = create_run(tenant, "api-review", {"old_spec": "a", "new_spec": "b"}, actor="user:t")
    take_lease(run.run_id, "worker:gone", seconds)
    return run


def test_a_lease_about_to_end_brings_the_next_sweep_to_that_moment(tenant_a: Tenant) -> None:
    """A crashed worker's run is rung right at its lease's end, not up to an interval later:
    the sweep that sees the end coming says when (`next_due`), moves the fleet's turn there,
    and the sweeper loop sleeps until then (`pause`)."""
    # A lease of 1.5 s and an interval of 4 s (the next tick 3-5 s away): room for a loaded
    # machine between the lease and the sweep (CI once took more than 0.5 s there).
    run = _leased(tenant_a, 1.5)
    _leased(tenant_a, 60)  # a healthy lease far off changes nothing
    result = sweep_turn(4.0, "a")
    assert result is not None and result.rung == 0
    assert result.next_due is not None and 0.2 < result.next_due <= 1.5
    lease_end = Run.objects.get(pk=run.pk).lease_expires_at
    turn = SweeperTurn.objects.get(name=TURN)
    assert abs((turn.next_at - lease_end).total_seconds()) < 0.5  # not 3-5 s from now
    for _ in range(20):  # whatever the jitter draws, the loop wakes just after the end
        assert pause(4.0, result) == pytest.approx(result.next_due + 0.05)
    time.sleep(pause(4.0, result))
    rung: list[str] = []
    assert take_turn(4.0, "b") is True  # the turn came round at the lease's end
    assert sweep_once(ring=rung.append).rung == 1 and rung == [str(run.run_id)]


def test_no_early_wake_without_a_run_becoming_due(tenant_a: Tenant, tenant_b: Tenant) -> None:
    """Healthy leases and runs an external executor holds (whose end the sweeper flags
    instead of ringing) do not shorten the loop's sleep; a timer does."""
    from runtime.lifecycle import create_run

    _leased(tenant_a, 30)
    external = _leased(tenant_b, 0.5)
    Run.objects.filter(pk=external.pk).update(external=True)
    assert next_due_in(2.5) is None
    for _ in range(20):
        assert 1.5 <= pause(2.0, sweep_once(look_ahead=2.5)) <= 2.5
    timer = create_run(tenant_b, "api-review", {"old_spec": "a", "new_spec": "b"}, actor="t")
    Run.objects.filter(pk=timer.pk).update(wake_at=timezone.now() + timedelta(seconds=1))
    due = next_due_in(2.5)
    assert due is not None and 0.5 < due <= 1.0
    assert next_due_in(0.5) is None  # beyond the look-ahead: the ordinary tick comes first
