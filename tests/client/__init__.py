"""Fixtures shared by the client tests, imported by the modules that use them (as tests/api
does: there is no conftest here)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from approvals.models import ApprovalPolicy
from approvals.policies import grant
from runtime.models import Tenant
from tests.conftest import Persona

# The tracker performed by the agent itself (executor `client`).
TOOL = "agent.tasks.create"


@pytest.fixture
def hold_point(tenant_a: Tenant, reviewer_a: Persona) -> ApprovalPolicy:
    """agent.tasks.create waits for tenant A's reviewers."""
    policy = ApprovalPolicy.objects.create(tenant=tenant_a, name="review", tool=TOOL)
    grant(policy, Group.objects.get(name="acme-reviewers"))
    return policy
