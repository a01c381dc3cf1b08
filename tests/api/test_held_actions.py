"""A run waits for a reviewer as long as any of its actions does (runtime/holds.py).

An external executor (an agent's own loop, a LangGraph batch, an MCP session) may prepare
several gated actions before any is decided. Deciding one — approve, reject, its expiry —
or a person settling another action woke the run (`queued`, `waiting_for` null) while the
other still waited for its reviewer: the Runs pages, the metrics and the executor reading
the run saw nothing waiting. The run now stays `waiting_approval`, `waiting_for` naming the
oldest action still held, and wakes when none is.

And an executor's `running` checkpoint says the executor is at it again: a `waiting_for`
left from its earlier `waiting_input` checkpoint is stale then — but a wait only a person
can end (a held action, an action in `manual_review`) is not the executor's to end.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from approvals.expiry import sweep_approvals
from approvals.models import ApprovalPolicy, ApprovalRequest, OnExpiry
from tests.api import get, grant_policy, new_run, ok, post, prepare, session, take_lease
from tests.conftest import Persona

pytestmark = pytest.mark.django_db

HELD = {"param": "title", "op": "contains", "value": "HOLD"}  # the policy holds these only


def _run(client: APIClient, run_id: str) -> tuple[str, str | None]:
    """The run's status and the action its `waiting_for` names, as the API shows them."""
    run = ok(get(client, f"runs/{run_id}/"))
    return run["status"], (run["waiting_for"] or {}).get("action_id")


def _decide(reviewer: Persona, approval_id: str, how: str) -> None:
    """One decision of a held action: a reviewer's approve or reject, or its expiry under a
    policy that rejects what nobody decided."""
    if how == "expiry":
        ApprovalRequest.objects.filter(pk=approval_id).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        assert sweep_approvals() >= 1
        return
    alice = session(reviewer.user)
    shown = ok(get(alice, f"approvals/{approval_id}/"))
    body = {"decision": how, "action_hash": shown["action_hash"], "reason": "looked at it"}
    ok(post(alice, f"approvals/{approval_id}/decision/", body))


def _leased(agent: Persona) -> tuple[APIClient, str, int]:
    client = agent.api()
    run_id = new_run(client)["run_id"]
    return client, run_id, take_lease(client, run_id)


def _for_a_person(client: APIClient, run_id: str, fence: int, title: str) -> Any:
    """An action only a person can settle now: sent, its outcome `unknown`, of a tool that
    can neither deduplicate nor be looked up (HOLDPOINT_TASKS_DEDUP `none`)."""
    lost = ok(prepare(client, run_id, fence, params={"title": title}), 201)
    assert lost["status"] == "prepared"
    ok(post(client, f"actions/{lost['action_id']}/dispatch/", {"fence": fence}))
    unknown = {"fence": fence, "outcome": "unknown"}
    assert ok(post(client, f"actions/{lost['action_id']}/outcome/", unknown))["status"] == (
        "manual_review"
    )
    return lost


def _two_held(agent: Persona) -> tuple[APIClient, str, int, dict[str, Any], dict[str, Any]]:
    client, run_id, fence = _leased(agent)
    first = ok(prepare(client, run_id, fence, params={"title": "first"}), 201)
    second = ok(prepare(client, run_id, fence, params={"title": "second"}), 201)
    assert first["status"] == second["status"] == "awaiting_approval"
    assert _run(client, run_id) == ("waiting_approval", first["action_id"])
    return client, run_id, fence, first, second


@pytest.mark.parametrize("how", ["approve", "reject", "expiry"])
@pytest.mark.parametrize("oldest_first", [True, False])
def test_a_decision_wakes_the_run_only_when_no_other_action_is_held(
    agent_a: Persona, reviewer_a: Persona, how: str, oldest_first: bool
) -> None:
    policy = grant_policy(agent_a.tenant)
    ApprovalPolicy.objects.filter(pk=policy.pk).update(on_expiry=OnExpiry.REJECT)
    client, run_id, fence, first, second = _two_held(agent_a)
    decided, other = (first, second) if oldest_first else (second, first)

    _decide(reviewer_a, decided["approval"], how)

    assert _run(client, run_id) == ("waiting_approval", other["action_id"])
    _decide(reviewer_a, other["approval"], how)
    assert _run(client, run_id) == ("queued", None)
    if how == "approve":  # the executor goes on: it sends both
        for action in (first, second):
            body = {"fence": fence}
            ok(post(client, f"actions/{action['action_id']}/dispatch/", body))
        assert _run(client, run_id) == ("running", None)


