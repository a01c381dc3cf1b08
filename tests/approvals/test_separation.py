"""Separation of duties (issue 16 M1): whoever shaped an action — started the run, revised
its goal, or gave it input since the run's last decision — may not decide it, over the API
or on the page; someone else's approval works. Shapers are recorded by the writers
(`runtime.shapers.record_shaper`), not inferred at decision time.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from django.apps import apps
from django.test import Client
from django.urls import reverse

from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, ApprovalVote
from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Wait, register
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Role, Run, RunShaper, RunStatus, Tenant
from tests.approvals.conftest import GOAL
from tests.conftest import Persona, make_persona
from tests.sandbox import Sandbox

A = ApprovalStatus

# A run that asks a person for the task titles, then creates two tasks (each held).
titled = Graph("titled", version="1", tools=("tasks.create",))


@titled.step(start=True)
def ask(ctx: Any) -> Any:
    return Wait("input", then="act", prompt="Which titles?")


@titled.step
def act(ctx: Any) -> Any:
    for title in ctx.input["titles"]:
        ctx.act("tasks.create", {"title": title})
    return Complete()


register(titled)


@pytest.fixture
def beth(tenant_a: Tenant) -> Persona:
    """A second reviewer of tenant A, in the same reviewer group as alice."""
    return make_persona(tenant_a, "beth", Role.REVIEWER)


def _snapshot(request: ApprovalRequest) -> tuple[Any, ...]:
    """What a refused decision must leave as it was: the request, its votes, the action,
    and the journal (every stream; the test client's own logins aside)."""
    request.refresh_from_db()
    action = Action.objects.get(pk=request.action_id)
    return (
        request.status,
        request.action_hash,
        request.decided_by_id,
        ApprovalVote.objects.count(),
        action.status,
        action.params,
        JournalEntry.objects.exclude(type="login").count(),
    )


def _decide_api(persona: Persona, request: ApprovalRequest) -> Any:
    return persona.api().post(
        f"/api/v1/approvals/{request.pk}/decision/",
        {"decision": "approve", "action_hash": request.action_hash, "reason": ""},
        format="json",
    )


def _decide_page(persona: Persona, request: ApprovalRequest) -> Any:
    client = Client()
    client.force_login(persona.user)
    page = client.get(reverse("approval-page", args=[request.pk]))
    assert "You shaped this action" in page.content.decode()
    assert 'id="approve-form"' not in page.content.decode()  # no decision forms for them
    return client.post(
        reverse("approval-page-decide", args=[request.pk]),
        {"decision": "approve", "action_hash": request.action_hash, "params-typed": "1"},
    )


DECIDERS: dict[str, Callable[[Persona, ApprovalRequest], Any]] = {
    "api": _decide_api,
    "page": _decide_page,
}


def _refused(response: Any, channel: str) -> None:
    assert response.status_code == 403
    if channel == "api":
        assert response.json()["code"] == "not_permitted"
        assert "whoever shaped this action" in response.json()["detail"]
    else:
        said = [str(m) for m in response.context["messages"]]
        assert any(m.startswith("Not permitted: whoever shaped this action") for m in said)


@pytest.mark.parametrize("channel", ["api", "page"])
def test_whoever_revised_the_goal_cannot_approve_the_action_it_produced(
    held: Any, reviewer_a: Persona, beth: Persona, channel: str
) -> None:
    run, first, box = held  # started by an agent
    revised = beth.api().post(
        f"/api/v1/runs/{run.run_id}/revisions/",
        {"goal": {**GOAL, "scope": ["/orders"]}, "expected_goal_rev": 1},
        format="json",
    )
    assert revised.status_code == 200, revised.content
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert request.action.goal_rev == 2
    assert RunShaper.objects.filter(run=run, actor="user:beth", kind="revised").count() == 1
    before = _snapshot(request)
    _refused(DECIDERS[channel](beth, request), channel)
    assert _snapshot(request) == before  # nothing decided, nothing journalled
    # Someone who did not shape it approves: the task is created once.
    approved = _decide_api(reviewer_a, request)
    assert approved.status_code == 200 and approved.json()["status"] == "approved"
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


@pytest.mark.parametrize("channel", ["api", "page"])
def test_whoever_gave_input_cannot_approve_the_actions_it_produced(
    tenant_a: Tenant,
    policy: ApprovalPolicy,
    reviewer_a: Persona,
    beth: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    channel: str,
) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "titled", {}, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING_INPUT
    # beth answers the run's question on its page: she shaped what it does next.
    client = Client()
    client.force_login(beth.user)
    given = client.post(
        reverse("run-input", args=[run.run_id]),
        {"input": json.dumps({"titles": ["First", "Second"]}), "expected_rev": run.checkpoint_rev},
    )
    assert given.status_code in (200, 302), given.content
    assert RunShaper.objects.filter(run=run, actor="user:beth", kind="input").count() == 1
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    first = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    before = _snapshot(first)
    _refused(DECIDERS[channel](beth, first), channel)
    assert _snapshot(first) == before
    assert _decide_api(reviewer_a, first).status_code == 200
    # After that decision, beth's earlier input no longer makes her a shaper: she may
    # decide the run's next action (the quorum is someone who did not shape it since).
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    second = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert second.pk != first.pk
    answered = _decide_api(beth, second)
    assert answered.status_code == 200, answered.content
    assert answered.json()["status"] == "approved"
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert sorted(t["title"] for t in box.tasks()) == ["First", "Second"]


def test_the_goal_revision_in_force_keeps_its_author_a_shaper(
    held: Any, reviewer_a: Persona, beth: Persona, tenant_a: Tenant
) -> None:
    """The author of the goal an action was prepared under shaped it even after another
    decision on the run: a later request of the same revision still refuses them."""
    run, first, box = held
    beth.api().post(
        f"/api/v1/runs/{run.run_id}/revisions/",
        {"goal": {**GOAL, "scope": ["/orders"]}, "expected_goal_rev": 1},
        format="json",
    )
    advance_run(run.run_id, "w1")
    request = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    # An earlier request of the run decided after the revision (made here directly).
    ApprovalRequest.objects.filter(pk=first.pk).update(decided_at=request.created_at)
    _refused(_decide_api(beth, request), "api")


def test_a_repeated_vote_on_a_pending_quorum_request_is_a_replay(
    held: Any, reviewer_a: Persona, beth: Persona
) -> None:
    """API.md: repeating the decision that applied returns 200 with the same approval —
    also while a quorum request still waits for more votes (issue 16 L7), not 409."""
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(quorum=2)
    first = _decide_api(reviewer_a, request)
    assert first.status_code == 200 and first.json()["status"] == "pending"
    entries = JournalEntry.objects.exclude(type="login").count()
    again = _decide_api(reviewer_a, request)
    assert again.status_code == 200, again.content
    assert again.json() == first.json()
    assert ApprovalVote.objects.filter(request=request).count() == 1
    assert JournalEntry.objects.exclude(type="login").count() == entries  # replays write nothing
    other = reviewer_a.api().post(
        f"/api/v1/approvals/{request.pk}/decision/",
        {"decision": "reject", "action_hash": request.action_hash, "reason": "no"},
        format="json",
    )
    assert other.status_code == 409 and other.json()["code"] == "already_decided"
    done = _decide_api(beth, request)
    assert done.status_code == 200 and done.json()["status"] == "approved"
    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1
    assert Action.objects.get(pk=request.action_id).status == ActionStatus.CONFIRMED
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def test_the_migration_backfills_shapers_of_unfinished_runs(
    held: Any, beth: Persona, tenant_a: Tenant
) -> None:
    """Runs in flight at the upgrade keep their shapers: the migration reads the starter
    from the run and revisions and input from its journal (finished runs get none)."""
    run, request, box = held
    beth.api().post(
        f"/api/v1/runs/{run.run_id}/revisions/",
        {"goal": {**GOAL, "scope": ["/orders"]}, "expected_goal_rev": 1},
        format="json",
    )
    finished = create_run(tenant_a, "chain", {"steps": 1}, actor="user:beth")
    assert advance_run(finished.run_id, "w1").outcome == "completed"
    written = sorted(RunShaper.objects.filter(run=run).values_list("actor", "kind", "goal_rev"))
    RunShaper.objects.all().delete()  # as before the upgrade
    migration = importlib.import_module("runtime.migrations.0017_run_shapers")
    migration.backfill(apps, None)
    assert sorted(RunShaper.objects.values_list("actor", "kind", "goal_rev")) == written
    assert written == [("agent:agent-a", "started", 1), ("user:beth", "revised", 2)]
    assert not RunShaper.objects.filter(run=finished).exists()
