"""An approval request's life outside a decision: opened, closed, reassigned, the run woken.

Decisions (`approvals.decisions`), expiry (`approvals.expiry`) and the dispatch re-check
(`approvals.holdpoints`) all open, close and wake the same way, so each of those is one
named function here that they import (and not each other). Every one runs inside its
caller's transaction and writes its journal entry there.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Case, When
from django.db.models.functions import Now

from approvals.hashing import action_hash
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, ApprovalVote
from approvals.policies import policy_for
from audit import journal
from fastsql import statements
from fastsql.statements import tenant_check
from runtime import holds
from runtime.errors import AlreadyDecided, InvalidParams, NotPermitted
from runtime.events import RunEvent, record
from runtime.models import Action, ActionStatus, Run
from runtime.models.limits import NOTE_MAX
from runtime.queue import ring_sender
from runtime.tools import tool_of

A = ApprovalStatus
# A new request's times, written by the database clock and read back by its insert.
STAMPED = ("created_at", "updated_at", "expires_at")


def _shown(
    action: Action,
    params: dict[str, Any],
    run: Run,
    policy: ApprovalPolicy,
    compensates: dict[str, str] | None,
) -> dict[str, Any]:
    """What the reviewer is shown, frozen at request time (a later change supersedes it)."""
    tool = tool_of(action)
    extra = {"compensates": compensates} if compensates else {}
    return {
        **extra,
        "tool": action.tool,
        "tool_version": action.tool_version,
        "params": params,
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


def _compensates(
    action: Action, actor: str, previous: ApprovalRequest | None
) -> dict[str, str] | None:
    """For a compensation's request: which action it undoes, and who asked for the undo — the
    tenant admin `compensate` was called by (the first request's actor), kept from request to
    request (a re-request's actor is the expirer or a sender). None for a step's action."""
    if action.compensates_id is None:
        return None
    original = Action.objects.only("action_id", "tool", "idempotency_key").get(
        pk=action.compensates_id, tenant_id=action.tenant_id
    )
    before = ((previous.shown or {}).get("compensates") or {}) if previous else {}
    return {
        "action_id": str(original.action_id),
        "tool": original.tool,
        "idempotency_key": original.idempotency_key,
        "asked_by": str(before.get("asked_by") or actor),
    }


def lock_run_of(request_id: Any) -> Run | None:
    """The request's run, row-locked — taken before the request itself by whoever then locks
    the request (a decision, an expiry): the lock order of a goal revision, a cancel and a
    send (the run, then its actions and requests). The opposite order deadlocked against a
    revision withdrawing the request meanwhile. None if there is no such request."""
    run_id = ApprovalRequest.objects.filter(pk=request_id).values_list("run_id", flat=True).first()
    return None if run_id is None else Run.objects.select_for_update().get(pk=run_id)


def request_approval(
    action: Action,
    run: Run,
    actor: str,
    *,
    previous: ApprovalRequest | None = None,
    expired: bool = False,
) -> ApprovalRequest | None:
    """Open a request for a held action (inside its transaction); idempotent per action.

    `previous`: the request this one follows — by default the action's last one (an action
    held again at dispatch: its approval lapsed or stopped binding). Only one that `expired`
    counts against the policy's single re-request; any other passes its count on, so no way
    of asking again starts the count afresh."""
    last = (
        ApprovalRequest.objects.filter(tenant_check(action.tenant_id), action=action)
        # The open one if there is one (at most one: approvals_request_one_pending), else
        # the one furthest along the chain (counts only grow along it), the latest of those.
        .order_by(
            Case(When(status=A.PENDING, then=0), default=1), "-rerequest_count", "-created_at"
        )
        .first()
    )
    if last is not None and last.status == A.PENDING:
        return last
    previous = previous or last
    params = json.loads(action.params)
    policy = policy_for(run.tenant_id, action.tool, params, action.target)
    if policy is None:
        policy = _fallback_policy(run.tenant_id, action.tool, tool_of(action).default_hold)
    values = {
        "tenant_id": run.tenant_id,
        "run_id": run.pk,
        "action_id": action.pk,
        "policy_id": policy.pk,
        "action_hash": action_hash(action),
        "title": tool_of(action).title_for(params, action.target),
        "shown": _shown(action, params, run, policy, _compensates(action, actor, previous)),
        "params": action.params,
        "quorum": policy.quorum,
        "checkpoint_rev": run.checkpoint_rev,
        "previous_id": previous.pk if previous else None,
        "rerequest_count": (previous.rerequest_count + expired) if previous else 0,
        # The database's clock, which judges them: expiry (decide, the expirer, dispatch)
        # and escalation (created_at + escalate_after_seconds). A host whose clock runs
        # behind must not shorten the window nor escalate early, nor one ahead lengthen it.
        "created_at": statements.NOW,
        "updated_at": statements.NOW,
        "expires_at": statements.DbNow(policy.expiry_seconds),
    }
    request = statements.built(ApprovalRequest, values)
    try:
        with transaction.atomic():
            stored = statements.insert(ApprovalRequest, [request.__dict__], returning=STAMPED)
    except IntegrityError:  # a concurrent holder opened it: the database refused a second
        return ApprovalRequest.objects.get(
            tenant_check(action.tenant_id), action=action, status=A.PENDING
        )
    # The times the database wrote, as the instance's own.
    request.__dict__.update(zip(STAMPED, stored[0], strict=True))
    request._state.adding = False
    request._state.db = transaction.get_connection().alias
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
    announce_status(request.pk, run.pk, run.tenant_id, A.PENDING, actor)
    from approvals.notify import notify_requested

    notify_requested(request)
    return request


def default_write_policy(tenant_id: int, tool: str) -> ApprovalPolicy:
    """The policy of a tenant's write tool that no policy names: any reviewer of the tenant
    decides. Made when the tool's first action is held, or ahead of it (seed_demo) — the
    same policy either way, an ordinary one the admin may change."""
    policy, _ = ApprovalPolicy.objects.get_or_create(
        tenant_id=tenant_id,
        name=f"{tool} (write tools wait for reviewers by default)",
        defaults={"tool": tool, "any_reviewer": True},
    )
    return policy


def _fallback_policy(tenant_id: int, tool: str, by_default: bool) -> ApprovalPolicy:
    """No tenant policy holds the action. A tool that declares approval itself: nobody is
    granted yet, so the tenant admin sees the request and must grant a group (never
    auto-approve). A tenant's write tool that no policy named (`by_default`): the tenant's
    reviewers decide — the policy made for it is an ordinary one the admin may change."""
    if by_default:
        return default_write_policy(tenant_id, tool)
    policy, _ = ApprovalPolicy.objects.get_or_create(
        tenant_id=tenant_id, name=f"{tool} (declared by the tool)", defaults={"tool": tool}
    )
    return policy


def record_edits(
    request: ApprovalRequest, action: Action, edits: dict[str, Any], new_hash: str
) -> None:
    """A reviewer's edits were applied to the action (`ledger.edit_params`): the request now
    stands for the edited action — its edits, params, hash, and its title, which names the
    action by its params ("Create task: <the edited title>"), so inbox, history, notices and
    the page never show the original's title for what will actually be sent."""
    if new_hash != request.action_hash:
        # Under a quorum, the approvals cast so far were of the action before this edit: they
        # do not approve what will now be sent. Their reviewers vote again (on the new hash).
        ApprovalVote.objects.filter(request=request).delete()
    params = json.loads(action.params)
    request.title = tool_of(action).title_for(params, action.target)
    request.edits = edits
    request.edited_params = action.params
    request.action_hash = new_hash
    ApprovalRequest.objects.filter(tenant_check(request.tenant_id), pk=request.pk).update(
        edits=edits,
        edited_params=action.params,
        action_hash=new_hash,
        title=request.title,
        updated_at=Now(),
    )


def close_request(request: ApprovalRequest, status: str, actor: str, reason: str) -> bool:
    """A pending request ends undecided (`status`: expired, superseded, cancelled).

    A compare-and-swap on `pending`, so a request a reviewer decided a moment earlier keeps
    its decision; the journal says so only when this call closed it. True if it did."""
    pending = ApprovalRequest.objects.filter(
        tenant_check(request.tenant_id), pk=request.pk, status=A.PENDING
    )
    moved = pending.update(
        status=status,
        decision_reason=reason[:NOTE_MAX],  # no decision was made: its reason field says why
        closed_reason=reason[:NOTE_MAX],
        updated_at=Now(),
    )
    if moved:
        _record_closed(request.pk, request.run_id, request.tenant_id, status, actor, reason)
    return moved == 1


def supersede_approval(
    approval_id: Any, action: Action, actor: str, reason: str, *, status: str = A.SUPERSEDED
) -> bool:
    """An approval stopped counting before its action was sent: approved → `status`, with
    its journal entry. `reason`: why, in words, kept as the row's `closed_reason`.

    At dispatch it no longer binds its action (changed hash, expired, a decider lost the
    permission, a policy in force asks for more): `superseded`, and the hold point's verdict
    says why. At a withdrawal its action was cancelled unsent (`approvals.holdpoints`
    `withdrawn`): it ends as the action's pending request would have — `superseded` by a
    goal revision, `cancelled` by a run's cancel or an external run's last checkpoint — so
    no page or client reads an approval of something that will never be sent.

    A compare-and-swap on `approved`: a request something else already moved (superseded by
    another dispatch, closed) is left as it is, and journaled once, by whoever moved it. The
    reviewer's reason stays on the row. True if this call moved it."""
    approved = ApprovalRequest.objects.filter(
        tenant_check(action.tenant_id), pk=approval_id, action=action, status=A.APPROVED
    )
    moved = approved.update(status=status, closed_reason=reason[:NOTE_MAX], updated_at=Now())
    if moved:
        _record_closed(approval_id, action.run_id, action.tenant_id, status, actor, reason)
    return moved == 1


def _record_closed(
    approval_id: Any, run_id: Any, tenant_id: int, status: str, actor: str, reason: str
) -> None:
    record(
        Run(run_id=run_id, tenant_id=tenant_id),
        RunEvent.APPROVAL_CLOSED,
        actor,
        approval_id=str(approval_id),
        approval_status=status,
        reason=reason,
    )
    announce_status(approval_id, run_id, tenant_id, status, actor)


def announce_status(approval_id: Any, run_id: Any, tenant_id: int, status: str, actor: str) -> None:
    """A request was raised (`pending`) or moved to `status`: an entry in the tenant's stream,
    in the transaction that moved it — every writer of a request's status calls this.

    Its seq is the approvals stream's event id (`approvals.api`, `Last-Event-ID`): ordered
    per tenant and in commit order (an append holds the stream's head until it commits), so
    a client that resumes after the last id it saw misses nothing and gets nothing twice."""
    journal.append(
        journal.tenant_stream(tenant_id),
        "approval_status",
        tenant_id=tenant_id,
        actor=actor,
        object_ref=f"approvalrequest:{approval_id}",
        payload={"approval_id": str(approval_id), "run_id": str(run_id), "status": status},
    )


def after_decision(action: Action, run: Run, actor: str) -> None:
    """The request is decided (by reviewers, or by its policy at expiry) and the action moved:
    whoever waits for it goes on, after this transaction commits. A step's action: its
    waiting run is woken (the step sees approved or rejected). A standalone action — a
    compensation — has no step and no run waiting for it: approved, its own sender is rung
    (nothing else would ever send it; the send re-checks this approval before `sent`, as
    every send does); rejected, nothing waits for it, and a run that waits for something
    else is left alone."""
    if not action.standalone:
        holds.wake(run, actor)
    elif action.status == ActionStatus.APPROVED:
        ring_sender(action.action_id)


def wrong_tool(policy: ApprovalPolicy, tool: str, *, whose: str = "this request's action") -> str:
    """Why `policy` may not decide a request whose action is of `tool` ("" if it may). A
    policy's deciders, quorum and condition are chosen for its own tool: handed a request of
    another, it would be decided by people picked for another kind of action (and the send
    re-check would then ask the tool's own policy, not the one chosen)."""
    if policy.tool == tool:
        return ""
    return (
        f"The policy {policy.name!r} is written for {policy.tool}; {whose} is {tool}. "
        f"Choose a policy of {tool}."
    )


def reassign_request(
    request: ApprovalRequest, policy: ApprovalPolicy, actor: str, reason: str = ""
) -> ApprovalRequest:
    """Hand a pending request to another policy of its tenant and of its action's tool: that
    policy's deciders (and its quorum, separation of duties, escalation group) decide it from
    now on, and they are told. A compare-and-swap on `pending`, journalled in the tenant's
    stream; votes already cast stay and count under the new quorum. A policy of another
    tool is refused (InvalidParams, naming `policy`), whichever path asks."""
    from approvals.notify import notify_requested

    if policy.tenant_id != request.tenant_id:
        raise NotPermitted("a request is reassigned only to a policy of its own tenant")
    tool = Action.objects.filter(pk=request.action_id, tenant_id=request.tenant_id).values_list(
        "tool", flat=True
    )
    problem = wrong_tool(policy, tool.get())
    if problem:
        raise InvalidParams(problem, errors={"policy": [problem]})
    with transaction.atomic():
        previous = ApprovalPolicy.objects.get(pk=request.policy_id)
        moved = ApprovalRequest.objects.filter(
            tenant_check(request.tenant_id), pk=request.pk, status=A.PENDING
        ).update(policy=policy, quorum=policy.quorum, escalated=False, updated_at=Now())
        if moved != 1:
            request.refresh_from_db()
            raise AlreadyDecided(f"the request is {request.status}, not pending")
        journal.append(
            journal.tenant_stream(request.tenant_id),
            "approval_reassigned",
            tenant_id=request.tenant_id,
            actor=actor,
            object_ref=f"approvalrequest:{request.pk}",
            payload={
                "approval_id": str(request.pk),
                "run_id": str(request.run_id),
                "from_policy": previous.name,
                "to_policy": policy.name,
                "reason": reason[:NOTE_MAX],
            },
        )
        request.refresh_from_db()
        notify_requested(request)
    return request
