"""An approval that stopped counting at the send's re-check says why, through the client:
`Approval.closed_reason` (the REST approval object's `closed_reason`)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, timedelta
from typing import Any

import pytest
from django.core.cache import caches
from django.utils import timezone

import holdpoint_client.errors as errors
from approvals.models import ApprovalPolicy, ApprovalRequest
from holdpoint_client import Client
from tests.client import hold_point  # noqa: F401  (a fixture)
from tests.client.test_client import GOAL, TASK, TOOL, connect
from tests.conftest import Persona


@pytest.fixture(autouse=True)
def fresh_throttle() -> None:
    caches["default"].clear()


@pytest.fixture
def api(live_server: Any, agent_a: Persona) -> Iterator[Client]:
    client = connect(live_server.url, agent_a)
    yield client
    client.close()


def test_a_lapsed_approval_reads_why_it_no_longer_counts(
    api: Client,
    reviewer_a: Persona,
    hold_point: ApprovalPolicy,  # noqa: F811
) -> None:
    from approvals.decisions import decide

    run = api.create_run("api-review", GOAL, external=True)
    grant = api.lease(run.run_id, "me", 30)
    action = api.prepare_action(run.run_id, fence=grant.fence, tool=TOOL, params=TASK)
    assert action.approval is not None
    request = ApprovalRequest.objects.get(pk=action.approval)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")
    lapsed = timezone.now() - timedelta(minutes=3)  # the data moves, not the clock
    ApprovalRequest.objects.filter(pk=request.pk).update(
        decided_at=lapsed - timedelta(hours=1), expires_at=lapsed
    )

    with pytest.raises(errors.ApprovalExpired):
        api.dispatch(action.action_id, grant.fence)

    first = api.get_approval(action.approval)
    at = lapsed.astimezone(UTC).strftime("%Y-%m-%d %H:%M")
    assert first.status == "superseded"
    assert first.closed_reason == f"expired at {at} UTC before it was sent; re-requested"
    assert (first.decision, first.decision_reason) == ("approve", "fine")  # kept as given
    again = api.get_action(action.action_id)
    assert again.approval not in (None, first.id)
    assert api.get_approval(again.approval).closed_reason == ""  # the new one: open
