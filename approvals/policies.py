"""Which policy holds an action, and who may decide under it.

Permission to decide is an object permission on the policy (guardian's direct-FK tables),
read here explicitly: only grants on this very policy count — never a global model
permission, never superuser status — and only for an active member of the policy's tenant
with a deciding role. Global perms and superusers would leak across tenants.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Max, Q

from approvals.conditions import exempts, holds
from approvals.models import (
    ApprovalPolicy,
    ApprovalRequest,
    ApprovalVote,
    Decision,
    PolicyGroupPermission,
    PolicyUserPermission,
)
from fastsql import statements
from fastsql.cursor import cursor
from fastsql.statements import tenant_check
from runtime.models import Membership, Role, Run
from runtime.shapers import shapers_of

DECIDE = "decide_approvalpolicy"
DECIDING_ROLES = (Role.ADMIN, Role.REVIEWER)


def policy_for(
    tenant_id: int, tool: str, params: dict[str, Any], target: str = ""
) -> ApprovalPolicy | None:
    """The first active policy (by priority) of the tenant whose tool and condition match.

    Fail closed both ways: a hold policy whose condition cannot be evaluated holds the
    action, and an exemption (`required=False`) whose condition cannot be evaluated does not
    exempt it.

    Asked at every prepare: the candidates are read as three columns (usually there are
    none), and only a policy that holds the action is loaded whole."""
    candidates = statements.select(
        ApprovalPolicy,
        ("id", "condition", "required"),
        {"tenant_id": tenant_id, "tool": tool, "active": True},
        order_by=("priority", "name"),
    )
    for pk, condition, required in candidates:
        if not required:
            if exempts(condition, params, target):
                return None
        elif holds(condition, params, target):
            return ApprovalPolicy.objects.get(pk=pk, tenant_id=tenant_id)
    return None


def names_tool(tenant_id: int, tool: str) -> bool:
    """Does any active policy of the tenant name the tool (whatever its condition)?"""
    return ApprovalPolicy.objects.filter(tenant_id=tenant_id, tool=tool, active=True).exists()


def held_by_default(tool: Any, tenant_id: int) -> bool:
    """A tenant's write or irreversible tool that no policy names waits for the tenant's
    reviewers (API.md, "Tools as data": safe by default) until a policy says otherwise."""
    return bool(getattr(tool, "default_hold", False)) and not names_tool(tenant_id, tool.name)


_HOLDS_SQL: dict[str, str] = {}


def may_hold(tenant_id: int, tool: str, action_id: Any) -> bool:
    """One indexed query (dispatch's fast path): does any approval request exist for the
    action, or any active policy for its tool in its tenant? False means no hold point can
    apply, whatever the params or target."""
    sql = _HOLDS_SQL.get(connection.vendor)
    if sql is None:
        qn = connection.ops.quote_name
        requests, policies = ApprovalRequest._meta.db_table, ApprovalPolicy._meta.db_table
        sql = _HOLDS_SQL[connection.vendor] = (
            f"SELECT 1 FROM {qn(requests)} WHERE {qn('action_id')} = %s "
            # the action is the key; the tenant a check (see statements.tenant_check)
            f"AND ({qn('tenant_id')} + 0) = %s "
            f"UNION ALL SELECT 1 FROM {qn(policies)} WHERE {qn('tenant_id')} = %s "
            f"AND {qn('tool')} = %s AND {qn('active')} = %s LIMIT 1"
        )
    action_key = ApprovalRequest._meta.get_field("action").get_db_prep_value(
        action_id, connection, prepared=False
    )
    active = ApprovalPolicy._meta.get_field("active").get_db_prep_value(True, connection)
    cur = cursor(connection)
    cur.execute(sql, [action_key, tenant_id, tenant_id, tool, active])
    return cur.fetchone() is not None


def shaped_by(request: ApprovalRequest, run: Run, *, until: datetime | None = None) -> set[str]:
    """The actor labels of whoever shaped the request's action (separation of duties): the
    run's starter, the author of the goal revision the action was prepared under, and
    whoever revised the goal or gave the run input since its last decision (an earlier
    request of the run decided by a person or by its policy at expiry). `until`: as they
    stood at that time — the request's own decision, which the send re-check counts again
    (`approvals.holdpoints`) as the decision counted it."""
    earlier = ApprovalRequest.objects.filter(
        tenant_check(run.tenant_id), run_id=run.pk, decided_at__isnull=False
    ).exclude(pk=request.pk)
    if until is not None:
        earlier = earlier.filter(decided_at__lt=until)
    last = earlier.aggregate(last=Max("decided_at"))["last"]
    goal_rev = (request.shown or {}).get("goal_rev") or run.goal_rev
    return shapers_of(run, int(goal_rev), last, until=until)


def counted_approvals(votes: Iterable[ApprovalVote], shapers: set[str]) -> int:
    """The approvals a quorum counts: each approving vote but those of whoever shaped the
    action (`shapers`; empty when the policy does not separate duties). One count for the
    decision and for the re-check before sending."""
    return sum(
        1
        for vote in votes
        if vote.decision == Decision.APPROVE and f"user:{vote.user.get_username()}" not in shapers
    )


def may_decide(user: User, policy: ApprovalPolicy, *, escalated: bool = False) -> bool:
    if not user.is_active:
        return False
    member = Membership.objects.filter(
        user=user, tenant_id=policy.tenant_id, tenant__active=True, role__in=DECIDING_ROLES
    ).exists()
    if not member:
        return False
    if policy.any_reviewer:
        return True
    groups = Q(group__in=user.groups.all())
    # The grant tables have no tenant column: they are reached through the policy, whose
    # tenant is named too (defence in depth).
    on_policy = Q(content_object=policy, content_object__tenant_id=policy.tenant_id)
    granted = (
        PolicyGroupPermission.objects.filter(
            groups, on_policy, permission__codename=DECIDE
        ).exists()
        or PolicyUserPermission.objects.filter(
            on_policy, user=user, permission__codename=DECIDE
        ).exists()
    )
    if granted:
        return True
    return bool(
        escalated
        and policy.escalation_group_id
        and user.groups.filter(pk=policy.escalation_group_id).exists()
    )


def deciders(policy: ApprovalPolicy, *, escalated: bool = False) -> list[User]:
    """Who may decide now (for notifications): members granted on the policy."""
    from django.contrib.auth import get_user_model

    users = (
        get_user_model()
        .objects.filter(
            is_active=True,
            memberships__tenant_id=policy.tenant_id,
            memberships__role__in=DECIDING_ROLES,
        )
        .distinct()
    )
    return [user for user in users if may_decide(user, policy, escalated=escalated)]


def grant(policy: ApprovalPolicy, group: Any) -> None:
    """Let a reviewer group decide under a policy (guardian object permission)."""
    from guardian.shortcuts import assign_perm

    assign_perm(DECIDE, group, policy)
