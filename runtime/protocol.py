"""The executor protocol for agents that run their own loop (API.md, "Executor protocol").

An external agent leases a run, writes checkpoints and prepares, dispatches and records its
actions through these functions — under the same fences, the same ledger and the same hold
points as Holdpoint's own workers. Every write is conditional on the caller's fence.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from audit import journal
from audit.canonical import CanonicalError, canonical_bytes, digest
from runtime import gates, ledger
from runtime.artifacts import Encoder, collect_refs
from runtime.errors import (
    InvalidParams,
    InvalidTransition,
    RunFinished,
    StaleFence,
    VersionConflict,
)
from runtime.events import RunEvent, record
from runtime.leases import db_now_plus
from runtime.models import TERMINAL, Action, ActionStatus, Artifact, Checkpoint, Run, RunStatus
from runtime.tools import Tool, get_tool

S = ActionStatus
EXTERNAL_STATUSES = {
    "running": RunStatus.RUNNING,
    "waiting_input": RunStatus.WAITING_INPUT,
    "completed": RunStatus.COMPLETED,
    "failed": RunStatus.FAILED,
}


class IdempotencyKeyReused(InvalidParams):
    code = "idempotency_key_reused"
    title = "This idempotency key was used with different parameters"


def actor(run: Run, fence: int, who: str) -> str:
    return f"{who}#{fence}"


def heartbeat(run: Run, fence: int, ttl: float) -> Any:
    # A released lease (no owner) cannot be revived by its old fence.
    held = Run.objects.filter(pk=run.pk, fence=fence).exclude(lease_owner="")
    moved = held.exclude(status__in=TERMINAL).update(lease_expires_at=db_now_plus(ttl))
    if moved != 1:
        raise StaleFence(f"fence {fence} does not hold run {run.pk}")
    return Run.objects.values_list("lease_expires_at", flat=True).get(pk=run.pk)


def release(run: Run, fence: int, who: str) -> None:
    with transaction.atomic(durable=True):
        moved = Run.objects.filter(pk=run.pk, fence=fence).update(
            lease_owner="", lease_expires_at=None
        )
        if moved != 1:
            raise StaleFence(f"fence {fence} does not hold run {run.pk}")
        record(run, RunEvent.LEASE_RELEASED, actor(run, fence, who), fence=fence)


def write_checkpoint(
    run: Run,
    fence: int,
    expected_rev: int,
    state: Any,
    next_step: str,
    who: str,
    status: str = "running",
) -> Checkpoint:
    """One transaction: run CAS on fence and rev, artifacts, checkpoint, journal."""
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
    with transaction.atomic(durable=True):
        current = Run.objects.select_for_update().get(pk=run.pk)
        if current.fence != fence:
            raise StaleFence(f"fence {fence} does not hold run {run.pk} (now {current.fence})")
        if current.status in TERMINAL:
            raise InvalidTransition(f"the run is {current.status}")
        if current.checkpoint_rev != expected_rev:
            raise VersionConflict(f"checkpoint_rev is {current.checkpoint_rev}, not {expected_rev}")
        rev = expected_rev + 1
        changes: dict[str, Any] = {
            "checkpoint_rev": rev,
            "step_rev": rev,
            "next_step": next_step,
            "status": run_status,
            "updated_at": Now(),
        }
        if run_status != RunStatus.RUNNING:
            changes.update(lease_owner="", lease_expires_at=None)
        Run.objects.filter(pk=run.pk, fence=fence, checkpoint_rev=expected_rev).update(**changes)
        if encoder.new:
            Artifact.objects.bulk_create(
                [
                    Artifact(tenant_id=run.tenant_id, digest=d, content=t, size=len(t.encode()))
                    for d, t in encoder.new.items()
                ],
                ignore_conflicts=True,
            )
        body = {
            "run": str(run.pk),
            "rev": rev,
            "goal_rev": current.goal_rev,
            "step": "",
            "next_step": next_step,
            "status": run_status,
            "state": encoded,
            "waits": None,
            "fence": fence,
        }
        checkpoint = Checkpoint.objects.create(
            run=current,
            tenant_id=run.tenant_id,
            rev=rev,
            goal_rev=current.goal_rev,
            step="",
            next_step=next_step,
            status=run_status,
            state=encoded,
            waits=None,
            created_by=actor(run, fence, who),
            fence=fence,
            digest=digest(body),
        )
        record(
            current,
            RunEvent.STEP_COMMITTED,
            actor(run, fence, who),
            rev=rev,
            next_step=next_step,
            status=run_status,
            digest=checkpoint.digest,
            refs=len(collect_refs(encoded, set())),
        )
    return checkpoint


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
    """Prepare an action for an external executor; (action, created). The same key with the
    same params returns the first action; with other params it is refused."""
    tool: Tool = get_tool(tool_name)
    if not isinstance(params, dict):
        raise InvalidParams("params must be a JSON object", errors={"params": ["not an object"]})
    tool.validate(params)
    text, fingerprint = ledger.canonical_params(params)
    with transaction.atomic(durable=True):
        current = Run.objects.select_for_update().get(pk=run.pk)
        if current.fence != fence:
            raise StaleFence(f"fence {fence} does not hold run {run.pk}")
        if current.status in TERMINAL:
            raise RunFinished(f"the run is {current.status}")
        index = Action.objects.filter(run=current).count() + 1
        key = (
            idempotency_key
            or f"{current.pk}:{current.goal_rev}:api@{current.checkpoint_rev}:{index}"
        )
        existing = Action.objects.filter(tenant_id=current.tenant_id, idempotency_key=key).first()
        if existing is not None:
            if (
                existing.requested_fingerprint not in (fingerprint, "")
                and existing.fingerprint != fingerprint
            ):
                raise IdempotencyKeyReused(f"key {key!r} was prepared with other params")
            return existing, False
        approval = gates.needs_approval(tool, params, current)
        try:
            with transaction.atomic():
                action = Action.objects.create(
                    tenant_id=current.tenant_id,
                    run=current,
                    idempotency_key=key,
                    tool=tool.name,
                    tool_version=tool.version,
                    params=text,
                    fingerprint=fingerprint,
                    requested_fingerprint=fingerprint,
                    goal_rev=current.goal_rev,
                    fence=fence,
                    step="api",
                    call_index=index,
                    reason=reason[:5000],
                    target=target[:300],
                    status=S.AWAITING_APPROVAL if approval else S.PREPARED,
                )
        except IntegrityError:
            raise IdempotencyKeyReused(f"key {key!r} is taken") from None
        record(
            current,
            RunEvent.ACTION_PREPARED,
            actor(run, fence, who),
            action_id=str(action.action_id),
            idempotency_key=key,
            fingerprint=fingerprint,
            tool=tool.name,
            params=ledger.journal_params(tool, params),
            goal_rev=current.goal_rev,
            action_status=action.status,
        )
        if approval:
            gates.hold(action, current, actor(run, fence, who))
            if current.status == RunStatus.RUNNING:
                Run.objects.filter(pk=current.pk).update(
                    status=RunStatus.WAITING_APPROVAL,
                    updated_at=Now(),
                    waiting_for={
                        "kind": "approval",
                        "action_id": str(action.action_id),
                        "tool": tool.name,
                    },
                )
                record(
                    current,
                    RunEvent.PARKED,
                    actor(run, fence, who),
                    reason=f"{tool.name} needs approval",
                    status=RunStatus.WAITING_APPROVAL,
                )
    return action, True


def dispatch(action: Action, fence: int, who: str, ttl: float = 30.0) -> Action:
    """Mark `sent` (after every check of API.md's dispatch refusals); the agent then calls."""
    tool = get_tool(action.tool)
    if action.status == S.AWAITING_APPROVAL:
        from runtime.errors import ApprovalRequired

        raise ApprovalRequired(f"{action.tool} is waiting for approval")
    sent = ledger.mark_sent(action, fence, ttl, tool, actor(Run(pk=action.run_id), fence, who))
    _resume_after_approval(sent, who, fence)
    return sent


def _resume_after_approval(action: Action, who: str, fence: int) -> None:
    run = Run.objects.get(pk=action.run_id)
    if run.status in (RunStatus.WAITING_APPROVAL, RunStatus.QUEUED) and run.fence == fence:
        Run.objects.filter(pk=run.pk, fence=fence, status=run.status).update(
            status=RunStatus.RUNNING, waiting_for=None, updated_at=Now()
        )
        with transaction.atomic():
            record(
                run,
                RunEvent.RESUMED,
                actor(run, fence, who),
                previous_status=run.status,
                status=RunStatus.RUNNING,
            )


OUTCOMES = {"confirmed": S.CONFIRMED, "failed": S.FAILED, "unknown": S.UNKNOWN}


def record_outcome(
    action: Action, fence: int, outcome: str, *, who: str, external_id: str = "", result: Any = None
) -> Action:
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
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence)
        run = Run.objects.get(pk=action.run_id)
        if action.goal_rev != run.goal_rev:
            return ledger.record_late_result(
                action, outcome, result, actor(run, fence, who), external_id=external_id
            )
        changes: dict[str, Any] = {"result": result}
        if outcome == "confirmed":
            changes["external_id"] = external_id.strip()
        return ledger.transition(action, OUTCOMES[outcome], actor(run, fence, who), **changes)


def run_stream_entries(run: Run, after: int) -> Any:
    from audit.models import JournalEntry

    return JournalEntry.objects.filter(stream=journal.run_stream(run.pk), seq__gt=after)
