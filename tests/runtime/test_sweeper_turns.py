"""The fleet sweeps about once per interval however many worker processes tick (they take
turns on the database clock), and a crashed worker's run resumes with nothing but a fresh
cluster running — within seconds, not when django-q2's scheduler first fires (30 s after a
cluster starts; issue 8 measured 30.8 s "as deployed" before each worker process ran its
own sweeper loop)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone
from django_q.models import Schedule, Success

from runtime.faults import FaultPoint
from runtime.models import Run, RunStatus, SweeperTurn, Tenant
from runtime.sweeper import TURN, prune_task_history, take_turn
from tests import procs
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
    assert _lines(counter) == {  # step 1 committed before the crash: nothing done twice
        **{(rid, f"step {i}"): 1 for i in range(1, 6)},
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
