"""An approval whose action is withdrawn before it was sent stops counting as an approval.

A goal revision (the old revision's queued actions), a run's cancel and an external
executor's finishing checkpoint (`runtime.protocol.close_ledger`) withdraw every unsent
action of the run and close its pending requests. An approved request whose action had not
been sent yet stayed `approved`: the inbox history, the request page and `GET approvals/`
showed a usable approval for an action that will never be sent, and a repeat of the decision
answered 200 as if it still applied. It now leaves `approved` as a pending one does —
`superseded` by a revision, `cancelled` otherwise — keeping its reviewer's decision and
saying why in `closed_reason`.
"""

from __future__ import annotations

import re
import threading
from html import unescape
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models.signals import post_save
from django.test import Client
from django.urls import reverse

from approvals import decisions
from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus, ApprovalVote
from audit.journal import run_stream
from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.lifecycle import cancel_run, revise_goal
from runtime.models import Action, ActionStatus, Run
from tests.api import get, grant_policy, new_run, ok, post, prepare, problem, session, take_lease
from tests.approvals.conftest import GOAL
from tests.approvals.test_holdpoints import _closes, _wait_for_lock_waiters
from tests.conftest import Persona

A = ApprovalStatus
# How each path withdraws, and what becomes of a request it closes (pending or approved).
PATHS = {"revised": (A.SUPERSEDED, "goal revised"), "cancelled": (A.CANCELLED, "run cancelled")}


def _request_entries(run: Run, request: ApprovalRequest) -> list[dict[str, Any]]:
    """The run's journal entries about `request` after it was raised, in order: each
    payload with its type."""
    entries = JournalEntry.objects.filter(stream=run_stream(run.run_id)).order_by("seq")
    return [
        {"type": kind, **payload}
        for kind, payload in entries.values_list("type", "payload")
        if payload.get("approval_id") == str(request.pk) and kind != "approval_requested"
    ]


def _text(html: bytes) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html.decode())).split())


def _withdraw(run: Run, how: str) -> None:
    if how == "revised":
        revise_goal(run, {**GOAL, "scope": ["/orders"]}, expected_goal_rev=1, actor="user:zed")
    else:
        cancel_run(run, "not needed", actor="user:zed")


def _no_usable_approval(request: ApprovalRequest, reviewer: Persona, status: str, why: str) -> None:
    """Wherever a reviewer or a client reads it, the request is `status`, not approved, with
    its reviewer's decision kept and the reason it stopped counting; deciding it again is
    refused, not answered as the decision that applied."""
    request.refresh_from_db()
    words = f"its action was withdrawn before it was sent ({why})"
    assert (request.status, request.closed_reason) == (status, words)
    assert (request.decided_by, request.decision_reason) == (reviewer.user, "looks right")
    assert [(c["approval_status"], c["reason"]) for c in _closes(request.run, request)] == [
        (status, words)
    ]
    api = session(reviewer.user)
    assert ok(get(api, "approvals/?status=approved"))["results"] == []
    assert ok(get(api, f"approvals/{request.pk}/"))["status"] == status
    again = {"decision": "approve", "action_hash": request.action_hash, "reason": "looks right"}
    problem(post(api, f"approvals/{request.pk}/decision/", again), 409, "already_decided")

    client = Client()
    client.force_login(reviewer.user)
    page = _text(client.get(reverse("approval-page", args=[request.pk])).content)
    assert f"{status} — {words}. Approved by alice" in page, page
    assert f"the approval no longer counts: {words}" in page, page
    assert "the run sends the action" not in page
    history = _text(client.get(reverse("inbox-history")).content)
    assert f"{status} alice {words} (approved: “looks right”)" in history, history


@pytest.mark.django_db
@pytest.mark.parametrize("how", sorted(PATHS))
def test_an_approved_unsent_action_withdrawn_by_the_run_ends_its_approval(
    held: Any, reviewer_a: Persona, how: str
) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="looks right")
    assert Action.objects.get(run=run).status == ActionStatus.APPROVED  # approved, not sent
    _withdraw(run, how)
    assert Action.objects.get(pk=request.action_id).status == ActionStatus.CANCELLED
    status, why = PATHS[how]
    _no_usable_approval(request, reviewer_a, status, why)
    advance_run(run.run_id, "w1")
    assert box.tasks() == []


