"""The crash matrix: a real worker SIGKILLed at every fault point × every dedup mode.

Each case runs the api-review agent with task creation against a real sandbox process;
the worker dies at the named point (its whole process group, as in a machine crash); a clean
worker finishes. The oracle is the sandbox's own list of tasks (TEST-MATRIX.md, A1).
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import ApprovalPolicy
from runtime.faults import WORKER_POINTS, FaultPoint
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from runtime.outcomes import resolve
from runtime.sweeper import sweep_once
from tests import procs
from tests.sandbox import Sandbox
from tests.tooldefs import define_tickets

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
# Every point around a side effect; after_record (a paid call recorded, its step not yet
# committed) is crashed at in test_workers.py.
POINTS = [p for p in WORKER_POINTS if p != FaultPoint.AFTER_RECORD]
# Where the request may have left: mode none cannot know, a human must say.
AMBIGUOUS = {
    FaultPoint.AFTER_SENT_MARK,
    FaultPoint.AFTER_TOOL_RESPONSE,
    FaultPoint.DURING_RECONCILE,
}
REPORT = Path(__file__).resolve().parents[2] / "var" / "test" / "crash-matrix.jsonl"


def _worker(box: Sandbox, log: Path, faults: FaultPoint | str = "") -> Any:
    """A worker whose built-in tracker tools (HOLDPOINT_TASKS_URL) talk to `box`."""
    env = procs.child_env(**box.env(), HOLDPOINT_FAULTS=faults)
    return procs.start(["qcluster"], env, log=log)


def _until(condition: Callable[[], bool], timeout: float = 60) -> None:
    def tick() -> bool:
        sweep_once()
        return condition()

    procs.wait_for(tick, timeout=timeout, every=0.1)


def _after_crash(run: Run) -> None:
    """The dead worker's lease and in-flight window are over: move the data, not the clock."""
    past = timezone.now() - timedelta(seconds=1)
    Run.objects.filter(pk=run.pk, status=RunStatus.RUNNING).update(lease_expires_at=past)
    Action.objects.filter(run=run).update(in_flight_until=past)


def _crash(
    box: Sandbox,
    run_ref: list[Run],
    tmp_path: Path,
    faults: FaultPoint,
    name: str,
    start: bool = False,
    graph: tuple[str, dict[str, Any]] = ("api-review", GOAL),
    builtin: Sandbox | None = None,
) -> bool:
    """Run one worker armed with `faults`; True if it died at the point."""
    worker = _worker(builtin or box, tmp_path / f"{name}.log", faults)
    try:
        if start:
            run_ref.append(create_run(run_ref[0], graph[0], graph[1], actor="user:t"))
        run = run_ref[-1]

        def dead_or_parked() -> bool:
            run.refresh_from_db()
            return worker.poll() is not None or run.status in (
                RunStatus.COMPLETED,
                RunStatus.NEEDS_RECONCILIATION,
            )

        _until(dead_or_parked)
        if worker.poll() is None:
            # after_confirm can follow the commit that completes the run: the run may read
            # completed a few milliseconds before the point kills the worker
            try:
                worker.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        died = worker.poll() == -signal.SIGKILL
    finally:
        procs.kill(worker)
    if died:
        assert f"fault point reached: {faults}" in (tmp_path / f"{name}.log").read_text()
    _after_crash(run)
    return died


