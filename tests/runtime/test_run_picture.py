"""The run as a picture (issue 20): the Steps panel names the graph's steps with the current
one marked, and the Flow view groups the journal into step visits with durations — both in
the live fragment the page polls, so they move with the header.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from html import unescape
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.decisions import decide
from approvals.expiry import sweep_approvals
from approvals.models import ApprovalPolicy, ApprovalRequest
from approvals.policies import grant
from runtime import protocol
from runtime.executor import advance_run
from runtime.leases import take_lease
from runtime.lifecycle import cancel_run, create_run, revise_goal
from runtime.models import Run, Tenant
from runtime.pages.picture import duration_words
from tests.conftest import Persona
from tests.sandbox import Sandbox

HX = {"HTTP_HX_REQUEST": "true"}
GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
STEPS = ["read_specs", "analyse", "report", "propose_task"]


def text(html: str) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def steps_of(html: str) -> dict[str, tuple[str, str]]:
    """step name -> (mark class, the row's text) from the Steps panel."""
    rows = re.findall(r'<li class="step ([a-z-]+)" data-step="([^"]+)"[^>]*>(.*?)</li>', html, re.S)
    return {name: (mark, text(body)) for mark, name, body in rows}


def section(html: str, ident: str) -> str:
    found = re.search(rf'<section class="card [^"]*" id="{ident}".*?</section>', html, re.S)
    assert found is not None, ident
    return found.group(0)


@pytest.fixture
def held(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> tuple[Run, ApprovalRequest]:
    """An api-review run parked at its hold point (tasks.create, decided by A's reviewers)."""
    policy = ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tasks need review", tool="tasks.create"
    )
    grant(policy, Group.objects.get(name="acme-reviewers"))
    sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    return run, ApprovalRequest.objects.get(run=run)


def test_the_steps_panel_marks_the_step_waiting_for_approval_then_all_done(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request = held
    client.force_login(reviewer_a.user)
    page = client.get(reverse("run", args=[run.run_id])).content.decode()
    steps = steps_of(section(page, "run-steps"))
    assert list(steps) == STEPS  # the graph's order
    for name in ("read_specs", "analyse", "report"):
        mark, row = steps[name]
        assert mark == "done" and "done" in row and "1 visit" in row
        assert re.search(r"\d+(\.\d)? s", row), row  # its total duration
    mark, row = steps["propose_task"]
    assert mark == "current" and "current — waiting for approval" in row
    assert 'aria-current="step"' in section(page, "run-steps")
    assert "(start)" in steps["read_specs"][1]

    flow = text(section(page, "run-flow"))
    assert "recorded call spec:shop-v1" in flow and "recorded call spec:shop-v2" in flow
    assert "action tasks.create awaiting_approval" in flow
    assert "approval requested policy tasks need review" in flow
    assert "so far" in flow and "in progress" in flow  # the open request and visit count on
    assert "Timeline" in page and "step_committed" in page  # the audit view stays below
    # The held action's row links to its request, where a reviewer decides it.
    decide_link = f'<a href="{reverse("approval-page", args=[request.pk])}">decide…</a>'
    assert decide_link in page

    decide(request.pk, reviewer_a.user, "approve", request.action_hash)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    run.refresh_from_db()
    live_url = unescape(re.search(r'id="run-live"[^>]*hx-get="([^"]+)"', page).group(1))  # type: ignore[union-attr]
    live = client.get(live_url, **HX).content.decode()
    steps = steps_of(section(live, "run-steps"))  # the poll carries the panel
    assert {name: mark for name, (mark, _) in steps.items()} == dict.fromkeys(STEPS, "done")
    flow = text(section(live, "run-flow"))
    assert "approval approved" in flow and "approve by user:alice" in flow
    assert "awaiting_approval → approved" in flow and "→ confirmed" in flow
    assert "completed the run" in flow and "in progress" not in flow
    assert "decide…" not in live  # decided: nothing to link to


def test_a_queued_run_marks_its_start_step_and_nothing_reached(
    client: Client, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    run = create_run(tenant_a, "api-review", GOAL, actor="user:bob")
    client.force_login(reviewer_a.user)
    steps = steps_of(client.get(reverse("run", args=[run.run_id])).content.decode())
    assert steps["read_specs"][0] == "current" and "current — queued" in steps["read_specs"][1]
    assert [steps[n][0] for n in STEPS[1:]] == ["not-reached"] * 3
    assert "not reached" in steps["analyse"][1] and "—" in steps["analyse"][1]


def test_an_external_run_is_one_step_api_counting_its_checkpoints(
    client: Client, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    run = create_run(tenant_a, "chain", {"steps": 3}, actor="agent:t", external=True)
    fence = take_lease(run.run_id, "p1", 30, runnable_only=False).fence
    run = Run.objects.get(pk=run.pk)
    protocol.write_checkpoint(run, fence, 0, {"n": 1}, "tick", "agent:t")
    protocol.write_checkpoint(run, fence, 1, {"n": 2}, "tick", "agent:t")
    client.force_login(reviewer_a.user)
    page = client.get(reverse("run", args=[run.run_id])).content.decode()
    steps = steps_of(page)
    assert list(steps) == ["api"]  # not the graph's own steps: the executor is outside
    mark, row = steps["api"]
    assert mark == "current" and "current — running" in row and "2 visits" in row
    assert "counts checkpoints as visits" in text(section(page, "run-steps"))


def test_durations_read_as_words() -> None:
    assert duration_words(timedelta(seconds=0.42)) == "0.4 s"
    assert duration_words(timedelta(seconds=75)) == "1 min 15 s"
    assert duration_words(timedelta(hours=2, minutes=10)) == "2 h 10 min"


def test_a_rejection_reads_as_rejected_in_the_flow(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request = held
    decide(request.pk, reviewer_a.user, "reject", request.action_hash, reason="not now")
    advance_run(run.run_id, "w1")
    client.force_login(reviewer_a.user)
    flow = text(section(client.get(reverse("run", args=[run.run_id])).content.decode(), "run-flow"))
    assert "approval rejected" in flow and "reject by user:alice" in flow
    assert "→ cancelled" in flow


def decisions_of(html: str) -> list[tuple[bool, str]]:
    """(still open, the item's text) of each decision in the Flow, in order."""
    items = re.findall(
        r'<li class="flow-item decision( open)?">(.*?)</li>', section(html, "run-flow"), re.S
    )
    return [(bool(is_open), text(body)) for is_open, body in items]


def test_an_expired_request_ends_in_the_flow_and_its_re_request_is_the_open_one(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request = held
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert sweep_approvals() == 1  # the default policy: closed as expired, asked once more
    client.force_login(reviewer_a.user)
    expired, again = decisions_of(client.get(reverse("run", args=[run.run_id])).content.decode())
    assert not expired[0], expired  # no longer counting on as an open request
    assert expired[1].startswith("approval expired policy tasks need review")
    assert "expired by system:expirer: nobody decided before expiry" in expired[1]
    assert "so far" not in expired[1] and re.search(r"\d+(\.\d)? s$", expired[1]), expired
    assert again[0] and again[1].startswith("approval requested") and "so far" in again[1]


def test_a_request_superseded_by_a_goal_revision_ends_in_the_flow(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, _ = held
    revise_goal(run, {**GOAL, "scope": ["/orders"]}, run.goal_rev, actor="user:bob")
    client.force_login(reviewer_a.user)
    (closed,) = decisions_of(client.get(reverse("run", args=[run.run_id])).content.decode())
    assert not closed[0] and "so far" not in closed[1], closed
    assert closed[1].startswith("approval superseded")
    assert "superseded by user:bob: goal revised" in closed[1]


def test_an_approval_superseded_at_dispatch_keeps_its_decision_and_says_what_became_of_it(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, request = held
    decide(request.pk, reviewer_a.user, "approve", request.action_hash)
    # The approval lapses before the run sends the action: dispatch supersedes it, asks again.
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    client.force_login(reviewer_a.user)
    lapsed, again = decisions_of(client.get(reverse("run", args=[run.run_id])).content.decode())
    assert not lapsed[0] and lapsed[1].startswith("approval approved, then superseded"), lapsed
    assert "approve by user:alice" in lapsed[1] and "superseded by " not in lapsed[1]
    assert "superseded: expired at " in lapsed[1]
    assert "before it was sent; re-requested" in lapsed[1]
    assert again[0] and again[1].startswith("approval requested")


def test_a_cancelled_run_shows_its_last_visit_ended_with_its_request_cancelled(
    client: Client, reviewer_a: Persona, held: Any
) -> None:
    run, _ = held
    cancel_run(run, "not needed any more", actor="user:bob")
    client.force_login(reviewer_a.user)
    page = client.get(reverse("run", args=[run.run_id])).content.decode()
    flow = text(section(page, "run-flow"))
    assert "propose_task cancelled the run" in flow and "in progress" not in flow
    (closed,) = decisions_of(page)
    assert not closed[0] and closed[1].startswith("approval cancelled"), closed
    assert "cancelled by user:bob: run cancelled" in closed[1]
    assert "action tasks.create awaiting_approval → cancelled" in flow


JSON_WORDS = ["true", "null", "1e2"]  # step names that are also JSON texts


@pytest.fixture
def json_named_graph() -> Any:
    from runtime.graphs import Complete, Graph, Next, registry

    graph = Graph("json_named", version="1")
    for position, name in enumerate(JSON_WORDS):
        after = JSON_WORDS[position + 1] if position + 1 < len(JSON_WORDS) else None

        def step(ctx: Any, after: str | None = after) -> Any:
            return Next(after, update={}) if after else Complete(update={})

        graph.step(step, start=position == 0, name=name)
    registry.register(graph)
    yield graph
    registry.unregister("json_named", "1")


def test_step_names_that_are_json_texts_are_counted_under_their_own_names(
    tenant_a: Tenant, json_named_graph: Any
) -> None:
    """The Steps panel reads each step commit's name out of its journal payload. On SQLite
    Django decoded the extracted text as JSON, so a step named "true" came back as True
    ("True"), "null" as None ("") and "1e2" as 100.0: their visits went uncounted and the
    panel said they were never reached."""
    from audit.journal import run_stream
    from audit.models import JournalEntry
    from runtime.pages.picture import steps_panel

    run = create_run(tenant_a, "json_named", {}, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    run.refresh_from_db()
    rows = steps_panel(run, JournalEntry.objects.filter(stream=run_stream(run.run_id)))
    assert [(row.name, row.mark, row.visits) for row in rows] == [
        (name, "done", 1) for name in JSON_WORDS
    ]
