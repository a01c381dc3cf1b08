"""The retention purge keeps a finished run whose compensation is still to be sent.

A compensation is an action of the (finished) run that no step drives: a person asked for it
after the run completed, and its sender is rung for it — or the sweeper tries it again when
its tool could not be reached. Asking for it does not touch the run, so the run's updated_at
can be past its tenant's retention while the compensation waits. The purge kept runs with an
action whose outcome is not known (`sent`, `unknown`, `manual_review`) and a pending approval,
not this one: it deleted the authorised undo with the run, the effect it was to undo stayed,
and nothing said so.

And when both happen at once (PostgreSQL, two connections): the purge locks the due runs of a
batch, re-reads which still qualify and deletes them with their actions. Asking for a
compensation locked the confirmed action first and its run after, so each waited for a row
the other held and PostgreSQL aborted one ("deadlock detected": a failed compensation or
purge). And a purge whose locking read began while a compensation was being written waited
for it, then went on with what it had read before — no undo yet — and purged the run, the
undo committed meanwhile with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from runtime import compensation, retention
from runtime.compensation import compensate, dispatch_standalone
from runtime.errors import HoldpointError
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, Tenant
from tests.approvals.test_holdpoints import _wait_for_lock_waiters
from tests.approvals.test_lock_order import _both
from tests.sandbox import Sandbox

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/users"],
    "create_review_task": True,
}


def _aged(run: Run, days: int) -> None:
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(days=days))


def _purged(tenant: Tenant) -> list[str]:
    return retention.purge_tenant(Tenant.objects.get(pk=tenant.pk)).runs


def _finished_with_a_compensation(tenant: Tenant) -> tuple[Run, Action, Action]:
    Tenant.objects.filter(pk=tenant.pk).update(retention_days=30)
    run = create_run(tenant, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    undo = compensate(original, "created by mistake", actor="user:alice")
    assert undo.status == ActionStatus.PREPARED  # its sender is rung when this commits
    return run, original, undo


def test_a_compensation_waiting_for_its_send_keeps_its_run_until_it_is_settled(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    run, original, undo = _finished_with_a_compensation(tenant_a)
    _aged(run, 31)

    assert _purged(tenant_a) == []
    assert Action.objects.filter(pk=undo.pk, status=ActionStatus.PREPARED).exists()
    preview = retention.purge_tenant(Tenant.objects.get(pk=tenant_a.pk), dry_run=True)
    assert preview.runs == []  # the plan says the same

    # Its sender runs: the effect is undone, and the run is purged like any other after.
    assert dispatch_standalone(undo.action_id).status == ActionStatus.CONFIRMED
    original.refresh_from_db()
    assert original.status == ActionStatus.COMPENSATED
    assert [t["status"] for t in box.tasks()] == ["closed"]
    _aged(run, 31)
    assert _purged(tenant_a) == [str(run.run_id)]


@pytest.mark.parametrize("status", [ActionStatus.APPROVED, ActionStatus.AWAITING_APPROVAL])
def test_an_approved_or_held_compensation_keeps_its_run(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], status: ActionStatus
) -> None:
    """Approved: its sender is rung by the decision. Held: it waits for a reviewer — one
    held before compensations raised requests has none open, so no hold point keeps it."""
    sandbox_factory("key")
    run, _original, undo = _finished_with_a_compensation(tenant_a)
    Action.objects.filter(pk=undo.pk).update(status=status)
    _aged(run, 31)
    assert _purged(tenant_a) == []
    assert Action.objects.filter(pk=undo.pk).exists()


@pytest.mark.parametrize("status", [ActionStatus.CANCELLED, ActionStatus.FAILED])
def test_a_compensation_that_ended_unsent_does_not_keep_its_run(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], status: ActionStatus
) -> None:
    sandbox_factory("key")
    run, _original, undo = _finished_with_a_compensation(tenant_a)
    Action.objects.filter(pk=undo.pk).update(status=status)
    _aged(run, 31)
    assert _purged(tenant_a) == [str(run.run_id)]


# --- at the same moment (PostgreSQL) -------------------------------------------------------
# How long each side waits at its seam for the other to reach its own: only the old lock
# order lets both arrive; in the fixed one the compensation holds nothing at its seam.
SEAM = 3


def _due_with_a_confirmed_action(tenant: Tenant) -> tuple[Run, Action]:
    """A finished run past its tenant's retention, its action confirmed (a task created)."""
    Tenant.objects.filter(pk=tenant.pk).update(retention_days=30)
    run = create_run(tenant, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    _aged(run, 31)
    return run, Action.objects.get(run=run, status=ActionStatus.CONFIRMED)


class _RunsAtSeam:
    """`Run.objects` for the compensation: its row lock of the run waits at the seam first."""

    def __init__(self, arrived: threading.Event, other: threading.Event) -> None:
        self.arrived, self.other = arrived, other

    def select_for_update(self, *args: Any, **kwargs: Any) -> Any:
        self.arrived.set()
        self.other.wait(timeout=SEAM)
        return Run.objects.select_for_update(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(Run.objects, name)


def _gate_at_seam(arrived: threading.Event, other: threading.Event) -> Any:
    """`PurgeGate` for the purge, whose batch opens it once its runs are locked: it waits at
    the seam first."""
    real = retention.PurgeGate

    def create(**kwargs: Any) -> Any:
        arrived.set()
        other.wait(timeout=SEAM)
        return real.objects.create(**kwargs)

    return SimpleNamespace(objects=SimpleNamespace(create=create))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_compensation_and_the_purge_of_its_run_do_not_deadlock(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The purge holds the run's lock and the compensation reaches for it. In the old order
    the compensation held the action by then, the purge's delete of the run's actions waited
    for it, and PostgreSQL killed one of the two. Now one waits for the other: the purge
    takes the run and the compensation is told the action is gone — or, had the compensation
    come first, its undo stays and keeps the run."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks taken by two connections at once: PostgreSQL")
    box = sandbox_factory("key")
    run, original = _due_with_a_confirmed_action(tenant_a)
    at_run, purge_locked = threading.Event(), threading.Event()
    runs = _RunsAtSeam(at_run, purge_locked)
    monkeypatch.setattr(
        compensation, "Run", SimpleNamespace(objects=runs, DoesNotExist=Run.DoesNotExist)
    )
    monkeypatch.setattr(retention, "PurgeGate", _gate_at_seam(purge_locked, at_run))
    results = _both(
        {
            "compensate": lambda: compensate(original, "oops", actor="user:alice"),
            "purge": lambda: retention.purge_tenant(Tenant.objects.get(pk=tenant_a.pk)),
        }
    )
    failed = {k: v for k, v in results.items() if isinstance(v, Exception)}
    assert all(isinstance(v, HoldpointError) for v in failed.values()), failed
    report = results["purge"]
    assert isinstance(report, retention.PurgeReport), results
    if report.runs:  # the purge came first: the action went with its run
        assert report.runs == [str(run.run_id)]
        assert getattr(results["compensate"], "code", None) == "not_found", results
        assert not Action.objects.filter(run_id=run.pk).exists()
    else:  # the compensation came first: its undo keeps the run
        assert Action.objects.filter(compensates=original, status=ActionStatus.PREPARED).exists()
    assert [t["status"] for t in box.tasks()] == ["open"]  # the effect, undone by nobody yet


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_purge_that_waited_for_a_compensation_keeps_the_run_and_its_undo(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compensation has written its undo and not committed; the purge lists the run (no
    undo to be seen), locks the batch and waits for the compensation's lock on the run. Once
    that commits, the purge must see the undo and keep the run: under READ COMMITTED its
    locking read still answered from before the commit, so the run was purged and the undo
    deleted with it — the effect a person asked to undo stayed, and nothing said so."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks taken by two connections at once: PostgreSQL")
    box = sandbox_factory("key")
    run, original = _due_with_a_confirmed_action(tenant_a)
    written, go = threading.Event(), threading.Event()
    real_record = compensation.record

    def record_then_wait(*args: Any, **kwargs: Any) -> Any:
        written.set()  # inside the compensation's transaction, its undo created: hold it
        go.wait(timeout=30)
        return real_record(*args, **kwargs)

    monkeypatch.setattr(compensation, "record", record_then_wait)
    results: dict[str, Any] = {}

    def move(name: str, call: Callable[[], Any]) -> threading.Thread:
        def run_it() -> None:
            try:
                results[name] = call()
            except Exception as exc:  # noqa: BLE001  (reported by the assertions)
                results[name] = exc
            finally:
                connections.close_all()

        return threading.Thread(target=run_it)

    asker = move("compensate", lambda: compensate(original, "oops", actor="user:alice"))
    purger = move("purge", lambda: _purged(tenant_a))
    asker.start()
    try:
        assert written.wait(timeout=30), "the compensation never wrote its undo"
        purger.start()
        _wait_for_lock_waiters(1)  # the purge waits for the run the compensation holds
    finally:
        go.set()
        asker.join(timeout=60)
        if purger.ident is not None:
            purger.join(timeout=60)
    undo = results["compensate"]
    assert isinstance(undo, Action), results
    assert results["purge"] == [], results
    assert Run.objects.filter(pk=run.pk).exists()
    assert Action.objects.filter(pk=undo.pk, status=ActionStatus.PREPARED).exists()
    # Its sender runs: the effect is undone, and the run is purged like any other after.
    assert dispatch_standalone(undo.action_id).status == ActionStatus.CONFIRMED
    assert [t["status"] for t in box.tasks()] == ["closed"]
    _aged(run, 31)
    assert _purged(tenant_a) == [str(run.run_id)]
