"""The executor protocol for agents that run their own loop (API.md, "Executor protocol").

An external agent leases a run, writes checkpoints and prepares, dispatches and records its
actions through these functions. Each one validates what the agent sent, then calls the very
writers Holdpoint's own workers use: `leases.heartbeat`/`release` (run, tenant, fence and owner
checked alike), the ledger's one action constructor and its one idempotency-key spelling, the
step-commit module for checkpoints, `ledger.mark_sent` for dispatch. An external executor gets
the same fences, the same ledger and the same hold points as a worker — no weaker copy of
them. Every write is conditional on the caller's fence and commits with its journal entry.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from audit.canonical import CanonicalError, canonical_bytes
from runtime import gates, leases, ledger, stepcommit
from runtime.artifacts import Encoder, collect_refs
from runtime.errors import (
    ApprovalRequired,
    InvalidParams,
    InvalidTransition,
    RunFinished,
    StaleFence,
    VersionConflict,
)
from runtime.events import RunEvent, record
from runtime.leases import Lease
from runtime.models import TERMINAL, Action, ActionStatus, Checkpoint, Run, RunStatus
from runtime.stepcommit import StepCommit
from runtime.tools import Tool, get_tool

S = ActionStatus
EXTERNAL_STATUSES = {
    "running": RunStatus.RUNNING,
    "waiting_input": RunStatus.WAITING_INPUT,
    "completed": RunStatus.COMPLETED,
    "failed": RunStatus.FAILED,
}
# The statuses a run may be in for an external executor to write to it: any unfinished one.
UNFINISHED = tuple(status for status in RunStatus.values if status not in TERMINAL)
# An external executor's actions are calls of the step "api"; a visit of it lasts from one
# checkpoint to the next (every external checkpoint begins a visit: step_rev = rev).
API_STEP = "api"
# A checkpoint's compare-and-swap retried when only the goal revision moved under it.
_CHECKPOINT_ATTEMPTS = 3


class IdempotencyKeyReused(InvalidParams):
    code = "idempotency_key_reused"
    title = "This idempotency key was used with different parameters"


def _actor(who: str, fence: int) -> str:
    """An external executor acts as the API account that calls, under its fence."""
    return f"{who}#{fence}"


# --- the lease ---------------------------------------------------------------------------------


def lease_of(run: Run, fence: int, who: str, *, owner: str | None = None, ttl: float = 0) -> Lease:
    """The lease a caller claims to hold: its fence and, when it names it, its owner. Without
    an owner the fence alone speaks (each taking of the lease has its own), checked against
    the owner the run showed — a released lease, which has none, holds nothing."""
    return Lease(
        run_id=run.run_id,
        tenant_id=run.tenant_id,
        owner=run.lease_owner if owner is None else owner,
        fence=fence,
        ttl=ttl,
        expires_at=run.lease_expires_at,
        by=who,
    )


def heartbeat(run: Run, fence: int, ttl: float, *, who: str, owner: str | None = None) -> datetime:
    """Extend the lease by `ttl` from database now (runtime.leases.heartbeat)."""
    return leases.heartbeat(lease_of(run, fence, who, owner=owner, ttl=ttl))


def release(run: Run, fence: int, who: str, *, owner: str | None = None) -> None:
    """Give the lease up (runtime.leases.release): a running run is queued again."""
    leases.release(lease_of(run, fence, who, owner=owner))


# --- checkpoints -------------------------------------------------------------------------------


def write_checkpoint(
    run: Run,
    fence: int,
    expected_rev: int,
    state: Any,
    next_step: str,
    who: str,
    status: str = "running",
) -> Checkpoint:
    """The next checkpoint, compare-and-swap on the fence and `expected_rev`: one step commit
    (runtime.stepcommit), the same row, digest and journal entry as a worker's."""
    if not isinstance(state, dict):
        raise InvalidParams("state must be a JSON object", errors={"state": ["not an object"]})
    if status not in EXTERNAL_STATUSES:
        raise InvalidParams(
            f"status must be one of {sorted(EXTERNAL_STATUSES)}",
            errors={"status": ["unknown status"]},
        )
    try:
        canonical_bytes(state)
    except CanonicalError as exc:
        raise InvalidParams(str(exc), errors={"state": [str(exc)]}) from None
    run_status = EXTERNAL_STATUSES[status]
    encoder = Encoder()
    encoded = encoder.encode(state)
    rev = expected_rev + 1
    changes: dict[str, Any] = {"step_rev": rev, "next_step": next_step, "status": run_status}
    if run_status != RunStatus.RUNNING:
        changes.update(lease_owner="", lease_expires_at=None)
    for _ in range(_CHECKPOINT_ATTEMPTS):
        current = _writable(run, fence, expected_rev)
        commit = StepCommit(
            run=current,
            actor=_actor(who, fence),
            fence=fence,
            step="",
            next_step=next_step,
            status=run_status,
            state=encoded,
            changes=changes,
            expect_status=UNFINISHED,
            event=RunEvent.STEP_COMMITTED,
            payload={"refs": len(collect_refs(encoded, set()))},
            artifacts=encoder.new,
        )
        try:
            stepcommit.write(commit)
        except stepcommit.Moved:
            continue  # read again: say what moved, or go again if only the goal was revised
        return Checkpoint.objects.get(run_id=current.run_id, tenant_id=current.tenant_id, rev=rev)
    raise VersionConflict("the run kept moving under the checkpoint; read it and try again")


