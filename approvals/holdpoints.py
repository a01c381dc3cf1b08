"""The approvals app's side of `runtime.gates`: the port's adapter, installed at start-up.

The runtime asks (does this action wait? may it go now?) and acts on the answers itself;
this adapter only reads, or writes approvals' own rows through `approvals.requests`. It
never calls back into the ledger: at dispatch it returns a `Verdict`, and the ledger moves
the action and asks, through the port, for the stale approval to be superseded.
"""

from __future__ import annotations

import json
from datetime import UTC
from typing import Any

from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.db.models.functions import Now

from approvals.expiry import sweep_approvals
from approvals.hashing import action_hash, same_hash
from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    ApprovalStatus,
    ApprovalVote,
    Decision,
    OnExpiry,
)
from approvals.policies import (
    counted_approvals,
    held_by_default,
    may_decide,
    may_hold,
    policy_for,
    shaped_by,
)
from approvals.requests import close_request, request_approval, supersede_approval
from fastsql.statements import OneStatement, Part, tenant_check
from runtime.gates import GO, Verdict
from runtime.models import Action, Run
from runtime.tools import tool_of

A = ApprovalStatus


class HoldPoints:
    """Installed into `runtime.gates` by `ApprovalsConfig.ready`."""

    def needs_approval(self, tool: Any, params: dict[str, Any], run: Any, target: str = "") -> bool:
        if policy_for(run.tenant_id, tool.name, params, target) is not None:
            return True
        return held_by_default(tool, run.tenant_id)

    def unheld_part(self, one: OneStatement, tenant_id: int, tool: str, after: str) -> Part | None:
        """No active policy of the tenant names the tool (one that would hold it, or one that
        would exempt it: either is `policy_for`'s to judge, in the transaction path)."""
        where = {"tenant_id": tenant_id, "tool": tool, "active": True}
        return one.absent("unheld", ApprovalPolicy, where, after=after)

    def hold(self, action: Action, run: Any, actor: str) -> None:
        request_approval(action, Run.objects.get(pk=run.pk, tenant_id=run.tenant_id), actor)

    def may_hold(self, action: Action, tool: Any) -> bool:
        """The dispatch fast path's question (see `runtime.gates.HoldPoints.may_hold`)."""
        if tool.needs_approval(json.loads(action.params)) or tool.default_hold:
            return True
        return may_hold(action.tenant_id, action.tool, action.pk)

    def check_dispatch(self, action: Action) -> Verdict:
        """Re-check at execution: an approval binding this exact action, still valid, by
        deciders who still hold the permission. Anything else: refused, and the approval
        that no longer binds is named for the ledger to supersede."""
        params = json.loads(action.params)
        requests = ApprovalRequest.objects.filter(
            tenant_check(action.tenant_id), action=action
        ).select_related("policy")
        # Expiry is the database clock's verdict, as at the decision (decisions.decide).
        expired = ExpressionWrapper(Q(expires_at__lte=Now()), BooleanField())
        approved = (
            requests.filter(status=A.APPROVED)
            .annotate(expired=expired)
            .order_by("-decided_at")
            .first()
        )
        if approved is None:
            tool = tool_of(action)
            held = (
                requests.exists()
                or policy_for(action.tenant_id, action.tool, params, action.target) is not None
                or tool.needs_approval(params)
                or held_by_default(tool, action.tenant_id)
            )
            return Verdict("approval_required") if held else GO
        refusal, reason = _no_longer_binds(approved, action, expired=approved.expired)
        if not refusal:
            return GO
        if refusal == "approval_expired" and approved.policy.on_expiry == OnExpiry.REJECT:
            # The policy's expiry rejects, whoever was waiting: an approval that lapsed
            # unsent ends the action as one nobody decided in time does (approvals.expiry).
            at = _when(approved)
            return Verdict(
                refusal,
                stale=approved.pk,
                reason=f"expired at {at} before it was sent; rejected at expiry",
                withdraw=f"rejected at expiry: its approval expired at {at} before it was sent "
                f"(policy {approved.policy.name} rejects what expires)",
            )
        return Verdict(refusal, stale=approved.pk, reason=reason)

    def supersede(self, approval: Any, action: Action, reason: str, actor: str) -> None:
        supersede_approval(approval, action, actor, reason)

    def withdrawn(self, action_ids: list[str], reason: str, actor: str) -> None:
        """The actions were cancelled unsent: a request still open is closed, and one
        already approved ends the same way — nothing is left for it to approve, and left
        `approved` it read as a usable approval (inbox, request page, `GET approvals/`)."""
        status = A.SUPERSEDED if reason == "goal revised" else A.CANCELLED
        requests = ApprovalRequest.objects.filter(
            action_id__in=action_ids, status__in=(A.PENDING, A.APPROVED)
        )
        for request in requests:
            if request.status == A.PENDING:
                close_request(request, status, actor, reason)
                continue
            action = Action(
                action_id=request.action_id, tenant_id=request.tenant_id, run_id=request.run_id
            )
            words = f"its action was withdrawn before it was sent ({reason})"
            supersede_approval(request.pk, action, actor, words, status=status)

    def sweep(self) -> int:
        return sweep_approvals()

    def purgeable(self, runs: QuerySet[Run]) -> QuerySet[Run]:
        open_requests = ApprovalRequest.objects.filter(status=A.PENDING).values("run_id")
        return runs.exclude(run_id__in=open_requests)

    def tools_named(self, tenant_id: int) -> set[str]:
        """Tools an active policy of the tenant names (see `runtime.gates`)."""
        from approvals.models import ApprovalPolicy

        policies = ApprovalPolicy.objects.filter(tenant_id=tenant_id, active=True)
        return set(policies.values_list("tool", flat=True))


