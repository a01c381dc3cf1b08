"""Hold points: approvals bound to the exact action, applied once, re-checked (invariant 5)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, Permission
from django.db.models.functions import Now
from django.utils import timezone

from approvals.decisions import decide
from approvals.expiry import sweep_approvals
from approvals.hashing import action_hash
from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    ApprovalStatus,
    ApprovalVote,
    OnExpiry,
)
from approvals.policies import grant, may_decide
from runtime.artifacts import resolve as load_state
from runtime.errors import (
    AlreadyDecided,
    Expired,
    FieldNotEditable,
    HashMismatch,
    InvalidParams,
    NotPermitted,
)
from runtime.executor import advance_run
from runtime.lifecycle import create_run, revise_goal
from runtime.models import (
    Action,
    ActionStatus,
    Checkpoint,
    Membership,
    Role,
    Run,
    RunStatus,
    Tenant,
)
from tests.approvals.conftest import GOAL
from tests.conftest import Persona, make_persona
from tests.runtime.helpers import events, payloads

A = ApprovalStatus


def _state(run: Run) -> dict[str, Any]:
    run.refresh_from_db()
    return load_state(run.tenant_id, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)


def test_request_is_bound_to_the_exact_action(held: Any) -> None:
    run, request, box = held
    action = Action.objects.get(run=run)
    assert run.status == RunStatus.WAITING_APPROVAL
    assert run.waiting_for["kind"] == "approval"
    assert run.waiting_for["action_id"] == str(action.action_id)
    assert action.status == ActionStatus.AWAITING_APPROVAL
    assert request.status == A.PENDING and request.action_hash == action_hash(action)
    assert request.title.startswith("Create task: Review 3 API compatibility risk(s)")
    assert request.shown["initiator"] == "agent:agent-a" and request.shown["impact"] == "write"
    assert request.shown["policy"] == "tasks need review"
    assert box.tasks() == []


def test_approve_sends_exactly_once_and_completes(held: Any, reviewer_a: Persona) -> None:
    run, request, box = held
    decided = decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    assert decided.status == A.APPROVED and decided.decided_by == reviewer_a.user
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1 and _state(run)["review_task"]["id"] == box.tasks()[0]["id"]
    # Repeating the decision that applied returns the same result; it sends nothing more.
    again = decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    assert again.pk == decided.pk and again.status == A.APPROVED
    assert len(box.tasks()) == 1
    decided_events = payloads(run, "approval_decided")
    assert decided_events[0]["hash_seen"] == request.action_hash
    assert decided_events[0]["policy"] == "tasks need review"


def test_reject_needs_a_reason_and_the_run_finishes_without_the_task(
    held: Any, reviewer_a: Persona
) -> None:
    run, request, box = held
    with pytest.raises(InvalidParams):
        decide(request.id, reviewer_a.user, "reject", request.action_hash, reason=" ")
    decide(request.id, reviewer_a.user, "reject", request.action_hash, reason="Not needed")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    state = _state(run)
    assert len(state["report"]["risks"]) == 3
    assert "rejected by alice: Not needed" in state["review_task"]["rejected"]
    assert box.tasks() == []
    with pytest.raises(AlreadyDecided, match="already rejected by alice"):
        decide(request.id, reviewer_a.user, "approve", request.action_hash)


def test_stale_hash_and_conflicting_decisions_are_refused(held: Any, reviewer_a: Persona) -> None:
    run, request, box = held
    with pytest.raises(HashMismatch):
        decide(request.id, reviewer_a.user, "approve", "0" * 64)
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    with pytest.raises(AlreadyDecided):
        decide(request.id, reviewer_a.user, "reject", request.action_hash, reason="changed mind")


def test_viewer_outsider_and_self_approval_are_not_permitted(
    held: Any, viewer_a: Persona, outsider_b: Persona, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    run, request, box = held
    for persona in (viewer_a, outsider_b):
        with pytest.raises(NotPermitted):
            decide(request.id, persona.user, "approve", request.action_hash)
    starter = make_persona(tenant_a, "sam", Role.REVIEWER)  # in the reviewer group
    self_run = create_run(tenant_a, "api-review", GOAL, actor="user:sam")
    advance_run(self_run.run_id, "w1")
    own = ApprovalRequest.objects.get(run=self_run)
    with pytest.raises(NotPermitted, match="cannot decide"):
        decide(own.id, starter.user, "approve", own.action_hash)
    assert ApprovalRequest.objects.get(pk=request.pk).status == A.PENDING


def test_guardian_pitfalls_do_not_grant_decisions(
    held: Any, outsider_b: Persona, viewer_a: Persona, policy: ApprovalPolicy
) -> None:
    """A global model permission or superuser status never lets anyone decide."""
    run, request, box = held
    perm = Permission.objects.get(codename="decide_approvalpolicy")
    outsider_b.user.user_permissions.add(perm)
    viewer_a.user.user_permissions.add(perm)
    outsider_b.user.is_superuser = True
    outsider_b.user.save()
    for persona in (outsider_b, viewer_a):
        assert not may_decide(persona.user, policy)
        with pytest.raises(NotPermitted):
            decide(request.id, persona.user, "approve", request.action_hash)


def test_a_param_change_after_approval_is_never_sent(held: Any, reviewer_a: Persona) -> None:
    """TOCTOU: the bound action changes after the decision (a bug, an admin, raw SQL)."""
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    Action.objects.filter(run=run).update(params='{"title":"something else"}')
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    request.refresh_from_db()
    assert run.status == RunStatus.WAITING_APPROVAL
    assert request.status == A.SUPERSEDED and box.tasks() == []
    fresh = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert fresh.action_hash != request.action_hash


def test_permission_revoked_before_execution_requires_a_new_approval(
    held: Any, reviewer_a: Persona
) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    reviewer_a.user.groups.clear()
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and box.tasks() == []
    assert ApprovalRequest.objects.filter(run=run, status=A.PENDING).exists()


def test_deactivated_approver_before_execution(held: Any, reviewer_a: Persona) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    reviewer_a.user.is_active = False
    reviewer_a.user.save()
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    assert box.tasks() == []


def test_edit_then_approve_sends_the_edited_params(held: Any, reviewer_a: Persona) -> None:
    run, request, box = held
    with pytest.raises(FieldNotEditable):
        decide(request.id, reviewer_a.user, "approve", request.action_hash, edits={"owner": "x"})
    with pytest.raises(InvalidParams):
        decide(request.id, reviewer_a.user, "approve", request.action_hash, edits={"title": ""})
    decided = decide(
        request.id,
        reviewer_a.user,
        "approve",
        request.action_hash,
        edits={"title": "Review the shop-v2 breaking changes"},
    )
    assert decided.action_hash != request.action_hash and decided.edits
    assert advance_run(run.run_id, "w1").outcome == "completed"
    tasks = box.tasks()
    assert [t["title"] for t in tasks] == ["Review the shop-v2 breaking changes"]
    assert "action_edited" in events(run)


def test_quorum_two_of_three(
    held: Any, reviewer_a: Persona, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(quorum=2)
    second = make_persona(tenant_a, "beth", Role.REVIEWER)
    make_persona(tenant_a, "carl", Role.REVIEWER)
    first = decide(request.id, reviewer_a.user, "approve", request.action_hash)
    assert first.status == A.PENDING
    # The same vote again (a retry) is a replay: the request as it is, still one vote.
    again = decide(request.id, reviewer_a.user, "approve", request.action_hash)
    assert again.pk == request.pk and again.status == A.PENDING
    assert ApprovalVote.objects.filter(request=request).count() == 1
    with pytest.raises(AlreadyDecided, match="already voted approve"):
        decide(request.id, reviewer_a.user, "reject", request.action_hash, reason="no")  # one each
    done = decide(request.id, second.user, "approve", request.action_hash)
    assert done.status == A.APPROVED
    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1


def test_expiry_rerequests_once_then_needs_attention(held: Any, reviewer_a: Persona) -> None:
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with pytest.raises(Expired):
        decide(request.id, reviewer_a.user, "approve", request.action_hash)
    sweep_approvals()
    request.refresh_from_db()
    second = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert request.status == A.EXPIRED and second.rerequest_count == 1
    ApprovalRequest.objects.filter(pk=second.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    sweep_approvals()
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_ATTENTION and "expired twice" in run.attention_reason
    assert box.tasks() == []  # never auto-approved
    # What a resumed run does then: tests/approvals/test_expiry_outcome.py.


def test_a_request_replaced_because_its_action_changed_keeps_the_re_request(
    held: Any, reviewer_a: Persona
) -> None:
    """Only an expiry spends the policy's one re-request: a request closed because its action
    changed under it (and replaced at once) is no expiry, so the replacement, left to expire,
    is asked again before the run needs attention (before: needs_attention at once)."""
    run, request, box = held
    Action.objects.filter(run=run).update(params='{"title":"something else"}')
    with pytest.raises(HashMismatch):
        decide(request.id, reviewer_a.user, "approve", request.action_hash)
    replacement = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert replacement.previous_id == request.pk and replacement.rerequest_count == 0
    ApprovalRequest.objects.filter(pk=replacement.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    sweep_approvals()
    asked_again = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert asked_again.rerequest_count == 1
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL


@pytest.mark.parametrize("on_expiry", [OnExpiry.REJECT, OnExpiry.APPROVE])
def test_expiry_follows_the_policy(held: Any, policy: ApprovalPolicy, on_expiry: str) -> None:
    run, request, box = held
    ApprovalPolicy.objects.filter(pk=policy.pk).update(on_expiry=on_expiry)
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    sweep_approvals()
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == (1 if on_expiry == OnExpiry.APPROVE else 0)


def test_dispatch_after_the_approval_expired_is_refused(held: Any, reviewer_a: Persona) -> None:
    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and box.tasks() == []
    assert "approval expired" in Run.objects.get(pk=run.pk).waiting_for["prompt"]


def test_goal_revision_supersedes_the_pending_request(held: Any, reviewer_a: Persona) -> None:
    run, request, box = held
    revise_goal(run, {**GOAL, "scope": ["/orders"]}, expected_goal_rev=1, actor="user:alice")
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED
    with pytest.raises(AlreadyDecided, match="superseded"):
        decide(request.id, reviewer_a.user, "approve", request.action_hash)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    fresh = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert fresh.action.goal_rev == 2 and box.tasks() == []


def test_no_policy_no_hold(tenant_a: Tenant, sandbox_factory: Any) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1


def test_a_policy_condition_limits_the_hold(
    tenant_a: Tenant, sandbox_factory: Any, reviewer_a: Persona
) -> None:
    box = sandbox_factory("key")
    policy = ApprovalPolicy.objects.create(
        tenant=tenant_a,
        name="only prod",
        tool="tasks.create",
        condition={"param": "title", "op": "contains", "value": "PROD"},
    )
    grant(policy, Group.objects.get(name="acme-reviewers"))
    run = create_run(tenant_a, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1


def test_a_request_whose_action_changed_is_superseded_and_raised_again(
    held: Any, reviewer_a: Persona
) -> None:
    """Nobody can decide what they were not shown: the request closes and a new one opens."""
    run, request, box = held
    Action.objects.filter(run=run).update(params='{"title":"changed under the request"}')
    for decision, reason in (("approve", ""), ("reject", "no")):
        with pytest.raises((HashMismatch, AlreadyDecided)):
            decide(request.id, reviewer_a.user, decision, request.action_hash, reason=reason)
    request.refresh_from_db()
    fresh = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert request.status == A.SUPERSEDED and fresh.previous_id == request.pk
    assert fresh.action_hash == action_hash(Action.objects.get(run=run))
    decide(fresh.id, reviewer_a.user, "approve", fresh.action_hash)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert [t["title"] for t in box.tasks()] == ["changed under the request"]


def test_a_decision_made_while_the_run_is_still_parking_wakes_it(
    tenant_a: Tenant,
    policy: ApprovalPolicy,
    reviewer_a: Persona,
    sandbox_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by `manage.py chaos`: the reviewer approved between the action being held and
    the run parking; decide() saw the run `running` and woke nobody."""
    from runtime.executor import Executor

    box = sandbox_factory("key")
    park = Executor.park

    def decide_first(self: Executor, parked: Any, step: str) -> Any:
        request = ApprovalRequest.objects.get(action=parked.action, status=A.PENDING)
        decide(request.id, reviewer_a.user, "approve", request.action_hash)  # the race
        return park(self, parked, step)

    monkeypatch.setattr(Executor, "park", decide_first)
    run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
    advance_run(run.run_id, "w1")
    monkeypatch.setattr(Executor, "park", park)
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED  # woken, not stuck in waiting_approval
    assert "woken" in events(run)
    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1


