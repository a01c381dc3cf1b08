"""A hold point on tasks.create in tenant A, decided by A's reviewer group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Group

from approvals.models import ApprovalPolicy, ApprovalRequest
from approvals.policies import grant
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, Tenant
from tests.sandbox import Sandbox

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}


def reviewed_by_group(tenant: Tenant, name: str, tool: str) -> ApprovalPolicy:
    """A policy holding every action of `tool`, decided by the tenant's reviewer group."""
    policy = ApprovalPolicy.objects.create(tenant=tenant, name=name, tool=tool)
    grant(policy, Group.objects.get(name=f"{tenant.slug}-reviewers"))
    return policy


@pytest.fixture
def policy(tenant_a: Tenant, reviewer_a: Any) -> ApprovalPolicy:
    return reviewed_by_group(tenant_a, "tasks need review", "tasks.create")


@pytest.fixture
def held(
    tenant_a: Tenant, policy: ApprovalPolicy, sandbox_factory: Callable[[str], Sandbox]
) -> tuple[Run, ApprovalRequest, Sandbox]:
    """An api-review run waiting at its hold point, with a real sandbox behind tasks.create."""
    box = sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    return run, ApprovalRequest.objects.get(run=run), box
