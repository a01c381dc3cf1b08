"""The executor protocol over the API (API.md, "Executor protocol"): leases, checkpoints,
prepare / dispatch / outcome, with every refusal code; plus the lease race (B1) and the
revision-vs-dispatch race (B5) on PostgreSQL.

An external agent here is only an API client with a token: it leases, writes, prepares,
marks `sent`, calls its service itself and records what came back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest, ApprovalStatus
from audit.models import JournalEntry
from runtime.models import Action, ActionStatus, Checkpoint, Run
from tests.api import (
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
from tests.runtime.helpers import expire_lease

pytestmark = pytest.mark.django_db

# The tracker performed by the agent itself (executor `client`): the only kind of tool whose
# outcome an API client may report.
CLIENT = "agent.tasks.create"
ACTION_FIELDS = {
    "action_id",
    "run_id",
    "idempotency_key",
    "tool",
    "params",
    "fingerprint",
    "status",
    "goal_rev",
    "external_id",
    "result",
    "approval",
}


def leased(client: APIClient, **run_fields: Any) -> tuple[str, int]:
    run = new_run(client, **run_fields)
    return run["run_id"], take_lease(client, run["run_id"])


def dispatch(client: APIClient, action_id: str, fence: int) -> Any:
    return post(client, f"actions/{action_id}/dispatch/", {"fence": fence})


def outcome(client: APIClient, action_id: str, fence: int, verdict: str, **fields: Any) -> Any:
    return post(
        client, f"actions/{action_id}/outcome/", {"fence": fence, "outcome": verdict, **fields}
    )


def approve(reviewer: Persona, approval_id: str, **fields: Any) -> dict[str, Any]:
    alice = session(reviewer.user)
    shown = ok(get(alice, f"approvals/{approval_id}/"))
    body = {"decision": "approve", "action_hash": shown["action_hash"], "reason": "ok", **fields}
    return ok(post(alice, f"approvals/{approval_id}/decision/", body))


# --- lease, heartbeat, release ---------------------------------------------------------------


def test_lease_answers_fence_and_expiry_then_409_lease_held(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    data = ok(post(client, f"runs/{run['run_id']}/lease/", {"owner": "p1", "ttl_seconds": 30}))
    assert data["fence"] == 1 and data["owner"] == "p1"
    stored = Run.objects.get(pk=run["run_id"])
    assert data["expires_at"] == stored.lease_expires_at.isoformat().replace("+00:00", "Z")
    assert stored.lease_expires_at > timezone.now()
    response = post(client, f"runs/{run['run_id']}/lease/", {"owner": "p2", "ttl_seconds": 30})
    problem(response, 409, "lease_held")
    stored = Run.objects.get(pk=run["run_id"])
    assert (stored.lease_owner, stored.fence) == ("p1", 1)


def test_an_expired_lease_is_taken_over_with_fence_plus_one(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    expire_lease(run_id)
    assert take_lease(client, run_id, owner="p2") == fence + 1
    taken = JournalEntry.objects.filter(stream=f"run:{run_id}", type="lease_taken")
    assert taken.order_by("-seq").first().payload["takeover"] is True


def test_heartbeat_extends_then_a_stale_fence_is_409(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, ttl=5)
    before = Run.objects.get(pk=run_id).lease_expires_at
    data = ok(post(client, f"runs/{run_id}/lease/heartbeat/", {"fence": fence}))
    assert data["fence"] == fence
    after = Run.objects.get(pk=run_id).lease_expires_at
    assert after > before  # extended by the default 30 s from database now
    assert data["expires_at"] == after.isoformat().replace("+00:00", "Z")
    expire_lease(run_id)
    take_lease(client, run_id, owner="p2")
    response = post(client, f"runs/{run_id}/lease/heartbeat/", {"fence": fence})
    problem(response, 409, "stale_fence")
    assert Run.objects.get(pk=run_id).lease_owner == "p2"


def test_release_answers_200_then_a_stale_fence_is_409(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    data = ok(post(client, f"runs/{run_id}/lease/release/", {"fence": fence}))
    assert data["released"] is True
    stored = Run.objects.get(pk=run_id)
    assert stored.lease_owner == "" and stored.lease_expires_at is None
    second = take_lease(client, run_id, owner="p2")
    assert second == fence + 2  # the release moved the fence on, the take once more
    problem(post(client, f"runs/{run_id}/lease/release/", {"fence": fence}), 409, "stale_fence")
    assert Run.objects.get(pk=run_id).lease_owner == "p2"


def test_a_heartbeat_after_release_is_409_and_the_run_stays_free(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    ok(post(client, f"runs/{run_id}/lease/release/", {"fence": fence}))
    problem(post(client, f"runs/{run_id}/lease/heartbeat/", {"fence": fence}), 409, "stale_fence")
    stored = Run.objects.get(pk=run_id)
    assert (stored.lease_owner, stored.lease_expires_at) == ("", None)
    assert take_lease(client, run_id, owner="p2") == fence + 2


def test_a_checkpoint_that_waits_for_input_ends_its_lease_and_its_fence(
    agent_a: Persona,
) -> None:
    """`status: waiting_input` gives the lease up with the checkpoint: the same fence's
    next prepare or checkpoint is 409 stale_fence (before: 201 on a run waiting for input
    that nobody held); after the input, the next lease carries on."""
    client = agent_a.api()
    run_id, fence = leased(client)
    wait = {"fence": fence, "expected_rev": 0, "state": {"asked": True}, "next_step": "answer"}
    ok(post(client, f"runs/{run_id}/checkpoints/", {**wait, "status": "waiting_input"}), 201)
    stored = Run.objects.get(pk=run_id)
    assert (stored.status, stored.lease_owner) == ("waiting_input", "")
    problem(prepare(client, run_id, fence, tool=CLIENT), 409, "stale_fence")
    more = {**wait, "expected_rev": 1, "state": {"asked": False}}
    problem(post(client, f"runs/{run_id}/checkpoints/", more), 409, "stale_fence")
    assert not Action.objects.filter(run_id=run_id).exists()
    assert Checkpoint.objects.filter(run_id=run_id).count() == 1
    ok(post(client, f"runs/{run_id}/input/", {"data": {"answer": 42}, "expected_rev": 1}))
    again = take_lease(client, run_id, owner="p2")
    assert again == fence + 2
    ok(post(client, f"runs/{run_id}/checkpoints/", {**more, "fence": again}), 201)


def test_the_input_given_to_an_external_run_reaches_its_executor(agent_a: Persona) -> None:
    """`POST runs/{id}/input/` answered 200 for an external run waiting for input, and the
    data went into a column no API call shows: not the run object, not its events, not its
    checkpoints — the executor that asked for it, leasing the run again, could never read
    it (a hosted worker's step gets it as `ctx.input`). The run object now carries it as
    `input` until the executor's next checkpoint takes it, as a hosted step's commit does."""
    client = agent_a.api()
    run_id, fence = leased(client)
    wait = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "answer"}
    ok(post(client, f"runs/{run_id}/checkpoints/", {**wait, "status": "waiting_input"}), 201)
    ok(post(client, f"runs/{run_id}/input/", {"data": {"answer": 42}, "expected_rev": 1}))

    again = take_lease(client, run_id, owner="p2")
    assert ok(get(client, f"runs/{run_id}/"))["input"] == {"answer": 42}

    taken = {"fence": again, "expected_rev": 1, "state": {"answer": 42}, "next_step": "next"}
    ok(post(client, f"runs/{run_id}/checkpoints/", taken), 201)
    assert ok(get(client, f"runs/{run_id}/"))["input"] is None


def test_a_checkpoint_that_waits_for_input_says_what_it_asks_for(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """A `waiting_input` checkpoint's `prompt` is the run's `waiting_for` — what a person must
    do now (API.md), as a hosted step's Wait sets it — and the run page asks with it; before,
    an external run waiting for input said nothing of what it waited for. Given input, it
    waits for nothing; a prompt with another status is a field error, nothing written."""
    client = agent_a.api()
    run_id, fence = leased(client)
    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "answer"}
    refused = problem(
        post(client, f"runs/{run_id}/checkpoints/", {**body, "prompt": "Which budget?"}),
        422,
        "invalid_params",
    )
    assert "prompt" in refused["errors"] and Run.objects.get(pk=run_id).checkpoint_rev == 0

    odd = {**body, "status": "failed", "prompt": "\x03Í]\x8d"}  # schemathesis's, once
    problem(post(client, f"runs/{run_id}/checkpoints/", odd), 422, "invalid_params")
    asking = {**body, "status": "waiting_input", "prompt": "Which budget, in EUR?"}
    ok(post(client, f"runs/{run_id}/checkpoints/", asking), 201)
    run = ok(get(client, f"runs/{run_id}/"))
    assert run["waiting_for"] == {"kind": "input", "prompt": "Which budget, in EUR?"}
    page = session(reviewer_a.user).get(f"/runs/{run_id}/").content.decode()
    assert "Waiting for input: Which budget, in EUR?" in page

    ok(post(client, f"runs/{run_id}/input/", {"data": {"eur": 1200}, "expected_rev": 1}))
    assert ok(get(client, f"runs/{run_id}/"))["waiting_for"] is None


def test_a_checkpoint_after_the_run_finished_is_run_finished(agent_a: Persona) -> None:
    """The executor that completed the run still holds its fence (a finishing checkpoint
    ends the lease without moving it): a checkpoint after it is refused as a prepare and a
    lease are, 409 `run_finished` — not `invalid_transition`, which names an action's
    transition — and nothing is written."""
    client = agent_a.api()
    run_id, fence = leased(client)
    done = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "", "status": "completed"}
    ok(post(client, f"runs/{run_id}/checkpoints/", done), 201)
    more = {"fence": fence, "expected_rev": 1, "state": {"again": True}, "next_step": "x"}
    problem(post(client, f"runs/{run_id}/checkpoints/", more), 409, "run_finished")
    assert Checkpoint.objects.filter(run_id=run_id).count() == 1


def test_a_released_lease_writes_nothing(agent_a: Persona) -> None:
    """An executor that gave its lease up holds nothing: its fence is refused for every
    write, as a worker's is (before, its checkpoint was 201 and put the run back to running
    with no owner and no expiry — never flagged lost — and its prepare and dispatch went
    through on a run nobody held)."""
    client = agent_a.api()
    run_id, fence = leased(client)
    held = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(post(client, f"runs/{run_id}/lease/release/", {"fence": fence}))
    before = row_counts()
    checkpoint = {"fence": fence, "expected_rev": 0, "state": {"n": 1}, "next_step": "more"}
    problem(post(client, f"runs/{run_id}/checkpoints/", checkpoint), 409, "stale_fence")
    problem(prepare(client, run_id, fence, tool=CLIENT, params={"title": "x"}), 409, "stale_fence")
    problem(dispatch(client, held["action_id"], fence), 409, "stale_fence")
    stored = Run.objects.get(pk=run_id)
    assert (stored.status, stored.lease_owner, stored.checkpoint_rev) == ("queued", "", 0)
    assert Action.objects.get(pk=held["action_id"]).status == ActionStatus.PREPARED
    after = row_counts()
    after.pop("JournalEntry"), before.pop("JournalEntry")  # the refusals are journalled
    assert after == before


def test_heartbeat_and_release_naming_another_owner_are_409_stale_fence(
    agent_a: Persona,
) -> None:
    """The lease's owner is checked as a worker's is (runtime.leases): a call that names
    another owner than the one the lease was taken by changes nothing."""
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, owner="p1")
    before = Run.objects.get(pk=run_id)
    for path in ("heartbeat", "release"):
        body = {"fence": fence, "owner": "intruder"}
        problem(post(client, f"runs/{run_id}/lease/{path}/", body), 409, "stale_fence")
    stored = Run.objects.get(pk=run_id)
    assert (stored.lease_owner, stored.fence) == ("p1", fence)
    assert stored.lease_expires_at == before.lease_expires_at
    body = {"fence": fence, "owner": "p1"}
    ok(post(client, f"runs/{run_id}/lease/heartbeat/", body))
    ok(post(client, f"runs/{run_id}/lease/release/", body))
    assert Run.objects.get(pk=run_id).lease_owner == ""


def test_heartbeat_and_release_of_another_tenants_lease_are_404(
    agent_a: Persona, agent_b: Persona
) -> None:
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, owner="p1")
    before = Run.objects.get(pk=run_id)
    intruder = agent_b.api()
    for path in ("heartbeat", "release"):
        response = post(intruder, f"runs/{run_id}/lease/{path}/", {"fence": fence})
        assert response.status_code == 404, response.content[:300]
    stored = Run.objects.get(pk=run_id)
    assert (stored.lease_owner, stored.fence) == ("p1", fence)
    assert stored.lease_expires_at == before.lease_expires_at


def test_a_second_release_of_the_same_lease_answers_as_the_first_and_holds_nothing(
    agent_a: Persona,
) -> None:
    """Released is released: the old fence no longer holds anything (as for a worker). A
    release repeated with it (a client's retry after a lost answer) answers what the first
    did and writes nothing; once another executor leased the run, it is stale."""
    client = agent_a.api()
    run_id, fence = leased(client)
    first = ok(post(client, f"runs/{run_id}/lease/release/", {"fence": fence}))
    assert ok(post(client, f"runs/{run_id}/lease/release/", {"fence": fence})) == first
    released = JournalEntry.objects.filter(stream=f"run:{run_id}", type="lease_released")
    assert released.count() == 1
    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "b"}
    problem(post(client, f"runs/{run_id}/checkpoints/", body), 409, "stale_fence")
    take_lease(client, run_id, owner="p2")
    problem(post(client, f"runs/{run_id}/lease/release/", {"fence": fence}), 409, "stale_fence")


# --- POST runs/{id}/checkpoints/ -------------------------------------------------------------


def test_checkpoint_answers_201_then_refuses_stale_fence_and_stale_rev(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    url = f"runs/{run_id}/checkpoints/"
    body = {"fence": fence, "expected_rev": 0, "state": {"done": ["a"]}, "next_step": "b"}
    data = ok(post(client, url, body), 201)
    assert {"rev", "goal_rev", "next_step", "state", "digest", "created_at", "created_by"} <= set(
        data
    )
    assert (data["rev"], data["goal_rev"], data["next_step"]) == (1, 1, "b")
    assert data["state"] == {"done": ["a"]}
    run = ok(get(client, f"runs/{run_id}/"))
    assert (run["checkpoint_rev"], run["next_step"], run["status"]) == (1, "b", "running")

    problem(post(client, url, {**body, "expected_rev": 0}), 409, "version_conflict")
    expire_lease(run_id)
    new_fence = take_lease(client, run_id, owner="p2")
    problem(post(client, url, {**body, "expected_rev": 1}), 409, "stale_fence")
    assert Checkpoint.objects.filter(run_id=run_id).count() == 1
    ok(post(client, url, {**body, "fence": new_fence, "expected_rev": 1}), 201)
    assert list(Checkpoint.objects.filter(run_id=run_id).values_list("rev", "fence")) == [
        (1, fence),
        (2, new_fence),
    ]


# --- POST runs/{id}/actions/ (prepare) -------------------------------------------------------


def test_prepare_answers_201_prepared_with_the_action(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    data = ok(prepare(client, run_id, fence, params={"title": "Ship", "body": "é"}), 201)
    assert ACTION_FIELDS <= set(data), ACTION_FIELDS - set(data)
    assert data["status"] == "prepared" and data["approval"] is None
    assert (data["run_id"], data["tool"], data["goal_rev"]) == (run_id, CLIENT, 1)
    assert data["params"] == {"title": "Ship", "body": "é"}
    assert len(data["fingerprint"]) == 64 and data["external_id"] == ""
    assert data["idempotency_key"]
    detail = ok(get(client, f"actions/{data['action_id']}/"))
    assert detail == data


def test_prepare_with_an_expected_goal_rev_the_goal_moved_past_is_409_version_conflict(
    agent_a: Persona,
) -> None:
    """The executor keys its calls by the goal revision it last read. A prepare took no
    expected revision: under a revision the executor had not read yet, it made the new
    goal's action under the old goal's key. Now `expected_goal_rev` is compare-and-swapped
    (API.md's convention): moved on, 409 version_conflict and nothing is written; current,
    the action is prepared."""
    client = agent_a.api()
    run_id, fence = leased(client)
    body = {"goal": {"steps": 1}, "expected_goal_rev": 1}
    ok(post(client, f"runs/{run_id}/revisions/", body))
    before = row_counts()

    stale = prepare(client, run_id, fence, idempotency_key="call-1", expected_goal_rev=1)

    assert "goal_rev is 2" in problem(stale, 409, "version_conflict")["detail"]
    assert row_counts() == before
    made = ok(prepare(client, run_id, fence, idempotency_key="call-1", expected_goal_rev=2), 201)
    assert (made["goal_rev"], made["idempotency_key"]) == (2, "call-1")


def test_prepare_under_a_policy_answers_201_awaiting_approval(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)
    client = agent_a.api()
    run_id, fence = leased(client)
    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "act"}
    ok(post(client, f"runs/{run_id}/checkpoints/", body), 201)  # the run is running
    data = ok(prepare(client, run_id, fence), 201)
    assert data["status"] == "awaiting_approval" and data["approval"]
    request = ApprovalRequest.objects.get(pk=data["approval"])
    assert request.status == ApprovalStatus.PENDING
    run = ok(get(client, f"runs/{run_id}/"))
    assert run["status"] == "waiting_approval"
    assert run["waiting_for"]["kind"] == "approval"
    assert run["waiting_for"]["action_id"] == data["action_id"]


def test_a_held_action_parks_a_run_leased_from_queued(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)
    client = agent_a.api()
    run_id, fence = leased(client)
    data = ok(prepare(client, run_id, fence), 201)
    assert data["status"] == "awaiting_approval"
    run = ok(get(client, f"runs/{run_id}/"))
    assert run["status"] == "waiting_approval"
    assert run["waiting_for"] is not None and run["waiting_for"]["kind"] == "approval"


def test_prepare_with_a_stale_fence_is_409(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    expire_lease(run_id)
    take_lease(client, run_id, owner="p2")
    before = row_counts()
    problem(prepare(client, run_id, fence), 409, "stale_fence")
    assert row_counts() == before


@pytest.mark.parametrize(
    ("tool", "params", "field"),
    [
        ("tasks.create", {"body": "no title"}, "params"),
        ("tasks.create", {"title": ""}, "title"),
        ("tasks.create", {"title": "t", "colour": "red"}, "params"),
        ("tasks.create", ["not", "an", "object"], "params"),
        ("no.such.tool", {"title": "t"}, "tool"),
    ],
    ids=["missing-required", "too-short", "extra-field", "not-an-object", "unknown-tool"],
)
def test_prepare_with_invalid_params_is_422(
    agent_a: Persona, tool: str, params: Any, field: str
) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    before = row_counts()
    data = problem(prepare(client, run_id, fence, tool, params), 422, "invalid_params")
    assert field in data["errors"], data
    assert row_counts() == before


def test_prepare_with_a_reused_idempotency_key(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    first = ok(prepare(client, run_id, fence, params={"title": "A"}, idempotency_key="k-1"), 201)
    assert first["idempotency_key"] == "k-1"
    again = ok(prepare(client, run_id, fence, params={"title": "A"}, idempotency_key="k-1"))
    assert again["action_id"] == first["action_id"]
    response = prepare(client, run_id, fence, params={"title": "B"}, idempotency_key="k-1")
    problem(response, 422, "idempotency_key_reused")
    assert Action.objects.filter(run_id=run_id).count() == 1
    assert Action.objects.get(pk=first["action_id"]).params == '{"title":"A"}'


def test_the_same_prepare_again_in_one_step_is_the_same_action(agent_a: Persona) -> None:
    """A retry of a prepare (its answer was lost) must not mint a second action: without an
    idempotency_key the key is the step visit's, and the same tool and params in the same
    visit are the same call. Other params are another call; a new checkpoint a new visit."""
    client = agent_a.api()
    run_id, fence = leased(client)
    first = ok(prepare(client, run_id, fence, params={"title": "A"}), 201)
    again = ok(prepare(client, run_id, fence, params={"title": "A"}))
    assert again["action_id"] == first["action_id"]
    other = ok(prepare(client, run_id, fence, params={"title": "B"}), 201)
    assert other["action_id"] != first["action_id"]
    assert other["idempotency_key"] != first["idempotency_key"]
    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "again"}
    ok(post(client, f"runs/{run_id}/checkpoints/", body), 201)
    later = ok(prepare(client, run_id, fence, params={"title": "A"}), 201)
    assert later["action_id"] not in (first["action_id"], other["action_id"])
    assert Action.objects.filter(run_id=run_id).count() == 3


def test_an_idempotency_key_of_another_run_is_422(agent_a: Persona) -> None:
    """The key names one request of one run: another run's action is never answered."""
    client = agent_a.api()
    run_id, fence = leased(client)
    ok(prepare(client, run_id, fence, idempotency_key="k-run"), 201)
    other_run, other_fence = leased(client)
    response = prepare(client, other_run, other_fence, idempotency_key="k-run")
    problem(response, 422, "idempotency_key_reused")
    assert not Action.objects.filter(run_id=other_run).exists()


def test_a_client_key_spelled_as_another_runs_step_key_is_refused(agent_a: Persona) -> None:
    """Keys are unique per tenant: a client key of another run spelled like this run's next
    call's key took it first, and this run's prepare was refused (409) for as long as the
    other action lived. Such a key is refused (actionkeys.reserved_key); the run keeps its own."""
    client = agent_a.api()
    run_id, fence = leased(client)
    other_run, other_fence = leased(client)
    spelled = f"{run_id}:1:api@0:1"  # what run_id's first call would be keyed
    before = row_counts()
    refused = prepare(client, other_run, other_fence, idempotency_key=spelled)
    assert "another run" in problem(refused, 422, "idempotency_key_reused")["detail"]
    assert row_counts() == before
    mine = ok(prepare(client, run_id, fence, params={"title": "mine"}), 201)
    assert mine["idempotency_key"] == spelled


# --- POST actions/{id}/dispatch/ --------------------------------------------------------------


def test_dispatch_answers_200_sent_and_outcome_200_confirmed(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    sent = ok(dispatch(client, action["action_id"], fence))
    assert sent["status"] == "sent" and sent["attempts"] == 1 and sent["sent_at"]
    done = ok(
        outcome(
            client, action["action_id"], fence, "confirmed", external_id="T-9", result={"id": 9}
        )
    )
    assert ACTION_FIELDS <= set(done)
    assert (done["status"], done["external_id"], done["result"]) == ("confirmed", "T-9", {"id": 9})


def test_dispatch_of_a_held_action_is_409_approval_required(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence), 201)
    problem(dispatch(client, action["action_id"], fence), 409, "approval_required")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.AWAITING_APPROVAL


def test_dispatch_after_the_approval_expired_is_409_approval_expired(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence), 201)
    approve(reviewer_a, action["approval"])
    ApprovalRequest.objects.filter(pk=action["approval"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    problem(dispatch(client, action["action_id"], fence), 409, "approval_expired")
    stored = Action.objects.get(pk=action["action_id"])
    assert stored.status == ActionStatus.AWAITING_APPROVAL  # held again, never sent
    assert ApprovalRequest.objects.get(pk=action["approval"]).status == ApprovalStatus.SUPERSEDED
    assert ApprovalRequest.objects.filter(action=stored, status=ApprovalStatus.PENDING).exists()


def test_dispatch_of_an_old_revisions_action_is_409_stale_goal_rev(agent_a: Persona) -> None:
    """Sent under goal_rev 1, revised to 2: sending it again is refused, and its late outcome
    is recorded on the action without moving the run."""
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    revised = ok(
        post(client, f"runs/{run_id}/revisions/", {"goal": {"steps": 1}, "expected_goal_rev": 1})
    )
    assert revised["goal_rev"] == 2
    problem(dispatch(client, action["action_id"], fence), 409, "stale_goal_rev")
    late = ok(outcome(client, action["action_id"], fence, "confirmed", external_id="T-1"))
    assert late["status"] == "confirmed" and late["goal_rev"] == 1
    assert JournalEntry.objects.filter(stream=f"run:{run_id}", type="late_result_ignored").exists()


@pytest.mark.parametrize("settled", ["confirmed", "manual_review", "cancelled"])
def test_an_old_revisions_outcome_is_refused_for_an_action_that_cannot_take_one(
    agent_a: Persona, settings: Any, settled: str
) -> None:
    """An outcome for an action of an older goal revision took a path of its own (kept on the
    action as a late result) that checked nothing of the action's status: a `failed` report
    for a confirmed action answered 200 and overwrote its result; a `confirmed` one settled an
    action that waits for a person (the run left in needs_reconciliation, its resolve then
    refused); a never-sent, cancelled action took a result. All are 409 invalid_transition,
    as for the current revision, and change nothing. Found by probing outcomes after a
    revision."""
    settings.HOLDPOINT_TASKS_DEDUP = "none" if settled == "manual_review" else "key"
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    if settled != "cancelled":
        ok(dispatch(client, action["action_id"], fence))
        verdict = "confirmed" if settled == "confirmed" else "unknown"
        body = {"external_id": "T-1", "result": {"id": "T-1"}}
        ok(outcome(client, action["action_id"], fence, verdict, **body))
    ok(post(client, f"runs/{run_id}/revisions/", {"goal": {"x": 1}, "expected_goal_rev": 1}))
    stored = Action.objects.get(pk=action["action_id"])
    assert stored.status == settled
    before = row_counts()

    for verdict, fields in (("failed", {"result": {"error": "no"}}), ("confirmed", {})):
        body = {"external_id": "T-2", "result": {"id": "T-2"}, **fields}
        response = outcome(client, action["action_id"], fence, verdict, **body)
        problem(response, 409, "invalid_transition")

    assert row_counts() == before
    after = Action.objects.get(pk=action["action_id"])
    assert (after.status, after.external_id, after.result) == (
        stored.status,
        stored.external_id,
        stored.result,
    )


@pytest.mark.parametrize("how", ["revision", "cancel"])
def test_dispatch_of_a_withdrawn_action_is_409_action_cancelled(agent_a: Persona, how: str) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence), 201)
    if how == "revision":
        ok(post(client, f"runs/{run_id}/revisions/", {"goal": {}, "expected_goal_rev": 1}))
    else:
        ok(post(client, f"runs/{run_id}/cancel/", {"reason": "stop"}))
    problem(dispatch(client, action["action_id"], fence), 409, "action_cancelled")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.CANCELLED


def test_dispatch_with_a_stale_fence_is_409(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence), 201)
    expire_lease(run_id)
    take_lease(client, run_id, owner="p2")
    problem(dispatch(client, action["action_id"], fence), 409, "stale_fence")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.PREPARED


