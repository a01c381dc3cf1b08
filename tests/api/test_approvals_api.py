"""Approvals and manual reconciliation over the API (API.md, "Approvals and manual
reconciliation"), with the whole external-executor hold point: lease → prepare (held) →
dispatch refused → a reviewer decides through the API → dispatch → outcome.

Reviewers use a browser session (alice, in acme-reviewers, which the policy grants);
agents use their token. Every refusal is asserted on status, `code` and problem+json.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest, ApprovalStatus, ApprovalVote
from audit.models import JournalEntry
from runtime.models import Action, ActionStatus, Run, RunStatus
from tests.api import (
    CLIENT_TOOL,
    fresh_throttle,  # noqa: F401
    get,
    grant_policy,
    new_run,
    ok,
    post,
    prepare,
    problem,
    row_counts,
    session,
    take_lease,
)
from tests.conftest import Persona

pytestmark = pytest.mark.django_db

APPROVAL_FIELDS = {
    "id",
    "run_id",
    "action",
    "action_hash",
    "status",
    "expires_at",
    "decided_by",
    "decided_at",
    "decision_reason",
}
SHOWN_ACTION_FIELDS = {"action_id", "tool", "params", "target", "reason", "impact"}


@pytest.fixture
def hold(agent_a: Persona, reviewer_a: Persona) -> dict[str, Any]:
    """An external executor's action held for approval: run, fence, action, approval id."""
    grant_policy(agent_a.tenant)
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    action = ok(
        prepare(client, run["run_id"], fence, params={"title": "Review v2"}, target="shop"),
        201,
    )
    assert action["status"] == "awaiting_approval"
    return {"run_id": run["run_id"], "fence": fence, "action": action, "id": action["approval"]}


def decide(
    client: APIClient, approval_id: str, decision: str, action_hash: str, **more: Any
) -> Any:
    body = {"decision": decision, "action_hash": action_hash, "reason": "looked at it", **more}
    return post(client, f"approvals/{approval_id}/decision/", body)


def shown(client: APIClient, approval_id: str) -> dict[str, Any]:
    return ok(get(client, f"approvals/{approval_id}/"))


# --- the whole hold point --------------------------------------------------------------------


def test_external_executor_hold_point_end_to_end(
    hold: dict[str, Any], agent_a: Persona, reviewer_a: Persona
) -> None:
    agent = agent_a.api()
    action_id, fence = hold["action"]["action_id"], hold["fence"]
    response = post(agent, f"actions/{action_id}/dispatch/", {"fence": fence})
    problem(response, 409, "approval_required")

    alice = session(reviewer_a.user)
    request = shown(alice, hold["id"])
    decided = ok(decide(alice, hold["id"], "approve", request["action_hash"]))
    assert decided["status"] == "approved" and decided["decided_by"] == "alice"
    assert decided["decided_at"] and decided["decision_reason"] == "looked at it"

    sent = ok(post(agent, f"actions/{action_id}/dispatch/", {"fence": fence}))
    assert sent["status"] == "sent" and sent["approval"] == hold["id"]
    # The agent calls its service itself, then records what came back.
    done = ok(
        post(
            agent,
            f"actions/{action_id}/outcome/",
            {"fence": fence, "outcome": "confirmed", "external_id": "TASK-1", "result": {}},
        )
    )
    assert (done["status"], done["external_id"]) == ("confirmed", "TASK-1")
    run = ok(get(agent, f"runs/{hold['run_id']}/"))
    assert run["status"] == "running" and run["waiting_for"] is None


# --- GET approvals/ and approvals/{id}/ ------------------------------------------------------


def test_list_and_detail_show_the_request(
    hold: dict[str, Any], reviewer_a: Persona, agent_a: Persona
) -> None:
    alice = session(reviewer_a.user)
    page = ok(get(alice, "approvals/"))
    assert set(page) >= {"next", "previous", "results"}
    assert [a["id"] for a in page["results"]] == [hold["id"]]
    data = shown(alice, hold["id"])
    assert APPROVAL_FIELDS <= set(data), APPROVAL_FIELDS - set(data)
    assert SHOWN_ACTION_FIELDS <= set(data["action"])
    assert data["action"]["action_id"] == hold["action"]["action_id"]
    assert data["action"]["tool"] == CLIENT_TOOL
    assert data["action"]["params"] == {"title": "Review v2"}
    assert data["action"]["target"] == "shop"
    assert data["run_id"] == hold["run_id"] and data["status"] == "pending"
    assert data["decided_by"] is None and data["decided_at"] is None
    assert len(data["action_hash"]) == 64
    assert ok(get(agent_a.api(), f"approvals/{hold['id']}/"))["id"] == hold["id"]