def _matrix_case(
    point: FaultPoint,
    mode: str,
    tenant_a: Tenant,
    tmp_path: Path,
    box: Sandbox,
    graph: tuple[str, dict[str, Any]],
    builtin: Sandbox | None = None,
) -> bool:
    """One case: crash at `point`, finish with a clean worker; `box` is the tracker the
    graph's tool talks to, `builtin` (default: `box`) the one the built-in tools do."""
    ref: list[Any] = [tenant_a]
    if point == FaultPoint.DURING_RECONCILE:  # something to reconcile first: the reply is lost
        assert _crash(
            box,
            ref,
            tmp_path,
            FaultPoint.AFTER_TOOL_RESPONSE,
            "w0",
            start=True,
            graph=graph,
            builtin=builtin,
        )
        died = _crash(box, ref, tmp_path, point, "w1", graph=graph, builtin=builtin)
        assert died == (mode != "none")  # mode none never calls the service to reconcile
    else:
        assert _crash(box, ref, tmp_path, point, "w1", start=True, graph=graph, builtin=builtin)
    run: Run = ref[-1]

    worker = _worker(builtin or box, tmp_path / "clean.log")
    try:
        _until(
            lambda: (
                run.refresh_from_db(),
                run.status in (RunStatus.COMPLETED, RunStatus.NEEDS_RECONCILIATION),
            )[1]
        )
        human = run.status == RunStatus.NEEDS_RECONCILIATION
        action = Action.objects.get(run=run)
        tasks = box.tasks(action.idempotency_key)
        if human:
            assert mode == "none" and point in AMBIGUOUS
            assert action.status == ActionStatus.MANUAL_REVIEW and len(tasks) <= 1
            if tasks:
                resolve(action, "applied", actor="user:t", external_id=tasks[0]["id"])
            else:
                resolve(action, "not_applied", actor="user:t")
            _until(lambda: (run.refresh_from_db(), run.status == RunStatus.COMPLETED)[1])
        else:
            assert not (mode == "none" and point in AMBIGUOUS), "none must ask a human"
    finally:
        procs.kill(worker)

    action.refresh_from_db()
    tasks = box.tasks()
    assert len(tasks) == 1, tasks  # no duplicate, nothing lost
    assert action.status == ActionStatus.CONFIRMED and action.external_id == tasks[0]["id"]
    return human


@pytest.mark.parametrize("mode", ["key", "lookup", "none"])
@pytest.mark.parametrize("point", POINTS)
def test_crash_at_point(
    point: FaultPoint,
    mode: str,
    tenant_a: Tenant,
    tmp_path: Path,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    started = timezone.now()
    box = sandbox_factory(mode)
    human = _matrix_case(point, mode, tenant_a, tmp_path, box, ("api-review", GOAL))
    _report(point, mode, human, started, "tasks.create")


# The tool layer of a tool that is data, over the same ledger paths test_crash_at_point
# proves on both databases: CI runs it on SQLite only (tests/ci_pair.py).
@pytest.mark.ci_database("sqlite")
@pytest.mark.parametrize("mode", ["key", "lookup", "none"])
@pytest.mark.parametrize("point", POINTS)
def test_crash_at_point_on_a_tool_the_tenant_defined(
    point: FaultPoint,
    mode: str,
    tenant_a: Tenant,
    tmp_path: Path,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    """The same matrix for `tickets.create`, a tool that is data: imported by the tenant
    (not built in), its dedup mode and lookup from its definition, sent by the worker's
    generic HTTP tool to a second sandbox; the first, which the built-in tracker tools talk
    to, must see nothing."""
    started = timezone.now()
    decoy = sandbox_factory(mode)
    box = sandbox_factory(mode)
    define_tickets(tenant_a, box.url, mode)
    ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tickets go", tool="tickets.create", required=False
    )
    human = _matrix_case(
        point, mode, tenant_a, tmp_path, box, ("ticketing", {"title": "Crash-proof"}), decoy
    )
    assert Action.objects.get(run__tenant=tenant_a).tool == "tickets.create"
    assert decoy.tasks() == []
    _report(point, mode, human, started, "tickets.create")


def _report(point: FaultPoint, mode: str, human: bool, started: Any, tool: str) -> None:
    """One line of var/test/crash-matrix.jsonl (each case has asserted exactly one task)."""
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    with REPORT.open("a") as out:
        out.write(
            json.dumps(
                {
                    "point": point,
                    "mode": mode,
                    "tool": tool,
                    "tasks": 1,
                    "human": human,
                    "seconds": round((timezone.now() - started).total_seconds(), 2),
                }
            )
            + "\n"
        )
