"""The side-effect ledger: preparing actions and fencing them by goal revision.

This issue gives actions their place: steps propose them, the step's commit prepares them
(with a stable idempotency key and a fingerprint of the canonical params), a goal revision
cancels what was prepared under an older revision, and an old revision's late result is
recorded without advancing the run. Sending, confirming and reconciling arrive with tools.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet

from audit.canonical import CanonicalError, canonical_bytes, sha256_hex
from runtime.errors import (
    ActionCancelled,
    InvalidParams,
    InvalidTransition,
    StaleFence,
    StaleGoalRev,
)
from runtime.events import RunEvent, record
from runtime.models import UNSENT, Action, ActionStatus, Run


def idempotency_key(run_id: Any, goal_rev: int, step: str, call_index: int) -> str:
    """Stable across retries and processes: the same call of the same step gets the same key."""
    return f"{run_id}:{goal_rev}:{step}:{call_index}"


def canonical_params(params: Any) -> tuple[str, str]:
    """(canonical text, fingerprint); refuses what cannot be canonicalised unambiguously."""
    if not isinstance(params, dict):
        raise InvalidParams("params must be a JSON object", errors={"params": ["not an object"]})
    try:
        data = canonical_bytes(params)
    except CanonicalError as exc:
        raise InvalidParams(str(exc), errors={"params": [str(exc)]}) from None
    return data.decode("utf-8"), sha256_hex(data)


def prepare_proposals(
    run: Run, fence: int, step: str, proposals: list[dict[str, Any]], actor: str
) -> list[Action]:
    """Inside the step's commit: write each proposal `prepared`, or find it prepared already.

    The same key with a different fingerprint is refused: a re-executed step that now asks
    for something else must not silently become a second action.
    """
    prepared = []
    for proposal in proposals:
        text, fingerprint = canonical_params(proposal["params"])
        key = idempotency_key(run.run_id, run.goal_rev, step, proposal["call_index"])
        existing = Action.objects.filter(tenant_id=run.tenant_id, idempotency_key=key).first()
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise InvalidParams(
                    f"step {step} re-proposed call {proposal['call_index']} "
                    "with different params under the same key"
                )
            prepared.append(existing)
            continue
        action = Action.objects.create(
            tenant_id=run.tenant_id,
            run=run,
            idempotency_key=key,
            tool=proposal["tool"],
            params=text,
            fingerprint=fingerprint,
            goal_rev=run.goal_rev,
            fence=fence,
            step=step,
            call_index=proposal["call_index"],
            reason=proposal.get("reason", ""),
            target=proposal.get("target", ""),
        )
        record(
            run,
            RunEvent.ACTION_PREPARED,
            actor,
            action_id=str(action.action_id),
            idempotency_key=key,
            fingerprint=fingerprint,
            tool=action.tool,
            goal_rev=run.goal_rev,
        )
        prepared.append(action)
    return prepared


def cancel_older_revisions(run: Run, goal_rev: int, actor: str) -> list[str]:
    """Cancel every unsent action prepared under a revision older than `goal_rev`."""
    stale: QuerySet[Action] = Action.objects.filter(
        run_id=run.run_id, goal_rev__lt=goal_rev, status__in=UNSENT
    )
    ids = [str(a) for a in stale.values_list("action_id", flat=True)]
    if ids:
        stale.update(status=ActionStatus.CANCELLED)
        for action_id in ids:
            record(
                run,
                RunEvent.ACTION_CANCELLED,
                actor,
                action_id=action_id,
                reason="goal revised",
                goal_rev=goal_rev,
            )
    return ids


def check_dispatchable(action_id: Any, fence: int) -> Action:
    """Refuse to send an action whose revision is stale or whose run moved to another fence.

    Locks the action and run rows so a concurrent goal revision cannot slip in between the
    check and the `sent` mark made in the same transaction by the caller.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("check_dispatchable must run inside the dispatch transaction")
    action = Action.objects.select_for_update().get(pk=action_id)
    run = Run.objects.select_for_update().get(pk=action.run_id)
    if action.status == ActionStatus.CANCELLED:
        raise ActionCancelled("the action was cancelled")
    if action.goal_rev != run.goal_rev:
        raise StaleGoalRev(f"prepared under goal_rev {action.goal_rev}, run is at {run.goal_rev}")
    if run.fence != fence:
        raise StaleFence("the run was taken over by another executor")
    if action.status not in (ActionStatus.PREPARED, ActionStatus.APPROVED):
        raise InvalidTransition(f"action is {action.status}")
    return action


def record_late_result(action: Action, outcome: str, result: Any, actor: str) -> Action:
    """Record an old revision's result on its action; the run itself does not move."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=action.run_id)
        Action.objects.filter(pk=action.pk).update(result=result)
        record(
            run,
            RunEvent.LATE_RESULT_IGNORED,
            actor,
            action_id=str(action.action_id),
            outcome=outcome,
            action_goal_rev=action.goal_rev,
            run_goal_rev=run.goal_rev,
        )
    action.refresh_from_db()
    return action