@pytest.mark.parametrize(
    ("finish", "write"),
    [
        ("cancel", "prepare"),
        ("complete", "prepare"),
        ("cancel", "dispatch"),
        ("complete", "dispatch"),
    ],
)
def test_no_action_is_prepared_or_sent_on_a_finished_run(
    agent_a: Persona, finish: str, write: str
) -> None:
    """The lifecycle promises that after a cancel "an executor's next write is refused"."""
    client = agent_a.api()
    run_id, fence = leased(client)
    earlier = ok(prepare(client, run_id, fence), 201)
    if finish == "cancel":
        ok(post(client, f"runs/{run_id}/cancel/", {"reason": "stop"}))
    else:
        body = {
            "fence": fence,
            "expected_rev": 0,
            "state": {},
            "next_step": "",
            "status": "completed",
        }
        ok(post(client, f"runs/{run_id}/checkpoints/", body), 201)
    before = row_counts()
    if write == "prepare":
        response = prepare(client, run_id, fence, params={"title": "after the end"})
        codes = ("run_finished", "stale_fence", "invalid_transition")
    else:
        response = dispatch(client, earlier["action_id"], fence)
        codes = ("run_finished", "action_cancelled", "stale_fence", "invalid_transition")
    assert response.status_code == 409, response.content[:300]
    assert response.json()["code"] in codes
    assert row_counts() == before
    assert not Action.objects.filter(run_id=run_id, status=ActionStatus.SENT).exists()