# What follows a refusal at dispatch: the ledger holds the action again and a new request
# is raised for it (runtime.ledger.hold_again) — unless the policy rejects at expiry.
THEN = "re-requested"


def _when(approved: ApprovalRequest) -> str:
    return approved.expires_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _no_longer_binds(
    approved: ApprovalRequest, action: Action, *, expired: bool
) -> tuple[str, str]:
    """Why an approved request does not let this action go now: the sender's error code and
    the words the journal and reviewers read (("", "") if it does). An expiry says when, not
    the code word: a reviewer reading "superseded by worker:…: approval_expired" learnt
    neither what happened nor what comes next."""
    if not same_hash(action_hash(action), approved.action_hash):
        return "approval_required", f"the action changed after it was approved; {THEN}"
    if expired:
        return "approval_expired", f"expired at {_when(approved)} before it was sent; {THEN}"
    votes = list(
        approved.votes.filter(
            decision=Decision.APPROVE, request__tenant_id=action.tenant_id
        ).select_related("user")
    )
    if not all(may_decide(v.user, approved.policy, escalated=approved.escalated) for v in votes):
        return "approval_required", f"an approver no longer holds the permission; {THEN}"
    policy = _in_force(approved, action)
    if policy is None:
        return "", ""
    if policy.pk != approved.policy_id:
        short = _falls_short(policy, approved, action, votes, deciders=True)
        if short:
            return "approval_required", f"the policy {policy.name} holds the action now, {short}"
    elif approved.decided_by_id is not None:  # at expiry, the policy approved it itself
        short = _falls_short(policy, approved, action, votes, deciders=False)
        if short:
            return (
                "approval_required",
                f"the policy {policy.name} changed since the approval: {short}",
            )
    return "", ""


def _in_force(approved: ApprovalRequest, action: Action) -> ApprovalPolicy | None:
    """The policy the approval answers to at the send: the one that holds the action now —
    a policy added, re-ordered or turned off since — or else the one it was approved under
    as that row stands now (policies are edited in place: a quorum raised, separation of
    duties turned on). The approved one also when the policy that holds the action is still
    the one its request was raised under and an admin reassigned the request: the admin's
    choice of other deciders stands. None: no policy holds the action now."""
    now = policy_for(action.tenant_id, action.tool, json.loads(action.params), action.target)
    if now is None:
        return None
    if now.pk == approved.policy_id or now.name == (approved.shown or {}).get("policy"):
        return approved.policy  # read with the request, in this transaction
    return now


def _falls_short(
    policy: ApprovalPolicy,
    approved: ApprovalRequest,
    action: Action,
    votes: list[ApprovalVote],
    *,
    deciders: bool,
) -> str:
    """What the approval lacks under `policy` as it stands (and what follows), or "".

    Its approvers must be the policy's deciders (`deciders`: asked of a policy other than
    the one they approved under) and as many as its quorum — counted as the decision
    counted them (`counted_approvals`), without whoever shaped the action by the time of
    the decision if the policy separates duties now. Without it a reviewer of a lenient
    policy, or a lenient version of this one, would send what the policy holds by then."""
    if deciders and not all(may_decide(v.user, policy) for v in votes):
        return f"and its approvers may not decide under it; {THEN}"
    shapers: set[str] = set()
    if policy.separation_of_duties and len(votes) >= policy.quorum:
        run = Run(run_id=action.run_id, tenant_id=action.tenant_id, goal_rev=action.goal_rev)
        shapers = shaped_by(approved, run, until=approved.decided_at)
    counted = counted_approvals(votes, shapers)
    if counted >= policy.quorum:
        return ""
    whose = " from people who did not shape the action" if policy.separation_of_duties else ""
    return f"it has {counted} of the {policy.quorum} approvals it asks for{whose}; {THEN}"