def test_an_edit_voids_the_quorum_votes_cast_for_the_unedited_action(
    held: Any, reviewer_a: Persona, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(quorum=2)
    beth = make_persona(tenant_a, "beth", Role.REVIEWER)
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    edited = decide(
        request.id, beth.user, "approve", request.action_hash, edits={"title": "Something else"}
    )
    # Alice approved the original title, not this one: one approval of the edited action.
    assert edited.status == A.PENDING
    assert Action.objects.get(run=run).status == ActionStatus.AWAITING_APPROVAL
    # She votes again on what will be sent.
    done = decide(request.id, reviewer_a.user, "approve", edited.action_hash)
    assert done.status == A.APPROVED
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert [t["title"] for t in box.tasks()] == ["Something else"]


def test_expiry_at_decision_is_judged_by_the_database_clock(held: Any, reviewer_a: Persona) -> None:
    """The expirer and leases read the database's clock; a decision does too. Python's clock
    is moved back (time-machine never moves the database's): a request the database sees
    expired is refused, and nothing is written."""
    import time_machine

    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with time_machine.travel(timezone.now() - timedelta(minutes=5), tick=False):
        with pytest.raises(Expired):
            decide(request.id, reviewer_a.user, "approve", request.action_hash)
    request.refresh_from_db()
    assert request.status == A.PENDING and not ApprovalVote.objects.filter(request=request)
    assert Action.objects.get(run=run).status == ActionStatus.AWAITING_APPROVAL


def test_dispatch_judges_the_approvals_expiry_by_the_database_clock(
    held: Any, reviewer_a: Persona
) -> None:
    import time_machine

    run, request, box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash)
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with time_machine.travel(timezone.now() - timedelta(minutes=5)):
        assert advance_run(run.run_id, "w1").outcome == "waiting"
    request.refresh_from_db()
    assert request.status == A.SUPERSEDED and box.tasks() == []


