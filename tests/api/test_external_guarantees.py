"""External executors get exactly what a worker gets, and no more (issue 16 H1, issue 15.3).

H1: an API client may not execute a run Holdpoint's workers execute — not by leasing it, nor
by writing under the fence any run object shows — nor an external run that is not its own;
leases are capped; what came back from a request Holdpoint sends itself is never an API
client's to report. 15.3: the server applies each tool's dedup contract to what an external
executor reports and says on the action what happens next (`reconcile`); `none` goes to a
person at once; a lost executor is flagged by the sweeper and a new lease takes the run back.

The tracker is the real sandbox process; the executor here is the test, over the API.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.db.models import F
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest
from audit.models import JournalEntry
from runtime import tooldefs
from runtime.errors import InvalidParams
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Role, Run, RunStatus
from runtime.protocol import name_executor
from runtime.sweeper import sweep_once
from runtime.tools import get_tool
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
from tests.conftest import Persona, make_persona
from tests.runtime.helpers import expire_lease
from tests.sandbox import Sandbox

CLIENT = "agent.tasks.create"  # performed by the agent itself (executor `client`)
GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
Factory = Callable[[str], Sandbox]


def dispatch(client: APIClient, action_id: str, fence: int) -> Any:
    return post(client, f"actions/{action_id}/dispatch/", {"fence": fence})


def outcome(client: APIClient, action_id: str, fence: int, verdict: str, **fields: Any) -> Any:
    return post(
        client, f"actions/{action_id}/outcome/", {"fence": fence, "outcome": verdict, **fields}
    )


def perform(box: Sandbox, action: dict[str, Any], fence: int) -> dict[str, Any]:
    """What an external executor does after `sent`: call the tracker itself, with the key."""
    response = httpx.post(
        box.url + "/tasks",
        content=json.dumps(action["params"], sort_keys=True, separators=(",", ":")),
        headers={
            "Content-Type": "application/json",
            "Idempotency-Key": action["idempotency_key"],
            "Holdpoint-Run": action["run_id"],
            "Holdpoint-Fence": str(fence),
        },
        timeout=10,
    )
    assert response.status_code in (200, 201), response.text
    return dict(response.json())


def sent(client: APIClient, run_id: str, fence: int, tool: str = CLIENT) -> dict[str, Any]:
    action = ok(prepare(client, run_id, fence, tool=tool), 201)
    return dict(ok(dispatch(client, action["action_id"], fence)))


# --- H1: who may execute --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_h1_an_agent_cannot_forge_a_hosted_runs_completion(
    agent_a: Persona, reviewer_a: Persona, sandbox_factory: Factory
) -> None:
    """H1's reproduction: a person starts a hosted run, a worker brings it to its hold point.
    The tenant's agent token tries to lease it, then to write under the fence the run shows
    — every call is refused, and after the approval the worker's own send is what the
    tracker and the ledger both record."""
    box = sandbox_factory("key")
    grant_policy(agent_a.tenant, tool="tasks.create")
    run = create_run(agent_a.tenant, "api-review", GOAL, actor="user:alice")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.AWAITING_APPROVAL
    agent = agent_a.api()
    before = row_counts()

    lease = post(agent, f"runs/{run.run_id}/lease/", {"owner": "forger", "ttl_seconds": 3600})
    problem(lease, 409, "not_external")
    fence = ok(get(agent, f"runs/{run.run_id}/"))["lease"]["fence"]  # visible to every reader
    forged = [
        dispatch(agent, str(action.action_id), fence),
        outcome(agent, str(action.action_id), fence, "confirmed", external_id="FAKE-TASK-1"),
        post(
            agent,
            f"runs/{run.run_id}/checkpoints/",
            {
                "fence": fence,
                "expected_rev": 1,
                "state": {},
                "next_step": "",
                "status": "completed",
            },
        ),
        prepare(agent, str(run.run_id), fence),
        post(agent, f"runs/{run.run_id}/lease/heartbeat/", {"fence": fence}),
        post(agent, f"runs/{run.run_id}/lease/release/", {"fence": fence}),
    ]
    for response in forged:
        problem(response, 409, "not_external")
    assert row_counts() == before  # nothing written, not even a lease entry

    # A person approves (not the one who started it); the worker sends it itself.
    carol = session(make_persona(agent_a.tenant, "carol", Role.REVIEWER).user)
    request = ApprovalRequest.objects.get(action=action)
    shown = ok(get(carol, f"approvals/{request.pk}/"))
    body = {"decision": "approve", "action_hash": shown["action_hash"], "reason": "ok"}
    ok(post(carol, f"approvals/{shown['id']}/decision/", body))
    assert advance_run(run.run_id, "w1").outcome == "completed"
    (task,) = box.tasks()
    action.refresh_from_db()
    assert (action.status, action.external_id) == (ActionStatus.CONFIRMED, task["id"])
    assert not Action.objects.filter(external_id="FAKE-TASK-1").exists()


def test_h1_a_reviewers_browser_session_cannot_execute(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """A person's session is refused on a hosted run (not external) and on an external one
    (not its executor account): people decide and resolve, agents execute."""
    hosted = create_run(agent_a.tenant, "chain", {"steps": 2}, actor="user:alice")
    external = new_run(agent_a.api())
    alice = session(reviewer_a.user)
    before = row_counts()

    problem(
        post(alice, f"runs/{hosted.run_id}/lease/", {"owner": "alice", "ttl_seconds": 60}),
        409,
        "not_external",
    )
    problem(
        post(alice, f"runs/{external['run_id']}/lease/", {"owner": "alice", "ttl_seconds": 60}),
        403,
        "not_permitted",
    )
    assert row_counts() == before
    assert Run.objects.get(pk=external["run_id"]).fence == 0


def test_h1_only_the_runs_executor_account_executes_it(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """Another agent of the same tenant is refused at the lease and under the fence; the
    account a tenant admin names instead may take it."""
    other = make_persona(agent_a.tenant, "agent-a2", Role.AGENT)
    mine = agent_a.api()
    run_id = new_run(mine)["run_id"]
    assert Run.objects.get(pk=run_id).executor_account == agent_a.user
    fence = take_lease(mine, run_id)
    action = ok(prepare(mine, run_id, fence, tool=CLIENT), 201)
    theirs = other.api()

    problem(
        post(theirs, f"runs/{run_id}/lease/", {"owner": "x", "ttl_seconds": 60}),
        403,
        "not_permitted",
    )
    problem(dispatch(theirs, action["action_id"], fence), 403, "not_permitted")
    problem(prepare(theirs, run_id, fence, tool=CLIENT, idempotency_key="k2"), 403, "not_permitted")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.PREPARED

    with pytest.raises(InvalidParams):  # a person is never named
        name_executor(Run.objects.get(pk=run_id), reviewer_a.user, actor="user:ada")
    name_executor(Run.objects.get(pk=run_id), other.user, actor="user:ada")  # the admin's act
    assert JournalEntry.objects.filter(stream=f"run:{run_id}", type="executor_named").exists()
    expire_lease(run_id)
    assert take_lease(theirs, run_id) == fence + 1
    problem(
        post(mine, f"runs/{run_id}/lease/", {"owner": "x", "ttl_seconds": 60}),
        403,
        "not_permitted",
    )


def test_h1_the_lease_ttl_is_capped(agent_a: Persona, settings: Any) -> None:
    settings.HOLDPOINT_MAX_LEASE_TTL = 300
    client = agent_a.api()
    run_id = new_run(client)["run_id"]

    refused = post(client, f"runs/{run_id}/lease/", {"owner": "p", "ttl_seconds": 3600})
    assert "ttl_seconds" in problem(refused, 422, "invalid_params")["errors"]
    assert Run.objects.get(pk=run_id).fence == 0
    fence = take_lease(client, run_id, ttl=300)
    beat = post(client, f"runs/{run_id}/lease/heartbeat/", {"fence": fence, "ttl_seconds": 301})
    problem(beat, 422, "invalid_params")
    stored = Run.objects.get(pk=run_id)
    assert stored.lease_expires_at <= timezone.now() + timedelta(seconds=301)


@pytest.mark.django_db(transaction=True)
def test_h1_an_outcome_for_a_tool_holdpoint_sends_is_refused_from_any_api_client(
    agent_a: Persona, reviewer_a: Persona, sandbox_factory: Factory
) -> None:
    """tasks.create is sent by Holdpoint (executor http): the dispatch of the agent's own
    external run sends it and records the tracker's answer; neither the agent's token nor a
    reviewer's session may then say another one."""
    box = sandbox_factory("key")
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence, tool="tasks.create")
    [task] = box.tasks()
    assert (action["status"], action["external_id"]) == ("confirmed", task["id"])

    for caller in (client, session(reviewer_a.user)):
        for said in ("confirmed", "failed", "unknown"):
            response = outcome(caller, action["action_id"], fence, said, external_id="FAKE-1")
            problem(response, 403, "not_permitted")

    stored = Action.objects.get(pk=action["action_id"])
    assert (stored.status, stored.external_id) == (ActionStatus.CONFIRMED, task["id"])
    assert len(box.tasks()) == 1  # the tracker and the ledger agree: one task, its id