def _writable(run: Run, fence: int, expected_rev: int) -> Run:
    """The run as it is now, if `fence` may write checkpoint `expected_rev + 1` to it."""
    current = Run.objects.get(pk=run.run_id, tenant_id=run.tenant_id)
    if current.fence != fence:
        raise StaleFence(f"fence {fence} does not hold run {run.run_id} (now {current.fence})")
    if current.status in TERMINAL:
        raise InvalidTransition(f"the run is {current.status}")
    if current.checkpoint_rev != expected_rev:
        raise VersionConflict(f"checkpoint_rev is {current.checkpoint_rev}, not {expected_rev}")
    return current


# --- actions -----------------------------------------------------------------------------------


def prepare(
    run: Run,
    fence: int,
    tool_name: str,
    params: Any,
    *,
    reason: str,
    who: str,
    idempotency_key: str | None = None,
    target: str = "",
) -> tuple[Action, bool]:
    """Prepare an action for an external executor; (action, created).

    The key is the client's `idempotency_key`, or else the step visit's next call
    (runtime.ledger.idempotency_key). Asked again — a retry, or a second request racing the
    first — the same request is the same action: the same key with the same params, or
    without a key the same tool and params in the same visit. The same key with other params
    is refused (422); so is a key another run used. All of it runs under the run's row lock.
    """
    tool: Tool = get_tool(tool_name)
    if not isinstance(params, dict):
        raise InvalidParams("params must be a JSON object", errors={"params": ["not an object"]})
    tool.validate(params)
    canonical = ledger.canonical_params(params)
    actor = _actor(who, fence)
    with transaction.atomic(durable=True):
        # The fence check workers make (and the run row lock that holds the ledger still).
        ledger.fenced(run.run_id, fence, run.tenant_id)
        current = Run.objects.get(pk=run.run_id, tenant_id=run.tenant_id)
        if current.status in TERMINAL:
            raise RunFinished(f"the run is {current.status}")
        calls = ledger.visit_actions(current, API_STEP)
        earlier = _asked_before(current, tool, canonical[1], idempotency_key, calls)
        if earlier is not None:
            return earlier, False
        index = max(calls, default=0) + 1
        key = idempotency_key or ledger.idempotency_key(current, API_STEP, index)
        approval = gates.needs_approval(tool, params, current, target)
        try:
            with transaction.atomic():
                action = ledger.create_action(
                    current,
                    fence,
                    tool,
                    params,
                    step=API_STEP,
                    call_index=index,
                    reason=reason,
                    target=target,
                    actor=actor,
                    needs_approval=approval,
                    canonical=canonical,
                    key=key,
                )
        except IntegrityError:
            # The key was taken meanwhile by another run (a client key), or a client key
            # spelled like this visit's next call: the same request or a refusal.
            taken = ledger.by_key(current.tenant_id, key)
            if taken is not None and _same(taken, current, tool, canonical[1]):
                return taken, False
            if idempotency_key:
                raise IdempotencyKeyReused(f"key {key!r} is taken") from None
            raise VersionConflict(f"call {index} of this step was taken; try again") from None
        if approval and current.status == RunStatus.RUNNING:
            _park(current, fence, action, actor)
    return action, True


