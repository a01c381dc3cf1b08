"""Runs over the API (API.md, "Runs"): every call's success shape and every refusal code.

Refusals are asserted on HTTP status, the stable `code` and application/problem+json.
Runs are driven through the API as an external executor would (lease, checkpoint with a
status) or, where only a hosted graph gets there (needs_attention), by the real engine.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from rest_framework.test import APIClient

from runtime.api.base import Cursor
from runtime.executor import advance_run
from runtime.models import Run, RunStatus
from tests.api import (
    fresh_throttle,  # noqa: F401
    get,
    new_run,
    ok,
    post,
    problem,
    row_counts,
    take_lease,
)
from tests.conftest import Persona
from tests.runtime.helpers import make_due

pytestmark = pytest.mark.django_db

RUN_FIELDS = {
    "run_id",
    "thread_id",
    "graph",
    "graph_version",
    "status",
    "goal",
    "goal_rev",
    "checkpoint_rev",
    "next_step",
    "waiting_for",
    "lease",
    "created_at",
    "updated_at",
}
CHECKPOINT_FIELDS = {"rev", "goal_rev", "next_step", "state", "digest", "created_at", "created_by"}
ENTRY_FIELDS = {"seq", "type", "actor", "payload", "prev_hash", "hash", "created_at"}


def assert_run(data: dict[str, Any]) -> None:
    assert RUN_FIELDS <= set(data), RUN_FIELDS - set(data)
    assert set(data["lease"]) >= {"owner", "expires_at", "fence"}
    assert data["status"] in RunStatus.values
    uuid.UUID(data["run_id"])
    assert data["created_at"].endswith("Z") and data["updated_at"].endswith("Z")


def checkpoint(client: APIClient, run_id: str, fence: int, expected_rev: int, **fields: Any) -> Any:
    body = {
        "fence": fence,
        "expected_rev": expected_rev,
        "state": {"step": expected_rev + 1},
        "next_step": "tick",
        **fields,
    }
    return post(client, f"runs/{run_id}/checkpoints/", body)


def waiting_input(client: APIClient) -> dict[str, Any]:
    """A run an external executor parked on input (checkpoint with status waiting_input)."""
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    ok(checkpoint(client, run["run_id"], fence, 0, status="waiting_input"), 201)
    data = ok(get(client, f"runs/{run['run_id']}/"))
    assert data["status"] == "waiting_input" and data["checkpoint_rev"] == 1
    return data


def completed(client: APIClient) -> dict[str, Any]:
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    ok(checkpoint(client, run["run_id"], fence, 0, status="completed", next_step=""), 201)
    return ok(get(client, f"runs/{run['run_id']}/"))


def cancelled(client: APIClient) -> dict[str, Any]:
    run = new_run(client)
    return ok(post(client, f"runs/{run['run_id']}/cancel/", {"reason": "not needed"}))


# --- POST runs/ ------------------------------------------------------------------------------


def test_create_run_answers_201_with_the_run(agent_a: Persona) -> None:
    data = new_run(
        agent_a.api(), goal={"steps": 2, "note": "ü"}, thread_id="thread-1", graph_version="1"
    )
    assert_run(data)
    assert data["graph"] == "chain" and data["graph_version"] == "1" and data["external"] is True
    assert data["thread_id"] == "thread-1"
    assert data["goal"] == {"steps": 2, "note": "ü"}
    assert (data["status"], data["goal_rev"], data["checkpoint_rev"]) == ("queued", 1, 0)
    assert data["lease"] == {"owner": "", "expires_at": None, "fence": 0}
    assert data["waiting_for"] is None
    run = Run.objects.get(pk=data["run_id"])
    assert run.tenant == agent_a.tenant and run.created_by == "agent:agent-a"


def test_create_run_with_only_graph_and_goal(agent_a: Persona) -> None:
    data = ok(post(agent_a.api(), "runs/", {"graph": "chain", "goal": {}}), 201)
    assert data["thread_id"]
    assert data["graph_version"] == "1"  # the latest registered version is pinned
    assert data.get("external", False) is False  # a hosted run unless the agent says so


@pytest.mark.parametrize(
    "body",
    [
        {"graph": "no-such-graph", "goal": {}},
        {"graph": "chain", "goal": {}, "graph_version": "99"},
    ],
    ids=["unknown-name", "unknown-version"],
)
def test_create_run_with_an_unknown_graph_is_422(agent_a: Persona, body: dict[str, Any]) -> None:
    before = row_counts()
    data = problem(post(agent_a.api(), "runs/", body), 422, "unknown_graph")
    assert data["detail"]
    assert row_counts() == before


def test_create_run_with_missing_fields_has_field_errors(agent_a: Persona) -> None:
    data = problem(post(agent_a.api(), "runs/", {}), 400, "invalid_request")
    assert set(data["errors"]) == {"graph", "goal"}


# --- GET runs/ and runs/{id}/ ---------------------------------------------------------------


def test_get_run_answers_200_and_another_tenants_run_is_404(
    agent_a: Persona, agent_b: Persona
) -> None:
    mine = new_run(agent_a.api())
    theirs = new_run(agent_b.api())
    data = ok(get(agent_a.api(), f"runs/{mine['run_id']}/"))
    assert_run(data)
    assert data["run_id"] == mine["run_id"]
    foreign = get(agent_a.api(), f"runs/{theirs['run_id']}/")
    missing = get(agent_a.api(), f"runs/{uuid.uuid4()}/")
    problem(foreign, 404, "not_found")
    assert foreign.content == missing.content


def test_list_filters_by_status_thread_and_graph(agent_a: Persona, agent_b: Persona) -> None:
    client = agent_a.api()
    a1 = new_run(client, thread_id="t-1")
    a2 = new_run(client, thread_id="t-2")
    asker = new_run(client, graph="asker", goal={}, thread_id="t-1")
    gone = cancelled(client)
    new_run(agent_b.api(), thread_id="t-1")  # another tenant, same thread id

    def ids(query: str) -> set[str]:
        page = ok(get(client, f"runs/{query}"))
        assert set(page) >= {"next", "previous", "results"}
        for item in page["results"]:
            assert_run(item)
        return {r["run_id"] for r in page["results"]}

    assert ids("") == {a1["run_id"], a2["run_id"], asker["run_id"], gone["run_id"]}
    assert ids("?thread_id=t-1") == {a1["run_id"], asker["run_id"]}
    assert ids("?graph=asker") == {asker["run_id"]}
    assert ids("?status=cancelled") == {gone["run_id"]}
    assert ids("?status=queued&thread_id=t-2") == {a2["run_id"]}
    assert ids("?graph=chain&status=completed") == set()


def test_list_refuses_an_unknown_status(agent_a: Persona) -> None:
    data = problem(get(agent_a.api(), "runs/?status=sleeping"), 422, "invalid_params")
    assert "status" in data["errors"]


def test_list_is_cursor_paginated(agent_a: Persona, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Cursor, "page_size", 2)
    client = agent_a.api()
    created = [new_run(client)["run_id"] for _ in range(5)]
    seen: list[str] = []
    pages: list[dict[str, Any]] = []
    url: str | None = "/api/v1/runs/"
    while url:
        page = ok(client.get(url))
        pages.append(page)
        assert len(page["results"]) <= 2
        seen += [r["run_id"] for r in page["results"]]
        url = page["next"]
    assert seen == list(reversed(created))  # newest first, each exactly once
    assert len(pages) == 3
    assert pages[0]["previous"] is None and pages[-1]["next"] is None
    back = ok(client.get(pages[1]["previous"]))
    assert [r["run_id"] for r in back["results"]] == seen[:2]


# --- POST runs/{id}/revisions/ ---------------------------------------------------------------


def test_revision_answers_200_with_goal_rev_plus_one(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    data = ok(
        post(
            client,
            f"runs/{run['run_id']}/revisions/",
            {"goal": {"steps": 5}, "expected_goal_rev": 1},
        )
    )
    assert_run(data)
    assert data["goal_rev"] == 2 and data["goal"] == {"steps": 5}


def test_revision_with_a_stale_expected_goal_rev_is_409_version_conflict(
    agent_a: Persona,
) -> None:
    client = agent_a.api()
    run = new_run(client)
    url = f"runs/{run['run_id']}/revisions/"
    ok(post(client, url, {"goal": {"steps": 4}, "expected_goal_rev": 1}))
    problem(
        post(client, url, {"goal": {"steps": 9}, "expected_goal_rev": 1}), 409, "version_conflict"
    )
    assert Run.objects.get(pk=run["run_id"]).goal == {"steps": 4}


@pytest.mark.parametrize("finish", [cancelled, completed], ids=["cancelled", "completed"])
def test_revision_of_a_finished_run_is_409_run_finished(agent_a: Persona, finish: Any) -> None:
    client = agent_a.api()
    run = finish(client)
    response = post(
        client, f"runs/{run['run_id']}/revisions/", {"goal": {}, "expected_goal_rev": 1}
    )
    problem(response, 409, "run_finished")


# --- POST runs/{id}/input/ -------------------------------------------------------------------


def test_input_to_a_waiting_run_answers_200(agent_a: Persona) -> None:
    client = agent_a.api()
    run = waiting_input(client)
    data = ok(
        post(client, f"runs/{run['run_id']}/input/", {"data": {"title": "x"}, "expected_rev": 1})
    )
    assert_run(data)
    assert data["status"] == "queued" and data["waiting_for"] is None
    assert Run.objects.get(pk=run["run_id"]).pending_input == {"title": "x"}


def test_input_to_a_run_not_waiting_is_409_not_waiting_input(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    response = post(client, f"runs/{run['run_id']}/input/", {"data": {}, "expected_rev": 0})
    problem(response, 409, "not_waiting_input")


def test_input_with_a_stale_expected_rev_is_409_version_conflict(agent_a: Persona) -> None:
    client = agent_a.api()
    run = waiting_input(client)
    response = post(client, f"runs/{run['run_id']}/input/", {"data": {}, "expected_rev": 0})
    problem(response, 409, "version_conflict")
    assert Run.objects.get(pk=run["run_id"]).status == RunStatus.WAITING_INPUT


# --- POST runs/{id}/cancel/ ------------------------------------------------------------------


def test_cancel_answers_200_then_409_run_finished(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    url = f"runs/{run['run_id']}/cancel/"
    data = ok(post(client, url, {"reason": "wrong repo"}))
    assert_run(data)
    assert data["status"] == "cancelled"
    assert data["lease"]["owner"] == "" and data["lease"]["fence"] == fence
    problem(post(client, url, {"reason": "again"}), 409, "run_finished")
    problem(post(client, url, {}), 409, "run_finished")


def test_cancel_of_a_completed_run_is_409_run_finished(agent_a: Persona) -> None:
    client = agent_a.api()
    run = completed(client)
    problem(post(client, f"runs/{run['run_id']}/cancel/", {}), 409, "run_finished")


def test_a_viewer_may_look_but_not_cancel(agent_a: Persona, viewer_a: Persona) -> None:
    run = new_run(agent_a.api())
    ok(get(viewer_a.api(), f"runs/{run['run_id']}/"))
    problem(post(viewer_a.api(), f"runs/{run['run_id']}/cancel/", {}), 403, "not_permitted")
    assert Run.objects.get(pk=run["run_id"]).status == RunStatus.QUEUED


# --- POST runs/{id}/resume/ ------------------------------------------------------------------


def test_resume_answers_202_and_wakes_a_run_that_needs_attention(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client, graph="flaky", goal={"fail_times": 3}, external=False)
    for attempt in range(3):
        if attempt:
            make_due(run["run_id"])
        advance_run(run["run_id"], "w1")
    assert Run.objects.get(pk=run["run_id"]).status == RunStatus.NEEDS_ATTENTION
    response = post(client, f"runs/{run['run_id']}/resume/", {"expected_rev": 0})
    data = ok(response, 202)
    assert_run(data)
    assert data["status"] == "queued" and data["attention_reason"] == ""


def test_resume_with_a_stale_expected_rev_is_409_version_conflict(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    ok(checkpoint(client, run["run_id"], fence, 0), 201)
    response = post(client, f"runs/{run['run_id']}/resume/", {"expected_rev": 0})
    problem(response, 409, "version_conflict")


def test_resume_of_a_completed_run_is_409_already_completed(agent_a: Persona) -> None:
    client = agent_a.api()
    run = completed(client)
    problem(post(client, f"runs/{run['run_id']}/resume/", {}), 409, "already_completed")


def test_resume_of_a_cancelled_run_is_409_run_finished(agent_a: Persona) -> None:
    client = agent_a.api()
    run = cancelled(client)
    problem(post(client, f"runs/{run['run_id']}/resume/", {}), 409, "run_finished")


# --- checkpoints, events, actions of a run ---------------------------------------------------


def test_checkpoints_list_and_detail(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    for rev in range(3):
        ok(checkpoint(client, run["run_id"], fence, rev, next_step=f"s{rev + 1}"), 201)
    page = ok(get(client, f"runs/{run['run_id']}/checkpoints/"))
    assert set(page) >= {"next", "previous", "results"}
    assert [c["rev"] for c in page["results"]] == [3, 2, 1]
    for item in page["results"]:
        assert CHECKPOINT_FIELDS <= set(item)
    one = ok(get(client, f"runs/{run['run_id']}/checkpoints/2/"))
    assert CHECKPOINT_FIELDS <= set(one)
    assert (one["rev"], one["goal_rev"], one["next_step"]) == (2, 1, "s2")
    assert one["state"] == {"step": 2} and len(one["digest"]) == 64
    assert one["created_by"] == f"agent:agent-a#{fence}"
    problem(get(client, f"runs/{run['run_id']}/checkpoints/4/"), 404, "not_found")


def test_events_after_a_sequence_number(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    ok(checkpoint(client, run["run_id"], fence, 0), 201)
    every = ok(get(client, f"runs/{run['run_id']}/events/"))["results"]
    assert [e["seq"] for e in every] == list(range(1, len(every) + 1))
    assert [e["type"] for e in every][:3] == ["run_created", "lease_taken", "step_committed"]
    for entry in every:
        assert ENTRY_FIELDS <= set(entry)
    for before, after in zip(every, every[1:], strict=False):
        assert after["prev_hash"] == before["hash"]
    later = ok(get(client, f"runs/{run['run_id']}/events/?after=2"))["results"]
    assert later == every[2:]
    assert ok(get(client, f"runs/{run['run_id']}/events/?after={len(every)}"))["results"] == []
    problem(get(client, f"runs/{run['run_id']}/events/?after=x"), 422, "invalid_params")


def test_actions_of_a_run_is_a_page(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    other = new_run(client)
    fence = take_lease(client, run["run_id"])
    prepared = [
        ok(
            post(
                client,
                f"runs/{run['run_id']}/actions/",
                {"fence": fence, "tool": "tasks.create", "params": {"title": f"t{i}"}},
            ),
            201,
        )
        for i in range(2)
    ]
    page = ok(get(client, f"runs/{run['run_id']}/actions/"))
    assert set(page) >= {"next", "previous", "results"}
    assert {a["action_id"] for a in page["results"]} == {a["action_id"] for a in prepared}
    assert ok(get(client, f"runs/{other['run_id']}/actions/"))["results"] == []
