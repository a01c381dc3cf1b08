"""Two reviewers deciding the same request at the same moment (PostgreSQL, two connections)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus, ApprovalVote
from runtime.errors import HoldpointError
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Role, Tenant
from tests.approvals.conftest import GOAL
from tests.conftest import Persona, make_persona

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _race(request_id: Any, moves: list[tuple[Any, str, str]]) -> list[Any]:
    barrier = threading.Barrier(len(moves))
    results: list[Any] = [None] * len(moves)

    def go(index: int, user: Any, decision: str, seen: str) -> None:
        try:
            barrier.wait(timeout=10)
            results[index] = decide(request_id, user, decision, seen, reason="race")
        except HoldpointError as exc:
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=go, args=(i, *move)) for i, move in enumerate(moves)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


ROUNDS = 10


def test_conflicting_decisions_at_once_apply_exactly_one(
    held: Any, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    first_run, _, box = held
    bob = make_persona(tenant_a, "bob2", Role.REVIEWER)
    runs = [first_run] + [
        create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a") for _ in range(ROUNDS - 1)
    ]
    approved = 0
    for index, run in enumerate(runs):
        if index:
            advance_run(run.run_id, "w1")
        request = ApprovalRequest.objects.get(run=run)
        moves = [
            (reviewer_a.user, "approve", request.action_hash),
            (bob.user, "reject", request.action_hash),
        ]
        results = _race(request.id, moves[:: 1 if index % 2 else -1])
        applied = [r for r in results if isinstance(r, ApprovalRequest)]
        refused = [r for r in results if isinstance(r, HoldpointError)]
        assert len(applied) == 1 and len(refused) == 1
        assert refused[0].code == "already_decided" and refused[0].status == 409
        final = ApprovalRequest.objects.get(pk=request.pk)
        assert ApprovalVote.objects.filter(request=request).count() == 1
        approved += final.status == ApprovalStatus.APPROVED
        advance_run(run.run_id, "w1")
    assert len(box.tasks()) == approved  # one task per approved request, none otherwise


def test_double_submit_of_the_same_decision_applies_once(held: Any, reviewer_a: Persona) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    run, request, box = held
    results = _race(request.id, [(reviewer_a.user, "approve", request.action_hash)] * 2)
    statuses = {r.status if isinstance(r, ApprovalRequest) else r.code for r in results}
    # One applies; the other is either the same result (it saw the vote) or refused as a
    # second vote of the same reviewer — never a second decision.
    assert ApprovalStatus.APPROVED in statuses
    assert ApprovalVote.objects.filter(request=request).count() == 1
    advance_run(run.run_id, "w1")
    assert len(box.tasks()) == 1