def test_a_person_settling_an_action_leaves_the_run_waiting_for_a_held_one(
    agent_a: Persona, reviewer_a: Persona, settings: Any
) -> None:
    """The run waited for a person (`needs_reconciliation`) and a reviewer at once: the
    person's resolve woke it (`queued`) though the reviewer had not decided."""
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    grant_policy(agent_a.tenant, condition=HELD)
    client, run_id, fence = _leased(agent_a)
    held = ok(prepare(client, run_id, fence, params={"title": "HOLD this"}), 201)
    assert held["status"] == "awaiting_approval"
    lost = _for_a_person(client, run_id, fence, "send this")
    assert _run(client, run_id) == ("needs_reconciliation", lost["action_id"])

    alice = session(reviewer_a.user)
    body = {"outcome": "applied", "external_id": "TASK-1", "note": "it is in the tracker"}
    ok(post(alice, f"actions/{lost['action_id']}/resolve/", body))

    assert _run(client, run_id) == ("waiting_approval", held["action_id"])
    _decide(reviewer_a, held["approval"], "approve")
    assert _run(client, run_id) == ("queued", None)


# --- a running checkpoint ----------------------------------------------------------------------


def _checkpoint(client: APIClient, run_id: str, fence: int, status: str) -> None:
    rev = ok(get(client, f"runs/{run_id}/"))["checkpoint_rev"]
    body = {"fence": fence, "expected_rev": rev, "state": {}, "next_step": "go", "status": status}
    if status == "waiting_input":
        body["prompt"] = "Which budget?"
    ok(post(client, f"runs/{run_id}/checkpoints/", body), 201)


def test_a_running_checkpoint_after_a_waiting_input_one_clears_the_stale_wait(
    agent_a: Persona,
) -> None:
    """The executor asked for input, then leased the run again and went on without it: the
    run said `running` while `waiting_for` still asked for the input."""
    client, run_id, fence = _leased(agent_a)
    _checkpoint(client, run_id, fence, "waiting_input")
    assert ok(get(client, f"runs/{run_id}/"))["waiting_for"]["kind"] == "input"

    again = take_lease(client, run_id, owner="p2")
    _checkpoint(client, run_id, again, "running")

    run = ok(get(client, f"runs/{run_id}/"))
    assert (run["status"], run["waiting_for"]) == ("running", None)


def test_a_running_checkpoint_keeps_the_run_waiting_for_a_held_action(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)
    client, run_id, fence = _leased(agent_a)
    held = ok(prepare(client, run_id, fence, params={"title": "first"}), 201)
    ok(prepare(client, run_id, fence, params={"title": "second"}), 201)

    _checkpoint(client, run_id, fence, "running")  # while both wait for their reviewer
    assert _run(client, run_id) == ("waiting_approval", held["action_id"])
    _checkpoint(client, run_id, fence, "waiting_input")
    again = take_lease(client, run_id, owner="p2")
    _checkpoint(client, run_id, again, "running")
    assert _run(client, run_id) == ("waiting_approval", held["action_id"])


def test_a_running_checkpoint_keeps_the_run_waiting_for_a_person(
    agent_a: Persona, settings: Any
) -> None:
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    client, run_id, fence = _leased(agent_a)
    lost = _for_a_person(client, run_id, fence, "send this")
    assert _run(client, run_id) == ("needs_reconciliation", lost["action_id"])

    _checkpoint(client, run_id, fence, "running")
    assert _run(client, run_id) == ("needs_reconciliation", lost["action_id"])
    _checkpoint(client, run_id, fence, "waiting_input")
    again = take_lease(client, run_id, owner="p2")
    _checkpoint(client, run_id, again, "running")
    assert _run(client, run_id) == ("needs_reconciliation", lost["action_id"])