# --- POST actions/{id}/outcome/ ---------------------------------------------------------------


@pytest.mark.parametrize("result", ["failed", "unknown"])
def test_outcome_failed_or_unknown_answers_200(agent_a: Persona, result: str) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    data = ok(outcome(client, action["action_id"], fence, result, result={"error": "timeout"}))
    assert data["status"] == result and data["external_id"] == ""


def test_outcome_with_a_stale_fence_is_409(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    expire_lease(run_id)
    take_lease(client, run_id, owner="p2")
    response = outcome(client, action["action_id"], fence, "confirmed", external_id="T-1")
    problem(response, 409, "stale_fence")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.SENT


def test_outcome_of_an_action_never_sent_is_409_invalid_transition(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    response = outcome(client, action["action_id"], fence, "confirmed", external_id="T-1")
    problem(response, 409, "invalid_transition")
    ok(dispatch(client, action["action_id"], fence))
    ok(outcome(client, action["action_id"], fence, "failed"))
    again = outcome(client, action["action_id"], fence, "confirmed", external_id="T-1")
    problem(again, 409, "invalid_transition")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.FAILED


def entries(run_id: str) -> int:
    return JournalEntry.objects.filter(stream=f"run:{run_id}").count()


@pytest.mark.parametrize(
    ("verdict", "fields"),
    [("confirmed", {"external_id": "T-1"}), ("failed", {}), ("unknown", {})],
)
def test_a_repeated_outcome_answers_200_with_the_action_and_changes_nothing(
    agent_a: Persona, verdict: str, fields: dict[str, Any]
) -> None:
    """The executor's outcome landed and its answer was lost; it reports the same again.
    That was 409 invalid_transition (an `unknown` even counted twice), so a client could not
    tell "mine landed" from "someone else moved the action". Now the same report — the
    same fence, the same outcome and, for `confirmed`, the same external id — answers 200
    with the action, as a repeated decision or release does, and nothing is written."""
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    first = ok(outcome(client, action["action_id"], fence, verdict, result={"n": 1}, **fields))
    written, attempts = entries(run_id), Action.objects.get(pk=first["action_id"]).attempts
    counted = Action.objects.get(pk=first["action_id"]).reconcile_attempts

    again = ok(outcome(client, action["action_id"], fence, verdict, result={"n": 1}, **fields))

    assert again == first
    assert entries(run_id) == written
    stored = Action.objects.get(pk=action["action_id"])
    assert (stored.status, stored.attempts, stored.reconcile_attempts) == (
        verdict,
        attempts,
        counted,
    )


def test_an_outcome_other_than_the_one_that_applied_stays_409(agent_a: Persona) -> None:
    """Only the same report is answered again: another external id, another outcome word,
    or the report under a fence that lost the lease is refused as before."""
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    ok(outcome(client, action["action_id"], fence, "confirmed", external_id="T-1"))

    other_id = outcome(client, action["action_id"], fence, "confirmed", external_id="T-2")
    problem(other_id, 409, "invalid_transition")
    problem(outcome(client, action["action_id"], fence, "failed"), 409, "invalid_transition")
    problem(outcome(client, action["action_id"], fence, "unknown"), 409, "invalid_transition")
    expire_lease(run_id)
    take_lease(client, run_id, owner="p2")
    stale = outcome(client, action["action_id"], fence, "confirmed", external_id="T-1")
    problem(stale, 409, "stale_fence")
    stored = Action.objects.get(pk=action["action_id"])
    assert (stored.status, stored.external_id) == (ActionStatus.CONFIRMED, "T-1")


def test_a_repeated_unknown_after_a_person_settled_it_undoes_nothing(
    agent_a: Persona, reviewer_a: Persona, settings: Any
) -> None:
    """An `unknown` of a tool that can neither deduplicate nor be looked up goes to a person
    at once; the person says "not applied" (the action is `prepared`, to be sent again with
    its key). The executor's repeat of its `unknown` — its answer was lost — arrives only
    now: it answers 200 with the action as the person left it, moves nothing back and
    journals nothing."""
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    first = ok(outcome(client, action["action_id"], fence, "unknown"))
    assert first["status"] == "manual_review"
    Action.objects.filter(pk=action["action_id"]).update(
        in_flight_until=timezone.now() - timedelta(seconds=1)
    )
    alice = session(reviewer_a.user)
    body = {"outcome": "not_applied", "note": "not in the tracker"}
    ok(post(alice, f"actions/{action['action_id']}/resolve/", body))
    written = entries(run_id)

    again = ok(outcome(client, action["action_id"], fence, "unknown"))

    assert again["status"] == "prepared" and entries(run_id) == written
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.PREPARED
    assert ok(dispatch(client, action["action_id"], fence))["status"] == "sent"


def test_confirmed_without_an_external_id_is_refused(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    data = problem(outcome(client, action["action_id"], fence, "confirmed"), 422, "invalid_params")
    assert "external_id" in data["errors"]
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.SENT


# --- GET actions/ ------------------------------------------------------------------------------


def test_actions_by_idempotency_key(agent_a: Persona, agent_b: Persona) -> None:
    client = agent_a.api()
    run_id, fence = leased(client)
    mine = ok(prepare(client, run_id, fence, idempotency_key="order-7"), 201)
    ok(prepare(client, run_id, fence, params={"title": "other"}), 201)
    b_client = agent_b.api()
    b_run, b_fence = leased(b_client)
    ok(prepare(b_client, b_run, b_fence, idempotency_key="order-7"), 201)
    page = ok(get(client, "actions/?idempotency_key=order-7"))
    assert set(page) >= {"next", "previous", "results"}
    assert [a["action_id"] for a in page["results"]] == [mine["action_id"]]
    assert ok(get(client, "actions/?idempotency_key=nope"))["results"] == []
    assert len(ok(get(client, "actions/"))["results"]) == 2


# --- B1 / B5 on PostgreSQL ------------------------------------------------------------------


def _race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls at once from threads, each on its own connection."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def go(index: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[index] = calls[index]()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("k", [2, 8])
def test_lease_race_gives_exactly_one_fence(agent_a: Persona, k: int) -> None:
    """B1: k clients lease the same run at once: one 200 with fence + 1, the rest lease_held."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    rounds = 10
    run = new_run(agent_a.api())
    last_fence = 0
    for round_ in range(rounds):
        calls = [
            (
                lambda owner=f"p{round_}-{i}": post(
                    agent_a.api(),
                    f"runs/{run['run_id']}/lease/",
                    {"owner": owner, "ttl_seconds": 30},
                )
            )
            for i in range(k)
        ]
        responses = _race(calls)
        won = [r for r in responses if r.status_code == 200]
        lost = [r for r in responses if r.status_code != 200]
        assert len(won) == 1, [r.status_code for r in responses]
        for response in lost:
            problem(response, 409, "lease_held")
        fence = won[0].json()["fence"]
        assert fence == last_fence + 1
        last_fence = fence
        expire_lease(run["run_id"])
    assert Run.objects.get(pk=run["run_id"]).fence == rounds


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_revision_racing_dispatch_never_sends_under_an_old_rev(agent_a: Persona) -> None:
    """B5: either the dispatch committed before the bump (its `sent` entry precedes the
    revision in the journal), or it was refused; never `sent` after the bump under rev 1.

    Every call of every round answers as API.md says — the revision 200 (it is the only
    writer of the goal), the dispatch 200 or 409 — so a deadlock answered 500 (or 503), or a
    thread that never answered, fails the test rather than passing as "refused".
    """
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    outcomes: Counter[str] = Counter()
    for _ in range(ROUNDS):
        client = agent_a.api()
        run_id, fence = leased(client)
        action = ok(prepare(client, run_id, fence), 201)
        action_id, url = action["action_id"], f"runs/{run_id}/revisions/"
        sent, revised = _race(
            [
                lambda a=action_id, f=fence: dispatch(agent_a.api(), a, f),
                lambda u=url: post(
                    agent_a.api(), u, {"goal": {"steps": 9}, "expected_goal_rev": 1}
                ),
            ]
        )
        assert sent is not None and revised is not None, "a racer never answered"
        assert revised.status_code == 200, (revised.status_code, revised.content[:300])
        assert sent.status_code in (200, 409), (sent.status_code, sent.content[:300])
        stored = Action.objects.get(pk=action["action_id"])
        entries = JournalEntry.objects.filter(stream=f"run:{run_id}")
        bump = entries.filter(type="goal_revised").first()
        mark = entries.filter(type="action_outcome", payload__action_status="sent").first()
        assert (revised.status_code == 200) == (bump is not None)
        assert (sent.status_code == 200) == (mark is not None)
        if mark is not None and bump is not None:
            assert mark.seq < bump.seq  # the dispatch committed before the bump
        if bump is not None:
            assert stored.status in (ActionStatus.SENT, ActionStatus.CANCELLED)
            assert stored.status != ActionStatus.SENT or mark.seq < bump.seq
        if sent.status_code == 409:
            assert sent.json()["code"] in ("stale_goal_rev", "action_cancelled")
        outcomes[f"dispatch {sent.status_code} / revision {revised.status_code}"] += 1
    print(f"\nB5 outcomes over {ROUNDS} races: {dict(outcomes)}")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("keyed", [False, True], ids=["step-key", "client-key"])
def test_concurrent_prepares_of_one_step_get_one_action(agent_a: Persona, keyed: bool) -> None:
    """Two prepares of the same call of one step at once, each on its own connection: both
    answer the same action, or the second a clean 409 version_conflict — never a second
    action, never idempotency_key_reused for what is the same request."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    outcomes: Counter[str] = Counter()
    for round_ in range(10):
        client = agent_a.api()
        run_id, fence = leased(client)
        fields = {"idempotency_key": f"race-{round_}"} if keyed else {}

        def same_prepare(r: str = run_id, f: int = fence, k: dict = fields) -> Any:
            return prepare(agent_a.api(), r, f, params={"title": "A"}, **k)

        first, second = _race([same_prepare, same_prepare])
        answered = [r for r in (first, second) if r.status_code in (200, 201)]
        for response in (first, second):
            if response.status_code not in (200, 201):
                problem(response, 409, "version_conflict")
        assert answered, (first.content[:300], second.content[:300])
        assert len({r.json()["action_id"] for r in answered}) == 1
        assert sorted(r.status_code for r in answered)[-1] == 201
        assert Action.objects.filter(run_id=run_id).count() == 1
        outcomes[f"{first.status_code}/{second.status_code}"] += 1
    print(f"\nconcurrent prepares ({'client' if keyed else 'step'} key): {dict(outcomes)}")


ROUNDS = 20


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_revision_and_dispatch_interleaved_answer_no_5xx(agent_a: Persona) -> None:
    """B5, one interleaving forced with a third connection's row lock: the dispatch waits for
    the action row first, the revision then takes the run row and waits for the action row.
    Correct: one of them goes first; neither answers 5xx."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence), 201)
    locked, release = threading.Event(), threading.Event()

    def hold_action_row() -> None:
        try:
            with transaction.atomic():
                Action.objects.select_for_update().get(pk=action["action_id"])
                locked.set()
                release.wait(timeout=30)
        finally:
            connections.close_all()

    results: dict[str, Any] = {}

    def call(name: str, do: Callable[[], Any]) -> threading.Thread:
        def go() -> None:
            try:
                results[name] = do()
            finally:
                connections.close_all()

        thread = threading.Thread(target=go)
        thread.start()
        return thread

    holder = threading.Thread(target=hold_action_row)
    holder.start()
    assert locked.wait(timeout=10)
    sender = call("dispatch", lambda: dispatch(agent_a.api(), action["action_id"], fence))
    _wait_for_lock_waiters(1)
    reviser = call(
        "revision",
        lambda: post(
            agent_a.api(), f"runs/{run_id}/revisions/", {"goal": {}, "expected_goal_rev": 1}
        ),
    )
    _wait_for_lock_waiters(2)
    release.set()
    for thread in (holder, sender, reviser):
        thread.join(timeout=60)
    statuses = {name: response.status_code for name, response in results.items()}
    assert statuses["dispatch"] in (200, 409) and statuses["revision"] == 200, statuses
    stored = Action.objects.get(pk=action["action_id"])
    assert stored.status == (
        ActionStatus.SENT if statuses["dispatch"] == 200 else ActionStatus.CANCELLED
    )


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


def test_a_held_action_after_a_goal_revision_parks_the_run(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """A goal revision wakes a run parked for an approval (`queued`, the executor keeps its
    lease); the executor's next held action left it `queued` with `waiting_for` null, as if
    nothing waited for a reviewer — a worker's run parks in `waiting_approval` (DESIGN.md,
    API.md `waiting_for`). Found reviewing the protocol's park."""
    grant_policy(agent_a.tenant)
    client = agent_a.api()
    run_id, fence = leased(client)
    first = ok(prepare(client, run_id, fence), 201)
    assert ok(get(client, f"runs/{run_id}/"))["status"] == "waiting_approval"
    revised = ok(post(client, f"runs/{run_id}/revisions/", {"goal": {}, "expected_goal_rev": 1}))
    assert revised["status"] == "queued" and revised["lease"]["fence"] == fence

    second = ok(prepare(client, run_id, fence, params={"title": "the new goal's"}), 201)
    assert second["status"] == "awaiting_approval" and second["action_id"] != first["action_id"]
    run = ok(get(client, f"runs/{run_id}/"))
    assert run["status"] == "waiting_approval"
    assert run["waiting_for"]["kind"] == "approval"
    assert run["waiting_for"]["action_id"] == second["action_id"]

    approve(reviewer_a, second["approval"])
    assert ok(dispatch(client, second["action_id"], fence))["status"] == "sent"
    assert ok(get(client, f"runs/{run_id}/"))["status"] == "running"


@pytest.mark.parametrize(
    ("mode", "verdict", "settled", "run_status"),
    [
        ("key", "failed", "failed", "running"),
        ("none", "failed", "failed", "running"),
        ("none", "unknown", "manual_review", "needs_reconciliation"),
        ("key", "unknown", "manual_review", "needs_reconciliation"),
        ("lookup", "unknown", "unknown", "running"),
        ("lookup", "not_found", "cancelled", "running"),
    ],
)
def test_an_old_revisions_outcome_settles_its_sent_action(
    agent_a: Persona, settings: Any, mode: str, verdict: str, settled: str, run_status: str
) -> None:
    """A late outcome (its action prepared under an older goal revision) was only kept as the
    action's result: a `failed` left the action `sent` (to be reconciled, or sent to a person,
    though the service had said no); an `unknown` of a tool with neither key nor lookup left
    it `sent` instead of going to a person with the run `needs_reconciliation` (API.md);
    a lookup's `not_found` left it `sent` for ever. Now the outcome settles the action as for
    the current revision — a proved absence withdraws it, since no step sends it again — and
    the run, parked for nothing, does not advance. An `unknown` of a key tool goes to a
    person too: its replay would be a send of the old revision's action; a lookup tool's
    stays `unknown` for a lookup (which sends nothing)."""
    settings.HOLDPOINT_TASKS_DEDUP = mode
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    ok(dispatch(client, action["action_id"], fence))
    ok(post(client, f"runs/{run_id}/revisions/", {"goal": {"x": 1}, "expected_goal_rev": 1}))
    if verdict == "not_found":
        too_soon = outcome(client, action["action_id"], fence, verdict)
        problem(too_soon, 409, "invalid_transition")  # its sender may still be in flight
        Action.objects.filter(pk=action["action_id"]).update(
            in_flight_until=timezone.now() - timedelta(seconds=1)
        )
    run_before = ok(get(client, f"runs/{run_id}/"))

    late = ok(outcome(client, action["action_id"], fence, verdict, result={"error": "no"}))

    assert (late["status"], late["goal_rev"]) == (settled, 1)
    run = ok(get(client, f"runs/{run_id}/"))
    assert run["status"] == run_status
    assert (run["goal_rev"], run["checkpoint_rev"]) == (2, run_before["checkpoint_rev"])
    if settled == "manual_review":
        assert run["waiting_for"]["action_id"] == action["action_id"]
    late_entries = JournalEntry.objects.filter(stream=f"run:{run_id}", type="late_result_ignored")
    assert [e.payload["outcome"] for e in late_entries] == [verdict]


@pytest.mark.parametrize("held", ["awaiting_approval", "cancelled", "old_revision"])
@pytest.mark.parametrize("lost", ["takeover", "release"])
def test_a_stale_holders_dispatch_learns_it_lost_the_lease_first(
    agent_a: Persona, reviewer_a: Persona, held: str, lost: str
) -> None:
    """A holder whose lease was taken over (or that gave it up) is told `stale_fence` on
    dispatch, whatever else is wrong with the action: before, a held action answered
    `approval_required` (checked before the fence), a withdrawn one `action_cancelled`, an
    old revision's `stale_goal_rev` — a stale executor was told to wait for a reviewer or
    carry on, instead of to stop (README: a released holder's dispatch is 409 stale_fence)."""
    if held == "awaiting_approval":
        grant_policy(agent_a.tenant)
    client = agent_a.api()
    run_id, fence = leased(client)
    action = ok(prepare(client, run_id, fence), 201)
    if held == "cancelled":
        ok(post(client, f"runs/{run_id}/revisions/", {"goal": {}, "expected_goal_rev": 1}))
    elif held == "old_revision":
        Action.objects.filter(pk=action["action_id"]).update(goal_rev=0)
    if lost == "takeover":
        expire_lease(run_id)
        take_lease(client, run_id, owner="p2")
    else:
        ok(post(client, f"runs/{run_id}/lease/release/", {"fence": fence}))
    before = row_counts()
    problem(dispatch(client, action["action_id"], fence), 409, "stale_fence")
    assert Action.objects.get(pk=action["action_id"]).status != ActionStatus.SENT
    stale = row_counts()
    assert {k: v for k, v in stale.items() if k != "JournalEntry"} == {
        k: v for k, v in before.items() if k != "JournalEntry"
    }