def test_a_client_tools_outcome_names_the_reporting_executor(agent_a: Persona) -> None:
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, owner="laptop-7")
    action = sent(client, run_id, fence)

    ok(outcome(client, action["action_id"], fence, "confirmed", external_id="T-1"))

    entry = JournalEntry.objects.filter(stream=f"run:{run_id}", type="action_outcome").latest("seq")
    assert entry.payload["action_status"] == "confirmed"
    assert (entry.payload["reported_by"], entry.payload["executor_owner"]) == (
        "agent:agent-a",
        "laptop-7",
    )
    assert entry.actor == f"agent:agent-a#{fence}"


# --- 15.3: the server applies the tool's dedup contract ------------------------------------


@pytest.mark.django_db(transaction=True)
def test_mode_none_an_unknown_outcome_goes_to_a_person_at_once_and_the_run_continues(
    agent_a: Persona, reviewer_a: Persona, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("none")
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence)
    assert action["reconcile"] == {"how": "manual_review"}
    task = perform(box, action, fence)  # applied; the reply is lost to the executor

    held = ok(outcome(client, action["action_id"], fence, "unknown", result={"error": "reset"}))

    assert (held["status"], held["reconcile"]) == ("manual_review", {"how": "manual_review"})
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.NEEDS_RECONCILIATION
    assert run.waiting_for["action_id"] == action["action_id"]
    alice = session(reviewer_a.user)
    listed = alice.get("/reconcile/")
    assert listed.status_code == 200 and action["idempotency_key"] in listed.content.decode()
    # The executor may not settle it itself any more; a person does.
    problem(
        outcome(client, action["action_id"], fence, "confirmed", external_id=task["id"]),
        409,
        "invalid_transition",
    )
    resolved = ok(
        post(
            alice,
            f"actions/{action['action_id']}/resolve/",
            {"outcome": "applied", "external_id": task["id"], "note": "in the tracker"},
        )
    )
    assert resolved["status"] == "confirmed" and resolved["reconcile"] is None
    assert Run.objects.get(pk=run_id).status == RunStatus.QUEUED
    done = {"fence": fence, "expected_rev": 0, "state": {"task": task["id"]}, "next_step": ""}
    ok(post(client, f"runs/{run_id}/checkpoints/", {**done, "status": "completed"}), 201)
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED
    assert box.tasks() == [task]


