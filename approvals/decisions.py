"""Hold points at work: raising requests, deciding them once, re-checking at dispatch.

Every state change here is one named function, a compare-and-swap under row locks, with its
journal entries (the run's stream and the tenant's) in the same transaction. Pages and the
API only call these.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models.functions import Now
from django.utils import timezone

from approvals.hashing import action_hash, same_hash
from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    ApprovalStatus,
    ApprovalVote,
    Decision,
)
from approvals.policies import may_decide, may_hold, policy_for
from audit import journal
from runtime import ledger
from runtime.errors import (
    AlreadyDecided,
    Expired,
    FieldNotEditable,
    HashMismatch,
    InvalidParams,
    NotPermitted,
)
from runtime.events import RunEvent, record
from runtime.lifecycle import wake_from_approval
from runtime.models import Action, ActionStatus, Run
from runtime.statements import tenant_check
from runtime.tools import get_tool

A = ApprovalStatus
PRESET_REJECT_REASONS = (
    "Not needed",
    "Wrong target",
    "Parameters look wrong",
    "Needs more context",
    "Duplicate of existing work",
)


def _params(text: str) -> dict[str, Any]:
    return json.loads(text)


def _title(action: Action) -> str:
    verb = {"tasks.create": "Create task", "tasks.close": "Close task"}.get(
        action.tool, f"Run {action.tool}"
    )
    params = _params(action.params)
    subject = params.get("title") or params.get("task_id") or action.target
    return f"{verb}: {subject}"[:300] if subject else verb


def _shown(action: Action, run: Run, policy: ApprovalPolicy) -> dict[str, Any]:
    tool = get_tool(action.tool)
    return {
        "tool": action.tool,
        "tool_version": action.tool_version,
        "params": _params(action.params),
        "schema": tool.schema,
        "editable": list(tool.editable),
        "target": action.target,
        "reason": action.reason,
        "impact": tool.effect,
        "initiator": run.created_by,
        "graph": f"{run.graph}@{run.graph_version}",
        "goal_rev": action.goal_rev,
        "policy": policy.name,
    }


def _tenant_event(tenant_id: int, type: str, actor: str, **payload: Any) -> None:
    journal.append(
        journal.tenant_stream(tenant_id), type, tenant_id=tenant_id, actor=actor, payload=payload
    )


def request_approval(
    action: Action, run: Run, actor: str, *, previous: ApprovalRequest | None = None
) -> ApprovalRequest | None:
    """Open a request for a held action (inside its transaction); idempotent per action."""
    open_ = ApprovalRequest.objects.filter(
        tenant_check(action.tenant_id), action=action, status=A.PENDING
    ).first()
    if open_ is not None:
        return open_
    params = _params(action.params)
    policy = policy_for(run.tenant_id, action.tool, params, action.target)
    if policy is None:
        policy = _fallback_policy(run.tenant_id, action.tool)
    try:
        with transaction.atomic():
            request = ApprovalRequest.objects.create(
                tenant_id=run.tenant_id,
                run=run,
                action=action,
                policy=policy,
                action_hash=action_hash(action),
                title=_title(action),
                shown=_shown(action, run, policy),
                params=action.params,
                quorum=policy.quorum,
                expires_at=timezone.now() + timedelta(seconds=policy.expiry_seconds),
                checkpoint_rev=run.checkpoint_rev,
                previous=previous,
                rerequest_count=(previous.rerequest_count + 1) if previous else 0,
            )
    except IntegrityError:  # a concurrent holder opened it: the database refused a second
        return ApprovalRequest.objects.get(
            tenant_check(action.tenant_id), action=action, status=A.PENDING
        )
    record(
        run,
        RunEvent.APPROVAL_REQUESTED,
        actor,
        approval_id=str(request.id),
        action_id=str(action.action_id),
        action_hash=request.action_hash,
        policy=policy.name,
        expires_at=request.expires_at.isoformat(),
    )
    from approvals.notify import notify_requested

    notify_requested(request)
    return request


def _fallback_policy(tenant_id: int, tool: str) -> ApprovalPolicy:
    """A tool that declares approval itself, with no tenant policy: nobody is granted yet,
    so the tenant admin sees the request and must grant a group (never auto-approve)."""
    policy, _ = ApprovalPolicy.objects.get_or_create(
        tenant_id=tenant_id, name=f"{tool} (declared by the tool)", defaults={"tool": tool}
    )
    return policy


def _close(request: ApprovalRequest, status: str, actor: str, reason: str) -> None:
    pending = ApprovalRequest.objects.filter(
        tenant_check(request.tenant_id), pk=request.pk, status=A.PENDING
    )
    moved = pending.update(status=status, decision_reason=reason[:2000], updated_at=Now())
    if moved:
        run = Run(run_id=request.run_id, tenant_id=request.tenant_id)
        record(
            run,
            RunEvent.APPROVAL_CLOSED,
            actor,
            approval_id=str(request.id),
            approval_status=status,
            reason=reason,
        )


def decide(
    request_id: Any,
    user: AbstractBaseUser,
    decision: str,
    seen_hash: str,
    *,
    reason: str = "",
    edits: dict[str, Any] | None = None,
) -> ApprovalRequest:
    """Apply a reviewer's decision once.

    Refused: not permitted (403), a stale page or a changed action (hash_mismatch), already
    decided or superseded (already_decided), past expiry (expired), an edit of a field the
    tool does not let reviewers edit (field_not_editable). Repeating the decision that
    applied returns the same request.
    """
    if decision not in Decision.values:
        raise InvalidParams(
            "decision must be approve or reject", errors={"decision": ["approve or reject"]}
        )
    if decision == Decision.REJECT and not reason.strip():
        raise InvalidParams("a rejection needs a reason", errors={"reason": ["required"]})
    label = f"user:{user.get_username()}"
    changed = False
    with transaction.atomic(durable=True):
        request = (
            ApprovalRequest.objects.select_for_update().select_related("policy").get(pk=request_id)
        )
        # Permission first: whoever may not decide learns nothing about the request's state.
        if not may_decide(user, request.policy, escalated=request.escalated):
            raise NotPermitted("you may not decide under this policy")
        if request.status != A.PENDING:
            return _repeat_or_refuse(request, user, decision, seen_hash, edits)
        run = Run.objects.select_for_update().get(pk=request.run_id)
        if request.policy.separation_of_duties and run.created_by == label:
            raise NotPermitted("whoever started the run cannot approve its actions")
        if timezone.now() >= request.expires_at:
            raise Expired(f"expired at {request.expires_at.isoformat()}")
        action = Action.objects.select_for_update().get(pk=request.action_id)
        if not same_hash(seen_hash, request.action_hash):
            raise HashMismatch("the page you decided on shows an older version of this action")
        if not same_hash(action_hash(action), request.action_hash):
            # The action changed under the request: it can never be decided as shown. Close it
            # and raise a request for what the action is now — committed — then refuse.
            _close(request, A.SUPERSEDED, label, "the action changed after it was requested")
            if action.status == ActionStatus.AWAITING_APPROVAL:
                request_approval(action, run, label, previous=request)
            changed = True
        else:
            _vote(request, action, run, user, decision, seen_hash, reason, edits, label)
    if changed:
        raise HashMismatch("the action changed after it was requested; a new request was raised")
    request.refresh_from_db()
    return request


def _vote(
    request: ApprovalRequest,
    action: Action,
    run: Run,
    user: AbstractBaseUser,
    decision: str,
    seen_hash: str,
    reason: str,
    edits: dict[str, Any] | None,
    label: str,
) -> None:
    """Record one reviewer's vote; the last one the quorum needs decides the request."""
    if ApprovalVote.objects.filter(request=request, user=user).exists():
        raise AlreadyDecided("you already voted on this request")
    if edits and decision == Decision.APPROVE:
        action = _apply_edits(request, action, edits, label)
    ApprovalVote.objects.create(
        request=request,
        user=user,
        decision=decision,
        action_hash=seen_hash,
        reason=reason[:2000],
    )
    approvals = request.votes.filter(decision=Decision.APPROVE).count()
    final = decision == Decision.REJECT or approvals >= request.quorum
    payload = {
        "approval_id": str(request.id),
        "action_id": str(action.action_id),
        "decision": decision,
        "hash_seen": seen_hash,
        "reason": reason[:2000],
        "policy": request.policy.name,
        "votes": approvals,
        "quorum": request.quorum,
        "final": final,
    }
    record(run, RunEvent.APPROVAL_DECIDED, label, **payload)
    _tenant_event(run.tenant_id, "approval_decided", label, run_id=str(run.run_id), **payload)
    if final:
        _finalise(request, action, run, user, decision, reason, label)
        from approvals.notify import notify_decided

        notify_decided(request)


