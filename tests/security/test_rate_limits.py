"""Rate limits: per agent token and per reviewer on the API, per reviewer on the decision
pages; beyond the limit a 429 with Retry-After — a problem document on the API, a page
saying nothing was recorded on the site (issue 9, "Rate limits"; OWASP ASVS V11.1.4).

The limits are configured, not mocked: the API's rate is set on the throttle class as
HOLDPOINT_API_RATE would set it at start-up, the pages' through the setting. Counts live in
the default cache, shared by all web processes; the clock is moved with time-machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.core.cache import cache
from django.test import Client

from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, ApprovalVote
from runtime.api.base import PerToken
from tests.approvals.conftest import policy  # noqa: F401  (fixture)
from tests.approvals.test_pages import raise_request
from tests.conftest import Persona, make_persona

pytestmark = pytest.mark.django_db
START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
API_LIMIT = 3


@pytest.fixture(autouse=True)
def api_rate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """HOLDPOINT_API_RATE=3/minute, and no count left over from another test."""
    monkeypatch.setattr(PerToken, "THROTTLE_RATES", {"agent": f"{API_LIMIT}/minute"})
    cache.clear()
    yield
    cache.clear()


def throttled(response: Any) -> int:
    """Assert the API's 429 problem; returns Retry-After in seconds."""
    assert response.status_code == 429, response.status_code
    assert response["Content-Type"].startswith("application/problem+json")
    body = response.json()
    assert body["code"] == "throttled" and body["status"] == 429
    retry_after = int(response["Retry-After"])
    assert 1 <= retry_after <= 61
    return retry_after


def test_one_reviewers_api_limit_leaves_another_reviewer_alone(
    reviewer_a: Persona, tenant_a: Any
) -> None:
    carol = make_persona(tenant_a, "carol", "reviewer")
    with time_machine.travel(START, tick=False) as clock:
        alice = reviewer_a.api()
        codes = [alice.get("/api/v1/runs/").status_code for _ in range(API_LIMIT)]
        assert codes == [200] * API_LIMIT
        wait = throttled(alice.get("/api/v1/runs/"))
        assert carol.api().get("/api/v1/runs/").status_code == 200
        clock.shift(timedelta(seconds=wait))
        assert alice.get("/api/v1/runs/").status_code == 200  # the window moved on


def test_one_agents_api_limit_leaves_another_agent_alone(
    agent_a: Persona, agent_b: Persona
) -> None:
    a = agent_a.api()
    for _ in range(API_LIMIT):
        assert a.get("/api/v1/runs/").status_code == 200
    throttled(a.get("/api/v1/runs/"))
    throttled(a.post("/api/v1/runs/", {"graph": "chain", "goal": {}}, format="json"))
    assert agent_b.api().get("/api/v1/runs/").status_code == 200


def test_a_throttled_write_changes_nothing(agent_a: Persona) -> None:
    from runtime.models import Run

    a = agent_a.api()
    body = {"graph": "chain", "goal": {"steps": 1}, "external": True}
    for _ in range(API_LIMIT):
        assert a.post("/api/v1/runs/", body, format="json").status_code == 201
    throttled(a.post("/api/v1/runs/", body, format="json"))
    assert Run.objects.count() == API_LIMIT


# --- decisions on the reviewer pages ----------------------------------------------------------


def test_decision_posts_beyond_the_rate_get_a_page_and_record_nothing(
    reviewer_a: Persona,
    tenant_a: Any,
    policy: ApprovalPolicy,  # noqa: F811
    settings: Any,
) -> None:
    settings.HOLDPOINT_DECISION_RATE = "2/minute"
    carol = make_persona(tenant_a, "carol", "reviewer")
    requests = [raise_request(tenant_a, target=f"shop-{i}") for i in range(4)]

    def decide(user: Any, request: ApprovalRequest) -> Any:
        client = Client()
        client.force_login(user)
        return client.post(
            f"/approvals/{request.pk}/decide/",
            {"decision": "reject", "reason": "not now", "action_hash": request.action_hash},
        )

    with time_machine.travel(START, tick=False) as clock:
        assert decide(reviewer_a.user, requests[0]).status_code == 302
        assert decide(reviewer_a.user, requests[1]).status_code == 302
        response = decide(reviewer_a.user, requests[2])
        assert response.status_code == 429
        wait = int(response["Retry-After"])
        assert 1 <= wait <= 61
        body = response.content.decode()
        assert "Nothing was recorded" in body and f"Wait {wait} second" in body
        assert ApprovalRequest.objects.get(pk=requests[2].pk).status == ApprovalStatus.PENDING
        assert not ApprovalVote.objects.filter(request=requests[2]).exists()

        assert decide(carol.user, requests[3]).status_code == 302  # her own count
        clock.shift(timedelta(seconds=wait))
        assert decide(reviewer_a.user, requests[2]).status_code == 302
    statuses = set(
        ApprovalRequest.objects.filter(pk__in=[r.pk for r in requests]).values_list(
            "status", flat=True
        )
    )
    assert statuses == {ApprovalStatus.REJECTED}
