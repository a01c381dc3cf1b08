"""What an answer about an action that may have been sent does to it — one writer for every
sender: a worker's call, an external executor's reported outcome, a late answer to either.

An answer that cannot say whether the effect happened (`unknown`) is settled by the tool's
dedup contract: a tool with neither key nor lookup goes to a person at once, as does the
HOLDPOINT_RECONCILE_ATTEMPTS-th unknown of any tool. A late answer — its run moved on (goal
revised, run finished) while the request was out — is still the truth about the effect, so
the action is settled by it as any answer would settle it (DESIGN.md invariants 2 and 6):
confirmed with its proof, failed when the service refused it, withdrawn when it certainly
did not apply (no step will send an old revision's action again), a person's when only a
person can tell — which, for an unknown, includes a tool that deduplicates by key alone: its
replay would be a send after the run moved on. Only the run does not advance on it.

And a person's answer where nothing could prove the outcome (`resolve`): applied, with the
id that proves it, or not applied. Everything else here runs inside the caller's
transaction, after `ledger.fenced` locked the run row under the caller's fence.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.models.functions import Now

from audit import journal
from audit.canonical import digest, digests
from audit.journal import run_stream
from audit.models import JournalEntry
from runtime import holds, ledger
from runtime.errors import InvalidParams, InvalidTransition
from runtime.events import RunEvent, record
from runtime.models import TERMINAL, Action, ActionStatus, Run, RunStatus
from runtime.models.limits import NOTE_MAX
from runtime.tools import Dedup, tool_of

S = ActionStatus


def to_person(action: Action, fence: int, actor: str, reason: str, **journal_extra: Any) -> Action:
    """The action to `manual_review`, its run (if it is still going and `fence` holds it) to
    `needs_reconciliation` — for a reviewer, over the API or the Reconcile page. An undo's
    run is left as it is: an undo holds no run (holds.holds_its_run)."""
    ledger.transition(
        action,
        S.MANUAL_REVIEW,
        actor,
        journal_extra=journal_extra or None,
        last_error=reason[:NOTE_MAX],
        reconcile_attempts=action.reconcile_attempts + 1,
    )
    if not holds.holds_its_run(action):
        return action
    waiting = holds.reconciliation_for(action)
    moved = (
        Run.objects.filter(pk=action.run_id, tenant_id=action.tenant_id, fence=fence)
        .exclude(status__in=TERMINAL)
        .update(status=RunStatus.NEEDS_RECONCILIATION, waiting_for=waiting, updated_at=Now())
    )
    if moved:
        record(
            ledger.RunRef(action.run_id, action.tenant_id),
            RunEvent.NEEDS_RECONCILIATION,
            actor,
            action_id=str(action.action_id),
            reason=reason[:500],
            status=RunStatus.NEEDS_RECONCILIATION,
        )
    return action


def report(who: str, owner: str, outcome: str, external_id: str, result: Any) -> dict[str, Any]:
    """What an external executor's report adds to each journal entry it writes: the API
    account that reported it, the lease owner, the outcome word it said, and the digest of
    the whole report — by which `repeated` knows the report again."""
    return {
        "reported_by": who,
        "executor_owner": owner,
        "outcome": outcome,
        "report_digest": digest(_said(outcome, external_id, result)),
    }


def _said(outcome: str, external_id: str, result: Any) -> dict[str, Any]:
    """The whole report, as the server reads it (the id without surrounding blanks): a
    repeat is the same outcome, external id and result, the result as canonical JSON — so
    neither key order nor number spelling makes a retry another report."""
    return {"outcome": outcome, "external_id": external_id.strip(), "result": result}


def repeated(action: Action, actor: str, outcome: str, external_id: str, result: Any) -> bool:
    """Whether this very report already applied: since the action was last marked `sent`,
    `actor` (the reporting account under its fence) made a report with this digest (see
    `report`). A client repeating a report whose answer it lost is answered with the action
    as it is now: whatever followed the report (an `unknown` handed to a person, the
    person's resolution) stays, and nothing is journalled again. Any other report meets
    the action as it is — refused (InvalidTransition) where a report settled it. Read
    newest first through the action's outcome entries, back to its latest send (none: not
    `sent` now)."""
    if action.status == S.SENT:
        return False  # every report moves an action off `sent`: none since this send
    entries = (
        JournalEntry.objects.filter(
            tenant_id=action.tenant_id,
            stream=run_stream(action.run_id),
            type=RunEvent.ACTION_OUTCOME,
            payload__action_id=str(action.action_id),
        )
        .order_by("-seq")
        .values_list("actor", "payload")
    )
    said = _said(outcome, external_id, result)
    forms = digests(said)  # once, for every entry compared
    for by, payload in entries:
        if payload.get("action_status") == S.SENT:
            return False
        if by == actor and payload.get("reported_by") and _same(payload, said, forms):
            return True
    return False


def _same(payload: dict[str, Any], said: dict[str, Any], forms: tuple[str, ...]) -> bool:
    """Whether the journalled report is `said`: its digest is one of `forms`, the digests of
    `said` in each canonical form audit.canonical knows (`report` stores RFC 8785's). An
    entry written before reports carried a digest names only the outcome word (and, for
    `confirmed`, the id): a retry across that upgrade is matched on those, as before."""
    stored = payload.get("report_digest")
    if stored is not None:
        return str(stored) in forms
    outcome, external_id = payload.get("outcome"), payload.get("external_id")
    return bool(
        outcome == said["outcome"]
        and (outcome != "confirmed" or external_id == said["external_id"])
    )


def settle_unknown(
    action: Action,
    fence: int,
    actor: str,
    mode: str,
    *,
    journal_extra: dict[str, Any] | None = None,
    **changes: Any,
) -> Action:
    """An answer that says nothing of whether the effect happened: `unknown` for the tool's
    contract to settle (replay or lookup), or a person's when nothing ever can (mode `none`)
    or when HOLDPOINT_RECONCILE_ATTEMPTS answers in a row said nothing."""
    extra = journal_extra or {}
    attempts = action.reconcile_attempts + 1
    if mode == Dedup.NONE:
        reason = f"{action.tool} cannot deduplicate or be looked up: only a person can tell"
        return to_person(action, fence, actor, reason, **extra)
    if attempts >= settings.HOLDPOINT_RECONCILE_ATTEMPTS:
        return to_person(action, fence, actor, f"{attempts} outcomes reported unknown", **extra)
    return ledger.transition(
        action,
        S.UNKNOWN,
        actor,
        journal_extra=extra or None,
        reconcile_attempts=attempts,
        **changes,
    )


def record_late_result(
    action: Action,
    target: str,
    actor: str,
    *,
    fence: int,
    outcome: str,
    result: Any = None,
    external_id: str = "",
    last_error: str = "",
    journal_extra: dict[str, Any] | None = None,
) -> Action:
    """An answer to a request whose run moved on since (goal revised, run finished): `target`
    is what the answer would make of the action (confirmed, failed, prepared = certainly
    not applied, unknown), `outcome` the answer's own word for the journal.

    The action is settled by it (see the module): the effect happened or not whatever the
    goal is now. The run is not advanced — its steps belong to the new revision — but an
    action only a person can settle puts it in `needs_reconciliation`, as any such action
    does. Only an action that may have been sent takes an answer: a settled or never-sent
    one's status and result are not a late report's to change (InvalidTransition)."""
    if action.status not in ledger.UNSETTLED:
        raise InvalidTransition(f"action is {action.status}; an outcome answers a send")
    run = Run.objects.only("status", "goal_rev", "external").get(
        pk=action.run_id, tenant_id=action.tenant_id
    )
    record(
        run,
        RunEvent.LATE_RESULT_IGNORED,
        actor,
        action_id=str(action.action_id),
        outcome=outcome,
        action_goal_rev=action.goal_rev,
        run_goal_rev=run.goal_rev,
    )
    extra = journal_extra
    external_id = external_id.strip()
    if target == S.CONFIRMED and external_id:
        return ledger.transition(
            action, S.CONFIRMED, actor, journal_extra=extra, external_id=external_id, result=result
        )
    if target == S.FAILED:
        return ledger.transition(
            action, S.FAILED, actor, journal_extra=extra, result=result, last_error=last_error
        )
    if target == S.PREPARED:
        ledger.transition(action, S.PREPARED, actor, journal_extra=extra, last_error=last_error)
        return ledger.withdraw_if_moved_on(run, action, actor)
    mode = tool_of(action).dedup_mode()
    if mode == Dedup.KEY:
        # Its contract would replay it with its key — a send of an action whose run moved on
        # (invariant 6), which makes the effect now where the first request never arrived.
        reason = (
            f"{action.tool}: the answer came after the run moved on and said nothing certain; "
            "a replay with its key would send it now, so only a person can tell"
        )
        return to_person(action, fence, actor, reason, **(extra or {}))
    said = {"last_error": last_error} if last_error else {}
    return settle_unknown(action, fence, actor, mode, journal_extra=extra, result=result, **said)


def resolve(
    action: Action, outcome: str, *, actor: str, external_id: str = "", note: str = ""
) -> Action:
    """A human settles an action nothing could prove: applied (with the id) or not applied.

    Not applied puts it back to `prepared`: the step sends it again with the same key (an
    undo, which no step drives: its sender, rung) — or, when nobody will (`moved_on`),
    withdraws it (`cancelled`). The run leaves
    `needs_reconciliation` when no other action of it waits for a human.
    """
    if outcome not in ("applied", "not_applied"):
        raise InvalidParams(
            "outcome must be applied or not_applied", errors={"outcome": ["applied or not_applied"]}
        )
    if outcome == "applied" and not external_id.strip():
        raise InvalidParams(
            "applied needs the external id that proves it",
            errors={"external_id": ["required when applied"]},
        )
    with transaction.atomic(durable=True):
        # Lock order run → action, as every writer of a run's actions (a revision,
        # check_dispatchable, a fenced outcome): the opposite order deadlocks with them.
        run = Run.objects.select_for_update().get(pk=action.run_id, tenant_id=action.tenant_id)
        # The window is the database clock's verdict (in_flight_until is database time), as
        # for an executor's not_found (protocol._not_found): not this host's clock.
        locked = (
            Action.objects.select_for_update()
            .annotate(in_flight=ExpressionWrapper(Q(in_flight_until__gt=Now()), BooleanField()))
            .get(pk=action.pk, tenant_id=action.tenant_id)
        )
        if locked.status != S.MANUAL_REVIEW:
            raise InvalidTransition(f"action is {locked.status}, not manual_review")
        in_flight = locked.in_flight_until
        if outcome == "not_applied" and in_flight and locked.in_flight:
            # Saying "not applied" while the sender may still land its request is how a
            # human causes a duplicate; wait until it cannot.
            raise InvalidTransition(
                f"the sender may still be in flight until {in_flight.isoformat()}; "
                "check again after that"
            )
        target = S.CONFIRMED if outcome == "applied" else S.PREPARED
        changes: dict[str, Any] = (
            {"external_id": external_id.strip()} if target == S.CONFIRMED else {}
        )
        ledger.transition(locked, target, actor, **changes)
        resolution: dict[str, Any] = {
            "action_id": str(locked.action_id),
            "run_id": str(run.run_id),
            "outcome": outcome,
            "external_id": external_id.strip(),
            "note": note[:NOTE_MAX],
        }
        record(run, RunEvent.ACTION_RESOLVED, actor, **resolution)
        if target == S.PREPARED:
            ledger.withdraw_if_moved_on(run, locked, actor)
        # A human act: the tenant's stream records it too (DESIGN.md, "Journal").
        journal.append(
            journal.tenant_stream(run.tenant_id),
            RunEvent.ACTION_RESOLVED.value,
            tenant_id=run.tenant_id,
            actor=actor,
            payload=resolution,
        )
        if not holds.for_review(run.tenant_id, run.run_id).exists():
            holds.wake(run, actor, waiting=RunStatus.NEEDS_RECONCILIATION)
    locked.refresh_from_db()
    return locked
