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
    Decision,
    OnExpiry,
)
from approvals.policies import held_by_default, may_decide, may_hold, policy_for
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
    votes = approved.votes.filter(
        decision=Decision.APPROVE, request__tenant_id=action.tenant_id
    ).select_related("user")
    if not all(may_decide(v.user, approved.policy, escalated=approved.escalated) for v in votes):
        return "approval_required", f"an approver no longer holds the permission; {THEN}"
    now = _held_now_by_another(approved, action)
    if now is not None and (
        len(votes) < now.quorum or not all(may_decide(v.user, now) for v in votes)
    ):
        return (
            "approval_required",
            f"the policy {now.name} holds the action now, and its approvers may not decide "
            f"under it; {THEN}",
        )
    return "", ""


def _held_now_by_another(approved: ApprovalRequest, action: Action) -> ApprovalPolicy | None:
    """The policy that holds the action now, when it is neither the one it was approved
    under nor the one its request was raised under (an admin's reassignment stands): a
    policy added, re-ordered or turned off since. Its deciders must be the approvers, or a
    reviewer of a lenient policy would send what a stricter one holds by then."""
    now = policy_for(action.tenant_id, action.tool, json.loads(action.params), action.target)
    if now is None or now.pk == approved.policy_id:
        return None
    return None if now.name == (approved.shown or {}).get("policy") else now