@pytest.mark.django_db(transaction=True)
def test_mode_none_resolved_on_the_reconcile_page(
    agent_a: Persona, reviewer_a: Persona, sandbox_factory: Factory
) -> None:
    """Not applied, on the page: the action is prepared again and the executor sends it with
    the same key; one task in the tracker."""
    box = sandbox_factory("none")
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence)
    ok(outcome(client, action["action_id"], fence, "unknown"))  # it never reached the tracker
    Action.objects.filter(pk=action["action_id"]).update(
        in_flight_until=timezone.now() - timedelta(seconds=1)  # the sender can no longer land
    )

    page = session(reviewer_a.user).post(
        f"/reconcile/{action['action_id']}/resolve/", {"outcome": "not_applied", "note": "absent"}
    )

    assert page.status_code == 302
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.PREPARED
    again = ok(dispatch(client, action["action_id"], fence))
    task = perform(box, again, fence)
    ok(outcome(client, action["action_id"], fence, "confirmed", external_id=task["id"]))
    assert box.tasks() == [task]
    assert Run.objects.get(pk=run_id).status == RunStatus.RUNNING


def test_mode_key_reconcile_says_replay_with_the_same_key(agent_a: Persona, settings: Any) -> None:
    settings.HOLDPOINT_TASKS_DEDUP = "key"
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence)

    unknown = ok(outcome(client, action["action_id"], fence, "unknown"))

    assert (unknown["status"], unknown["reconcile"]) == ("unknown", {"how": "replay_same_key"})
    problem(outcome(client, action["action_id"], fence, "not_found"), 409, "invalid_transition")
    again = ok(dispatch(client, action["action_id"], fence))  # allowed: the same key
    assert (again["status"], again["attempts"]) == ("sent", 2)
    assert again["idempotency_key"] == action["idempotency_key"]
    done = ok(outcome(client, action["action_id"], fence, "confirmed", external_id="T-1"))
    assert done["status"] == "confirmed"
    problem(dispatch(client, action["action_id"], fence), 409, "invalid_transition")


