"""Fixtures and helpers shared by the client and adapter tests, imported by the modules that
use them (as tests/api does: there is no conftest here)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Group

from approvals.models import ApprovalPolicy
from approvals.policies import grant
from runtime.models import Action, Tenant
from tests import procs
from tests.api import get, ok, post, session
from tests.conftest import Persona

# The tracker performed by the agent itself (executor `client`).
TOOL = "agent.tasks.create"


@pytest.fixture
def hold_point(tenant_a: Tenant, reviewer_a: Persona) -> ApprovalPolicy:
    """agent.tasks.create waits for tenant A's reviewers."""
    policy = ApprovalPolicy.objects.create(tenant=tenant_a, name="review", tool=TOOL)
    grant(policy, Group.objects.get(name="acme-reviewers"))
    return policy


def the_action(thread: str, status: str | None = None, timeout: float = 60) -> Action:
    def found() -> Action | None:
        rows = Action.objects.filter(run__thread_id=thread)
        return (rows.filter(status=status) if status else rows).first()

    return procs.wait_for(found, timeout=timeout)


def decide(
    reviewer: Persona,
    action: Action,
    decision: str = "approve",
    reason: str = "fine",
    edits: dict[str, Any] | None = None,
) -> None:
    """The reviewer decides through the REST API, on the hash they were shown."""
    browser = session(reviewer.user)
    approval_id = ok(get(browser, f"actions/{action.action_id}/"))["approval"]
    approval = ok(get(browser, f"approvals/{approval_id}/"))
    body: dict[str, Any] = {
        "decision": decision,
        "action_hash": approval["action_hash"],
        "reason": reason,
    }
    if edits:
        body["edits"] = edits
    ok(post(browser, f"approvals/{approval_id}/decision/", body))
