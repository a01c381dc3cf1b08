"""The re-check right before sending asks the policy in force then, not only the one the
approval was given under (invariant 5: the approvers hold the permission at execution).

A tenant admin tightens who decides an action — a new policy that holds it with other
deciders, or the lenient policy turned off so a stricter one applies — after a reviewer
approved it and before it was sent: the approval under the old policy does not let it go;
the action is held again under the policy in force. An approval that still satisfies the
policy in force (its approvers are deciders there) still goes, and so does one whose
request an admin reassigned to another policy on purpose.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Group

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from approvals.policies import grant
from approvals.requests import reassign_request
from runtime.executor import advance_run
from runtime.models import Role, Run, RunStatus, Tenant
from tests.conftest import Persona, make_persona

A = ApprovalStatus


def _release_managers(tenant: Tenant, **fields: Any) -> ApprovalPolicy:
    policy = ApprovalPolicy.objects.create(
        tenant=tenant, name="release managers", tool="tasks.create", **fields
    )
    grant(policy, Group.objects.create(name=f"{tenant.slug}-release-managers"))
    return policy


def test_a_policy_added_after_the_approval_holds_the_action_again(
    held: Any, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    strict = _release_managers(tenant_a, priority=10)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    assert box.tasks() == []
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and "release managers" in request.closed_reason
    fresh = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert fresh.policy_id == strict.pk
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL


def test_the_approved_policy_turned_off_leaves_the_stricter_one_in_force(
    held: Any, reviewer_a: Persona, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    run, request, box = held
    _release_managers(tenant_a, priority=200)  # behind the lenient one until it is off
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    ApprovalPolicy.objects.filter(pk=policy.pk).update(active=False)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    assert box.tasks() == []


def test_an_approval_that_satisfies_the_policy_in_force_still_goes(
    held: Any, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    also_reviewers = ApprovalPolicy.objects.create(
        tenant=tenant_a, name="renamed review", tool="tasks.create", priority=10
    )
    grant(also_reviewers, Group.objects.get(name="acme-reviewers"))
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_an_approval_under_a_policy_an_admin_reassigned_the_request_to_still_goes(
    held: Any, tenant_a: Tenant
) -> None:
    """The policy in force is still the one the request was raised under: the admin's
    choice of other deciders for it stands."""
    run, request, box = held
    oncall = _release_managers(tenant_a, condition={"target_matches": "^never"})
    rita = make_persona(tenant_a, "rita", Role.REVIEWER)
    rita.user.groups.set([Group.objects.get(name=f"{tenant_a.slug}-release-managers")])
    reassign_request(request, oncall, "user:root", "the usual reviewers are away")
    decide(request.id, rita.user, "approve", request.action_hash)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1