def test_mode_lookup_not_found_is_accepted_only_after_the_in_flight_grace(
    agent_a: Persona, settings: Any
) -> None:
    settings.HOLDPOINT_TASKS_DEDUP = "lookup"
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence)
    assert action["reconcile"]["how"] == "lookup" and action["reconcile"]["not_found_after"]

    problem(dispatch(client, action["action_id"], fence), 409, "invalid_transition")  # look up
    early = outcome(client, action["action_id"], fence, "not_found")

    problem(early, 409, "invalid_transition")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.SENT
    Action.objects.filter(pk=action["action_id"]).update(
        in_flight_until=timezone.now() - timedelta(seconds=1)
    )
    absent = ok(outcome(client, action["action_id"], fence, "not_found"))
    assert absent["status"] == "prepared" and absent["idempotency_key"] == action["idempotency_key"]
    assert ok(dispatch(client, action["action_id"], fence))["attempts"] == 2


def key_tool_sent(agent: Persona, settings: Any) -> tuple[APIClient, str, int, dict[str, Any]]:
    """An external run leased by `agent` with one action of a mode-`key` tool `sent`."""
    settings.HOLDPOINT_TASKS_DEDUP = "key"
    client = agent.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    return client, run_id, fence, sent(client, run_id, fence)


def test_mode_key_an_unknown_action_of_a_revised_goal_goes_to_a_person_not_stuck(
    agent_a: Persona, settings: Any
) -> None:
    """An `unknown` action of a tool reconciled by `replay_same_key`, then the goal revised:
    a replay would send the old goal's action after the revision, so the dispatch is refused
    (stale_goal_rev) — and the action stayed `unknown` for ever, its `reconcile` still saying
    "replay_same_key", with nobody ever told. A worker's reconciler hands it to a person
    (runtime.dispatch._revised_since); an external executor's run gets the same."""
    client, run_id, fence, action = key_tool_sent(agent_a, settings)
    ok(outcome(client, action["action_id"], fence, "unknown"))
    ok(post(client, f"runs/{run_id}/revisions/", {"goal": {"v": 2}, "expected_goal_rev": 1}))

    shown = ok(get(client, f"actions/{action['action_id']}/"))
    assert shown["reconcile"] == {"how": "manual_review"}  # what happens next, truthfully
    problem(dispatch(client, action["action_id"], fence), 409, "stale_goal_rev")

    stored = Action.objects.get(pk=action["action_id"])
    assert stored.status == ActionStatus.MANUAL_REVIEW and stored.attempts == 1  # not resent
    assert "revision" in stored.last_error
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.waiting_for["action_id"]) == (
        RunStatus.NEEDS_RECONCILIATION,
        action["action_id"],
    )


def test_a_takeover_hands_a_sent_action_of_a_revised_goal_to_a_person(
    agent_a: Persona, settings: Any
) -> None:
    """The executor died with an action `sent` (mode key), and the goal was revised: its
    successor keys its calls under the new revision, so nothing would ever look at the old
    action again — `sent` for ever, though its effect may have happened. The new lease hands
    it to a person, as a worker's recovery does."""
    client, run_id, fence, old = key_tool_sent(agent_a, settings)  # ...and it died
    ok(post(client, f"runs/{run_id}/revisions/", {"goal": {"v": 2}, "expected_goal_rev": 1}))
    expire_lease(run_id)

    successor = take_lease(client, run_id, owner="agent-2")

    stored = Action.objects.get(pk=old["action_id"])
    assert stored.status == ActionStatus.MANUAL_REVIEW and "revision" in stored.last_error
    assert Run.objects.get(pk=run_id).status == RunStatus.NEEDS_RECONCILIATION
    shown = ok(get(client, f"actions/{old['action_id']}/"))
    assert shown["reconcile"] == {"how": "manual_review"}
    # The successor's own work under the new goal goes on meanwhile.
    new = ok(prepare(client, run_id, successor, tool=CLIENT, params={"title": "v2"}), 201)
    assert ok(dispatch(client, new["action_id"], successor))["status"] == "sent"