def test_an_edit_into_a_stricter_policy_is_not_approved_under_the_lenient_one(
    held: Any, reviewer_a: Persona, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    """A reviewer may not edit an action into one that another policy holds, and approve it
    under the policy the original fell under: whoever the other policy names decides it."""
    run, request, box = held
    production = ApprovalPolicy.objects.create(
        tenant=tenant_a,
        name="production tasks",
        tool="tasks.create",
        condition={"param": "title", "op": "contains", "value": "PRODUCTION"},
        priority=10,
    )
    grant(production, Group.objects.create(name="acme-release-managers"))
    with pytest.raises(NotPermitted):
        decide(
            request.id,
            reviewer_a.user,
            "approve",
            request.action_hash,
            edits={"title": "Wipe PRODUCTION"},
        )
    request.refresh_from_db()
    assert request.status == A.PENDING and request.edits is None
    assert Action.objects.get(run=run).status == ActionStatus.AWAITING_APPROVAL
    assert box.tasks() == []


def test_an_edit_into_another_policy_is_decided_by_that_policys_quorum(
    held: Any, reviewer_a: Persona, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    run, request, box = held
    production = ApprovalPolicy.objects.create(
        tenant=tenant_a,
        name="production tasks",
        tool="tasks.create",
        condition={"param": "title", "op": "contains", "value": "PRODUCTION"},
        priority=10,
        quorum=2,
    )
    grant(production, Group.objects.get(name="acme-reviewers"))
    beth = make_persona(tenant_a, "beth", Role.REVIEWER)
    edited = decide(
        request.id, reviewer_a.user, "approve", request.action_hash, edits={"title": "PRODUCTION"}
    )
    assert (edited.status, edited.policy_id, edited.quorum) == (A.PENDING, production.pk, 2)
    done = decide(request.id, beth.user, "approve", edited.action_hash)
    assert done.status == A.APPROVED
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert [t["title"] for t in box.tasks()] == ["PRODUCTION"]


def test_an_edit_into_a_policy_that_separates_duties_is_not_decided_by_a_shaper(
    tenant_a: Tenant, reviewer_a: Persona, policy: ApprovalPolicy, sandbox_factory: Any
) -> None:
    box = sandbox_factory("key")
    ApprovalPolicy.objects.filter(pk=policy.pk).update(separation_of_duties=False)
    production = ApprovalPolicy.objects.create(
        tenant=tenant_a,
        name="production tasks",
        tool="tasks.create",
        condition={"param": "title", "op": "contains", "value": "PRODUCTION"},
        priority=10,
    )
    grant(production, Group.objects.get(name="acme-reviewers"))
    run = create_run(tenant_a, "api-review", GOAL, actor="user:alice")  # alice shaped it
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    with pytest.raises(NotPermitted, match="cannot decide"):
        decide(
            request.id,
            reviewer_a.user,
            "approve",
            request.action_hash,
            edits={"title": "PRODUCTION"},
        )
    request.refresh_from_db()
    assert (request.status, request.policy_id, request.edits) == (A.PENDING, policy.pk, None)
    assert box.tasks() == []


def test_a_request_raised_by_a_worker_whose_clock_runs_behind_gets_the_policys_whole_window(
    tenant_a: Tenant, policy: ApprovalPolicy, sandbox_factory: Any, reviewer_a: Persona
) -> None:
    """Expiry is the database clock's verdict (decide, the expirer, dispatch), so the window
    must be the database's too: a worker whose clock ran two hours behind set expires_at
    from its own clock — an hour's window was over before anyone saw the request, a
    reviewer's approval was refused 409 expired and the sweeper expired it at once."""
    import time_machine

    ApprovalPolicy.objects.filter(pk=policy.pk).update(expiry_seconds=3600)
    box = sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
    with time_machine.travel(timezone.now() - timedelta(hours=2), tick=False):
        assert advance_run(run.run_id, "w-behind").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    decided = decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    assert decided.status == A.APPROVED
    assert decided.expires_at > timezone.now() + timedelta(minutes=59)
    sweep_approvals()
    assert ApprovalRequest.objects.get(pk=request.pk).status == A.APPROVED  # not expired
    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1


def _on_call(tenant: Tenant, policy: ApprovalPolicy) -> Persona:
    """A reviewer in the policy's escalation group only (not in acme-reviewers): she may
    decide once a request escalates, an hour after it was raised."""
    oncall = Group.objects.create(name="acme-oncall")
    erin = make_persona(tenant, "erin", Role.VIEWER)
    Membership.objects.filter(user=erin.user).update(role=Role.REVIEWER)
    erin.user.groups.add(oncall)
    ApprovalPolicy.objects.filter(pk=policy.pk).update(
        escalation_group=oncall, escalate_after_seconds=3600
    )
    return erin


def test_escalation_waits_for_the_database_clock_not_a_sweepers_clock_running_ahead(
    held: Any, tenant_a: Tenant, policy: ApprovalPolicy
) -> None:
    """Escalation widens who may decide (the policy's escalation group), so when it is due
    is the database clock's verdict as expiry is: a sweeper whose clock ran two hours ahead
    escalated a request due in an hour, and the on-call group could decide it at once."""
    import time_machine

    run, request, box = held
    erin = _on_call(tenant_a, policy)
    with time_machine.travel(timezone.now() + timedelta(hours=2), tick=False):
        sweep_approvals()
    assert not ApprovalRequest.objects.get(pk=request.pk).escalated
    with pytest.raises(NotPermitted):
        decide(request.id, erin.user, "approve", request.action_hash)
    ApprovalRequest.objects.filter(pk=request.pk).update(
        created_at=timezone.now() - timedelta(hours=1, seconds=1)
    )
    sweep_approvals()
    assert ApprovalRequest.objects.get(pk=request.pk).escalated
    assert decide(request.id, erin.user, "approve", request.action_hash).status == A.APPROVED


@pytest.mark.parametrize("skew", [timedelta(hours=-2), timedelta(hours=2)])
def test_escalation_is_due_by_the_database_clock_whatever_the_raising_workers_clock(
    tenant_a: Tenant, policy: ApprovalPolicy, sandbox_factory: Any, skew: timedelta
) -> None:
    """Escalation is due `escalate_after_seconds` after the request was raised, judged by the
    database clock (3809768) — so the time it was raised must be the database's too. A worker
    whose clock ran two hours behind stamped created_at two hours early: the sweep escalated
    an hour's escalation at once and the on-call group could decide; one ahead put it off by
    two hours."""
    import time_machine

    erin = _on_call(tenant_a, policy)
    sandbox_factory("key")
    run = create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a")
    with time_machine.travel(timezone.now() + skew, tick=False):
        assert advance_run(run.run_id, "w-skewed").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    assert abs(request.created_at - timezone.now()) < timedelta(minutes=5)
    assert abs(request.updated_at - timezone.now()) < timedelta(minutes=5)
    sweep_approvals()
    assert not ApprovalRequest.objects.get(pk=request.pk).escalated
    with pytest.raises(NotPermitted):
        decide(request.id, erin.user, "approve", request.action_hash)
    # An hour later by the database (the row moved back: time-machine moves only Python's).
    ApprovalRequest.objects.filter(pk=request.pk).update(
        created_at=request.created_at - timedelta(hours=1, seconds=1)
    )
    sweep_approvals()
    assert ApprovalRequest.objects.get(pk=request.pk).escalated


def test_an_approval_that_expired_before_sending_keeps_the_re_request_spent(
    held: Any, reviewer_a: Persona
) -> None:
    """The re-request policy asks once more, then rejects at the next expiry. An approved
    request that expired before its action was sent was replaced by one with a fresh count,
    so the limit could be dodged for ever: expired, asked again, approved too late, asked
    with a fresh count, expired and asked again … The replacement follows the approval it
    replaces and carries its count (an approval that lapsed is no unanswered expiry)."""
    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    sweep_approvals()
    second = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert second.rerequest_count == 1
    decide(second.id, reviewer_a.user, "approve", second.action_hash, reason="ok")
    ApprovalRequest.objects.filter(pk=second.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert advance_run(run.run_id, "w1").outcome == "waiting"  # re-checked before sending
    third = ApprovalRequest.objects.get(run=run, status=A.PENDING)
    assert (third.previous_id, third.rerequest_count) == (second.pk, 1)
    ApprovalRequest.objects.filter(pk=third.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    sweep_approvals()
    assert not ApprovalRequest.objects.filter(run=run, status=A.PENDING).exists()
    run.refresh_from_db()
    assert run.status == RunStatus.NEEDS_ATTENTION and "expired twice" in run.attention_reason
    assert Action.objects.get(run=run).status == ActionStatus.CANCELLED
    assert box.tasks() == []


def _requests(tenant: Tenant, n: int) -> list[ApprovalRequest]:
    """`n` api-review runs held at their hold point, in the order they were raised."""
    made = []
    for _ in range(n):
        run = create_run(tenant, "api-review", GOAL, actor="agent:agent-a")
        assert advance_run(run.run_id, "w1").outcome == "waiting"
        made.append(ApprovalRequest.objects.get(run=run))
    return made


def test_a_due_escalation_is_not_starved_by_requests_not_due_yet(
    tenant_a: Tenant, policy: ApprovalPolicy, sandbox_factory: Any
) -> None:
    """The sweep escalates at most `batch` requests, but looked at only its first `batch`
    candidates, in no order, and judged each due in Python: `batch` requests raised first and
    not due yet hid a due one for as long as they waited (here batch 2: the third, an hour
    old by the database, never escalated)."""
    _on_call(tenant_a, policy)
    sandbox_factory("key")
    *fresh, due = _requests(tenant_a, 3)
    ApprovalRequest.objects.filter(pk=due.pk).update(
        created_at=Now() - timedelta(hours=1, seconds=1)
    )
    sweep_approvals(batch=2)
    escalated = set(ApprovalRequest.objects.filter(escalated=True).values_list("pk", flat=True))
    assert escalated == {due.pk}, [r.pk for r in fresh]


def test_a_due_reminder_is_not_starved_by_requests_expiring_sooner(
    tenant_a: Tenant, policy: ApprovalPolicy, sandbox_factory: Any
) -> None:
    """Reminders looked at the first `batch` requests by expiry only: with windows that
    differ per policy, `batch` requests expiring sooner but not due a reminder hid one that
    was (here: two expire in 2 h with a 1 h window; the third expires in 3 h with a 4 h
    window of its own policy's, so its reminder is due, and was never sent)."""
    sandbox_factory("key")
    ApprovalPolicy.objects.filter(pk=policy.pk).update(remind_before_seconds=3600)
    *sooner, later = _requests(tenant_a, 3)
    wide = ApprovalPolicy.objects.get(pk=policy.pk)
    wide.pk, wide.name, wide.remind_before_seconds = None, "wide reminders", 4 * 3600
    wide.save()
    ApprovalRequest.objects.filter(pk__in=[r.pk for r in sooner]).update(
        expires_at=Now() + timedelta(hours=2)
    )
    ApprovalRequest.objects.filter(pk=later.pk).update(
        expires_at=Now() + timedelta(hours=3), policy=wide
    )
    sweep_approvals(batch=2)
    reminded = set(ApprovalRequest.objects.filter(reminded=True).values_list("pk", flat=True))
    assert reminded == {later.pk}


def test_expiry_is_found_by_the_database_clock_not_a_sweepers_clock_running_behind(
    held: Any,
) -> None:
    """The sweep picked the requests to expire by its own clock: one running two hours
    behind left a request the database had expired pending (decisions were refused 409
    `expired` meanwhile) until its clock caught up."""
    import time_machine

    run, request, box = held
    ApprovalRequest.objects.filter(pk=request.pk).update(expires_at=Now() - timedelta(seconds=1))
    with time_machine.travel(timezone.now() - timedelta(hours=2), tick=False):
        sweep_approvals()
    assert ApprovalRequest.objects.get(pk=request.pk).status != A.PENDING
