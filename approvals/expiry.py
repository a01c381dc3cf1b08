"""Expiry, reminders and escalation of pending hold points (run by the sweeper).

What expiry means is the policy's choice, never an accident: re-request once and then ask a
human to look at the run (the default; an MCP session's host is answered REJECTED instead),
reject, or — only when the policy says so explicitly — approve.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from approvals.models import ApprovalRequest, ApprovalStatus, Decision, OnExpiry
from approvals.requests import (
    after_decision,
    announce_status,
    close_request,
    lock_run_of,
    request_approval,
)
from runtime import ledger
from runtime.events import RunEvent, record
from runtime.graphs import registry
from runtime.models import Action, ActionStatus, Run, RunStatus

A = ApprovalStatus
SYSTEM = "system:expirer"


def sweep_approvals(batch: int = 200) -> int:
    """Expire, remind and escalate what is due, at most `batch` of each. Due by the database
    clock, which wrote the times: a sweeper whose clock runs behind would leave expired
    requests pending (each `expire` re-checks by the database clock, so never early)."""
    now = timezone.now()
    due = ApprovalRequest.objects.filter(status=A.PENDING, expires_at__lte=Now())
    done = 0
    for request_id in due.values_list("id", flat=True)[:batch]:
        done += expire(request_id)
    done += remind(now, batch) + escalate(now, batch)
    return done


def expire(request_id: UUID) -> int:
    with transaction.atomic(durable=True):
        run = lock_run_of(request_id)  # the run first, then the request
        if run is None:
            return 0  # gone since the sweep listed it
        request = (
            ApprovalRequest.objects.select_for_update()
            .select_related("policy")
            .filter(pk=request_id, status=A.PENDING, expires_at__lte=Now())
            .first()
        )
        if request is None:
            return 0
        action = Action.objects.select_for_update().get(pk=request.action_id)
        policy = request.policy
        if policy.on_expiry == OnExpiry.APPROVE:
            _approve_at_expiry(request, action, run)
            return 1
        close_request(request, A.EXPIRED, SYSTEM, "nobody decided before expiry")
        if policy.on_expiry == OnExpiry.REJECT:
            _reject_at_expiry(action, run, "nobody decided in time")
        elif request.rerequest_count < 1:
            request_approval(action, run, SYSTEM, previous=request, expired=True)
        else:
            reason = (
                f"approval of {action.tool} expired twice without a decision (policy {policy.name})"
            )
            _reject_at_expiry(action, run, reason, attention=_needs_attention(run, action))
    return 1


def _approve_at_expiry(request: ApprovalRequest, action: Action, run: Run) -> None:
    """The policy approves what nobody decided: a decision like a reviewer's, by the expirer,
    so the run's stream says it was decided (and by whom, on which hash) in the transaction
    that decided it, as it does for every other end of a request — the run's history must
    not show it open for ever, then an approved action nobody named."""
    policy = request.policy
    reason = "approved at expiry: the policy says so explicitly"
    ApprovalRequest.objects.filter(pk=request.pk).update(
        status=A.APPROVED,
        decision=Decision.APPROVE,
        decided_at=Now(),
        decision_reason=reason,
        expires_at=Now() + timedelta(seconds=policy.expiry_seconds),
        updated_at=Now(),
    )
    record(
        run,
        RunEvent.APPROVAL_DECIDED,
        SYSTEM,
        approval_id=str(request.pk),
        action_id=str(action.action_id),
        decision=Decision.APPROVE.value,
        hash_seen=request.action_hash,
        reason=reason,
        policy=policy.name,
        votes=0,
        quorum=request.quorum,
        final=True,
    )
    announce_status(request.pk, run.pk, run.tenant_id, A.APPROVED, SYSTEM)
    ledger.transition(action, ActionStatus.APPROVED, SYSTEM)
    after_decision(action, run, SYSTEM)


def _needs_attention(run: Run, action: Action) -> bool:
    """A compensation (a standalone action) rejected at its last expiry needs nobody to look
    at its run: no step waits for it, and the run may wait for something else or be done.
    Its original stays confirmed; the run page lists the compensation as cancelled."""
    if action.standalone:
        return False
    return final_expiry_needs_attention(run.graph, run.graph_version)


def final_expiry_needs_attention(name: str, version: str) -> bool:
    """Whether a run of this graph needs a person once its action was rejected at the last
    expiry: its graph says (an MCP session's host gets REJECTED as its answer; nobody need
    look). A graph not registered here: a person looks. `approvals.wording` says the same."""
    graph = registry.get(name, version)
    return graph is None or graph.final_expiry_needs_attention


def _reject_at_expiry(action: Action, run: Run, reason: str, *, attention: bool = False) -> None:
    """Nobody decided and the policy asks no more: the action is withdrawn (`cancelled`,
    "rejected at expiry: …"), so every way of waiting for it gets its final answer — an
    external executor's dispatch 409 `action_cancelled`, the MCP gateway's REJECTED, a
    hosted step's ActionRejected — instead of a hold no open request can ever lift.
    `attention`: the run then needs a person (the re-request policy's last step, unless its
    graph hands the rejection to a client); otherwise it is woken to go on without it."""
    if action.status == ActionStatus.AWAITING_APPROVAL:
        ledger.transition(
            action, ActionStatus.CANCELLED, SYSTEM, last_error=f"rejected at expiry: {reason}"
        )
    if not attention:
        after_decision(action, run, SYSTEM)
        return
    moved = Run.objects.filter(pk=run.pk, status=RunStatus.WAITING_APPROVAL).update(
        status=RunStatus.NEEDS_ATTENTION,
        attention_reason=reason,
        waiting_for=None,
        updated_at=Now(),
    )
    if moved:
        record(run, RunEvent.ESCALATED, SYSTEM, reason=reason, status=RunStatus.NEEDS_ATTENTION)


def remind(now: object, batch: int) -> int:
    """Tell the deciders of each request whose reminder is due (`remind_before_seconds`
    before it expires), once. Due by the database's clock, read with the candidates (`db_now`),
    as expiry is."""
    from approvals.notify import notify_reminder

    pending = (
        ApprovalRequest.objects.filter(status=A.PENDING, reminded=False)
        .annotate(db_now=Now())
        .select_related("policy")
        .order_by("expires_at")
    )
    count = 0
    # Every pending request is looked at, `batch` reminders at most sent: windows differ per
    # policy, so the first `batch` by expiry may all be not due while a later one is.
    for request in pending.iterator(chunk_size=500):
        if count >= batch:
            break
        window = timedelta(seconds=request.policy.remind_before_seconds)
        if request.expires_at - window > request.db_now:
            continue
        if ApprovalRequest.objects.filter(pk=request.pk, reminded=False).update(reminded=True):
            notify_reminder(request)
            count += 1
    return count


def escalate(now: object, batch: int) -> int:
    """Widen who may decide a request nobody decided in `escalate_after_seconds` (the
    policy's escalation group), once. Due by the database's clock, read with the candidates
    (`db_now`), as expiry is: a sweeper whose clock runs ahead must not hand the decision
    to the escalation group early."""
    from approvals.notify import notify_escalated

    count = 0
    candidates = (
        ApprovalRequest.objects.filter(
            status=A.PENDING,
            escalated=False,
            policy__escalate_after_seconds__isnull=False,
            policy__escalation_group__isnull=False,
        )
        .annotate(db_now=Now())
        .select_related("policy")
        .order_by("created_at")
    )
    # Every candidate is looked at, `batch` escalations at most made: windows differ per
    # policy, so the first `batch` raised may all be not due while a later one is.
    for request in candidates.iterator(chunk_size=500):
        if count >= batch:
            break
        due = request.created_at + timedelta(seconds=request.policy.escalate_after_seconds or 0)
        if due <= request.db_now and ApprovalRequest.objects.filter(
            pk=request.pk, escalated=False
        ).update(escalated=True):
            notify_escalated(request)
            count += 1
    return count