def test_a_takeover_keeps_a_sent_action_of_the_current_goal_for_a_replay(
    agent_a: Persona, settings: Any
) -> None:
    client, run_id, fence, action = key_tool_sent(agent_a, settings)
    expire_lease(run_id)

    successor = take_lease(client, run_id, owner="agent-2")

    shown = ok(get(client, f"actions/{action['action_id']}/"))
    assert (shown["status"], shown["reconcile"]) == ("sent", {"how": "replay_same_key"})
    assert ok(dispatch(client, action["action_id"], successor))["attempts"] == 2


def test_a_takeover_hands_a_sent_action_of_a_none_tool_to_a_person(
    agent_a: Persona, settings: Any
) -> None:
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence)  # ...and the executor died
    expire_lease(run_id)

    successor = take_lease(client, run_id, owner="agent-2")

    stored = Action.objects.get(pk=action["action_id"])
    assert stored.status == ActionStatus.MANUAL_REVIEW and "executor changed" in stored.last_error
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.fence) == (RunStatus.NEEDS_RECONCILIATION, successor)
    shown = ok(get(client, f"actions/{action['action_id']}/"))
    assert shown["reconcile"] == {"how": "manual_review"}


def test_a_lost_executor_is_flagged_by_the_sweeper_and_a_new_lease_takes_the_run_back(
    agent_a: Persona, settings: Any
) -> None:
    settings.HOLDPOINT_EXECUTOR_GRACE = 10
    client = agent_a.api()
    lost_id = new_run(client)["run_id"]
    fence = take_lease(client, lost_id, ttl=5)
    recent_id = new_run(client)["run_id"]
    take_lease(client, recent_id, ttl=5)
    Run.objects.filter(pk=lost_id).update(lease_expires_at=timezone.now() - timedelta(seconds=11))
    Run.objects.filter(pk=recent_id).update(lease_expires_at=timezone.now() - timedelta(seconds=5))

    sweep_once(ring=lambda run_id: None)

    lost = Run.objects.get(pk=lost_id)
    assert (lost.status, lost.attention_reason, lost.lease_owner) == (
        RunStatus.NEEDS_ATTENTION,
        "executor_lost",
        "",
    )
    assert Run.objects.get(pk=recent_id).status == RunStatus.RUNNING  # still within the grace
    shown = ok(get(client, f"runs/{lost_id}/"))
    assert (shown["status"], shown["attention_reason"]) == ("needs_attention", "executor_lost")
    problem(post(client, f"runs/{lost_id}/lease/heartbeat/", {"fence": fence}), 409, "stale_fence")

    again = take_lease(client, lost_id, owner="agent-2")

    back = Run.objects.get(pk=lost_id)
    assert (back.status, back.attention_reason, back.fence) == (RunStatus.RUNNING, "", again)
    assert again > fence
    ok(
        post(
            client,
            f"runs/{lost_id}/checkpoints/",
            {
                "fence": again,
                "expected_rev": 0,
                "state": {},
                "next_step": "",
                "status": "completed",
            },
        ),
        201,
    )
    assert Run.objects.get(pk=lost_id).status == RunStatus.COMPLETED


