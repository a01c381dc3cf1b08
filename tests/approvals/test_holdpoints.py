"""The dispatch re-check through the `gates` port: a verdict that writes nothing, and the
superseding of an approval that no longer binds as one compare-and-swap on `approved`."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection, connections, transaction

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.requests import supersede_approval
from runtime import gates
from runtime.events import RunEvent, record
from runtime.executor import advance_run
from runtime.models import Action, ActionStatus, Run, RunStatus
from tests.conftest import Persona
from tests.runtime.helpers import payloads

A = ApprovalStatus


def _closes(run: Run, request: ApprovalRequest) -> list[dict[str, Any]]:
    return [p for p in payloads(run, "approval_closed") if p["approval_id"] == str(request.pk)]


def _approved_then_revoked(held: Any, reviewer_a: Persona) -> tuple[Run, ApprovalRequest]:
    """An approved request whose only decider has since lost the permission."""
    run, request, _ = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    reviewer_a.user.groups.clear()
    return run, request


@pytest.mark.django_db
def test_the_verdict_names_the_stale_approval_and_writes_nothing(
    held: Any, reviewer_a: Persona
) -> None:
    run, request = _approved_then_revoked(held, reviewer_a)
    action = Action.objects.get(run=run)
    with transaction.atomic():
        verdict = gates.dispatch_gate(action)
    assert not verdict.go
    assert verdict == gates.Verdict(
        "approval_required",
        stale=request.pk,
        reason="an approver no longer holds the permission; re-requested",
    )
    request.refresh_from_db()
    action.refresh_from_db()
    assert request.status == A.APPROVED and action.status == ActionStatus.APPROVED
    assert _closes(run, request) == []


@pytest.mark.django_db
def test_a_binding_approval_lets_the_action_go(held: Any, reviewer_a: Persona) -> None:
    run, request, _ = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    with transaction.atomic():
        assert gates.dispatch_gate(Action.objects.get(run=run)) == gates.GO


@pytest.mark.django_db
def test_superseding_moves_only_an_approved_request_and_journals_it_once(
    held: Any, reviewer_a: Persona
) -> None:
    run, request, _ = held
    action = Action.objects.get(run=run)
    with transaction.atomic():  # still pending: a reviewer's open request is not touched
        assert not supersede_approval(request.pk, action, "system:test", "approval_required")
    request.refresh_from_db()
    assert request.status == A.PENDING
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="looks right")
    with transaction.atomic():
        assert supersede_approval(request.pk, action, "system:test", "approval_required")
        assert not supersede_approval(request.pk, action, "system:test", "approval_required")
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and request.decision_reason == "looks right"
    assert [(c["approval_status"], c["reason"]) for c in _closes(run, request)] == [
        (A.SUPERSEDED, "approval_required")
    ]


@pytest.mark.django_db
def test_a_stale_approval_is_superseded_by_the_ledger_and_the_action_held_again(
    held: Any, reviewer_a: Persona
) -> None:
    run, request = _approved_then_revoked(held, reviewer_a)
    _, _, box = held
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and box.tasks() == []
    assert [c["reason"] for c in _closes(run, request)] == [
        "an approver no longer holds the permission; re-requested"
    ]
    assert request.closed_reason == "an approver no longer holds the permission; re-requested"
    assert Action.objects.get(run=run).status == ActionStatus.AWAITING_APPROVAL
    fresh = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert fresh.pk != request.pk
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL


def _wait_for_lock_waiters(n: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0] >= n:
                return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {n} sessions waiting for a lock")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_approval_closed_concurrently_is_not_superseded_over_again(
    held: Any, reviewer_a: Persona
) -> None:
    """The dispatch re-check read the request as approved; before its write, another
    session closed it. The supersede is a compare-and-swap on `approved`: the other
    session's close stands and the journal says exactly one close (a raw update by id
    re-applied it and journaled a second)."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    run, request = _approved_then_revoked(held, reviewer_a)
    _, _, box = held
    locked, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def close_it_meanwhile() -> None:
        try:
            with transaction.atomic():
                list(ApprovalRequest.objects.select_for_update().filter(pk=request.pk))
                locked.set()
                release.wait(timeout=20)
                ApprovalRequest.objects.filter(pk=request.pk).update(status=A.SUPERSEDED)
                record(
                    run,
                    RunEvent.APPROVAL_CLOSED,
                    "system:other",
                    approval_id=str(request.pk),
                    approval_status=A.SUPERSEDED,
                    reason="closed by another session",
                )
        finally:
            connections.close_all()

    def dispatch() -> None:
        try:
            outcome["advance"] = advance_run(run.run_id, "w1").outcome
        finally:
            connections.close_all()

    closer = threading.Thread(target=close_it_meanwhile)
    closer.start()
    try:
        assert locked.wait(timeout=10)
        sender = threading.Thread(target=dispatch)
        sender.start()
        _wait_for_lock_waiters(1)  # the re-check has read `approved` and waits to write
    finally:
        release.set()
        closer.join(timeout=30)
    sender.join(timeout=30)
    assert outcome.get("advance") == "waiting"
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and box.tasks() == []
    closes = _closes(run, request)
    assert [(c["reason"], c["approval_status"]) for c in closes] == [
        ("closed by another session", A.SUPERSEDED)
    ]
    assert ApprovalRequest.objects.filter(run=run, status=A.PENDING).count() == 1
