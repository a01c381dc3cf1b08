"""Odd input on the reviewer pages (issue 16, L1): each value the attack found answering 500
is a 400 page that names the field and the reason, and nothing is written.

The pages validate through the API's own FilterSets and request serializers (and a Django
form for the inbox's filters), so the same value gets the same refusal through either door.
Run on SQLite and PostgreSQL: PostgreSQL text cannot hold NUL, SQLite integers overflow.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from approvals.models import ApprovalRequest, ApprovalStatus
from runtime.models import Run, RunStatus
from tests.conftest import Persona
from tests.security.matrix import changed_tables, db_state, sessions_of
from tests.security.world import World, build_world

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(settings: Any, agent_a: Persona, reviewer_a: Persona) -> World:
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    return build_world(agent_a, reviewer_a)


@pytest.fixture
def reviewer(world: World) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(world.reviewer.user)
    return client


def refused_400(response: Any, field: str) -> str:
    text = response.content.decode()
    assert response.status_code == 400, text[:500]
    assert "This input cannot be used" in text and field in text
    assert "Nothing was changed." in text
    return text


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"policy": "²"}, "policy"),  # '²'.isdigit() is True, int('²') raises
        ({"policy": "99999999999999999999999"}, "policy"),  # SQLite: integer overflow
        ({"policy": "-1"}, "policy"),
        ({"policy": "x"}, "policy"),
        ({"tool": "a\x00b"}, "tool"),  # PostgreSQL: text cannot hold NUL
        ({"tool": "t" * 101}, "tool"),
        ({"mine": "yes"}, "mine"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("page", ["/inbox/", "/inbox/list/"])
def test_odd_inbox_filters_are_a_400_page(
    reviewer: Client, page: str, query: dict[str, str], field: str
) -> None:
    before = db_state(sessions_of(reviewer))
    refused_400(reviewer.get(page, query), field)
    assert changed_tables(before, db_state(sessions_of(reviewer))) == []


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"graph": "a\x00b"}, "graph"),
        ({"thread_id": "a\x00b"}, "thread_id"),
        ({"thread_id": "t" * 201}, "thread_id"),
        ({"status": "no-such-status"}, "status"),
    ],
    ids=repr,
)
def test_odd_run_filters_are_a_400_page(
    reviewer: Client, query: dict[str, str], field: str
) -> None:
    before = db_state(sessions_of(reviewer))
    refused_400(reviewer.get("/runs/", query), field)
    assert changed_tables(before, db_state(sessions_of(reviewer))) == []


def test_the_filters_still_filter(reviewer: Client, world: World) -> None:
    """The validated filters select what they did: valid values are unchanged."""
    page = reviewer.get("/inbox/", {"policy": str(world.policy.pk), "mine": "1"})
    assert page.status_code == 200
    assert [str(c.request.pk) for c in page.context["cards"]] == [world.approval_id]
    page = reviewer.get("/runs/", {"thread_id": f"thread-of-{world.slug}", "status": ""})
    assert page.status_code == 200 and len(page.context["page_obj"]) == 3


def test_nul_in_the_cancel_reason_is_a_400_and_the_run_runs_on(
    reviewer: Client, world: World
) -> None:
    run = Run.objects.get(pk=world.other_run_id)
    before = db_state(sessions_of(reviewer))
    response = reviewer.post(f"/runs/{run.run_id}/cancel/", {"reason": "a\x00b"})
    refused_400(response, "reason")
    assert changed_tables(before, db_state(sessions_of(reviewer))) == []
    run.refresh_from_db()
    assert run.status != RunStatus.CANCELLED


def test_nul_in_the_reject_reason_is_a_400_and_the_request_stays_pending(
    reviewer: Client, world: World
) -> None:
    form = {"decision": "reject", "action_hash": world.approval_hash, "reason": "a\x00b"}
    before = db_state(sessions_of(reviewer))
    response = reviewer.post(f"/approvals/{world.approval_id}/decide/", form)
    refused_400(response, "reason")
    assert changed_tables(before, db_state(sessions_of(reviewer))) == []
    assert ApprovalRequest.objects.get(pk=world.approval_id).status == ApprovalStatus.PENDING


def test_nul_in_a_reconcile_note_is_a_400_and_the_action_stays_parked(
    reviewer: Client, world: World
) -> None:
    form = {"outcome": "applied", "external_id": "T-1", "note": "a\x00b"}
    before = db_state(sessions_of(reviewer))
    response = reviewer.post(f"/reconcile/{world.parked_id}/resolve/", form)
    refused_400(response, "note")
    assert changed_tables(before, db_state(sessions_of(reviewer))) == []


def test_nul_in_a_new_runs_thread_id_is_refused_and_creates_nothing(
    reviewer: Client, world: World
) -> None:
    before = db_state(sessions_of(reviewer))
    response = reviewer.post("/runs/", {"graph": "chain", "goal": "{}", "thread_id": "a\x00b"})
    assert response.status_code == 422 and "thread_id" in response.content.decode()
    assert changed_tables(before, db_state(sessions_of(reviewer))) == []
