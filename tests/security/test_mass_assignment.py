"""Mass assignment (TEST-MATRIX E3; OWASP ASVS 15.3.3): server-owned fields in the body of
every writing API call of API.md — `tenant`, `status`, `fence`, `goal_rev`, `decided_by`,
`id`, `created_at`, `step_rev`, `sent_at`, `approved`, … — are refused (422 in the problem
format) or ignored, never applied.

Each call is made twice on twin objects: once with its documented body, once with the same
body plus every server-owned field it does not document (its request serializer says which
fields are the client's). The twins must end in the same state — run, actions, approvals,
checkpoints and journal entries compared field by field, their own ids aside — no row may
carry one of the forged values, and tenant B's rows stay untouched.

Today the request serializers ignore unknown fields (DRF's default; API.md lets fields be
added, so refusing them would break clients of a newer server version): ignored it is, and
this test proves "ignored" means "never applied". tests/api/test_isolation.py checks the
same for runs, checkpoints, actions, revisions and decisions field by field; this covers
every writing call with one list of server-owned fields.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.db.models import Q
from rest_framework.test import APIClient

from approvals.api import DecisionIn
from approvals.models import ApprovalRequest, ApprovalVote
from audit.models import JournalEntry
from runtime.api import serializers as s
from runtime.executor import advance_run
from runtime.models import Action, Checkpoint, Run, RunStatus
from tests.api import (
    CLIENT_TOOL,
    fresh_throttle,  # noqa: F401  (the rate limit must not leak between tests)
    grant_policy,
    new_run,
    ok,
    post,
    prepare,
    problem,
    session,
    take_lease,
)
from tests.conftest import Persona
from tests.runtime.helpers import make_due
from tests.security import matrix

pytestmark = pytest.mark.django_db

T_PAST = "2000-01-01T00:00:00Z"
T_FUTURE = "2099-01-01T00:00:00Z"
FORGED_INT = 424242
FORGED_UUID = "00000000-0000-4000-8000-00000000beef"


def forged(tenant_b: Any, bob: Any, b_run: str) -> dict[str, Any]:
    """Every server-owned field a client might try to set, with a value no server would."""
    return {
        "tenant": tenant_b.pk,
        "tenant_id": tenant_b.pk,
        "id": FORGED_UUID,
        "pk": FORGED_UUID,
        "run": b_run,
        "run_id": b_run,
        "action_id": FORGED_UUID,
        "approval": FORGED_UUID,
        "approval_id": FORGED_UUID,
        "status": "completed",
        "fence": FORGED_INT,
        "goal_rev": 77,
        "checkpoint_rev": 55,
        "step_rev": 55,
        "rev": 66,
        "decided_by": bob.pk,
        "decided_at": T_PAST,
        "created_at": T_PAST,
        "updated_at": T_PAST,
        "sent_at": T_PAST,
        "in_flight_until": T_PAST,
        "expires_at": T_FUTURE,
        "lease_expires_at": T_FUTURE,
        "wake_at": T_FUTURE,
        "approved": True,
        "decision": "approve",
        "lease_owner": "forged-owner",
        "lease": {"owner": "forged-owner", "fence": FORGED_INT, "expires_at": T_FUTURE},
        "created_by": "user:forged",
        "fingerprint": "0" * 64,
        "requested_fingerprint": "0" * 64,
        "digest": "0" * 64,
        "action_hash": "0" * 64,
        "attempts": 99,
        "reconcile_attempts": 99,
        "consecutive_failures": 9,
        "quorum": 9,
        "rerequest_count": 9,
        "escalated": True,
        "tool_version": "99",
        "sent_fence": FORGED_INT,
        "call_index": 9,
        "step": "forged",
        "waiting_for": {"kind": "forged"},
        "pending_input": {"forged": True},
        "metadata": {"forged": True},
        "attention_reason": "forged",
        "last_error": "forged",
        "external_id": "FORGED",
        "votes": [{"user": bob.pk, "decision": "approve"}],
        "policy": FORGED_INT,
        "shown": {"tool": "forged"},
    }


# --- the calls --------------------------------------------------------------------------------


@dataclass
class Target:
    """One object ready for a call: where to post, what body documents it, who posts."""

    url: str
    body: dict[str, Any]
    client: APIClient
    run_id: str | None = None


@dataclass(frozen=True)
class Call:
    serializer: type[Any]  # the request serializer: which body fields are the client's
    status: int
    make: Callable[[Any], Target]


class Env:
    def __init__(self, agent: Persona, reviewer: Persona, settings: Any) -> None:
        self.agent = agent.api()
        self.reviewer = session(reviewer.user)
        self.tenant = agent.tenant
        self.settings = settings

    def run(self, **fields: Any) -> str:
        return new_run(self.agent, **fields)["run_id"]

    def leased(self) -> tuple[str, int]:
        run_id = self.run()
        return run_id, take_lease(self.agent, run_id)

    def action(self, tool: str = CLIENT_TOOL, **params: Any) -> tuple[str, int, dict]:
        run_id, fence = self.leased()
        made = ok(prepare(self.agent, run_id, fence, tool, params or None), 201)
        return run_id, fence, made


def _create(env: Env) -> Target:
    body = {"graph": "chain", "goal": {"steps": 2}, "external": True, "thread_id": "mass"}
    return Target("runs/", body, env.agent)


def _lever(suffix: str, body: dict[str, Any]) -> Callable[[Env], Target]:
    def make(env: Env) -> Target:
        run_id = env.run()
        return Target(f"runs/{run_id}/{suffix}", body, env.agent, run_id)

    return make


def _input(env: Env) -> Target:
    run_id, fence = env.leased()
    waiting = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "ask"}
    ok(post(env.agent, f"runs/{run_id}/checkpoints/", {**waiting, "status": "waiting_input"}), 201)
    return Target(f"runs/{run_id}/input/", {"data": {"a": 1}, "expected_rev": 1}, env.agent, run_id)


def _resume(env: Env) -> Target:
    run_id = env.run(graph="flaky", goal={"fail_times": 3}, external=False)
    for attempt in range(3):
        if attempt:
            make_due(run_id)
        advance_run(run_id, "w1")
    assert Run.objects.get(pk=run_id).status == RunStatus.NEEDS_ATTENTION
    return Target(f"runs/{run_id}/resume/", {"expected_rev": 0}, env.agent, run_id)


def _fenced(suffix: str, **more: Any) -> Callable[[Env], Target]:
    def make(env: Env) -> Target:
        run_id, fence = env.leased()
        body = {"fence": fence, **more}
        return Target(f"runs/{run_id}/{suffix}", body, env.agent, run_id)

    return make


def _checkpoint(env: Env) -> Target:
    run_id, fence = env.leased()
    body = {"fence": fence, "expected_rev": 0, "state": {"k": 1}, "next_step": "n"}
    return Target(f"runs/{run_id}/checkpoints/", body, env.agent, run_id)


def _prepare(env: Env) -> Target:
    run_id, fence = env.leased()
    body = {"fence": fence, "tool": "tasks.create", "params": {"title": "t"}, "reason": "r"}
    return Target(f"runs/{run_id}/actions/", body, env.agent, run_id)


def _dispatch(env: Env) -> Target:
    run_id, fence, action = env.action()
    return Target(f"actions/{action['action_id']}/dispatch/", {"fence": fence}, env.agent, run_id)


def _outcome(env: Env) -> Target:
    run_id, fence, action = env.action()
    ok(post(env.agent, f"actions/{action['action_id']}/dispatch/", {"fence": fence}))
    body = {"fence": fence, "outcome": "confirmed", "external_id": "T-1", "result": {"ok": 1}}
    return Target(f"actions/{action['action_id']}/outcome/", body, env.agent, run_id)


def _decision(env: Env) -> Target:
    run_id, fence, action = env.action("tasks.close", task_id="T-1")
    approval = ApprovalRequest.objects.get(pk=action["approval"])
    body = {"decision": "approve", "action_hash": approval.action_hash, "reason": "fine"}
    return Target(f"approvals/{approval.pk}/decision/", body, env.reviewer, run_id)


def _resolve(env: Env) -> Target:
    env.settings.HOLDPOINT_TASKS_DEDUP = "none"
    run_id, fence, action = env.action()
    ok(post(env.agent, f"actions/{action['action_id']}/dispatch/", {"fence": fence}))
    unknown = {"fence": fence, "outcome": "unknown"}
    ok(post(env.agent, f"actions/{action['action_id']}/outcome/", unknown))
    # The service can neither deduplicate nor be looked up: a person has it at once.
    assert Action.objects.get(pk=action["action_id"]).status == "manual_review"
    body = {"outcome": "applied", "external_id": "T-9", "note": "found it"}
    return Target(f"actions/{action['action_id']}/resolve/", body, env.reviewer, run_id)


# Every writing call of API.md (the "Runs", "Executor protocol" and "Approvals and manual
# reconciliation" tables), by its path.
CALLS: dict[str, Call] = {
    "POST runs/": Call(s.RunCreate, 201, _create),
    "POST runs/{run_id}/revisions/": Call(
        s.RevisionIn, 200, _lever("revisions/", {"goal": {"steps": 5}, "expected_goal_rev": 1})
    ),
    "POST runs/{run_id}/input/": Call(s.InputIn, 200, _input),
    "POST runs/{run_id}/cancel/": Call(s.CancelIn, 200, _lever("cancel/", {"reason": "done"})),
    "POST runs/{run_id}/resume/": Call(s.ResumeIn, 202, _resume),
    "POST runs/{run_id}/lease/": Call(
        s.LeaseIn, 200, _lever("lease/", {"owner": "me", "ttl_seconds": 30})
    ),
    "POST runs/{run_id}/lease/heartbeat/": Call(
        s.HeartbeatIn, 200, _fenced("lease/heartbeat/", ttl_seconds=30)
    ),
    "POST runs/{run_id}/lease/release/": Call(s.FenceIn, 200, _fenced("lease/release/")),
    "POST runs/{run_id}/checkpoints/": Call(s.CheckpointIn, 201, _checkpoint),
    "POST runs/{run_id}/actions/": Call(s.ActionIn, 201, _prepare),
    "POST actions/{action_id}/dispatch/": Call(s.FenceIn, 200, _dispatch),
    "POST actions/{action_id}/outcome/": Call(s.OutcomeIn, 200, _outcome),
    "POST approvals/{id}/decision/": Call(DecisionIn, 200, _decision),
    "POST actions/{action_id}/resolve/": Call(s.ResolveIn, 200, _resolve),
}


# --- what "the same state" means ----------------------------------------------------------------

RUN_FIELDS = (
    "tenant_id",
    "graph",
    "graph_version",
    "status",
    "goal",
    "goal_rev",
    "checkpoint_rev",
    "step_rev",
    "next_step",
    "waiting_for",
    "pending_input",
    "lease_owner",
    "fence",
    "consecutive_failures",
    "attempts",
    "last_error",
    "attention_reason",
    "metadata",
    "external",
    "created_by",
)
ACTION_FIELDS = (
    "tenant_id",
    "tool",
    "tool_version",
    "params",
    "fingerprint",
    "status",
    "goal_rev",
    "fence",
    "step",
    "call_index",
    "reason",
    "target",
    "external_id",
    "result",
    "attempts",
    "reconcile_attempts",
    "last_error",
    "sent_fence",
)
APPROVAL_FIELDS = (
    "tenant_id",
    "status",
    "decision",
    "decided_by_id",
    "decision_reason",
    "quorum",
    "edits",
    "edited_params",
    "rerequest_count",
    "escalated",
)
CHECKPOINT_FIELDS = (
    "tenant_id",
    "rev",
    "goal_rev",
    "step",
    "next_step",
    "status",
    "state",
    "waits",
    "created_by",
    "fence",
)


def state_of(run_id: str | None) -> str:
    """The run's rows as data, with the twin's own ids and times left out."""
    run = Run.objects.filter(pk=run_id).first() if run_id else None
    if run is None:
        return ""
    actions = Action.objects.filter(run=run).order_by("call_index", "created_at")
    approvals = ApprovalRequest.objects.filter(run=run).order_by("created_at")
    entries = JournalEntry.objects.filter(stream=f"run:{run.pk}").order_by("seq")
    data = {
        "run": Run.objects.filter(pk=run.pk).values(*RUN_FIELDS).get(),
        "lease_set": run.lease_expires_at is not None,
        "actions": list(actions.values(*ACTION_FIELDS)),
        "sent": [a.sent_at is not None for a in actions],
        "approvals": list(approvals.values(*APPROVAL_FIELDS)),
        "votes": list(ApprovalVote.objects.filter(request__run=run).values("user", "decision")),
        "checkpoints": list(Checkpoint.objects.filter(run=run).values(*CHECKPOINT_FIELDS)),
        "journal": [(e.type, e.actor, _steady(e.payload)) for e in entries],
    }
    text = json.dumps(data, sort_keys=True, default=str)
    for own in [str(run.pk), *map(str, actions.values_list("pk", flat=True))]:
        text = text.replace(own, "<own>")
    for own in map(str, approvals.values_list("pk", flat=True)):
        text = text.replace(own, "<own>")
    return text


# Payload values that differ between twins by nature: clock readings, hashes over content
# that includes the twin's own ids, and the retry jitter.
UNSTEADY = {"retry_in_seconds"}
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d")
_HASH = re.compile(r"^[0-9a-f]{64}$")


def _steady(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items() if k not in UNSTEADY}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    if isinstance(value, str) and _TIME.match(value):
        return "<time>"
    if isinstance(value, str) and _HASH.match(value) and value != "0" * 64:
        return "<hash>"
    return value


def forged_rows(bob: Any) -> list[str]:
    """Rows anywhere that carry a forged value: none may."""
    past, future = 2000, 2099
    checks = {
        "runs": Run.objects.filter(
            Q(fence=FORGED_INT)
            | Q(goal_rev=77)
            | Q(checkpoint_rev=55)
            | Q(step_rev=55)
            | Q(lease_owner="forged-owner")
            | Q(created_by="user:forged")
            | Q(attention_reason="forged")
            | Q(last_error="forged")
            | Q(consecutive_failures=9)
            | Q(created_at__year=past)
            | Q(lease_expires_at__year=future)
            | Q(wake_at__year=future)
            | Q(pk=FORGED_UUID)
        ),
        "actions": Action.objects.filter(
            Q(fence=FORGED_INT)
            | Q(sent_fence=FORGED_INT)
            | Q(goal_rev=77)
            | Q(attempts=99)
            | Q(reconcile_attempts=99)
            | Q(tool_version="99")
            | Q(call_index=9)
            | Q(step="forged")
            | Q(fingerprint="0" * 64)
            | Q(external_id="FORGED")
            | Q(sent_at__year=past)
            | Q(in_flight_until__year=past)
            | Q(created_at__year=past)
            | Q(pk=FORGED_UUID)
        ),
        "checkpoints": Checkpoint.objects.filter(
            Q(rev=66)
            | Q(goal_rev=77)
            | Q(fence=FORGED_INT)
            | Q(digest="0" * 64)
            | Q(created_by="user:forged")
            | Q(created_at__year=past)
        ),
        "approvals": ApprovalRequest.objects.filter(
            Q(quorum=9)
            | Q(decided_by=bob)
            | Q(decided_at__year=past)
            | Q(expires_at__year=future)
            | Q(rerequest_count=9)
            | Q(pk=FORGED_UUID)
        ),
        "votes": ApprovalVote.objects.filter(user=bob),
    }
    return [name for name, rows in checks.items() if rows.exists()]


@pytest.mark.parametrize("name", list(CALLS))
def test_server_owned_fields_are_never_applied(
    name: str,
    agent_a: Persona,
    reviewer_a: Persona,
    agent_b: Persona,
    outsider_b: Persona,
    settings: Any,
) -> None:
    grant_policy(agent_a.tenant, tool="tasks.close")
    call = CALLS[name]
    env = Env(agent_a, reviewer_a, settings)
    b_run = new_run(agent_b.api())["run_id"]
    control = call.make(env)
    twin = call.make(env)
    b_before = matrix.tenant_state(agent_b.tenant.pk)

    expected = post(control.client, control.url, control.body)
    assert expected.status_code == call.status, expected.content[:500]
    legit = set(call.serializer().fields)
    injected = forged(agent_b.tenant, outsider_b.user, b_run)
    sent = {**{k: v for k, v in injected.items() if k not in legit}, **twin.body}
    before = state_of(twin.run_id)
    response = post(twin.client, twin.url, sent)

    if response.status_code == 422:  # refused: in the problem format, and nothing written
        problem(response, 422, response.json().get("code", ""))
        assert state_of(twin.run_id) == before
    else:
        assert response.status_code == call.status, response.content[:500]
        if name == "POST runs/":
            twin.run_id = response.json()["run_id"]
            control.run_id = expected.json()["run_id"]
        assert state_of(twin.run_id) == state_of(control.run_id), name
        assert _public(response.json()) == _public(expected.json()), name
    assert not forged_rows(outsider_b.user), name
    assert matrix.tenant_state(agent_b.tenant.pk) == b_before, name
    matrix.record("mass_assignment", **{name: len(set(injected) - legit)})


def _public(data: dict[str, Any]) -> dict[str, Any]:
    """A response body with the fields that differ between twins by nature left out."""
    volatile = {"run_id", "action_id", "id", "thread_id", "idempotency_key", "created_at"}
    volatile |= {"updated_at", "expires_at", "sent_at", "decided_at", "lease", "digest"}
    volatile |= {"in_flight_until", "reconcile"}  # database time: each call's own
    volatile |= {"approval", "action", "action_hash", "fingerprint", "title"}
    return {k: v for k, v in data.items() if k not in volatile}
