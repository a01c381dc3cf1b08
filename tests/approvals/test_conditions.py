"""Approval-policy conditions with teeth: every operator and the target condition, holding
and not holding, through the gate's own read (`policy_for` on stored policies); conditions
that cannot be evaluated hold the action (fail closed); patterns run on RE2 (issue 16 L5).

A condition check that never holds, or one that lets an unevaluable condition go, fails
this module (checked against such a build; see the commit message).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.test import Client

from approvals.conditions import compile_pattern, evaluate, holds
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from approvals.policies import grant, policy_for
from runtime.models import Action, ActionStatus, Run, Tenant
from tests.approvals.test_admin import POLICIES, _errors, _policy_form
from tests.conftest import Persona

PARAMS: dict[str, Any] = {
    "title": "Deploy PROD now",
    "count": 5,
    "ratio": 0.5,
    "labels": ["prod", "db"],
    "urgent": True,
}
TARGET = "prod-db-1"

HOLDING = [
    {"param": "count", "op": "eq", "value": 5},
    {"param": "count", "value": 5},  # eq by default
    {"param": "count", "op": "eq", "value": 5.0},  # JSON: 5 is 5.0
    {"param": "urgent", "op": "eq", "value": True},
    {"param": "count", "op": "ne", "value": 4},
    {"param": "count", "op": "gt", "value": 4},
    {"param": "ratio", "op": "gt", "value": 0.25},
    {"param": "count", "op": "gte", "value": 5},
    {"param": "count", "op": "lt", "value": 6},
    {"param": "count", "op": "lte", "value": 5},
    {"param": "title", "op": "contains", "value": "PROD"},
    {"param": "labels", "op": "contains", "value": "db"},
    {"param": "title", "op": "matches", "value": r"^Deploy\b"},
    {"target_matches": "^prod-"},
]
NOT_HOLDING = [
    {"param": "count", "op": "eq", "value": 6},
    {"param": "count", "op": "eq", "value": "5"},  # a string is not a number
    {"param": "urgent", "op": "eq", "value": 1},  # true is not 1
    {"param": "count", "op": "ne", "value": 5},
    {"param": "count", "op": "gt", "value": 5},
    {"param": "count", "op": "gte", "value": 6},
    {"param": "count", "op": "lt", "value": 5},
    {"param": "count", "op": "lte", "value": 4},
    {"param": "title", "op": "contains", "value": "STAGING"},
    {"param": "labels", "op": "contains", "value": "web"},
    {"param": "title", "op": "matches", "value": "^Rollback"},
    {"target_matches": "^staging-"},
]
UNEVALUABLE = [
    {"param": "amount", "op": "gt", "value": 100},  # the action has no such param
    {"param": "amount", "op": "eq", "value": None},
    {"param": "title", "op": "gt", "value": 3},  # wrong type: gt compares numbers
    {"param": "urgent", "op": "gt", "value": 0},  # a boolean is not a number
    {"param": "count", "op": "gt", "value": None},
    {"param": "count", "op": "contains", "value": "5"},  # contains on a number
    {"param": "count", "op": "matches", "value": "5"},  # matches on a number
    {"param": "title", "op": "matches", "value": 5},  # a pattern that is not a string
    {"param": "title", "op": "matches", "value": r"(D)\1"},  # RE2 refuses backreferences
    {"target_matches": "(?=prod)"},  # RE2 refuses lookaround
    {"target_matches": "(["},
    {"param": "count", "op": "between", "value": [1, 9]},  # unknown op
    {"param": ["count"], "op": "eq", "value": 5},  # a path that is not a name
    {"target_matches": "^staging-", "param": "count"},  # two conditions in one
    {"op": "eq", "value": 5},  # no param
    {"param": "count", "op": "eq", "value": 6, "or": 5},  # unknown key
    ["count"],  # not an object
    "count > 4",
]


@pytest.fixture
def tenant(tenant_a: Tenant, reviewer_a: Persona) -> Tenant:
    return tenant_a


def _held_by(tenant: Tenant, condition: Any, *, required: bool = True) -> ApprovalPolicy | None:
    """Store a policy with this condition (as a tenant admin's save would) and ask the gate."""
    ApprovalPolicy.objects.filter(tenant=tenant).delete()
    ApprovalPolicy.objects.create(
        tenant=tenant, name="rule", tool="tasks.create", condition=condition, required=required
    )
    return policy_for(tenant.pk, "tasks.create", PARAMS, TARGET)


@pytest.mark.parametrize("condition", HOLDING, ids=str)
def test_a_condition_that_holds_holds_the_action(tenant: Tenant, condition: Any) -> None:
    assert evaluate(condition, PARAMS, TARGET) is True
    found = _held_by(tenant, condition)
    assert found is not None and found.name == "rule"


@pytest.mark.parametrize("condition", NOT_HOLDING, ids=str)
def test_a_condition_that_does_not_hold_lets_the_action_go(tenant: Tenant, condition: Any) -> None:
    assert evaluate(condition, PARAMS, TARGET) is False
    assert _held_by(tenant, condition) is None


@pytest.mark.parametrize("condition", UNEVALUABLE, ids=str)
def test_a_condition_that_cannot_be_evaluated_holds_the_action(
    tenant: Tenant, condition: Any
) -> None:
    """Fail closed: stored anyway (raw SQL, an old row, a bypassed form), it holds."""
    assert holds(condition, PARAMS, TARGET) is True
    found = _held_by(tenant, condition)
    assert found is not None and found.name == "rule"


@pytest.mark.parametrize("condition", UNEVALUABLE[:3], ids=str)
def test_an_exemption_that_cannot_be_evaluated_does_not_exempt(
    tenant: Tenant, condition: Any
) -> None:
    """`required=False` lets matching actions go without a person: an exemption whose
    condition cannot be evaluated must not let anything go."""
    ApprovalPolicy.objects.create(
        tenant=tenant,
        name="exempt",
        tool="tasks.create",
        condition=condition,
        required=False,
        priority=1,
    )
    ApprovalPolicy.objects.create(tenant=tenant, name="hold all", tool="tasks.create", priority=2)
    found = policy_for(tenant.pk, "tasks.create", PARAMS, TARGET)
    assert found is not None and found.name == "hold all"


def test_an_exemption_that_holds_exempts(tenant: Tenant) -> None:
    ApprovalPolicy.objects.create(
        tenant=tenant,
        name="exempt staging",
        tool="tasks.create",
        condition={"target_matches": "^prod-"},
        required=False,
        priority=1,
    )
    ApprovalPolicy.objects.create(tenant=tenant, name="hold all", tool="tasks.create", priority=2)
    assert policy_for(tenant.pk, "tasks.create", PARAMS, TARGET) is None
    found = policy_for(tenant.pk, "tasks.create", PARAMS, "staging-1")
    assert found is not None and found.name == "hold all"


# --- RE2 (issue 16 L5) --------------------------------------------------------------------

EVIL = "^(a+)+$"


def test_patterns_run_on_re2_in_linear_time(tenant: Tenant) -> None:
    """The pattern that took a backtracking engine 0.44 s at 23 characters, doubling per
    character: accepted, compiled by RE2, and evaluated on 10,000 characters."""
    assert type(compile_pattern(EVIL)).__module__.split(".")[0] == "re2"
    policy = ApprovalPolicy(
        tenant=tenant, name="evil", tool="tasks.create", condition={"target_matches": EVIL}
    )
    policy.full_clean()  # accepted: RE2 runs it in linear time
    policy.save()
    long_miss, long_hit = "a" * 10_000 + "!", "a" * 10_000
    assert policy_for(tenant.pk, "tasks.create", PARAMS, long_miss) is None
    assert policy_for(tenant.pk, "tasks.create", PARAMS, long_hit) is not None
    matches = {"param": "title", "op": "matches", "value": EVIL}
    assert evaluate(matches, {"title": long_miss}, "") is False
    assert evaluate(matches, {"title": long_hit}, "") is True


@pytest.mark.parametrize(
    "condition",
    [
        {"target_matches": r"(prod)-\1"},
        {"param": "title", "op": "matches", "value": "(?<=a)b"},
        {"target_matches": "x" * 1001},
    ],
    ids=["backreference", "lookbehind", "too long"],
)
def test_a_pattern_re2_cannot_run_is_refused_when_saved(
    client: Client, admin_a: Persona, tenant_a: Tenant, condition: Any
) -> None:
    policy = ApprovalPolicy(tenant=tenant_a, name="p", tool="tasks.create", condition=condition)
    with pytest.raises(ValidationError) as refused:
        policy.full_clean()
    assert "RE2 cannot run this regular expression" in str(refused.value.message_dict)
    stored = ApprovalPolicy.objects.create(tenant=tenant_a, name="stored", tool="tasks.close")
    client.force_login(admin_a.user)
    response = client.post(
        f"{POLICIES}{stored.pk}/change/", _policy_form(stored, condition=json.dumps(condition))
    )
    errors = _errors(response)
    assert list(errors) == ["condition"]
    assert "RE2 cannot run this regular expression" in str(errors["condition"])
    stored.refresh_from_db()
    assert stored.condition is None  # nothing saved


@pytest.mark.parametrize(
    ("condition", "message"),
    [
        ({"param": "count", "op": "gt", "value": "5"}, "gt compares numbers"),
        ({"param": "count", "op": "between", "value": 1}, "op must be one of"),
        ({"target_matches": "^p", "param": "x"}, "stands alone"),
        ({"param": "count", "value": 1, "or": 2}, "unknown keys: or"),
        (["count"], "an object"),
    ],
)
def test_a_condition_that_could_not_be_evaluated_is_refused_when_saved(
    tenant_a: Tenant, condition: Any, message: str
) -> None:
    policy = ApprovalPolicy(tenant=tenant_a, name="p", tool="tasks.create", condition=condition)
    with pytest.raises(ValidationError, match=message):
        policy.full_clean()


# --- the target condition at prepare (issue 16 L7) -----------------------------------------


def test_a_target_condition_holds_the_action_at_prepare(
    tenant_a: Tenant, agent_a: Persona, reviewer_a: Persona
) -> None:
    """An external executor's prepare: the 201 already says the action waits, with its
    approval pending — not `prepared` with `approval: null`, held only at dispatch."""
    policy = ApprovalPolicy.objects.create(
        tenant=tenant_a,
        name="prod targets",
        tool="tasks.create",
        condition={"target_matches": "^prod-"},
    )
    grant(policy, Group.objects.get(name="acme-reviewers"))
    api = agent_a.api()
    created = api.post(
        "/api/v1/runs/",
        {"graph": "api-review", "goal": {"x": 1}, "external": True},
        format="json",
        HTTP_IDEMPOTENCY_KEY="run-1",
    )
    assert created.status_code == 201, created.content
    run_id = created.json()["run_id"]
    lease = api.post(
        f"/api/v1/runs/{run_id}/lease/", {"owner": "ext", "ttl_seconds": 30}, format="json"
    )
    assert lease.status_code == 200, lease.content
    fence = lease.json()["fence"]
    for target, held in (("prod-db-1", True), ("staging-1", False)):
        prepared = api.post(
            f"/api/v1/runs/{run_id}/actions/",
            {
                "fence": fence,
                "tool": "tasks.create",
                "params": {"title": f"Rotate {target}"},
                "reason": "rotation",
                "target": target,
            },
            format="json",
            HTTP_IDEMPOTENCY_KEY=f"act-{target}",
        )
        assert prepared.status_code == 201, prepared.content
        body = prepared.json()
        action = Action.objects.get(action_id=body["action_id"])
        if held:
            assert body["status"] == ActionStatus.AWAITING_APPROVAL
            request = ApprovalRequest.objects.get(action=action)
            assert body["approval"] == str(request.pk)
            assert request.status == ApprovalStatus.PENDING and request.policy == policy
        else:
            assert body["status"] == ActionStatus.PREPARED and body["approval"] is None
            assert not ApprovalRequest.objects.filter(action=action).exists()
    assert Run.objects.get(pk=run_id).tenant == tenant_a