def test_a_lost_executor_writes_nothing_after_the_sweeper_flagged_it(
    agent_a: Persona, settings: Any
) -> None:
    """The sweeper clears a lost executor's lease and says its holder's writes are refused
    from then on; but it kept the fence, and every executor write is conditional on the fence
    alone — so the executor, back from its pause, wrote a checkpoint (the run `running` again,
    with no lease and still `executor_lost`, never flagged again) and prepared and sent an
    action on a run nobody held. Found by probing the protocol after a sweep."""
    settings.HOLDPOINT_EXECUTOR_GRACE = 10
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, ttl=5)
    earlier = ok(prepare(client, run_id, fence, tool=CLIENT), 201)
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(seconds=11))
    sweep_once(ring=lambda run_id: None)
    before = row_counts()

    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "x"}
    problem(post(client, f"runs/{run_id}/checkpoints/", body), 409, "stale_fence")
    problem(prepare(client, run_id, fence, tool=CLIENT), 409, "stale_fence")
    problem(dispatch(client, earlier["action_id"], fence), 409, "stale_fence")

    assert row_counts() == before
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.attention_reason, run.checkpoint_rev) == (
        RunStatus.NEEDS_ATTENTION,
        "executor_lost",
        0,
    )
    assert Action.objects.get(pk=earlier["action_id"]).status == ActionStatus.PREPARED
    again = take_lease(client, run_id, owner="agent-2")
    assert again > fence
    ok(dispatch(client, earlier["action_id"], again))


def _lost(client: APIClient, settings: Any) -> tuple[str, int]:
    """An external run whose executor the sweeper declared lost: (run id, its old fence)."""
    settings.HOLDPOINT_EXECUTOR_GRACE = 10
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, ttl=5)
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(seconds=11))
    sweep_once(ring=lambda run_id: None)
    shown = ok(get(client, f"runs/{run_id}/"))
    assert (shown["status"], shown["attention_reason"]) == ("needs_attention", "executor_lost")
    return run_id, fence


@pytest.mark.parametrize(
    ("way_out", "status"),
    [
        ("revisions/", "queued"),
        ("cancel/", "cancelled"),
        ("resume/", "queued"),
        ("lease/", "running"),
    ],
)
def test_every_way_out_of_needs_attention_takes_its_reason_along(
    agent_a: Persona, settings: Any, way_out: str, status: str
) -> None:
    """Revising the goal of an `executor_lost` run queued it again, but the run still said
    `attention_reason: executor_lost` — read by the Overview, the admin and every client as
    "a person must look" on a run that needs nobody. Cancelling it kept the reason too."""
    client = agent_a.api()
    run_id, _ = _lost(client, settings)
    body = {
        "revisions/": {"goal": dict(GOAL, scope=["/orders"]), "expected_goal_rev": 1},
        "cancel/": {"reason": "no longer needed"},
        "resume/": {},
        "lease/": {"owner": "agent-2", "ttl_seconds": 60},
    }[way_out]
    ok(post(client, f"runs/{run_id}/{way_out}", body), 202 if way_out == "resume/" else 200)
    shown = ok(get(client, f"runs/{run_id}/"))
    assert (shown["status"], shown["attention_reason"]) == (status, "")
    assert Run.objects.get(pk=run_id).attention_reason == ""


def test_an_external_checkpoint_out_of_needs_attention_takes_its_reason_along(
    agent_a: Persona,
) -> None:
    """The executor holding the lease of a run escalated under it (an approval's last expiry
    asks a person to look) may still checkpoint it `running`: the reason went no further."""
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    Run.objects.filter(pk=run_id).update(  # as approvals.expiry escalates it
        status=RunStatus.NEEDS_ATTENTION, attention_reason="approval expired"
    )
    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "x"}
    ok(post(client, f"runs/{run_id}/checkpoints/", body), 201)
    shown = ok(get(client, f"runs/{run_id}/"))
    assert (shown["status"], shown["attention_reason"]) == ("running", "")


def test_cancelling_an_external_run_hands_its_unproven_actions_to_a_person(
    agent_a: Persona, reviewer_a: Persona, settings: Any
) -> None:
    """Issue 15.3: a cancelled run's `unknown` action stayed unknown for ever (its executor
    may write no more, no worker reconciles it); now a person has it on the Reconcile page."""
    settings.HOLDPOINT_TASKS_DEDUP = "key"
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence)
    ok(outcome(client, action["action_id"], fence, "unknown"))

    ok(post(client, f"runs/{run_id}/cancel/", {"reason": "not needed"}))

    stored = Action.objects.get(pk=action["action_id"])
    assert stored.status == ActionStatus.MANUAL_REVIEW and "cancelled" in stored.last_error
    alice = session(reviewer_a.user)
    assert action["idempotency_key"] in alice.get("/reconcile/").content.decode()
    body = {"outcome": "applied", "external_id": "T-3", "note": "it was made"}
    ok(post(alice, f"actions/{action['action_id']}/resolve/", body))
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.CONFIRMED
    assert Run.objects.get(pk=run_id).status == RunStatus.CANCELLED