@pytest.mark.django_db
@pytest.mark.parametrize("finish", ["completed", "failed"])
def test_an_external_runs_finishing_checkpoint_ends_an_approval_it_never_used(
    agent_a: Persona, reviewer_a: Persona, finish: str
) -> None:
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    grant_policy(agent_a.tenant)
    held = ok(prepare(client, run_id, fence, params={"title": "held"}), 201)
    request = ApprovalRequest.objects.get(pk=held["approval"])
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="looks right")
    assert Action.objects.get(pk=held["action_id"]).status == ActionStatus.APPROVED

    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "", "status": finish}
    ok(post(client, f"runs/{run_id}/checkpoints/", body), 201)

    assert Action.objects.get(pk=held["action_id"]).status == ActionStatus.CANCELLED
    _no_usable_approval(request, reviewer_a, A.CANCELLED, f"the run {finish}")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", sorted(PATHS))
def test_a_decision_that_wins_the_race_with_a_withdrawal_does_not_outlive_it(
    held: Any, reviewer_a: Persona, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """PostgreSQL, two sessions: the decision holds the run's lock when the revision or the
    cancel arrives, so it commits `approved` first; the withdrawal that follows must end that
    approval too — no moment after both leaves an approved request on a cancelled action."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    run, request, box = held
    deciding, release = threading.Event(), threading.Event()
    may_decide = decisions.may_decide  # called by decide with the run locked

    def paused(*args: Any, **kwargs: Any) -> bool:
        deciding.set()
        release.wait(timeout=20)
        return may_decide(*args, **kwargs)

    monkeypatch.setattr(decisions, "may_decide", paused)
    results: dict[str, Any] = {}

    def go(name: str, move: Any) -> None:
        try:
            results[name] = move()
        except Exception as exc:  # what the caller would have seen
            results[name] = exc
        finally:
            connections.close_all()

    decider = threading.Thread(
        target=go,
        args=(
            "decide",
            lambda: decide(
                request.id, reviewer_a.user, "approve", request.action_hash, reason="looks right"
            ),
        ),
    )
    withdrawer = threading.Thread(target=go, args=("withdraw", lambda: _withdraw(run, how)))
    decider.start()
    try:
        assert deciding.wait(timeout=10)
        withdrawer.start()
        _wait_for_lock_waiters(1)  # the withdrawal waits for the run the decision holds
    finally:
        release.set()
        decider.join(timeout=30)
        if withdrawer.is_alive() or withdrawer.ident is not None:
            withdrawer.join(timeout=30)
    assert isinstance(results["decide"], ApprovalRequest), results
    # The decision applied first: its answer says so, and its entry precedes the close.
    assert results["decide"].status == A.APPROVED
    order = [
        (entry["type"], entry.get("decision") or entry.get("approval_status"))
        for entry in _request_entries(run, request)
    ]
    assert order == [("approval_decided", "approve"), ("approval_closed", PATHS[how][0])], order
    assert not isinstance(results["withdraw"], Exception), results
    assert Action.objects.get(pk=request.action_id).status == ActionStatus.CANCELLED
    status, why = PATHS[how]
    _no_usable_approval(request, reviewer_a, status, why)
    advance_run(run.run_id, "w1")
    assert box.tasks() == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", sorted(PATHS))
def test_the_answer_to_an_approve_that_applied_says_approved_though_a_withdrawal_follows(
    held: Any, reviewer_a: Persona, how: str
) -> None:
    """The withdrawal waiting on the run closes the request the moment the decision commits —
    here on purpose, from an on-commit hook the vote's save sets. The reviewer's answer still
    says what their decision did (`approved`), as the journal's order does; every later read
    says what became of it. `decide` read the request again after its commit, and answered
    `superseded` or `cancelled` to an approve that applied (seen under CI load, stop 51)."""
    run, request, _box = held

    def withdraw_once_committed(sender: Any, created: bool, **kwargs: Any) -> None:
        if created:
            transaction.on_commit(lambda: _withdraw(run, how))

    post_save.connect(withdraw_once_committed, sender=ApprovalVote, weak=False)
    try:
        api = session(reviewer_a.user)
        body = {"decision": "approve", "action_hash": request.action_hash, "reason": "looks right"}
        answer = ok(post(api, f"approvals/{request.pk}/decision/", body))
    finally:
        post_save.disconnect(withdraw_once_committed, sender=ApprovalVote)
    assert (answer["status"], answer["decision_reason"]) == ("approved", "looks right"), answer
    order = [
        (entry["type"], entry.get("decision") or entry.get("approval_status"))
        for entry in _request_entries(run, request)
    ]
    assert order == [("approval_decided", "approve"), ("approval_closed", PATHS[how][0])], order
    status, why = PATHS[how]
    _no_usable_approval(request, reviewer_a, status, why)
