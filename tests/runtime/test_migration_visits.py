"""A graph migration keeps the step visit: an action begun on version 1 is found on version 2.

A real worker running version 1 is SIGKILLed at a fault point around the side effect; the
"deploy" leaves only version 2 and a migration 1 → 2 registered; a new worker migrates the
run. The migrated step must derive the same idempotency key and find the action — not ask
for it anew (a second approval request, and once approved a second task). The oracle is
the real sandbox's task list (TEST-MATRIX.md, reach wave G2).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.utils import timezone

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest
from approvals.policies import grant
from runtime.artifacts import resolve
from runtime.faults import FaultPoint
from runtime.graphs import registry
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Checkpoint, Run, RunStatus, Tenant
from runtime.sweeper import sweep_once
from tests import procs
from tests.conftest import Persona
from tests.runtime.filer import filer, migrate_1_to_2
from tests.runtime.helpers import payloads
from tests.sandbox import Sandbox

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SETTLED = (
    RunStatus.COMPLETED,
    RunStatus.WAITING_APPROVAL,
    RunStatus.NEEDS_ATTENTION,
    RunStatus.NEEDS_RECONCILIATION,
    RunStatus.FAILED,
)


@pytest.fixture
def versions() -> Iterator[None]:
    """This process starts runs on version 1; the test swaps in version 2 at the deploy."""
    registry.register(filer("1"))
    yield
    for version in ("1", "2"):
        registry.unregister("filer", version)
    registry.migrations.pop(("filer", "1"), None)


def _deploy_in_this_process() -> None:
    registry.unregister("filer", "1")
    registry.register(filer("2"))
    registry.register_migration("filer", "1", "2", migrate_1_to_2)


def _worker(box: Sandbox, log: Path, modules: str, faults: str = "") -> Any:
    env = procs.child_env(**box.env(), HOLDPOINT_GRAPH_MODULES=modules, HOLDPOINT_FAULTS=faults)
    return procs.start(["qcluster"], env, log=log)


def _until(condition: Callable[[], bool], timeout: float = 90) -> None:
    def tick() -> bool:
        sweep_once()  # the scheduled sweeper's job, so the test does not wait for its turn
        return condition()

    procs.wait_for(tick, timeout=timeout, every=0.3)


def _status_in(run: Run, *statuses: str) -> Callable[[], bool]:
    def check() -> bool:
        run.refresh_from_db()
        return run.status in statuses

    return check


def _approve(run: Run, reviewer: Persona) -> None:
    request = ApprovalRequest.objects.get(run=run, status="pending")
    decide(request.pk, reviewer.user, "approve", request.action_hash)


def _check_migrations() -> str:
    out = StringIO()
    call_command("check_migrations", stdout=out)
    return out.getvalue()


@pytest.mark.parametrize(
    "point",
    [FaultPoint.AFTER_PREPARE, FaultPoint.AFTER_SENT_MARK, FaultPoint.AFTER_TOOL_RESPONSE],
)
def test_a_run_migrated_mid_action_finds_its_action(
    point: FaultPoint,
    tenant_a: Tenant,
    reviewer_a: Persona,
    versions: None,
    tmp_path: Path,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    box = sandbox_factory("key")
    policy = ApprovalPolicy.objects.create(tenant=tenant_a, name="review", tool="tasks.create")
    grant(policy, Group.objects.get(name="acme-reviewers"))
    run = create_run(tenant_a, "filer", {"what": "the API"}, actor="user:t", graph_version="1")

    old = _worker(box, tmp_path / "v1.log", "tests.runtime.filer_v1", faults=point)
    try:
        if point != FaultPoint.AFTER_PREPARE:  # approved on version 1, then sent
            _until(_status_in(run, RunStatus.WAITING_APPROVAL))
            _approve(run, reviewer_a)
        _until(lambda: old.poll() is not None)
    finally:
        procs.kill(old)
    assert old.returncode == -signal.SIGKILL
    assert f"fault point reached: {point}" in (tmp_path / "v1.log").read_text()
    # The dead worker's lease and in-flight window are over: move the data, not the clock.
    past = timezone.now() - timedelta(seconds=1)
    Run.objects.filter(pk=run.pk).update(lease_expires_at=past)
    Action.objects.filter(run=run).update(in_flight_until=past)
    first = Action.objects.get(run=run)

    _deploy_in_this_process()
    report = _check_migrations()
    assert f"MID  {run.run_id} filer@1: would migrate 1 → 2, landing mid-action" in report
    assert f"call 1: tasks.create {first.status}" in report

    new = _worker(box, tmp_path / "v2.log", "tests.runtime.filer_v2")
    try:
        _until(_status_in(run, *SETTLED))
        if point == FaultPoint.AFTER_PREPARE:  # prepared on version 1, decided now
            assert run.status == RunStatus.WAITING_APPROVAL
            assert ApprovalRequest.objects.filter(run=run).count() == 1
            _approve(run, reviewer_a)
            _until(_status_in(run, *SETTLED[:1], *SETTLED[2:]))
    finally:
        procs.kill(new)

    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED, (run.status, run.waiting_for, run.last_error)
    assert run.graph_version == "2"
    assert len(payloads(run, "migrated")) == 1
    # One action (the one begun on version 1), one approval request, one task.
    assert list(Action.objects.filter(run=run).values_list("pk", flat=True)) == [first.pk]
    assert ApprovalRequest.objects.filter(run=run).count() == 1
    tasks = box.tasks()
    assert len(tasks) == 1, tasks
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED and action.external_id == tasks[0]["id"]
    final = resolve(tenant_a.pk, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)
    assert final["finished_on"] == "2" and final["shape"] == 2 and final["task"] == tasks[0]["id"]
