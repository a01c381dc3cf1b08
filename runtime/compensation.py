"""Compensation: undoing a confirmed effect with the tool's compensating tool.

A compensation is a new ledger action of its own — its own idempotency key, its own hold
point under the tenant's policy — linked to the original. The original becomes `compensated`
only once the compensation is confirmed; until then it stays what it was: confirmed.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from runtime import gates, ledger
from runtime.dispatch import perform
from runtime.errors import InvalidParams, InvalidTransition, ToolUnavailable
from runtime.events import RunEvent, record
from runtime.models import Action, ActionStatus, Run
from runtime.queue import on_commit_task
from runtime.tools import get_tool, tool_of

S = ActionStatus
STANDALONE = "standalone"
# The longest reason a compensation keeps (on the action, and sent to an undo tool that takes
# a `reason` as long as that): the run page's form refuses a longer one rather than cutting
# it silently. An undo tool whose schema bounds its `reason` shorter (tasks.close: 2000) gets
# the reason's first that many characters, the most it accepts; the action keeps it whole.
REASON_MAX = 5000


def compensation_params(action: Action, param: str) -> dict[str, Any]:
    """What the compensating tool needs: the effect's external id, in the param the
    compensated tool's definition names (`compensation_param`)."""
    return {param: action.external_id}


def sent_reason(reason: str, schema: Any) -> str:
    """The reason as the undo tool gets it: all that the action keeps (REASON_MAX), or its
    first `maxLength` characters where the tool's schema bounds its `reason` shorter — cut to
    what the tool accepts, not refused, since the person's reason is kept whole anyway."""
    bound = schema.get("maxLength") if isinstance(schema, dict) else None
    if isinstance(bound, int) and not isinstance(bound, bool) and 0 <= bound < REASON_MAX:
        return reason[:bound]
    return reason[:REASON_MAX]


def compensate(action: Action, reason: str, *, actor: str) -> Action:
    """Prepare the compensating action for a confirmed one and ring its dispatcher."""
    action.refresh_from_db()
    if action.status != S.CONFIRMED:
        raise InvalidTransition(f"only a confirmed action can be compensated ({action.status})")
    tool = tool_of(action)
    if not tool.compensation:
        raise InvalidParams(f"{tool.name} declares no compensation")
    undo = get_tool(tool.compensation, action.tenant_id)
    params = compensation_params(action, tool.compensation_param)
    if "reason" in undo.schema.get("properties", {}):
        params["reason"] = sent_reason(reason, undo.schema["properties"]["reason"])
    undo.validate(params)
    text, fingerprint = ledger.canonical_params(params)
    with transaction.atomic(durable=True):
        original = Action.objects.select_for_update().get(pk=action.pk)
        if original.status != S.CONFIRMED:
            raise InvalidTransition(
                f"only a confirmed action can be compensated ({original.status})"
            )
        run = Run.objects.select_for_update().get(pk=original.run_id)
        existing = Action.objects.filter(compensates=original).first()
        if existing is not None:
            # Asking twice is the same compensation. One still unsent (its send met a tool
            # that could not be reached: the circuit open, the server down or switched off)
            # is rung again: nothing else ever sends it, and asking again is how a person
            # says "now". The compare-and-swap to `sent` keeps two rings to one send.
            if existing.status in (S.PREPARED, S.APPROVED):
                on_commit_task("runtime.tasks.dispatch_standalone", str(existing.action_id))
            return existing
        created = Action.objects.create(
            tenant_id=run.tenant_id,
            run=run,
            idempotency_key=f"{original.idempotency_key}{ledger.UNDO}",
            tool=undo.name,
            tool_version=undo.version,
            params=text,
            fingerprint=fingerprint,
            goal_rev=run.goal_rev,
            fence=run.fence,
            step=STANDALONE,
            call_index=0,
            reason=reason[:REASON_MAX],
            target=original.external_id,
            compensates=original,
            status=S.AWAITING_APPROVAL
            if gates.needs_approval(undo, params, run, original.external_id)
            else S.PREPARED,
        )
        record(
            run,
            RunEvent.ACTION_PREPARED,
            actor,
            action_id=str(created.action_id),
            idempotency_key=created.idempotency_key,
            fingerprint=fingerprint,
            tool=undo.name,
            compensates=str(original.action_id),
            action_status=created.status,
        )
        if created.status == S.PREPARED:
            on_commit_task("runtime.tasks.dispatch_standalone", str(created.action_id))
    return created


def dispatch_standalone(action_id: Any, *, actor: str = "worker:standalone") -> Action:
    """Send an action that no step drives (a compensation), under the run's current fence.

    The compare-and-swap to `sent` is the lock: of two dispatchers, one wins, the other finds
    the action already sent. An unknown outcome is reconciled by the tool's contract.
    """
    action = Action.objects.get(pk=action_id)
    if action.status not in (*ledger.UNSETTLED, S.PREPARED, S.APPROVED):
        return action
    tool = get_tool(action.tool, action.tenant_id)
    fence = Run.objects.values_list("fence", flat=True).get(pk=action.run_id)
    try:
        action = perform(action, fence, tool, actor)
    except (InvalidTransition, ToolUnavailable):
        return Action.objects.get(pk=action_id)
    return _finish(action, actor)


def _finish(action: Action, actor: str) -> Action:
    if action.status != S.CONFIRMED or action.compensates_id is None:
        return action
    with transaction.atomic(durable=True):
        original = Action.objects.select_for_update().get(pk=action.compensates_id)
        if original.status == S.CONFIRMED:
            ledger.transition(original, S.COMPENSATED, actor)
            Action.objects.filter(pk=original.pk).update(updated_at=Now())
    return action