@pytest.mark.parametrize("finish", ["completed", "failed"])
def test_an_external_run_that_finishes_leaves_no_action_open(
    agent_a: Persona, reviewer_a: Persona, settings: Any, finish: str
) -> None:
    """An executor's last checkpoint (`completed` or `failed`) while its ledger was open left
    the run finished with an action `sent` that nobody would ever settle (no worker
    reconciles an external run, the sweeper flags only executing ones: "done" while nobody
    knows whether the effect happened) and an approval pending in the reviewers' inbox that
    a reviewer could still approve (200, the action `approved` for a run that sends nothing
    more). A finishing checkpoint now closes the ledger as a cancel does: what was never sent
    is withdrawn with its approval; what may have been sent goes to a person."""
    settings.HOLDPOINT_TASKS_DEDUP = "key"
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    in_flight = sent(client, run_id, fence)
    grant_policy(agent_a.tenant)
    held = ok(prepare(client, run_id, fence, params={"title": "held"}), 201)
    assert held["status"] == "awaiting_approval"

    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "", "status": finish}
    ok(post(client, f"runs/{run_id}/checkpoints/", body), 201)

    assert Run.objects.get(pk=run_id).status == finish
    unproven = Action.objects.get(pk=in_flight["action_id"])
    assert unproven.status == ActionStatus.MANUAL_REVIEW
    alice = session(reviewer_a.user)
    assert in_flight["idempotency_key"] in alice.get("/reconcile/").content.decode()
    assert Action.objects.get(pk=held["action_id"]).status == ActionStatus.CANCELLED
    assert ApprovalRequest.objects.get(pk=held["approval"]).status == "cancelled"
    assert ok(get(alice, "approvals/?status=pending"))["results"] == []
    shown = ok(get(alice, f"approvals/{held['approval']}/"))
    decision = {"decision": "approve", "action_hash": shown["action_hash"], "reason": "ok"}
    response = post(alice, f"approvals/{held['approval']}/decision/", decision)
    assert response.status_code == 409, response.content[:300]
    assert Action.objects.get(pk=held["action_id"]).status == ActionStatus.CANCELLED


def test_the_in_flight_window_lasts_the_senders_lease_plus_the_tools_timeout(
    agent_a: Persona, settings: Any
) -> None:
    """A sender may start its call for as long as its lease runs: `not_found` must not be
    accepted (and the action sent again) before then, however long the lease."""
    settings.HOLDPOINT_TASKS_DEDUP = "lookup"
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, ttl=240)
    action = Action.objects.get(pk=sent(client, run_id, fence)["action_id"])

    lease_ends = Run.objects.get(pk=run_id).lease_expires_at
    assert action.in_flight_until is not None and lease_ends is not None
    timeout = timedelta(seconds=get_tool(action.tool).timeout)
    assert lease_ends + timeout - timedelta(seconds=2) <= action.in_flight_until
    assert action.in_flight_until <= lease_ends + timeout + timedelta(seconds=2)


def passed(run_id: str, seconds: float) -> None:
    """`seconds` go by for the run and its actions: their database-time marks move back."""
    ago = timedelta(seconds=seconds)
    Run.objects.filter(pk=run_id).update(lease_expires_at=F("lease_expires_at") - ago)
    Action.objects.filter(run_id=run_id).update(
        sent_at=F("sent_at") - ago, in_flight_until=F("in_flight_until") - ago
    )


def heartbeat(client: APIClient, run_id: str, fence: int, ttl: int) -> Any:
    body = {"fence": fence, "ttl_seconds": ttl}
    return ok(post(client, f"runs/{run_id}/lease/heartbeat/", body))