def _repeat_or_refuse(
    request: ApprovalRequest,
    user: AbstractBaseUser,
    decision: str,
    seen_hash: str,
    edits: dict[str, Any] | None,
) -> ApprovalRequest:
    vote = ApprovalVote.objects.filter(request=request, user=user).first()
    if (
        vote is not None
        and vote.decision == decision
        and same_hash(seen_hash, vote.action_hash)
        and request.status in (A.APPROVED, A.REJECTED)
    ):
        return request  # the same decision again (double click, network retry): same result
    if request.status == A.EXPIRED:
        raise Expired(f"expired at {request.expires_at.isoformat()}")
    who = request.decided_by.get_username() if request.decided_by else "the system"
    raise AlreadyDecided(
        f"already {request.status} by {who}"
        + (f" at {request.decided_at:%Y-%m-%d %H:%M} UTC" if request.decided_at else "")
    )


def _apply_edits(
    request: ApprovalRequest, action: Action, edits: dict[str, Any], actor: str
) -> Action:
    tool = get_tool(action.tool)
    refused = sorted(set(edits) - set(tool.editable))
    if refused:
        raise FieldNotEditable(
            f"not editable: {', '.join(refused)}", errors={k: ["not editable"] for k in refused}
        )
    params = {**_params(action.params), **edits}
    tool.validate(params)
    action = ledger.edit_params(action, params, actor)
    new_hash = action_hash(action)
    ApprovalRequest.objects.filter(pk=request.pk).update(
        edits=edits, edited_params=action.params, action_hash=new_hash
    )
    request.action_hash = new_hash
    return action