def _asked_before(
    run: Run,
    tool: Tool,
    fingerprint: str,
    idempotency_key: str | None,
    calls: dict[int, Action],
) -> Action | None:
    """The action this request made before, if any (see `prepare`); `calls`: the visit's."""
    if not idempotency_key:
        same = (calls[i] for i in sorted(calls) if _same(calls[i], run, tool, fingerprint))
        return next(same, None)
    existing = ledger.by_key(run.tenant_id, idempotency_key)
    if existing is not None and not _same(existing, run, tool, fingerprint):
        raise IdempotencyKeyReused(
            f"key {idempotency_key!r} was prepared with other params or for another run"
        )
    return existing


def _same(action: Action, run: Run, tool: Tool, fingerprint: str) -> bool:
    return (
        action.run_id == run.run_id
        and action.tool == tool.name
        and ledger.same_request(action, fingerprint)
    )


def _park(run: Run, fence: int, action: Action, actor: str) -> None:
    """A running run whose action waits for a reviewer waits with it (inside the prepare)."""
    waiting = {"kind": "approval", "action_id": str(action.action_id), "tool": action.tool}
    Run.objects.filter(
        pk=run.run_id, tenant_id=run.tenant_id, fence=fence, status=RunStatus.RUNNING
    ).update(status=RunStatus.WAITING_APPROVAL, waiting_for=waiting, updated_at=Now())
    record(
        run,
        RunEvent.PARKED,
        actor,
        reason=f"{action.tool} needs approval",
        status=RunStatus.WAITING_APPROVAL,
    )


def dispatch(action: Action, fence: int, who: str, ttl: float = 30.0) -> Action:
    """Mark `sent` (runtime.ledger.mark_sent: every check of API.md's dispatch refusals); the
    agent then calls the service itself. A run parked for this action's approval runs again
    — in the same transaction as the mark, so the two commit together or not at all."""
    tool = get_tool(action.tool)
    if action.status == S.AWAITING_APPROVAL:
        raise ApprovalRequired(f"{action.tool} is waiting for approval")
    actor = _actor(who, fence)
    return ledger.mark_sent(
        action, fence, ttl, tool, actor, then=lambda sent: _resume(sent, fence, actor)
    )


def _resume(action: Action, fence: int, actor: str) -> None:
    """Inside the dispatch: the run this fence holds, parked for an approval (or woken by
    it), is running again — with its journal entry."""
    parked = Run.objects.filter(
        pk=action.run_id,
        tenant_id=action.tenant_id,
        fence=fence,
        status__in=(RunStatus.WAITING_APPROVAL, RunStatus.QUEUED),
    )
    previous = parked.values_list("status", flat=True).first()
    if previous is None:
        return
    parked.update(status=RunStatus.RUNNING, waiting_for=None, updated_at=Now())
    record(
        Run(run_id=action.run_id, tenant_id=action.tenant_id),
        RunEvent.RESUMED,
        actor,
        previous_status=previous,
        status=RunStatus.RUNNING,
    )


OUTCOMES = {"confirmed": S.CONFIRMED, "failed": S.FAILED, "unknown": S.UNKNOWN}


def record_outcome(
    action: Action, fence: int, outcome: str, *, who: str, external_id: str = "", result: Any = None
) -> Action:
    """What the service said, as a worker records it (runtime.ledger.transition); an old
    revision's result is kept on the action but advances nothing."""
    if outcome not in OUTCOMES:
        raise InvalidParams(
            "outcome must be confirmed, failed or unknown",
            errors={"outcome": ["confirmed, failed or unknown"]},
        )
    if outcome == "confirmed" and not external_id.strip():
        raise InvalidParams(
            "confirmed needs the external id that proves it",
            errors={"external_id": ["required when confirmed"]},
        )
    if result is not None:
        try:
            canonical_bytes(result)
        except CanonicalError as exc:
            raise InvalidParams(str(exc), errors={"result": [str(exc)]}) from None
    actor = _actor(who, fence)
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence, action.tenant_id)
        goal_rev = (
            Run.objects.filter(pk=action.run_id, tenant_id=action.tenant_id)
            .values_list("goal_rev", flat=True)
            .get()
        )
        if action.goal_rev != goal_rev:
            return ledger.record_late_result(
                action, outcome, result, actor, external_id=external_id
            )
        changes: dict[str, Any] = {"result": result}
        if outcome == "confirmed":
            changes["external_id"] = external_id.strip()
        return ledger.transition(action, OUTCOMES[outcome], actor, **changes)