def test_list_filters_by_status(hold: dict[str, Any], reviewer_a: Persona) -> None:
    alice = session(reviewer_a.user)
    assert len(ok(get(alice, "approvals/?status=pending"))["results"]) == 1
    assert ok(get(alice, "approvals/?status=approved"))["results"] == []
    problem(get(alice, "approvals/?status=maybe"), 422, "invalid_params")


def test_another_tenants_approval_is_404(hold: dict[str, Any], outsider_b: Persona) -> None:
    bob = session(outsider_b.user)
    foreign = get(bob, f"approvals/{hold['id']}/")
    problem(foreign, 404, "not_found")
    assert foreign.content == get(bob, f"approvals/{uuid.uuid4()}/").content
    assert ok(get(bob, "approvals/"))["results"] == []
    before = row_counts()
    response = decide(bob, hold["id"], "approve", "0" * 64)
    problem(response, 404, "not_found")
    assert row_counts() == before


# --- POST approvals/{id}/decision/ ------------------------------------------------------------


def test_repeating_the_applied_decision_answers_200_with_the_same_approval(
    hold: dict[str, Any], reviewer_a: Persona
) -> None:
    alice = session(reviewer_a.user)
    action_hash = shown(alice, hold["id"])["action_hash"]
    first = ok(decide(alice, hold["id"], "approve", action_hash))
    again = ok(decide(alice, hold["id"], "approve", action_hash))
    assert again == first
    assert ApprovalVote.objects.filter(request_id=hold["id"]).count() == 1


@pytest.mark.parametrize("quorum", [1, 2])
def test_repeating_an_edited_approval_with_the_hash_it_answered_is_the_same_decision(
    hold: dict[str, Any], reviewer_a: Persona, quorum: int
) -> None:
    """An approval with edits answers the edited action's hash; a client that retries with
    that hash (what the approval it got back shows) asks for the same result, so it gets
    the same approval — with the same edits or none. Other edits conflict: 409. Under a
    quorum the vote waits for others, and repeating it is answered alike."""
    ApprovalRequest.objects.filter(pk=hold["id"]).update(quorum=quorum)
    alice = session(reviewer_a.user)
    before_edit = shown(alice, hold["id"])["action_hash"]
    edits = {"title": "Review v3"}
    first = ok(decide(alice, hold["id"], "approve", before_edit, edits=edits))
    assert first["action_hash"] != before_edit
    assert first["status"] == ("approved" if quorum == 1 else "pending")
    after_edit = first["action_hash"]
    assert ok(decide(alice, hold["id"], "approve", after_edit, edits=edits)) == first
    assert ok(decide(alice, hold["id"], "approve", after_edit)) == first
    assert ok(decide(alice, hold["id"], "approve", before_edit, edits=edits)) == first
    problem(
        decide(alice, hold["id"], "approve", after_edit, edits={"title": "Other"}),
        409,
        "already_decided",
    )
    problem(
        decide(alice, hold["id"], "approve", before_edit, edits={"title": "Other"}),
        409,
        "already_decided",
    )
    assert ApprovalVote.objects.filter(request_id=hold["id"]).count() == 1
    assert shown(alice, hold["id"])["action"]["params"] == {"title": "Review v3"}


def test_the_other_decision_after_one_applied_is_409_already_decided(
    hold: dict[str, Any], reviewer_a: Persona
) -> None:
    alice = session(reviewer_a.user)
    action_hash = shown(alice, hold["id"])["action_hash"]
    ok(decide(alice, hold["id"], "approve", action_hash))
    problem(decide(alice, hold["id"], "reject", action_hash), 409, "already_decided")
    assert ApprovalRequest.objects.get(pk=hold["id"]).status == ApprovalStatus.APPROVED


def test_a_stale_hash_is_409_hash_mismatch(hold: dict[str, Any], reviewer_a: Persona) -> None:
    alice = session(reviewer_a.user)
    problem(decide(alice, hold["id"], "approve", "f" * 64), 409, "hash_mismatch")
    request = ApprovalRequest.objects.get(pk=hold["id"])
    assert request.status == ApprovalStatus.PENDING
    assert not ApprovalVote.objects.filter(request=request).exists()


