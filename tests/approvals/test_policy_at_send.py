"""The re-check right before sending asks the policy in force then, not only the one the
approval was given under (invariant 5: the approvers hold the permission at execution).

A tenant admin tightens who decides an action — a new policy that holds it with other
deciders, or the lenient policy turned off so a stricter one applies — after a reviewer
approved it and before it was sent: the approval under the old policy does not let it go;
the action is held again under the policy in force. An approval that still satisfies the
policy in force (its approvers are deciders there) still goes, and so does one whose
request an admin reassigned to another policy on purpose.

A policy is edited in place, so the policy in force may be the very one the approval was
given under, stricter since: a quorum raised, separation of duties turned on. The approval
is counted again as its decision counted it, under the policy's rules at the send; short of
them, it is superseded and the action asked again, as for a stricter policy added.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from approvals.decisions import decide
from approvals.expiry import expire
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, OnExpiry
from approvals.policies import grant
from approvals.requests import reassign_request
from runtime.errors import NotPermitted
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import (
    Action,
    ActionStatus,
    Role,
    Run,
    RunShaper,
    RunStatus,
    ShaperKind,
    Tenant,
)
from runtime.shapers import record_shaper
from tests.approvals.conftest import GOAL
from tests.conftest import Persona, make_persona
from tests.sandbox import Sandbox

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


# --- the same policy, edited in place after the approval ---------------------------------
#
# A policy is one row an admin edits (no versions): raising its quorum or turning its
# separation of duties on after an approval must hold that approval to the policy as it
# stands at the send, as a stricter policy added since does (above).


@pytest.fixture
def beth(tenant_a: Tenant) -> Persona:
    """A second reviewer of tenant A, in alice's reviewer group."""
    return make_persona(tenant_a, "beth", Role.REVIEWER)


def _asked_again(run: Run, request: ApprovalRequest, box: Sandbox) -> ApprovalRequest:
    """The send was refused: nothing reached the tracker, the approval is superseded (its
    decision kept) and a new request waits under the policy in force."""
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    assert box.tasks() == []
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and request.decision == "approve"
    assert Action.objects.get(pk=request.action_id).status == ActionStatus.AWAITING_APPROVAL
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL
    return ApprovalRequest.objects.get(run=run, status=A.PENDING)


def test_a_quorum_raised_after_the_approval_asks_for_the_approvals_it_lacks(
    held: Any, reviewer_a: Persona, beth: Persona, policy: ApprovalPolicy
) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    policy.quorum = 2
    policy.save(update_fields=["quorum"])  # as the admin's change form saves it
    fresh = _asked_again(run, request, box)
    assert request.closed_reason == (
        "the policy tasks need review changed since the approval: it has 1 of the 2 approvals "
        "it asks for from people who did not shape the action; re-requested"
    )
    assert fresh.policy_id == policy.pk and fresh.quorum == 2
    decide(fresh.id, reviewer_a.user, "approve", fresh.action_hash)
    assert ApprovalRequest.objects.get(pk=fresh.pk).status == A.PENDING  # one of two
    decide(fresh.id, beth.user, "approve", fresh.action_hash)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_separation_of_duties_turned_on_after_the_approval_refuses_the_shapers_approval(
    tenant_a: Tenant,
    reviewer_a: Persona,
    beth: Persona,
    policy: ApprovalPolicy,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    """alice started the run; under a policy without separation of duties she could approve
    its action. The admin turns it on before the send: her approval is no longer enough."""
    box = sandbox_factory("key")
    ApprovalPolicy.objects.filter(pk=policy.pk).update(separation_of_duties=False)
    run = create_run(tenant_a, "api-review", GOAL, actor="user:alice")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    ApprovalPolicy.objects.filter(pk=policy.pk).update(separation_of_duties=True)
    fresh = _asked_again(run, request, box)
    assert request.closed_reason == (
        "the policy tasks need review changed since the approval: it has 0 of the 1 approvals "
        "it asks for from people who did not shape the action; re-requested"
    )
    with pytest.raises(NotPermitted):
        decide(fresh.id, reviewer_a.user, "approve", fresh.action_hash)
    decide(fresh.id, beth.user, "approve", fresh.action_hash)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_a_shaper_since_the_approval_is_not_counted_against_it(
    held: Any, reviewer_a: Persona, policy: ApprovalPolicy
) -> None:
    """The count at the send is the decision's, under the policy's rules now: someone who
    shaped the run only after approving did not shape the action they approved."""
    run, request, box = held
    decided = decide(request.id, reviewer_a.user, "approve", request.action_hash).decided_at
    assert decided is not None
    record_shaper(run, "user:alice", ShaperKind.INPUT, run.goal_rev)
    # A second after the decision, whatever the database clock's resolution.
    RunShaper.objects.filter(run=run, kind=ShaperKind.INPUT).update(
        created_at=decided + timedelta(seconds=1)
    )
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_a_policy_made_more_lenient_after_the_approval_lets_it_go(
    held: Any, reviewer_a: Persona, policy: ApprovalPolicy
) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    ApprovalPolicy.objects.filter(pk=policy.pk).update(separation_of_duties=False)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_an_approval_at_expiry_is_the_policys_own_and_not_counted_against_its_quorum(
    held: Any, policy: ApprovalPolicy
) -> None:
    """An explicit auto-approval has no approvers to count: a quorum raised after it does
    not undo the policy's own decision."""
    run, request, box = held
    ApprovalPolicy.objects.filter(pk=policy.pk).update(on_expiry=OnExpiry.APPROVE)
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert expire(request.pk) == 1
    ApprovalPolicy.objects.filter(pk=policy.pk).update(quorum=3)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_a_quorum_raised_on_the_policy_an_admin_reassigned_the_request_to_holds_too(
    held: Any, tenant_a: Tenant
) -> None:
    """The admin's choice of deciders stands over the policy the action matches (above);
    the policy chosen is then the one in force for the request, as it stands at the send."""
    run, request, box = held
    oncall = _release_managers(tenant_a, condition={"target_matches": "^never"})
    rita = make_persona(tenant_a, "rita", Role.REVIEWER)
    rita.user.groups.set([Group.objects.get(name=f"{tenant_a.slug}-release-managers")])
    reassign_request(request, oncall, "user:root", "the usual reviewers are away")
    decide(request.id, rita.user, "approve", request.action_hash)
    ApprovalPolicy.objects.filter(pk=oncall.pk).update(quorum=2)
    _asked_again(run, request, box)
    assert "the policy release managers changed since the approval" in request.closed_reason