def test_a_heartbeat_extends_the_in_flight_window_of_what_its_fence_sent(
    agent_a: Persona, settings: Any
) -> None:
    """An executor whose `perform` runs long keeps its lease with heartbeats, and may still be
    inside its call until that lease is lost (plus the tool's timeout). The window its
    dispatch set was not moved by them: once the lease lapsed, a successor's `not_found`
    was accepted at once — and the action sent again while the first call might still land.
    Now each heartbeat moves the window of the actions its fence sent that are still `sent`
    to the new lease expiry plus the tool's timeout (never earlier than it was)."""
    settings.HOLDPOINT_TASKS_DEDUP = "lookup"
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id, ttl=60)
    action = sent(client, run_id, fence)
    timeout = timedelta(seconds=get_tool(CLIENT).timeout)
    for _ in range(2):  # 100 s in `perform`, heartbeating: past the window the dispatch set
        passed(run_id, 50)
        heartbeat(client, run_id, fence, 60)
    stored = Action.objects.get(pk=action["action_id"])
    lease_ends = Run.objects.get(pk=run_id).lease_expires_at
    assert lease_ends is not None and stored.in_flight_until == lease_ends + timeout
    heartbeat(client, run_id, fence, 10)  # a shorter lease does not shorten the window
    assert Action.objects.get(pk=action["action_id"]).in_flight_until == lease_ends + timeout

    expire_lease(run_id)  # the executor is lost now; a successor takes the run
    successor = take_lease(client, run_id, owner="p2")
    early = outcome(client, action["action_id"], successor, "not_found")

    problem(early, 409, "invalid_transition")
    assert Action.objects.get(pk=action["action_id"]).status == ActionStatus.SENT
    passed(run_id, 61 + timeout.total_seconds())  # the last lease plus the timeout are over
    absent = ok(outcome(client, action["action_id"], successor, "not_found"))
    assert absent["status"] == "prepared"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["key", "lookup"])
def test_a_stale_holders_dispatch_of_an_unsettled_action_sends_nothing(
    agent_a: Persona, sandbox_factory: Factory, mode: str
) -> None:
    """A tool Holdpoint sends: the dispatch of a `sent`/`unknown` action reconciles it by the
    tool's contract. Under a fence that lost the lease, that reconcile ran first — a replay
    of the request (mode key) or a lookup went to the service for the stale holder — and
    only its write was refused. It is refused before anything leaves."""
    box = sandbox_factory(mode)
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    box.faults(drop_after=1)  # applied, the answer lost: the action is unknown
    action = sent(client, run_id, fence, tool="tasks.create")
    assert action["status"] in ("sent", "unknown")
    expire_lease(run_id)
    take_lease(client, run_id, owner="p2")
    asked = len(box.requests())

    problem(dispatch(client, action["action_id"], fence), 409, "stale_fence")

    assert len(box.requests()) == asked  # nothing went to the service for the stale holder
    assert Action.objects.get(pk=action["action_id"]).status == action["status"]


def _client_tool(mode: str) -> dict[str, Any]:
    """A tenant's own tool performed by its agent, read-only (held by no default)."""
    return {
        "name": "agent.tickets",
        "effect": "read",
        "executor": "client",
        "schema": {"type": "object", "properties": {"title": {"type": "string"}}},
        "dedup": {"mode": mode},
        "lookup": {"found": "$[0].id"},
    }


def test_a_redefinition_does_not_change_how_an_action_in_flight_is_reconciled(
    agent_a: Persona,
) -> None:
    """An action sent under version 1 (dedup `lookup`: the service does not honour keys) is
    reconciled by version 1's contract after the tool is redefined with dedup `key`: its
    `reconcile` says "lookup", so a dispatch again — a second request to a service that
    would make a second effect — is refused, as it was before the redefinition."""
    tooldefs.define(agent_a.tenant, _client_tool("lookup"), "user:admin")
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = take_lease(client, run_id)
    action = sent(client, run_id, fence, tool="agent.tickets")
    assert action["reconcile"]["how"] == "lookup"
    problem(dispatch(client, action["action_id"], fence), 409, "invalid_transition")

    tooldefs.define(agent_a.tenant, _client_tool("key"), "user:admin")  # version 2

    shown = ok(get(client, f"actions/{action['action_id']}/"))
    assert shown["reconcile"]["how"] == "lookup"  # version 1's contract, as it was sent
    problem(dispatch(client, action["action_id"], fence), 409, "invalid_transition")
    stored = Action.objects.get(pk=action["action_id"])
    assert (stored.status, stored.attempts, stored.tool_version) == (ActionStatus.SENT, 1, "1")