def test_a_decision_after_expiry_is_409_expired(hold: dict[str, Any], reviewer_a: Persona) -> None:
    alice = session(reviewer_a.user)
    action_hash = shown(alice, hold["id"])["action_hash"]
    ApprovalRequest.objects.filter(pk=hold["id"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    problem(decide(alice, hold["id"], "approve", action_hash), 409, "expired")
    assert Action.objects.get(pk=hold["action"]["action_id"]).status == (
        ActionStatus.AWAITING_APPROVAL
    )


def test_editing_a_field_the_tool_does_not_allow_is_422(
    hold: dict[str, Any], reviewer_a: Persona
) -> None:
    alice = session(reviewer_a.user)
    action_hash = shown(alice, hold["id"])["action_hash"]
    before = row_counts()
    response = decide(alice, hold["id"], "approve", action_hash, edits={"due": "tomorrow"})
    data = problem(response, 422, "field_not_editable")
    assert "due" in data["errors"]
    assert row_counts() == before


def test_approving_with_an_allowed_edit_rebinds_the_hash(
    hold: dict[str, Any], reviewer_a: Persona, agent_a: Persona
) -> None:
    alice = session(reviewer_a.user)
    old_hash = shown(alice, hold["id"])["action_hash"]
    data = ok(decide(alice, hold["id"], "approve", old_hash, edits={"title": "Review v3"}))
    assert data["status"] == "approved" and data["action_hash"] != old_hash
    assert data["action"]["params"] == {"title": "Review v3"}
    agent = agent_a.api()
    action_id = hold["action"]["action_id"]
    sent = ok(post(agent, f"actions/{action_id}/dispatch/", {"fence": hold["fence"]}))
    assert sent["params"] == {"title": "Review v3"}


def test_a_rejection_needs_a_reason(hold: dict[str, Any], reviewer_a: Persona) -> None:
    alice = session(reviewer_a.user)
    action_hash = shown(alice, hold["id"])["action_hash"]
    data = problem(
        decide(alice, hold["id"], "reject", action_hash, reason=""), 422, "invalid_params"
    )
    assert "reason" in data["errors"]
    rejected = ok(decide(alice, hold["id"], "reject", action_hash, reason="wrong target"))
    assert rejected["status"] == "rejected"
    assert Action.objects.get(pk=hold["action"]["action_id"]).status == ActionStatus.CANCELLED


def test_a_rejection_with_edits_is_refused_not_recorded_without_them(
    hold: dict[str, Any], reviewer_a: Persona
) -> None:
    """A reviewer who sends edits with a reject made a mistake (meant "approve with edits",
    or a client bug): the edits were dropped without a word and the action rejected."""
    alice = session(reviewer_a.user)
    action_hash = shown(alice, hold["id"])["action_hash"]
    before = row_counts()
    response = decide(
        alice, hold["id"], "reject", action_hash, reason="wrong title", edits={"title": "v3"}
    )
    data = problem(response, 422, "invalid_params")
    assert "edits" in data["errors"]
    assert row_counts() == before
    assert shown(alice, hold["id"])["status"] == "pending"
    rejected = ok(decide(alice, hold["id"], "reject", action_hash, reason="wrong title", edits={}))
    assert rejected["status"] == "rejected"


@pytest.mark.parametrize("who", ["viewer", "agent"])
def test_a_viewer_or_an_agent_token_may_not_decide(
    hold: dict[str, Any], viewer_a: Persona, agent_a: Persona, who: str
) -> None:
    client = session(viewer_a.user) if who == "viewer" else agent_a.api()
    action_hash = ApprovalRequest.objects.get(pk=hold["id"]).action_hash
    before = row_counts()
    problem(decide(client, hold["id"], "approve", action_hash), 403, "not_permitted")
    assert row_counts() == before
    assert ApprovalRequest.objects.get(pk=hold["id"]).status == ApprovalStatus.PENDING


@pytest.mark.parametrize("who", ["viewer", "agent"])
def test_a_viewer_or_an_agent_token_may_not_decide_a_decided_request_either(
    hold: dict[str, Any], reviewer_a: Persona, viewer_a: Persona, agent_a: Persona, who: str
) -> None:
    alice = session(reviewer_a.user)
    action_hash = shown(alice, hold["id"])["action_hash"]
    ok(decide(alice, hold["id"], "approve", action_hash))
    client = session(viewer_a.user) if who == "viewer" else agent_a.api()
    before = decided_state(hold["id"])
    for decision, reason in (("reject", "no"), ("approve", "")):
        refused = decide(client, hold["id"], decision, action_hash, reason=reason)
        problem(refused, 403, "not_permitted")
        # Nothing changed: the decision, its votes, the action, the journal.
        assert decided_state(hold["id"]) == before


def decided_state(approval_id: str) -> tuple[Any, ...]:
    from audit.models import JournalEntry

    request = ApprovalRequest.objects.get(pk=approval_id)
    action = Action.objects.get(pk=request.action_id)
    return (
        row_counts(),
        (request.status, request.decision, request.decided_by_id, request.decided_at),
        (request.decision_reason, request.action_hash, request.updated_at),
        list(ApprovalVote.objects.values_list("user_id", "decision", "action_hash")),
        (action.status, action.params, action.fence, action.last_error),
        list(JournalEntry.objects.order_by("id").values_list("id", "hash")),
    )


# --- POST actions/{id}/resolve/ -------------------------------------------------------------


@pytest.fixture
def parked(agent_a: Persona, settings: Any) -> dict[str, Any]:
    """An action whose outcome nobody can prove: the external executor reported `unknown`
    and the reconciler, for a service that can neither deduplicate nor be looked up, hands
    it to a human (manual_review). No network call is made in mode `none`."""
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    action = ok(prepare(client, run["run_id"], fence), 201)
    ok(post(client, f"actions/{action['action_id']}/dispatch/", {"fence": fence}))
    ok(
        post(
            client,
            f"actions/{action['action_id']}/outcome/",
            {"fence": fence, "outcome": "unknown"},
        )
    )
    # The service can neither deduplicate nor be looked up: a person has it at once.
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.MANUAL_REVIEW
    return {"run_id": run["run_id"], "action_id": action["action_id"], "fence": fence}


def test_resolve_applied_answers_200(parked: dict[str, Any], reviewer_a: Persona) -> None:
    alice = session(reviewer_a.user)
    data = ok(
        post(
            alice,
            f"actions/{parked['action_id']}/resolve/",
            {"outcome": "applied", "external_id": "TASK-77", "note": "found it in the tracker"},
        )
    )
    assert (data["status"], data["external_id"]) == ("confirmed", "TASK-77")


def test_resolve_not_applied_after_the_sender_could_land_answers_200(
    parked: dict[str, Any], reviewer_a: Persona
) -> None:
    Action.objects.filter(pk=parked["action_id"]).update(
        in_flight_until=timezone.now() - timedelta(seconds=1)
    )
    alice = session(reviewer_a.user)
    data = ok(post(alice, f"actions/{parked['action_id']}/resolve/", {"outcome": "not_applied"}))
    assert data["status"] == "prepared"


def test_resolve_not_applied_while_the_sender_may_be_in_flight_is_409(
    parked: dict[str, Any], reviewer_a: Persona
) -> None:
    alice = session(reviewer_a.user)
    response = post(alice, f"actions/{parked['action_id']}/resolve/", {"outcome": "not_applied"})
    problem(response, 409, "invalid_transition")
    assert Action.objects.get(pk=parked["action_id"]).status == ActionStatus.MANUAL_REVIEW


def test_resolve_judges_the_in_flight_window_by_the_database_clock(
    parked: dict[str, Any], reviewer_a: Persona
) -> None:
    """The window is database time (set by the sender's `sent` mark); an app host whose clock
    runs ahead of the database's must not take "not applied" while the sender may land."""
    import time_machine

    in_flight_until = Action.objects.get(pk=parked["action_id"]).in_flight_until
    assert in_flight_until is not None
    alice = session(reviewer_a.user)
    with time_machine.travel(in_flight_until + timedelta(seconds=60)):
        response = post(
            alice, f"actions/{parked['action_id']}/resolve/", {"outcome": "not_applied"}
        )
    problem(response, 409, "invalid_transition")
    assert Action.objects.get(pk=parked["action_id"]).status == ActionStatus.MANUAL_REVIEW


@pytest.mark.parametrize("how", ["cancelled", "revised"])
def test_resolve_not_applied_of_a_run_that_moved_on_withdraws_the_action(
    parked: dict[str, Any], reviewer_a: Persona, agent_a: Persona, how: str
) -> None:
    """Not applied puts an action back to `prepared` so that its step sends it again — but
    nothing sends it for a cancelled run, nor for a goal revised since it was prepared
    (dispatch refuses stale_goal_rev): it is withdrawn, as the cancel or the revision
    withdrew the run's other unsent actions, not left `prepared` for ever."""
    run_id = parked["run_id"]
    if how == "cancelled":
        ok(post(agent_a.api(), f"runs/{run_id}/cancel/", {"reason": "not needed"}))
    else:
        body = {"goal": {"topic": "another"}, "expected_goal_rev": 1}
        ok(post(agent_a.api(), f"runs/{run_id}/revisions/", body))
    Action.objects.filter(pk=parked["action_id"]).update(
        in_flight_until=timezone.now() - timedelta(seconds=1)
    )
    alice = session(reviewer_a.user)
    data = ok(post(alice, f"actions/{parked['action_id']}/resolve/", {"outcome": "not_applied"}))
    assert data["status"] == "cancelled"
    assert Action.objects.get(pk=parked["action_id"]).status == ActionStatus.CANCELLED
    if how == "cancelled":
        assert Run.objects.get(pk=run_id).status == RunStatus.CANCELLED


def test_resolve_of_an_action_not_in_manual_review_is_409_invalid_transition(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    action = ok(prepare(client, run["run_id"], fence), 201)
    alice = session(reviewer_a.user)
    body = {"outcome": "applied", "external_id": "X-1"}
    problem(post(alice, f"actions/{action['action_id']}/resolve/", body), 409, "invalid_transition")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.PREPARED


@pytest.mark.parametrize("who", ["viewer", "agent"])
def test_a_viewer_or_an_agent_token_may_not_resolve(
    parked: dict[str, Any], viewer_a: Persona, agent_a: Persona, who: str
) -> None:
    client = session(viewer_a.user) if who == "viewer" else agent_a.api()
    before = row_counts()
    body = {"outcome": "applied", "external_id": "X-1"}
    problem(post(client, f"actions/{parked['action_id']}/resolve/", body), 403, "not_permitted")
    assert row_counts() == before
    assert Action.objects.get(pk=parked["action_id"]).status == ActionStatus.MANUAL_REVIEW
    assert Run.objects.get(pk=parked["run_id"]).status != RunStatus.COMPLETED


@pytest.mark.parametrize(
    ("query", "header", "field"),
    [
        ({"after": "x"}, None, "after"),
        ({"after": ""}, None, "after"),
        ({}, "1.5", "Last-Event-ID"),
        ({}, "", "Last-Event-ID"),
        ({"after": "3"}, "x", "Last-Event-ID"),
        # What Python's int() reads as a number, but no id this API gave ever looked like.
        ({"after": "1_0"}, None, "after"),
        ({"after": "\u0661\u0662"}, None, "after"),  # Arabic-Indic digits
        ({"after": " 7"}, None, "after"),
        ({}, "+7", "Last-Event-ID"),
        ({"after": "9" * 5000}, None, "after"),  # past int()'s 4,300 digits
    ],
)
def test_the_approvals_stream_refuses_a_position_that_is_no_id(
    agent_a: Persona, query: dict[str, str], header: str | None, field: str
) -> None:
    """Where a stream resumes is an id it gave (a seq), as for a run's stream: anything else
    is refused in the one error format, not a stream opened at a guess."""
    extra = {} if header is None else {"HTTP_LAST_EVENT_ID": header}
    answer = get(agent_a.api(), "approvals/", data={"stream": "1", **query}, **extra)
    assert problem(answer, 422, "invalid_params")["errors"] == {field: ["an integer"]}


def test_the_approvals_stream_sends_the_changes_after_the_position_it_is_given(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """Through Django alone (no event loop: it does not follow) the stream sends the changes
    there are after `after` and ends; each event's id is its change's seq, and a change an
    approval has moved on from is left out (its later one shows it)."""
    grant_policy(agent_a.tenant)
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    first = ok(prepare(agent_a.api(), run_id, fence, params={"title": "one"}), 201)["approval"]
    second = ok(prepare(agent_a.api(), run_id, fence, params={"title": "two"}), 201)["approval"]
    approval = ApprovalRequest.objects.get(pk=first)
    decision = {"decision": "approve", "action_hash": approval.action_hash}
    ok(post(session(reviewer_a.user), f"approvals/{first}/decision/", decision))
    answer = get(agent_a.api(), "approvals/", data={"stream": "1", "after": "0"})
    assert answer.status_code == 200 and answer["Content-Type"] == "text/event-stream"
    body = b"".join(answer).decode()
    events = [block.splitlines() for block in body.split("\n\n") if "event: " in block]
    sent = [(lines[0], json.loads(lines[2][6:])["id"]) for lines in events]
    seq = dict(
        ((e.payload["approval_id"], e.payload["status"]), e.seq)
        for e in JournalEntry.objects.filter(type="approval_status")
    )
    assert sent == [
        (f"id: {seq[(second, 'pending')]}", second),
        (f"id: {seq[(first, 'approved')]}", first),
    ]
