"""The window after `sent` (TEST-MATRIX B3): a sender paused between committing `sent` and
sending, past its lease; another worker takes over and reconciles; then the sender wakes.

Settings under test: lease TTL 5 s (tests), tasks.create timeout 3 s, so the reconciler's
in-flight grace is sent_at + 8 s. The sandbox honours Holdpoint-Fence: the woken sender's
request carries fence 1 after fence 2 was seen for the run, and is refused unapplied.
Residual risk, stated: in mode none the service never hears fence 2 before a human decides,
so a sender frozen longer than the grace can still land its one request late.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.faults import FaultPoint
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from runtime.sweeper import sweep_once
from tests import procs
from tests.runtime.helpers import expire_lease, payloads
from tests.sandbox import Sandbox

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders"],
    "create_review_task": True,
}


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[1].split()[0] == "T"


@pytest.mark.parametrize("mode", ["key", "lookup", "none"])
def test_paused_sender_cannot_duplicate_after_takeover(
    mode: str, tenant_a: Tenant, tmp_path: Path, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory(mode)
    log_a = tmp_path / "a.log"
    a = procs.start(
        ["qcluster"],
        procs.child_env(**box.env(), HOLDPOINT_PAUSE=FaultPoint.AFTER_SENT_MARK),
        log=log_a,
    )
    b = None
    paused_pid = 0
    try:
        run = create_run(tenant_a, "api-review", GOAL, actor="t")
        found = procs.wait_for(
            lambda: re.search(r"pausing pid=(\d+)", log_a.read_text()) if log_a.exists() else None,
            timeout=60,
        )
        paused_pid = int(found.group(1))
        procs.wait_for(lambda: _stopped(paused_pid), timeout=10)
        # The whole of A's machine freezes, not only its sender: its other worker processes
        # would otherwise take the expired lease themselves (and pause in turn), and B would
        # not be the one that takes over.
        os.killpg(a.pid, signal.SIGSTOP)
        action = Action.objects.get(run=run)
        assert action.status == ActionStatus.SENT and box.tasks() == []

        expire_lease(run)  # A's lease lapses while it is frozen
        b = procs.start(["qcluster"], procs.child_env(**box.env()), log=tmp_path / "b.log")

        def settled() -> bool:
            sweep_once()
            run.refresh_from_db()
            return run.status in (RunStatus.COMPLETED, RunStatus.NEEDS_RECONCILIATION)

        procs.wait_for(settled, timeout=60, every=0.3)
        os.killpg(a.pid, signal.SIGCONT)  # A wakes and its sender sends its stale request
        procs.wait_for(
            lambda: "stale" in log_a.read_text() or not _alive(paused_pid) or _sent_by_a(box),
            timeout=30,
        )
    finally:
        if paused_pid and _alive(paused_pid):
            os.killpg(a.pid, signal.SIGCONT)
        procs.kill(a)
        if b is not None:
            procs.kill(b)

    action.refresh_from_db()
    tasks = box.tasks()
    assert len(tasks) <= 1
    if mode == "none":
        # Nothing told the service about fence 2 (no replay, no lookup in this mode), so the
        # woken sender's request may land — once. The human deciding sees it; never two.
        assert run.status == RunStatus.NEEDS_RECONCILIATION
        assert action.status == ActionStatus.MANUAL_REVIEW
    else:
        assert not [t for t in tasks if t["fence"] == 1]  # the stale sender applied nothing
        assert run.status == RunStatus.COMPLETED and len(tasks) == 1
        assert action.status == ActionStatus.CONFIRMED and action.external_id == tasks[0]["id"]
    taken = payloads(run, "lease_taken")
    assert taken[1]["takeover"] is True and taken[1]["previous_owner"] == taken[0]["owner"]
    assert Run.objects.get(pk=run.pk).fence >= 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _sent_by_a(box: Sandbox) -> bool:
    return any(t["fence"] == 1 for t in box.tasks())
