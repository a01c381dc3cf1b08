"""A decision or an expiry racing a goal revision of the same run (PostgreSQL, two sessions).

A revision locks the run, cancels its unsent actions and closes their requests; a decision
and the expirer locked the request first and the run after it. Each then waited for the
other's lock: PostgreSQL broke the deadlock by failing one of them — the reviewer's decision
answered with a database error (a 503 on the API, a 500 on the page). Both now take the run
first, so one simply waits for the other.
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

from approvals import decisions, expiry
from approvals.models import ApprovalRequest, ApprovalStatus
from runtime import lifecycle
from runtime.errors import HoldpointError
from runtime.executor import advance_run
from runtime.models import Action, ActionStatus, Run
from tests.approvals.conftest import GOAL
from tests.conftest import Persona

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

A = ApprovalStatus
# How long each side waits at its seam for the other to reach its own (only the order of
# the old code lets both arrive; the fixed one makes one side wait on the run's lock).
SEAM = 3


class _Seams:
    """The decision (or expirer) pauses once it holds what it locks before the run; the
    revision pauses once it holds the run, until the other has arrived."""

    def __init__(self) -> None:
        self.request_locked = threading.Event()
        self.run_locked = threading.Event()

    def before_run(self) -> None:
        self.request_locked.set()
        self.run_locked.wait(timeout=SEAM)

    def revision(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def cancel_older_revisions(*args: Any, **kwargs: Any) -> Any:
            self.request_locked.wait(timeout=SEAM)
            self.run_locked.set()
            return real(*args, **kwargs)

        return cancel_older_revisions


class _RunsAfterSeam:
    """`Run.objects` for the expirer: its row lock of the run waits at the seam first."""

    def __init__(self, seams: _Seams) -> None:
        self.seams = seams

    def select_for_update(self, *args: Any, **kwargs: Any) -> Any:
        self.seams.before_run()
        return Run.objects.select_for_update(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(Run.objects, name)


def _both(moves: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def go(name: str, move: Callable[[], Any]) -> None:
        try:
            results[name] = move()
        except Exception as exc:  # what the caller would have seen
            results[name] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=go, args=item) for item in moves.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _revise(run: Run) -> Any:
    return lifecycle.revise_goal(run, {**GOAL, "scope": ["/orders"]}, 1, actor="user:zed")


def _no_database_error(results: dict[str, Any]) -> None:
    failed = {k: v for k, v in results.items() if isinstance(v, Exception)}
    assert all(isinstance(v, HoldpointError) for v in failed.values()), failed
    assert "revise" not in failed


def test_a_decision_racing_a_goal_revision_is_applied_or_refused_not_a_database_error(
    held: Any, reviewer_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    run, request, box = held
    seams = _Seams()
    # Called with the run and the request locked (lock_run_of: the run first, since 8b83443);
    # the seam pauses the decision there while the revision waits for the run.
    may_decide = decisions.may_decide

    def paused(*args: Any, **kwargs: Any) -> bool:
        seams.before_run()
        return may_decide(*args, **kwargs)

    monkeypatch.setattr(decisions, "may_decide", paused)
    monkeypatch.setattr(
        lifecycle, "cancel_older_revisions", seams.revision(lifecycle.cancel_older_revisions)
    )
    results = _both(
        {
            "decide": lambda: decisions.decide(
                request.id, reviewer_a.user, "approve", request.action_hash
            ),
            "revise": lambda: _revise(run),
        }
    )
    _no_database_error(results)
    if isinstance(results["decide"], HoldpointError):  # the revision came first
        assert results["decide"].code == "already_decided"
    # Either way the old revision's action is withdrawn, and nothing of it is ever sent.
    assert Action.objects.get(run=run, goal_rev=1).status == ActionStatus.CANCELLED
    advance_run(run.run_id, "w1")
    assert box.tasks() == []


def test_an_expiry_racing_a_goal_revision_is_not_a_database_error(
    held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    seams = _Seams()
    monkeypatch.setattr(expiry, "Run", SimpleNamespace(objects=_RunsAfterSeam(seams)))
    monkeypatch.setattr(
        lifecycle, "cancel_older_revisions", seams.revision(lifecycle.cancel_older_revisions)
    )
    results = _both({"expire": lambda: expiry.expire(request.pk), "revise": lambda: _revise(run)})
    _no_database_error(results)
    request.refresh_from_db()
    assert request.status in (A.EXPIRED, A.SUPERSEDED)
    assert Action.objects.get(run=run, goal_rev=1).status == ActionStatus.CANCELLED
