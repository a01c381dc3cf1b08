"""Real worker processes: SIGKILL mid-run, and workers racing (the slow layer)."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from runtime.faults import FaultPoint
from runtime.lifecycle import create_run
from runtime.models import Checkpoint, Run, RunStatus, Tenant
from runtime.queue import _enqueue
from runtime.sweeper import sweep_once
from tests import procs
from tests.runtime.helpers import overlaps_commits, payloads

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _lines(counter: Path) -> Counter[tuple[str, str]]:
    if not counter.exists():
        return Counter()
    return Counter(
        (parts[0], " ".join(parts[1:3]))
        for parts in (line.split() for line in counter.read_text().splitlines())
    )


def _finish_with_fresh_worker(run: Run, log: Path, timeout: float = 90) -> None:
    """Start a clean cluster; ring due runs (as the scheduled sweeper would) until done."""
    worker = procs.start(["qcluster"], procs.child_env(), log=log)
    try:

        def done() -> bool:
            sweep_once()
            run.refresh_from_db()
            return run.status == RunStatus.COMPLETED

        procs.wait_for(done, timeout=timeout, every=0.5)
    finally:
        procs.kill(worker)


def _crash_at(
    point: FaultPoint, tenant: Tenant, tmp_path: Path, steps: int = 5
) -> tuple[Run, Path]:
    counter = tmp_path / "executions.log"
    crashing = procs.start(
        ["qcluster"], procs.child_env(HOLDPOINT_FAULTS=point), log=tmp_path / "crashing.log"
    )
    try:
        run = create_run(tenant, "chain", {"steps": steps, "counter": str(counter)}, actor="t")
        crashing.wait(timeout=60)  # dies by itself at the fault point
    finally:
        procs.kill(crashing)
    assert crashing.returncode == -signal.SIGKILL
    assert f"fault point reached: {point}" in (tmp_path / "crashing.log").read_text()
    return run, counter


def test_sigkill_after_checkpoint_another_worker_finishes_without_redoing(
    tenant_a: Tenant, tmp_path: Path
) -> None:
    run, counter = _crash_at(FaultPoint.AFTER_CHECKPOINT, tenant_a, tmp_path)
    run.refresh_from_db()
    assert run.checkpoint_rev == 1 and run.status == RunStatus.RUNNING
    assert run.lease_owner  # died holding the lease: no cleanup, no release

    _finish_with_fresh_worker(run, tmp_path / "fresh.log")

    run.refresh_from_db()
    assert run.checkpoint_rev == 5
    executions = _lines(counter)
    rid = str(run.run_id)
    # Every committed step ran once, and every paid call was made once. Step 2 had begun when
    # the worker died where the worker runs it while step 1's commit is on its way (it learns
    # the commit landed inside step 2, before step 2's paid call): an interrupted step, it ran
    # again on recovery — as after_record's does — and still paid once.
    again = 2 if overlaps_commits() else 1
    assert {k: v for k, v in executions.items()} == {
        **{(rid, f"step {i}"): again if i == 2 else 1 for i in range(1, 6)},
        **{(rid, f"call {i}"): 1 for i in range(1, 6)},
    }
    fences = sorted(set(Checkpoint.objects.filter(run=run).values_list("fence", flat=True)))
    assert fences == [1, 2]
    assert payloads(run, "lease_taken")[-1]["takeover"] is True


def test_sigkill_after_paid_call_reuses_it_on_recovery(tenant_a: Tenant, tmp_path: Path) -> None:
    run, counter = _crash_at(FaultPoint.AFTER_RECORD, tenant_a, tmp_path)
    run.refresh_from_db()
    assert run.checkpoint_rev == 0  # died inside step 1, after paying for its call

    _finish_with_fresh_worker(run, tmp_path / "fresh.log")

    executions = _lines(counter)
    rid = str(run.run_id)
    assert executions[(rid, "step 1")] == 2  # the interrupted step ran again…
    assert all(executions[(rid, f"call {i}")] == 1 for i in range(1, 6))  # …without paying again
    assert all(executions[(rid, f"step {i}")] == 1 for i in range(2, 6))


@pytest.mark.postgres
def test_two_workers_racing_execute_every_step_exactly_once(
    tenant_a: Tenant, tmp_path: Path
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    counter = tmp_path / "executions.log"
    workers = [
        procs.start(["qcluster"], procs.child_env(), log=tmp_path / f"w{i}.log") for i in (1, 2)
    ]
    try:
        runs = [
            create_run(tenant_a, "chain", {"steps": 4, "counter": str(counter)}, actor="t")
            for _ in range(8)
        ]
        for run in runs:  # duplicated doorbells: both clusters get every run three times
            _enqueue(str(run.run_id))
            _enqueue(str(run.run_id))

        def all_done() -> bool:
            return Run.objects.filter(status=RunStatus.COMPLETED).count() == len(runs)

        procs.wait_for(all_done, timeout=120, every=0.5)
    finally:
        for worker in workers:
            procs.kill(worker)
    executions = _lines(counter)
    expected: dict[Any, int] = {}
    for run in runs:
        for i in range(1, 5):
            expected[(str(run.run_id), f"step {i}")] = 1
            expected[(str(run.run_id), f"call {i}")] = 1
    assert dict(executions) == expected
    pids = {line.split("pid=")[1] for line in counter.read_text().splitlines()}
    assert len(pids) >= 2  # the work really was shared between processes


def test_long_step_keeps_its_lease_while_another_worker_waits(
    tenant_a: Tenant, tmp_path: Path
) -> None:
    """A step longer than the lease TTL (5 s in tests) is heartbeated: no takeover, no rerun."""
    counter = tmp_path / "executions.log"
    workers = [
        procs.start(["qcluster"], procs.child_env(), log=tmp_path / f"w{i}.log") for i in (1, 2)
    ]
    try:
        run = create_run(
            tenant_a, "chain", {"steps": 2, "sleep": 7, "counter": str(counter)}, actor="t"
        )

        def done() -> bool:
            sweep_once()  # would hand the run to the other worker if its lease lapsed
            run.refresh_from_db()
            return run.status == RunStatus.COMPLETED

        procs.wait_for(done, timeout=90, every=0.5)
    finally:
        for worker in workers:
            procs.kill(worker)
    executions = _lines(counter)
    rid = str(run.run_id)
    assert executions == Counter(
        {(rid, "step 1"): 1, (rid, "call 1"): 1, (rid, "step 2"): 1, (rid, "call 2"): 1}
    )
    assert run.fence == 1
