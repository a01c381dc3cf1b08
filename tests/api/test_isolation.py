"""Tenant isolation over the API (TEST-MATRIX E1, E2, E3).

E1: every URL pattern under /api/v1/ (from the resolver) × each of its methods, called by
tenant A — agent token and reviewer session — with tenant B's run, action, approval and
checkpoint ids, answers 404 byte-identical to the answer for random ids, and changes nothing.
E2: lists and filters return only the caller's rows, also with a cursor taken from tenant B.
E3: server-owned fields in request bodies are ignored.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import pytest
from rest_framework.test import APIClient

from approvals.models import ApprovalRequest
from audit.models import JournalEntry
from runtime.api.base import Cursor
from runtime.models import Action, Checkpoint, Run, Tenant
from tests.api import (
    api_routes,
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

ID_NAMES = {"run_id", "action_id", "approval_id", "rev"}
_keys = itertools.count()


def world(agent: Persona) -> dict[str, Any]:
    """A tenant's objects: a leased run with a checkpoint, a prepared action and two pending
    approvals (a policy on tasks.close), plus a second run."""
    grant_policy(agent.tenant, tool="tasks.close")
    client = agent.api()
    run = new_run(client, thread_id="shared-thread")
    fence = take_lease(client, run["run_id"])
    ok(
        post(
            client,
            f"runs/{run['run_id']}/checkpoints/",
            {"fence": fence, "expected_rev": 0, "state": {"k": 1}, "next_step": "n"},
        ),
        201,
    )
    action = ok(prepare(client, run["run_id"], fence, idempotency_key="shared-key"), 201)
    held = ok(prepare(client, run["run_id"], fence, "tasks.close", {"task_id": "T-1"}), 201)
    ok(prepare(client, run["run_id"], fence, "tasks.close", {"task_id": "T-2"}), 201)
    other = new_run(client, graph="asker", goal={}, thread_id="shared-thread")
    return {
        "run_id": run["run_id"],
        "fence": fence,
        "action_id": action["action_id"],
        "approval_id": held["approval"],
        "action_hash": ApprovalRequest.objects.get(pk=held["approval"]).action_hash,
        "rev": "1",
        "other_run_id": other["run_id"],
    }


def body_for(route: str, objects: dict[str, Any]) -> dict[str, Any]:
    """A body that would succeed if scoping were missing."""
    fence = objects["fence"]
    bodies = {
        "/revisions/": {"goal": {"x": 1}, "expected_goal_rev": 1},
        "/input/": {"data": {"title": "x"}, "expected_rev": 1},
        "/cancel/": {"reason": "probe"},
        "/resume/": {},
        "/checkpoints/": {"fence": fence, "expected_rev": 1, "state": {}, "next_step": "x"},
        "/actions/": {"fence": fence, "tool": "tasks.create", "params": {"title": "probe"}},
        "/lease/": {"owner": "intruder", "ttl_seconds": 30},
        "/lease/heartbeat/": {"fence": fence},
        "/lease/release/": {"fence": fence},
        "/dispatch/": {"fence": fence},
        "/outcome/": {"fence": fence, "outcome": "confirmed", "external_id": "X"},
        "/resolve/": {"outcome": "applied", "external_id": "X"},
        "/decision/": {"decision": "approve", "action_hash": objects["action_hash"]},
    }
    for suffix, body in bodies.items():
        if route.endswith(suffix):
            return body
    return {}


def fill(route: str, values: dict[str, Any]) -> str:
    for name in ID_NAMES:
        route = route.replace("{" + name + "}", str(values[name]))
    return route


def snapshot(tenant: Tenant) -> dict[str, Any]:
    return {
        "rows": row_counts(),
        "runs": list(
            Run.objects.filter(tenant=tenant)
            .order_by("pk")
            .values_list(
                "pk", "status", "fence", "lease_owner", "goal_rev", "checkpoint_rev", "updated_at"
            )
        ),
        "actions": list(
            Action.objects.filter(tenant=tenant)
            .order_by("pk")
            .values_list("pk", "status", "updated_at")
        ),
        "approvals": list(
            ApprovalRequest.objects.filter(tenant=tenant)
            .order_by("pk")
            .values_list("pk", "status", "updated_at")
        ),
        "journal": JournalEntry.objects.filter(tenant_id=tenant.pk).count(),
    }


# --- E1: the BOLA matrix -------------------------------------------------------------------------


@pytest.mark.parametrize("caller", ["agent", "reviewer"])
def test_every_route_and_method_with_foreign_ids_is_an_indistinguishable_404(
    caller: str, agent_a: Persona, reviewer_a: Persona, agent_b: Persona, outsider_b: Persona
) -> None:
    theirs = world(agent_b)
    world(agent_a)  # A has objects too (same names, own ids)
    client: APIClient = agent_a.api() if caller == "agent" else session(reviewer_a.user)
    before = snapshot(agent_b.tenant)
    rows_before = row_counts()
    covered: list[str] = []
    for route, names, methods in api_routes():
        if not set(names) & ID_NAMES - {"rev"}:
            continue
        random_ids = {
            "run_id": uuid.uuid4(),
            "action_id": uuid.uuid4(),
            "approval_id": uuid.uuid4(),
            "rev": "1",
        }
        for method in methods:
            body = body_for(route, theirs)
            answers = []
            for ids in (theirs, random_ids):
                extra = {}
                if method == "POST":
                    extra["HTTP_IDEMPOTENCY_KEY"] = f"probe-{next(_keys)}"
                answers.append(
                    client.generic(
                        method,
                        fill(route, ids),
                        json.dumps(body),
                        content_type="application/json",
                        **extra,
                    )
                )
            foreign, missing = answers
            problem(foreign, 404, "not_found")
            assert foreign.content == missing.content, (method, route)
            assert foreign.status_code == missing.status_code
            assert foreign["Content-Type"] == missing["Content-Type"]
            covered.append(f"{method} {route}")
    assert len(covered) >= 18, covered
    assert snapshot(agent_b.tenant) == before
    assert row_counts() == rows_before


def test_a_foreign_checkpoint_rev_and_events_are_404(agent_a: Persona, agent_b: Persona) -> None:
    theirs = world(agent_b)
    mine = world(agent_a)
    client = agent_a.api()
    for rev in (1, 2):
        foreign = get(client, f"runs/{theirs['run_id']}/checkpoints/{rev}/")
        problem(foreign, 404, "not_found")
        assert foreign.content == get(client, f"runs/{uuid.uuid4()}/checkpoints/{rev}/").content
    # A's own run has rev 1; asking for it under B's run id does not find it either.
    assert ok(get(client, f"runs/{mine['run_id']}/checkpoints/1/"))["rev"] == 1
    problem(get(client, f"runs/{theirs['run_id']}/events/?after=0"), 404, "not_found")


# --- E2: lists, filters and cursors ------------------------------------------------------------


def test_lists_and_filters_return_only_own_rows(agent_a: Persona, agent_b: Persona) -> None:
    theirs = world(agent_b)
    mine = world(agent_a)
    client = agent_a.api()
    own_runs = set(Run.objects.filter(tenant=agent_a.tenant).values_list("pk", flat=True))
    own_actions = set(Action.objects.filter(tenant=agent_a.tenant).values_list("pk", flat=True))
    own_approvals = set(
        ApprovalRequest.objects.filter(tenant=agent_a.tenant).values_list("pk", flat=True)
    )
    run_queries = [
        "",
        "?thread_id=shared-thread",
        "?graph=chain",
        "?graph=asker",
        "?status=queued",
        "?status=running",
        "?status=waiting_approval",
    ]
    for query in run_queries:
        found = {uuid.UUID(r["run_id"]) for r in ok(get(client, f"runs/{query}"))["results"]}
        assert found <= own_runs, query
    assert len(ok(get(client, "runs/?thread_id=shared-thread"))["results"]) == 2
    action_queries = [
        "",
        "?idempotency_key=shared-key",
        "?tool=tasks.create",
        "?tool=tasks.close",
        "?status=prepared",
        "?status=awaiting_approval",
    ]
    for query in action_queries:
        results = ok(get(client, f"actions/{query}"))["results"]
        assert {uuid.UUID(a["action_id"]) for a in results} <= own_actions, query
    by_key = ok(get(client, "actions/?idempotency_key=shared-key"))["results"]
    assert [a["action_id"] for a in by_key] == [mine["action_id"]]
    for query in ("", "?status=pending"):
        results = ok(get(client, f"approvals/{query}"))["results"]
        assert {uuid.UUID(a["id"]) for a in results} == own_approvals, query
    for url in (f"runs/{mine['run_id']}/checkpoints/", f"runs/{mine['run_id']}/actions/"):
        for item in ok(get(client, url))["results"]:
            assert item.get("run_id", mine["run_id"]) == mine["run_id"]
    events = ok(get(client, f"runs/{mine['run_id']}/events/"))["results"]
    assert all(theirs["run_id"] not in str(e["payload"]) for e in events)


@pytest.mark.parametrize("listing", ["runs/", "actions/", "approvals/"])
def test_a_cursor_from_another_tenant_shows_only_own_rows(
    listing: str, agent_a: Persona, agent_b: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Cursor, "page_size", 1)
    world(agent_b)
    world(agent_a)
    b_page = ok(get(agent_b.api(), listing))
    assert b_page["next"], "tenant B has more than one row"
    foreign_ids = _ids(listing, agent_b.tenant)
    url: str | None = b_page["next"]
    seen = 0
    client = agent_a.api()
    while url and seen < 20:
        page = ok(client.get(url))
        key = "id" if listing == "approvals/" else ("run_id" if listing == "runs/" else "action_id")
        assert not {item[key] for item in page["results"]} & foreign_ids
        url, seen = page["next"], seen + 1


def _ids(listing: str, tenant: Tenant) -> set[str]:
    model: Any = {"runs/": Run, "actions/": Action, "approvals/": ApprovalRequest}[listing]
    return {str(pk) for pk in model.objects.filter(tenant=tenant).values_list("pk", flat=True)}


# --- E3: mass assignment -----------------------------------------------------------------------


def test_server_owned_fields_in_a_new_run_are_ignored(agent_a: Persona, agent_b: Persona) -> None:
    chosen = str(uuid.uuid4())
    data = new_run(
        agent_a.api(),
        run_id=chosen,
        tenant=agent_b.tenant.pk,
        tenant_id=agent_b.tenant.pk,
        status="completed",
        fence=99,
        goal_rev=7,
        checkpoint_rev=5,
        lease={"owner": "me", "fence": 99, "expires_at": "2099-01-01T00:00:00Z"},
        created_by="user:admin",
        created_at="2000-01-01T00:00:00Z",
        waiting_for={"kind": "nothing"},
    )
    assert data["run_id"] != chosen
    assert (data["status"], data["goal_rev"], data["checkpoint_rev"]) == ("queued", 1, 0)
    assert data["lease"] == {"owner": "", "expires_at": None, "fence": 0}
    assert data["waiting_for"] is None and not data["created_at"].startswith("2000")
    run = Run.objects.get(pk=data["run_id"])
    assert run.tenant == agent_a.tenant and run.created_by == "agent:agent-a"
    assert not Run.objects.filter(tenant=agent_b.tenant).exists()


def test_server_owned_fields_in_executor_writes_are_ignored(
    agent_a: Persona, agent_b: Persona
) -> None:
    theirs = new_run(agent_b.api())
    client = agent_a.api()
    run = new_run(client)
    fence = ok(
        post(client, f"runs/{run['run_id']}/lease/", {"owner": "p", "ttl_seconds": 30, "fence": 99})
    )["fence"]
    assert fence == 1
    cp = ok(
        post(
            client,
            f"runs/{run['run_id']}/checkpoints/",
            {
                "fence": fence,
                "expected_rev": 0,
                "state": {},
                "next_step": "n",
                "rev": 50,
                "goal_rev": 9,
                "created_by": "user:admin",
                "digest": "0" * 64,
                "run": theirs["run_id"],
            },
        ),
        201,
    )
    assert (cp["rev"], cp["goal_rev"], cp["created_by"]) == (1, 1, f"agent:agent-a#{fence}")
    assert cp["digest"] != "0" * 64
    assert not Checkpoint.objects.filter(run_id=theirs["run_id"]).exists()
    action = ok(
        post(
            client,
            f"runs/{run['run_id']}/actions/",
            {
                "fence": fence,
                "tool": "tasks.create",
                "params": {"title": "t"},
                "status": "confirmed",
                "goal_rev": 9,
                "external_id": "FAKE",
                "fingerprint": "0" * 64,
                "approval": str(uuid.uuid4()),
                "run_id": theirs["run_id"],
                "tenant": agent_b.tenant.pk,
                "action_id": str(uuid.uuid4()),
            },
        ),
        201,
    )
    assert (action["status"], action["goal_rev"], action["external_id"]) == ("prepared", 1, "")
    assert action["run_id"] == run["run_id"] and action["approval"] is None
    assert action["fingerprint"] != "0" * 64
    assert Action.objects.get(pk=action["action_id"]).tenant == agent_a.tenant
    revised = ok(
        post(
            client,
            f"runs/{run['run_id']}/revisions/",
            {"goal": {}, "expected_goal_rev": 1, "goal_rev": 10, "status": "completed"},
        )
    )
    assert (revised["goal_rev"], revised["status"]) != (10, "completed")
    assert revised["goal_rev"] == 2


def test_server_owned_fields_in_a_decision_are_ignored(
    agent_a: Persona, reviewer_a: Persona, outsider_b: Persona
) -> None:
    objects = world(agent_a)
    alice = session(reviewer_a.user)
    data = ok(
        post(
            alice,
            f"approvals/{objects['approval_id']}/decision/",
            {
                "decision": "approve",
                "action_hash": objects["action_hash"],
                "reason": "fine",
                "decided_by": "bob",
                "status": "rejected",
                "decided_at": "2000-01-01T00:00:00Z",
                "quorum": 5,
                "run_id": str(uuid.uuid4()),
            },
        )
    )
    assert (data["status"], data["decided_by"]) == ("approved", "alice")
    assert not data["decided_at"].startswith("2000") and data["quorum"] == 1
    assert data["run_id"] == objects["run_id"]
    stored = ApprovalRequest.objects.get(pk=objects["approval_id"])
    assert stored.decided_by == reviewer_a.user