def _finalise(
    request: ApprovalRequest,
    action: Action,
    run: Run,
    user: AbstractBaseUser,
    decision: str,
    reason: str,
    actor: str,
) -> None:
    status = A.APPROVED if decision == Decision.APPROVE else A.REJECTED
    ApprovalRequest.objects.filter(pk=request.pk).update(
        status=status,
        decision=decision,
        decided_by=user,
        decided_at=Now(),
        decision_reason=reason[:2000],
        updated_at=Now(),
    )
    if status == A.APPROVED:
        ledger.transition(action, ActionStatus.APPROVED, actor)
    else:
        ledger.transition(
            action,
            ActionStatus.CANCELLED,
            actor,
            last_error=f"rejected by {user.get_username()}: {reason}"[:2000],
        )
    _wake(run, actor)


def _wake(run: Run, actor: str) -> None:
    """The decision is made: the waiting run goes on (its step sees approved or rejected)."""
    wake_from_approval(run, actor)


# --- the runtime's hold-point interface ----------------------------------------------------


class HoldPoints:
    """Installed into `runtime.gates` at start-up (the executor's one narrow function)."""

    def needs_approval(self, tool: Any, params: dict[str, Any], run: Any) -> bool:
        return policy_for(run.tenant_id, tool.name, params) is not None

    def hold(self, action: Action, run: Any, actor: str) -> None:
        request_approval(action, Run.objects.get(pk=run.pk, tenant_id=run.tenant_id), actor)

    def may_hold(self, action: Action) -> bool:
        """The dispatch fast path's question (see `runtime.gates.HoldPoints.may_hold`)."""
        if get_tool(action.tool).needs_approval(_params(action.params)):
            return True
        return may_hold(action.tenant_id, action.tool, action.pk)

    def check_dispatch(self, action: Action, actor: str) -> str | None:
        """Re-check at execution: an approval binding this exact action, still valid, by
        deciders who still hold the permission. Anything else: supersede and hold again."""
        requests = ApprovalRequest.objects.filter(
            tenant_check(action.tenant_id), action=action
        ).select_related("policy")
        approved = requests.filter(status=A.APPROVED).order_by("-decided_at").first()
        held = (
            requests.exists()
            or policy_for(action.tenant_id, action.tool, _params(action.params), action.target)
            is not None
        )
        if approved is None:
            if not held and not get_tool(action.tool).needs_approval(_params(action.params)):
                return None
            refusal = "approval_required"
        elif not same_hash(action_hash(action), approved.action_hash):
            refusal = "approval_required"
        elif timezone.now() >= approved.expires_at:
            refusal = "approval_expired"
        elif not all(
            may_decide(vote.user, approved.policy, escalated=approved.escalated)
            for vote in approved.votes.filter(
                decision=Decision.APPROVE, request__tenant_id=action.tenant_id
            ).select_related("user")
        ):
            refusal = "approval_required"
        else:
            return None
        if approved is not None:
            superseded = ApprovalRequest.objects.filter(pk=approved.pk, tenant_id=action.tenant_id)
            superseded.update(status=A.SUPERSEDED)
            run = Run(run_id=action.run_id, tenant_id=action.tenant_id)
            record(
                run,
                RunEvent.APPROVAL_CLOSED,
                actor,
                approval_id=str(approved.id),
                approval_status=A.SUPERSEDED,
                reason=refusal,
            )
        if action.status != ActionStatus.AWAITING_APPROVAL:
            ledger.hold_again(action, actor)
        return refusal

    def withdrawn(self, action_ids: list[str], reason: str, actor: str) -> None:
        status = A.SUPERSEDED if reason == "goal revised" else A.CANCELLED
        for request in ApprovalRequest.objects.filter(action_id__in=action_ids, status=A.PENDING):
            _close(request, status, actor, reason)

    def sweep(self) -> int:
        from approvals.expiry import sweep_approvals

        return sweep_approvals()
