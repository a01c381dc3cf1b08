"""A worker killed after an undo's confirmation: the original is `compensated` all the same.

A compensation's confirmation and its original's move to `compensated` were two commits: the
sender wrote the undo `confirmed`, then (`compensation._finish`) the original. A worker that
died between them (a real SIGKILL at `after_confirm`, which a compensation's send reaches
right after that first commit) left the original `confirmed` for good: the undo was settled,
so no sender, sweeper or second ask ever looked at it again. The run page and the API said
the effect was still in place — the tracker's task was closed — and a person asking for the
undo again was answered with the confirmed undo, and nothing changed. Now both are one commit.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.compensation import compensate
from runtime.errors import InvalidTransition
from runtime.executor import advance_run
from runtime.faults import FaultPoint
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Tenant
from tests import procs
from tests.approvals.conftest import GOAL
from tests.conftest import Persona
from tests.runtime.helpers import payloads
from tests.sandbox import Sandbox

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
S = ActionStatus


def _killed_sending(box: Sandbox, point: FaultPoint, log: Path) -> None:
    """A worker (armed at `point`) takes the undo's ring off the queue and dies there."""
    worker = procs.start(["qcluster"], procs.child_env(**box.env(), HOLDPOINT_FAULTS=point), log)
    try:
        worker.wait(timeout=90)  # dies by itself at the fault point
    finally:
        procs.kill(worker)
    assert worker.returncode == -signal.SIGKILL
    assert f"fault point reached: {point}" in log.read_text()


def test_a_worker_killed_right_after_the_undo_confirmed_leaves_the_original_compensated(
    tenant_a: Tenant,
    admin_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    tmp_path: Path,
) -> None:
    from django_q.models import OrmQ

    box = sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    OrmQ.objects.all().delete()  # only the undo's ring is left for the worker

    undo = compensate(original, "created by mistake", actor="user:ada")
    _killed_sending(box, FaultPoint.AFTER_CONFIRM, tmp_path / "worker.log")

    undo.refresh_from_db()
    original.refresh_from_db()
    assert undo.status == S.CONFIRMED
    assert [t["status"] for t in box.tasks()] == ["closed"]
    assert original.status == S.COMPENSATED  # in the undo's own commit: nothing left to do
    seen = admin_a.api().get(f"/api/v1/actions/{original.action_id}/")
    assert seen.status_code == 200 and seen.json()["status"] == "compensated"
    outcomes = [p for p in payloads(run, "action_outcome") if p["action_status"] == S.COMPENSATED]
    assert [p["action_id"] for p in outcomes] == [str(original.action_id)]
    assert outcomes[0]["compensated_by"] == str(undo.action_id)
    with pytest.raises(InvalidTransition):  # undone: no second undo to ask for
        compensate(original, "again", actor="user:ada")
    assert Action.objects.filter(compensates=original).count() == 1
