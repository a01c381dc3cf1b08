"""Deciding hold points: a reviewer's decision applies once, to the action they were shown.

Every state change here is one named function, a compare-and-swap under row locks, with its
journal entries (the run's stream and the tenant's) in the same transaction. Pages and the
API only call these. Opening, closing and waking are `approvals.requests`; the dispatch
re-check is `approvals.holdpoints`.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.models.functions import Now

from approvals.hashing import action_hash, same_hash
from approvals.models import ApprovalRequest, ApprovalStatus, ApprovalVote, Decision
from approvals.policies import counted_approvals, may_decide, policy_for, shaped_by
from approvals.requests import (
    after_decision,
    announce_status,
    close_request,
    lock_run_of,
    reassign_request,
    record_edits,
    request_approval,
)
from audit import journal
from runtime import actionkeys, ledger, observe
from runtime.errors import (
    AlreadyDecided,
    Expired,
    FieldNotEditable,
    HashMismatch,
    InvalidParams,
    NotPermitted,
)
from runtime.events import RunEvent, record
from runtime.models import Action, ActionStatus, Run
from runtime.models.limits import NOTE_MAX
from runtime.tools import tool_of

A = ApprovalStatus
PRESET_REJECT_REASONS = (
    "Not needed",
    "Wrong target",
    "Parameters look wrong",
    "Needs more context",
    "Duplicate of existing work",
)


def _params(text: str) -> dict[str, Any]:
    params: dict[str, Any] = json.loads(text)
    return params


def _tenant_event(tenant_id: int, type: str, actor: str, **payload: Any) -> None:
    journal.append(
        journal.tenant_stream(tenant_id), type, tenant_id=tenant_id, actor=actor, payload=payload
    )


def decide(
    request_id: Any,
    user: User,
    decision: str,
    seen_hash: str,
    *,
    reason: str = "",
    edits: dict[str, Any] | None = None,
) -> ApprovalRequest:
    """Apply a reviewer's decision once.

    Refused: a reject without a reason or with edits (invalid_params), not permitted (403),
    a stale page or a changed action (hash_mismatch), already decided or superseded
    (already_decided), past expiry (expired), an edit of a field the tool does not let
    reviewers edit (field_not_editable). Repeating the decision that
    applied returns the same request.
    """
    if decision not in Decision.values:
        raise InvalidParams(
            "decision must be approve or reject", errors={"decision": ["approve or reject"]}
        )
    if decision == Decision.REJECT and not reason.strip():
        raise InvalidParams("a rejection needs a reason", errors={"reason": ["required"]})
    if decision == Decision.REJECT and edits:
        # Edits only shape what an approval sends: sent with a reject they are a mistake
        # (meant "approve with edits", or a client bug), never dropped without a word.
        raise InvalidParams(
            "a rejection carries no edits: approve with them, or reject without them",
            errors={"edits": ["only an approval carries edits"]},
        )
    label = f"user:{user.get_username()}"
    changed = False
    with transaction.atomic(durable=True):
        run = lock_run_of(request_id)
        if run is None:
            raise ApprovalRequest.DoesNotExist(f"no approval request {request_id}")
        request = (
            ApprovalRequest.objects.select_for_update()
            .select_related("policy")
            # Expiry is the database clock's verdict, as the expirer's (expiry.expire): a
            # host whose clock runs behind must not accept what the database sees expired.
            .annotate(expired=ExpressionWrapper(Q(expires_at__lte=Now()), BooleanField()))
            .get(pk=request_id)
        )
        # Permission first: whoever may not decide learns nothing about the request's state.
        if not may_decide(user, request.policy, escalated=request.escalated):
            raise NotPermitted("you may not decide under this policy")
        if request.status != A.PENDING:
            return _repeat_or_refuse(request, user, decision, seen_hash, edits)
        shapers = shaped_by(request, run) if request.policy.separation_of_duties else set()
        if label in shapers:
            raise NotPermitted(
                "whoever shaped this action (started the run, revised its goal, or gave it "
                "input since its last decision) cannot decide it: someone else must"
            )
        vote = ApprovalVote.objects.filter(request=request, user=user).first()
        if vote is not None:
            return _repeat_vote(request, vote, decision, seen_hash, edits)
        if request.expired:
            raise Expired(f"expired at {request.expires_at.isoformat()}")
        action = Action.objects.select_for_update().get(pk=request.action_id)
        if not same_hash(seen_hash, request.action_hash):
            raise HashMismatch("the page you decided on shows an older version of this action")
        if not same_hash(action_hash(action), request.action_hash):
            # The action changed under the request: it can never be decided as shown. Close it
            # and raise a request for what the action is now — committed — then refuse.
            close_request(request, A.SUPERSEDED, label, "the action changed after it was requested")
            if action.status == ActionStatus.AWAITING_APPROVAL:
                request_approval(action, run, label, previous=request)
            changed = True
        else:
            with observe.deciding(request, action, run, decision):
                _vote(
                    request, action, run, user, decision, seen_hash, reason, edits, label, shapers
                )
            # The request as this decision left it, read before the commit lets go of the
            # run: after it, a withdrawal waiting on the run may close it at once, and the
            # answer to an approve that applied would say `superseded`.
            request.refresh_from_db()
    if changed:
        raise HashMismatch("the action changed after it was requested; a new request was raised")
    return request


def _vote(
    request: ApprovalRequest,
    action: Action,
    run: Run,
    user: User,
    decision: str,
    seen_hash: str,
    reason: str,
    edits: dict[str, Any] | None,
    label: str,
    shapers: set[str],
) -> None:
    """Record one reviewer's vote; the last one the quorum needs decides the request.

    The quorum counts only approvals by people who did not shape the action (`shapers`):
    a vote cast before its voter shaped the run does not count towards it."""
    if edits and decision == Decision.APPROVE:
        policy_id = request.policy_id
        action = _apply_edits(request, action, user, edits, label)
        if request.policy_id != policy_id:  # the edit moved it: that policy's duties apply
            shapers = shaped_by(request, run) if request.policy.separation_of_duties else set()
            if label in shapers:
                raise NotPermitted(
                    f"under the policy {request.policy.name!r} whoever shaped this action "
                    "cannot decide it: someone else must"
                )
    ApprovalVote.objects.create(
        request=request,
        user=user,
        decision=decision,
        action_hash=seen_hash,
        reason=reason[:NOTE_MAX],
    )
    approvers = request.votes.filter(decision=Decision.APPROVE).select_related("user")
    approvals = counted_approvals(approvers, shapers)
    final = decision == Decision.REJECT or approvals >= request.quorum
    payload: dict[str, Any] = {
        "approval_id": str(request.id),
        "action_id": str(action.action_id),
        "decision": decision,
        "hash_seen": seen_hash,
        "reason": reason[:NOTE_MAX],
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


def _repeat_vote(
    request: ApprovalRequest,
    vote: ApprovalVote,
    decision: str,
    seen_hash: str,
    edits: dict[str, Any] | None,
) -> ApprovalRequest:
    """A reviewer who already voted on a request that still waits for more votes (quorum):
    the same vote again (a double click, a network retry) answers the request as it is, as
    API.md has a repeated decision do; a different one is refused. Nothing is written."""
    if _same_vote(request, vote, decision, seen_hash, edits):
        return request
    raise AlreadyDecided(
        f"you already voted {vote.decision} on this request; it waits for more approvals"
    )


def _same_vote(
    request: ApprovalRequest,
    vote: ApprovalVote,
    decision: str,
    seen_hash: str,
    edits: dict[str, Any] | None,
) -> bool:
    """Whether a decision asks for what `vote` already decided: the same word, on the hash
    the vote saw or the one the request now shows, with edits that change nothing in what
    it now stands for. An approval with edits answers the edited action's hash, so a client
    that retries with that hash — with the same edits or none — asks for the same result.

    Any later edit voids every vote before it (`record_edits`), so what the request now
    stands for is what this vote approved (or rejected)."""
    if vote.decision != decision:
        return False
    if not (same_hash(seen_hash, vote.action_hash) or same_hash(seen_hash, request.action_hash)):
        return False
    if not edits:
        return True
    now = request.edited_params or request.params
    try:
        # `now` may be in the form before RFC 8785 (a request made before): either matches.
        return now in actionkeys.canonical_params({**_params(now), **edits}).texts()
    except InvalidParams:
        return False


def _repeat_or_refuse(
    request: ApprovalRequest,
    user: User,
    decision: str,
    seen_hash: str,
    edits: dict[str, Any] | None,
) -> ApprovalRequest:
    vote = ApprovalVote.objects.filter(request=request, user=user).first()
    if (
        vote is not None
        and request.status in (A.APPROVED, A.REJECTED)
        and _same_vote(request, vote, decision, seen_hash, edits)
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
    request: ApprovalRequest, action: Action, user: User, edits: dict[str, Any], actor: str
) -> Action:
    tool = tool_of(action)
    refused = sorted(set(edits) - set(tool.editable))
    if refused:
        raise FieldNotEditable(
            f"not editable: {', '.join(refused)}", errors={k: ["not editable"] for k in refused}
        )
    params = {**_params(action.params), **edits}
    tool.validate(params)
    _hold_as_edited(request, action, user, params, actor)
    action = ledger.edit_params(action, params, actor)
    record_edits(request, action, edits, action_hash(action))
    return action


def _hold_as_edited(
    request: ApprovalRequest, action: Action, user: User, params: dict[str, Any], actor: str
) -> None:
    """An edit can bring the action under another policy (one whose condition names an
    edited param): that policy decides it from now on — its deciders, its quorum. An editor
    it does not name may not make that edit, or a reviewer of a lenient policy could approve
    what a stricter one holds."""
    policy = policy_for(request.tenant_id, action.tool, params, action.target)
    if policy is None or policy.pk == request.policy_id:
        return
    if not may_decide(user, policy):
        raise NotPermitted(
            f"the edited action is held by the policy {policy.name!r}, "
            "under which you may not decide"
        )
    reassign_request(request, policy, actor, "the reviewer's edit brought it under this policy")


def _finalise(
    request: ApprovalRequest,
    action: Action,
    run: Run,
    user: User,
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
        decision_reason=reason[:NOTE_MAX],
        updated_at=Now(),
    )
    announce_status(request.pk, run.pk, run.tenant_id, status, actor)
    if status == A.APPROVED:
        ledger.transition(action, ActionStatus.APPROVED, actor)
    else:
        ledger.transition(
            action,
            ActionStatus.CANCELLED,
            actor,
            last_error=f"rejected by {user.get_username()}: {reason}"[:NOTE_MAX],
        )
    after_decision(action, run, actor)
