"""The side-effect ledger: every transition of an action, as one named function.

`prepared` always means "certainly not sent": `sent` is committed before a request leaves.
`confirmed` needs proof (the service's id; the database refuses it without). An unknown
outcome is never reported as success and never retried under a new key. Executor writes are
conditional on the run's fence; a revision of the goal fences off the old revision's work.
Network calls live in `runtime.dispatch`; this module only writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from fastsql import statements
from runtime import gates, toolcatalog
from runtime.actionkeys import (
    Canonical,
    canonical_params,
    idempotency_key,
    journal_params,
    visit_prefix,
)
from runtime.errors import (
    ActionCancelled,
    ApprovalExpired,
    ApprovalRequired,
    InvalidParams,
    InvalidTransition,
    RunFinished,
    StaleFence,
    StaleGoalRev,
    ToolChanged,
    ToolWithheld,
)
from runtime.events import RunEvent, record
from runtime.models import SENDABLE, TERMINAL, UNSENT, Action, ActionStatus, Run, RunStatus
from runtime.models.limits import NOTE_MAX
from runtime.queue import ring_sender
from runtime.tools import Tool, tool_of

S = ActionStatus
# The allowed transitions, in one place (DESIGN.md, "Action" state machine).
TRANSITIONS: dict[str, frozenset[str]] = {
    # prepared/approved → manual_review: an undo only an external executor can send, of a
    # run none can send it for now — a person undoes it by hand (compensation.dispatch_standalone).
    S.PREPARED: frozenset({S.AWAITING_APPROVAL, S.SENT, S.CANCELLED, S.MANUAL_REVIEW}),
    S.AWAITING_APPROVAL: frozenset({S.APPROVED, S.CANCELLED}),
    S.APPROVED: frozenset({S.SENT, S.CANCELLED, S.AWAITING_APPROVAL, S.MANUAL_REVIEW}),
    S.SENT: frozenset({S.CONFIRMED, S.UNKNOWN, S.FAILED, S.PREPARED, S.MANUAL_REVIEW}),
    S.UNKNOWN: frozenset({S.CONFIRMED, S.UNKNOWN, S.PREPARED, S.FAILED, S.MANUAL_REVIEW}),
    S.MANUAL_REVIEW: frozenset({S.CONFIRMED, S.PREPARED}),
    S.CONFIRMED: frozenset({S.COMPENSATED}),
}
UNSETTLED = (S.SENT, S.UNKNOWN)


def sources(target: str) -> list[str]:
    return [source for source, targets in TRANSITIONS.items() if target in targets]


@dataclass(frozen=True)
class RunRef:
    """What a journal record needs of a run — its id and its tenant — without a model."""

    run_id: Any
    tenant_id: int


def fenced(run_id: Any, fence: int, tenant_id: int | None = None) -> None:
    """Inside a transaction: proceed only if `fence` still owns the run (row-locking it)."""
    where: dict[str, Any] = {"run_id": run_id, "fence": fence}
    if tenant_id is not None:
        where["tenant_id"] = statements.Check(tenant_id)
    if statements.update(Run, {"updated_at": statements.NOW}, where) != 1:
        raise StaleFence(f"fence {fence} no longer owns run {run_id}")


def fence_moved(run_id: Any, fence: int) -> bool:
    """Whether `fence` is no longer the run's (a takeover or a release moved it on): one read
    of the run row by its key, no lock. A service's word that it refused our fence is
    believed only when this agrees (`dispatch.settle_fence_claim`)."""
    return not Run.objects.filter(pk=run_id, fence=fence).exists()


def absorb(action: Action, row: list[Any]) -> Action:
    """The row as the database now holds it, written onto the instance (a refresh)."""
    action.__dict__.update(zip(statements.attnames(Action), row, strict=True))
    return action


def _swap(
    action: Action, target: str, changes: dict[str, Any], **where: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The compare-and-swap into `target`: what it sets, and the condition — this action, its
    tenant, a status allowed to reach `target` — whether it runs alone (`_move`) or as a part
    of a one-statement commit (`transition_part`)."""
    sets = {"status": target, "updated_at": statements.NOW, **changes}
    condition = {
        "action_id": action.pk,
        "tenant_id": statements.Check(action.tenant_id),
        "status": sources(target),
        **where,
    }
    return sets, condition


def _move(action: Action, target: str, changes: dict[str, Any], **where: Any) -> bool:
    """The compare-and-swap itself; on success the instance holds the row as stored."""
    sets, condition = _swap(action, target, changes, **where)
    rows = statements.update(Action, sets, condition, returning=statements.attnames(Action))
    if len(rows) != 1:
        return False
    absorb(action, rows[0])
    return True


def _record_outcome(
    action: Action,
    target: str,
    actor: str,
    changes: dict[str, Any],
    journal_extra: dict[str, Any] | None = None,
) -> None:
    record(
        RunRef(action.run_id, action.tenant_id),
        RunEvent.ACTION_OUTCOME,
        actor,
        action_id=str(action.action_id),
        idempotency_key=action.idempotency_key,
        fingerprint=action.fingerprint,
        action_status=target,
        **{k: v for k, v in changes.items() if k in ("external_id", "last_error")},
        **(journal_extra or {}),
    )


def transition(
    action: Action,
    target: str,
    actor: str,
    *,
    journal_extra: dict[str, Any] | None = None,
    **changes: Any,
) -> Action:
    """Compare-and-swap the action into `target` from any status allowed to reach it.

    Database-time values are `statements.NOW` / `statements.DbNow(seconds)`. The instance is
    refreshed from the updated row itself (no second read). `journal_extra`: more for the
    outcome's journal entry (an external executor's outcome names who reported it).

    An undo confirmed (`action.compensates`) makes its original `compensated` in the same
    commit, by whichever path it is confirmed (`_undone`)."""
    undoes = target == S.CONFIRMED and action.compensates_id is not None
    if undoes:
        _hold_run(action)
    if not _move(action, target, changes):
        current = (
            Action.objects.filter(pk=action.pk, tenant_id=action.tenant_id)
            .values_list("status", flat=True)
            .first()
        )
        raise InvalidTransition(f"action is {current}, cannot become {target}")
    _record_outcome(action, target, actor, changes, journal_extra)
    if undoes:
        _undone(action, actor)
    return action


def _hold_run(action: Action) -> None:
    """Inside the caller's transaction, before an undo's confirmation: the run's row lock,
    which every path confirming one already holds (a fenced outcome, a person's resolution),
    so that the undo and its original are written in the order of every writer of a run's
    actions — the run, then its actions (`compensation.compensate`, the retention purge)."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("an undo is confirmed inside a transaction, with its original")
    where = {"run_id": action.run_id, "tenant_id": statements.Check(action.tenant_id)}
    statements.select(Run, ("fence",), where, for_update=True)


def _undone(undo: Action, actor: str) -> None:
    """The undo is confirmed: its original becomes `compensated` in the same commit. As two
    commits (the sender's, then a second), a sender that died between them left the original
    `confirmed` for good — the undo was settled, so nothing looked at it again — and only
    the sender's path wrote the second (not a reconciliation, a person's resolution, an
    executor's report). An original no longer `confirmed` is left as it is: its undo is
    settled either way (one live undo per action: `compensation.compensate`)."""
    original = Action(action_id=undo.compensates_id, tenant_id=undo.tenant_id)
    if _move(original, S.COMPENSATED, {}):
        extra = {"compensated_by": str(undo.action_id)}
        _record_outcome(original, S.COMPENSATED, actor, {}, extra)


def transition_part(
    one: statements.OneStatement,
    name: str,
    action: Action,
    target: str,
    actor: str,
    *,
    after: tuple[str, ...],
    **changes: Any,
) -> statements.Part:
    """`transition`'s compare-and-swap as a part of a one-statement commit (PostgreSQL),
    written only if the parts `after` wrote; its journal entry is recorded now, into the
    caller's batch of the run stream. The part writes no row if the action is no longer in
    a status that may reach `target` — the statement then fails whole, and the caller's
    transaction path raises InvalidTransition as `transition` does. The instance is not
    refreshed (no row comes back from a part). No step drives an undo, so none is confirmed
    here: `transition` confirms one, with its original."""
    if target == S.CONFIRMED and action.compensates_id is not None:
        raise InvalidTransition("an undo is confirmed with its original, by `transition`")
    sets, condition = _swap(action, target, changes)
    part = one.update(name, Action, sets, condition, after=after)
    _record_outcome(action, target, actor, changes)
    return part


def create_action(
    run: Run,
    fence: int,
    tool: Tool,
    params: dict[str, Any],
    *,
    step: str,
    call_index: int,
    reason: str,
    target: str,
    actor: str,
    needs_approval: bool,
    canonical: Canonical | None = None,
    key: str | None = None,
    send_ttl: float | None = None,
) -> Action:
    """Insert a prepared action (inside the transaction that fences it: a worker's step
    checkpoint, an external executor's prepare) — the one Action constructor, with
    `create_action_part` (the same row as a part of a one-statement commit).

    `canonical`: the canonical forms the caller already computed from `params`. `key`: an
    idempotency key the client chose; else the one derived from the step visit's call.

    `send_ttl` (the sender's lease TTL): an action that needs no approval is marked `sent` in
    the same transaction — its `sent` commit is its prepare's. Only for a caller whose
    transaction already holds the run row under `fence` at the run's goal_rev (the step
    commit's compare-and-swap ran first) and for a tool reconcilable by key or lookup: a
    crash before the request leaves then costs a replay or a lookup, never a person."""
    action, row = _new_action(
        run, fence, tool, params, step, call_index, reason, target, needs_approval, canonical, key
    )
    # Prepared and marked sent by one INSERT (what `transition` to SENT would write: the
    # sender's fence, database-time sent_at and in-flight window, one attempt); the instance
    # takes the database-time values back from it.
    sending = action.status == S.PREPARED and send_ttl is not None
    if sending:
        assert send_ttl is not None
        stamped = ("updated_at", *_sent_at_prepare(row, fence, send_ttl, tool))
        (stored,) = statements.insert(Action, [row], returning=stamped)
        action.__dict__.update(zip(stamped, stored, strict=True), status=S.SENT)
    else:
        statements.insert(Action, [row])
    action._state.adding = False
    action._state.db = transaction.get_connection().alias
    _journal_prepared(action, run, actor, tool, params, sending)
    return action


def create_action_part(
    one: statements.OneStatement,
    name: str,
    run: Run,
    fence: int,
    tool: Tool,
    params: dict[str, Any],
    *,
    step: str,
    call_index: int,
    reason: str,
    target: str,
    actor: str,
    canonical: Canonical,
    send_ttl: float | None,
    after: str,
) -> tuple[Action, statements.Part]:
    """`create_action` of an action no hold point holds, as a part of a step's one-statement
    commit (PostgreSQL), written only if the part `after` wrote; its journal entries are
    recorded now, into the caller's batch of the run stream. Nothing comes back from a part:
    the instance's database-time stamps (updated_at, sent_at, in_flight_until) are this
    process's clock, as close as it can say — reading the row gives the stored ones, and a
    reconciliation reads the row first."""
    action, row = _new_action(
        run, fence, tool, params, step, call_index, reason, target, False, canonical, None
    )
    sending = send_ttl is not None
    if send_ttl is not None:
        _sent_at_prepare(row, fence, send_ttl, tool)
        now = timezone.now()
        action.status, action.sent_fence, action.attempts = S.SENT, fence, 1
        action.sent_at = now
        action.in_flight_until = now + timedelta(seconds=send_ttl + tool.timeout)
    part = one.insert(name, Action, [row], after=after)
    action._state.adding = False
    action._state.db = one.conn.alias
    _journal_prepared(action, run, actor, tool, params, sending)
    return action, part


def _new_action(
    run: Run,
    fence: int,
    tool: Tool,
    params: dict[str, Any],
    step: str,
    call_index: int,
    reason: str,
    target: str,
    needs_approval: bool,
    canonical: Canonical | None,
    key: str | None,
) -> tuple[Action, dict[str, Any]]:
    """The prepared action (or awaiting approval) and its row to insert (attname → value)."""
    forms = canonical or canonical_params(params)
    text, fingerprint = forms.text, forms.fingerprint
    now = timezone.now()
    action = statements.built(
        Action,
        {
            "tenant_id": run.tenant_id,
            "run_id": run.run_id,
            "idempotency_key": key or idempotency_key(run, step, call_index),
            "tool": tool.name,
            "tool_version": tool.version,
            "params": text,
            "fingerprint": fingerprint,
            "goal_rev": run.goal_rev,
            "fence": fence,
            "step": step,
            "call_index": call_index,
            "reason": reason[:5000],
            "target": target[:300],
            "status": S.AWAITING_APPROVAL if needs_approval else S.PREPARED,
            "requested_fingerprint": fingerprint,
            "created_at": now,
            "updated_at": now,
        },
    )
    return action, {name: action.__dict__[name] for name in statements.attnames(Action)}


def _sent_at_prepare(row: dict[str, Any], fence: int, ttl: float, tool: Tool) -> tuple[str, ...]:
    """Mark a new action's `row` sent (what `transition` to SENT writes, one attempt); returns
    the names of the columns it set."""
    marks = {**_sent_changes(fence, ttl, tool), "attempts": 1}
    row.update(marks, status=S.SENT, updated_at=statements.NOW)
    return tuple(marks)


def _journal_prepared(
    action: Action, run: Run, actor: str, tool: Tool, params: dict[str, Any], sending: bool
) -> None:
    """A new action's journal entries: its prepare, then its hold or its `sent` mark."""
    record(
        run,
        RunEvent.ACTION_PREPARED,
        actor,
        action_id=str(action.action_id),
        idempotency_key=action.idempotency_key,
        fingerprint=action.fingerprint,
        tool=tool.name,
        params=journal_params(tool, params),
        goal_rev=run.goal_rev,
        action_status=S.PREPARED if sending else action.status,
    )
    if action.status == S.AWAITING_APPROVAL:
        gates.hold(action, run, actor)
    elif sending:
        _record_outcome(action, S.SENT, actor, {})  # the journal as a prepare, then a mark


def same_request(action: Action, canonical: Canonical) -> bool:
    """Whether params of these canonical forms are what the action was asked for — before any
    reviewer edit, so a retried or re-executed call still matches an action whose params a
    reviewer changed; and in the form it was stored in, so an action prepared before
    Holdpoint wrote RFC 8785 is still the one its step asks for (actionkeys.Canonical)."""
    return (action.requested_fingerprint or action.fingerprint) in canonical.fingerprints()


def by_key(tenant_id: int, key: str) -> Action | None:
    """The tenant's action with this idempotency key (keys are unique per tenant)."""
    return Action.objects.filter(tenant_id=tenant_id, idempotency_key=key).first()


def find_action(run: Run, step: str, call_index: int, canonical: Canonical) -> Action | None:
    """The action this call of this step prepared before, if any; refuses different params."""
    action = by_key(run.tenant_id, idempotency_key(run, step, call_index))
    if action is not None and not same_request(action, canonical):
        raise InvalidParams(
            f"step {step} asked for call {call_index} with different params under the same "
            "idempotency key; refusing to send something other than what was prepared",
            errors={"params": ["differs from the prepared action with this key"]},
        )
    return action


def visit_actions(run: Run, step: str) -> dict[int, Action]:
    """The actions of this visit of `step` under their derived keys, by call index (an
    external executor names no call index: it asks which calls of the visit were made)."""
    prefix = visit_prefix(run, step)
    calls: dict[int, Action] = {}
    candidates = Action.objects.filter(
        tenant_id=run.tenant_id, run_id=run.run_id, step=step, goal_rev=run.goal_rev
    )
    for action in candidates:
        key = action.idempotency_key
        # Compared here, not by LIKE: SQLite's LIKE ignores case.
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            calls[int(key[len(prefix) :])] = action
    return calls


def check_dispatchable(action_id: Any, fence: int, tenant_id: int | None = None) -> Action:
    """Refuse to send an action whose revision is stale or whose run moved to another fence.

    Locks the action and run rows so a concurrent goal revision cannot slip in between the
    check and the `sent` mark made in the same transaction.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("check_dispatchable must run inside the dispatch transaction")
    scope = {} if tenant_id is None else {"tenant_id": tenant_id}
    # Lock order run → action, the same as a goal revision's (run, then its actions):
    # the opposite order deadlocks against a concurrent revision.
    run_id = Action.objects.values_list("run_id", flat=True).get(pk=action_id, **scope)
    run = Run.objects.select_for_update().get(pk=run_id, **scope)
    action = Action.objects.select_for_update().get(pk=action_id, **scope)
    # The fence first: a holder that lost the lease learns that (and stops) before anything
    # about the action, which is no longer its business.
    if run.fence != fence:
        raise StaleFence("the run was taken over by another executor")
    if action.status == S.CANCELLED:
        raise ActionCancelled("the action was cancelled")
    finished = run.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
    if finished and not action.standalone:  # compensations may follow a finished run
        raise RunFinished(f"the run is {run.status}: nothing more is sent for it")
    if action.goal_rev != run.goal_rev:
        raise StaleGoalRev(f"prepared under goal_rev {action.goal_rev}, run is at {run.goal_rev}")
    if action.status not in SENDABLE:
        raise InvalidTransition(f"action is {action.status}")
    return action


def _unheld_goal_rev(action: Action, fence: int, tool: Tool) -> int | None:
    """The fast path's checks, under the run's row lock: the run's goal_rev if the action may
    be marked sent without consulting a hold point, else None (take the full path).

    The same refusals as `check_dispatchable` (finished run, stale revision or fence), and
    the hold-point question asked the cheap way first: does any approval request exist for
    this action, or any active policy for its tool in its tenant? Only when neither does —
    and the tool declares no approval itself — is the full re-check certain to let it go.
    The action's status is checked by the compare-and-swap that marks it.
    """
    rows = statements.select(
        Run,
        ("fence", "goal_rev", "status"),
        {"run_id": action.run_id, "tenant_id": statements.Check(action.tenant_id)},
        for_update=True,
    )
    if not rows:
        return None
    run_fence, goal_rev, status = rows[0]
    if run_fence != fence or goal_rev != action.goal_rev:
        return None
    if status in TERMINAL and not action.standalone:
        return None
    if action.status not in SENDABLE or gates.may_hold(action, tool):
        return None
    return int(goal_rev)


def _sent_changes(fence: int, ttl: float, tool: Tool) -> dict[str, Any]:
    """What marking `sent` writes: the sender's fence and, in database time, until when it
    may still be in flight (its lease plus the tool's longest request)."""
    return {
        "sent_fence": fence,
        "sent_at": statements.NOW,
        "in_flight_until": statements.DbNow(ttl + tool.timeout),
        "attempts": statements.Add(1),
    }


def mark_sent(
    action: Action,
    fence: int,
    ttl: float,
    tool: Tool,
    actor: str,
    *,
    then: Callable[[Action], None] | None = None,
) -> Action:
    """Commit `sent` before the request leaves. Until `in_flight_until` (this sender's lease
    plus the tool's longest request) nobody may conclude the request did not arrive. `then`:
    a write that must commit with the mark (it gets the sent action, the run row locked).

    The hold-point re-check runs in the same transaction, with the run row locked: when no
    hold point can apply (no request for the action, no policy for its tool) a cheap check
    says so and the action is swapped to `sent` directly; anything else takes the full path
    with the action row locked too. There the hold point only gives its verdict; an
    approval that no longer binds this exact action (hash, expiry, the decider's
    permission) makes the ledger hold the action again (`hold_again`) — committed — and
    refuse the send.

    An MCP tool whose server is inactive now (`toolcatalog.withheld`, the rule that refuses
    a new action of it) is not marked sent: ToolWithheld, with nothing written, so the
    action keeps its status — an approval given for it still binds — and is sent once the
    server is active again. Marked sent, its call would only have failed it locally, and
    the approved effect would have been lost for good.
    """
    changes = _sent_changes(fence, ttl, tool)
    if action.tool_version != tool.version:
        action = _take_version(action, fence, tool, actor)
    with transaction.atomic(durable=True):
        server = toolcatalog.withheld(tool, action.tenant_id)  # no statement for a non-MCP tool
        if server:
            # What the sender must hear first (a lost lease, a cancelled action, a revised
            # goal, a finished run) still comes first; nothing is written either way.
            check_dispatchable(action.action_id, fence, action.tenant_id)
            raise ToolWithheld(
                f"{action.tool} was not sent: its MCP server {server!r} is inactive",
                server=server,
            )
        goal_rev = _unheld_goal_rev(action, fence, tool)
        if goal_rev is not None and _move(action, S.SENT, changes, goal_rev=goal_rev):
            _record_outcome(action, S.SENT, actor, changes)
            if then is not None:
                then(action)
            return action
        action = check_dispatchable(action.action_id, fence, action.tenant_id)
        verdict = gates.dispatch_gate(action)
        if verdict.go:
            sent = transition(action, S.SENT, actor, **changes)
            if then is not None:
                then(sent)
            return sent
        if verdict.withdraw:
            reject_lapsed(action, actor, verdict)
        else:
            hold_again(action, actor, verdict)
    said = verdict.refusal.replace("_", " ")
    if verdict.withdraw:
        said = f"{said}; {verdict.withdraw}: the action is cancelled"
    raise (ApprovalExpired if verdict.refusal == ApprovalExpired.code else ApprovalRequired)(
        f"{action.tool} cannot be sent: {said}"
    )


def _take_version(action: Action, fence: int, tool: Tool, actor: str) -> Action:
    """Committed before the send's own transaction: the action moves to the tool's version
    in force (or is cancelled, if that version refuses its params — raised as ToolChanged)."""
    with transaction.atomic(durable=True):
        action = check_dispatchable(action.action_id, fence, action.tenant_id)
        refused = _restamp(action, tool, actor) if action.tool_version != tool.version else ""
        if refused:  # never sent: withdrawn, as an action of an old goal revision is —
            # and so is an approval given for it (gates.withdrawn, as withdraw_unsent does)
            transition(action, S.CANCELLED, actor, last_error=refused[:NOTE_MAX])
            gates.withdrawn([str(action.action_id)], refused, actor)
    if refused:
        raise ToolChanged(refused)
    return action


def _restamp(action: Action, tool: Tool, actor: str) -> str:
    """The tool was redefined after the action was prepared: the action is sent under the
    definition in force now, so it takes that version (rows locked by the caller). Its hash
    changes with the version, so an approval given for the old one no longer binds and the
    re-check that follows supersedes it, as for a changed action. Params the new schema
    refuses are not sent: the reason is returned (the caller cancels the action)."""
    try:
        tool.validate(json.loads(action.params))
    except InvalidParams as exc:
        errors = exc.extra.get("errors") or exc.detail
        return f"{tool.name} changed to version {tool.version}; it refuses these params: {errors}"
    previous = action.tool_version
    Action.objects.filter(pk=action.pk, tenant_id=action.tenant_id).update(
        tool_version=tool.version, updated_at=Now()
    )
    action.tool_version = tool.version
    record(
        Run(run_id=action.run_id, tenant_id=action.tenant_id),
        RunEvent.ACTION_TOOL_CHANGED,
        actor,
        action_id=str(action.action_id),
        tool=tool.name,
        previous_version=previous,
        version=tool.version,
    )
    return ""


def extend_in_flight(run_id: Any, tenant_id: int, fence: int, lease_ends: datetime) -> int:
    """After a heartbeat of `fence` (its lease now ends at `lease_ends`, database time): the
    actions it sent that are still `sent` may be in flight until then plus their tool's
    timeout — an external executor's `perform` may run as long as it keeps its lease, and
    nobody may conclude "not applied" (a successor's lookup, a person) before it could no
    longer land. Never earlier than the window was; returns how many moved.

    The run's `sent` actions are read through the partial index runtime_action_unsettled —
    none, usually: one statement per heartbeat — and moved by one compare-and-swap per
    timeout (still `sent` by this fence, and only later)."""
    sent = Action.objects.filter(
        tenant_id=tenant_id, run_id=run_id, status=S.SENT, sent_fence=fence
    )
    by_timeout: dict[float, list[Any]] = {}
    for action in sent.only("action_id", "tenant_id", "tool", "tool_version"):
        by_timeout.setdefault(tool_of(action).timeout, []).append(action.pk)
    moved = 0
    for timeout, ids in by_timeout.items():
        until = lease_ends + timedelta(seconds=timeout)
        moved += sent.filter(pk__in=ids, in_flight_until__lt=until).update(in_flight_until=until)
    return moved


def mark_resent(action: Action, fence: int, ttl: float, tool: Tool, actor: str) -> Action:
    """Inside the caller's fenced transaction: a `sent` or `unknown` action of a tool that
    honours its idempotency key is sent again with that key (reconcile `replay_same_key`) —
    the same effect, so no new hold-point check; the in-flight window starts again."""
    changes: dict[str, Any] = {
        "sent_fence": fence,
        "sent_at": statements.NOW,
        "in_flight_until": statements.DbNow(ttl + tool.timeout),
        "attempts": statements.Add(1),
    }
    rows = statements.update(
        Action,
        {"status": S.SENT, "updated_at": statements.NOW, **changes},
        {
            "action_id": action.pk,
            "tenant_id": statements.Check(action.tenant_id),
            "status": list(UNSETTLED),
        },
        returning=statements.attnames(Action),
    )
    if len(rows) != 1:
        raise InvalidTransition("only a sent or unknown action is sent again with its key")
    absorb(action, rows[0])
    _record_outcome(action, S.SENT, actor, changes, {"again": True})
    return action


def hold_again(action: Action, actor: str, verdict: gates.Verdict) -> Action:
    """Back to awaiting_approval, in the dispatch transaction: the approval the verdict names
    stopped binding (it is superseded, through the port) or there never was one; a new
    request is raised."""
    if verdict.stale is not None:
        gates.supersede(verdict.stale, action, verdict.reason or verdict.refusal, actor)
    action = transition(action, S.AWAITING_APPROVAL, actor)
    gates.hold(action, Run.objects.get(pk=action.run_id, tenant_id=action.tenant_id), actor)
    return action


def reject_lapsed(action: Action, actor: str, verdict: gates.Verdict) -> Action:
    """In the dispatch transaction: the approval lapsed unsent and its policy rejects at
    expiry — superseded (its words say so), and the action `cancelled` with the verdict's
    "rejected at expiry: …", as the expirer rejects a request nobody decided in time. Every
    way of waiting reads that: a step gets ActionRejected, a client's next dispatch 409
    `action_cancelled`, the MCP gateway REJECTED."""
    if verdict.stale is not None:
        gates.supersede(verdict.stale, action, verdict.reason or verdict.refusal, actor)
    return transition(action, S.CANCELLED, actor, last_error=verdict.withdraw[:NOTE_MAX])


def edit_params(action: Action, params: dict[str, Any], actor: str) -> Action:
    """A reviewer's edit of a held action: new canonical params, new fingerprint (so a new
    action hash); the step's original request stays matched via requested_fingerprint.

    Params the edit leaves as they were keep the text they are stored in — its form too, for
    an action prepared before Holdpoint wrote RFC 8785 (actionkeys.Canonical) — so such an
    edit changes no hash, as it did not before that upgrade: a quorum's votes still stand."""
    forms = canonical_params(params)
    if action.params in forms.texts():
        text, fingerprint = action.params, action.fingerprint
    else:
        text, fingerprint = forms.text, forms.fingerprint
    moved = Action.objects.filter(pk=action.pk, status=S.AWAITING_APPROVAL).update(
        params=text, fingerprint=fingerprint, updated_at=Now()
    )
    if moved != 1:
        raise InvalidTransition("only an action awaiting approval can be edited")
    run = Run(run_id=action.run_id, tenant_id=action.tenant_id)
    record(
        run,
        RunEvent.ACTION_EDITED,
        actor,
        action_id=str(action.action_id),
        previous_fingerprint=action.fingerprint,
        fingerprint=fingerprint,
    )
    action.refresh_from_db()
    return action


def cancel_older_revisions(run: Run, goal_rev: int, actor: str) -> list[str]:
    """Cancel every unsent action prepared under a revision older than `goal_rev`."""
    return withdraw_unsent(run, "goal revised", actor, goal_rev_below=goal_rev)


def withdraw_unsent(
    run: Run, reason: str, actor: str, *, goal_rev_below: int | None = None
) -> list[str]:
    """Cancel the run's unsent actions — nothing of them has left — (only those prepared
    under a revision below `goal_rev_below`, if given) and close their approval requests.
    Inside the caller's fenced transaction."""
    unsent: QuerySet[Action] = Action.objects.filter(
        run_id=run.run_id, tenant_id=run.tenant_id, status__in=UNSENT
    )
    revision: dict[str, Any] = {}
    if goal_rev_below is not None:
        unsent = unsent.filter(goal_rev__lt=goal_rev_below)
        revision["goal_rev"] = goal_rev_below
    ids = [str(a) for a in unsent.values_list("action_id", flat=True)]
    if ids:
        unsent.update(status=S.CANCELLED, updated_at=Now(), last_error=reason)
        for action_id in ids:
            record(
                run,
                RunEvent.ACTION_CANCELLED,
                actor,
                action_id=action_id,
                reason=reason,
                **revision,
            )
        gates.withdrawn(ids, reason, actor)
    return ids


def reload(action: Action) -> Action:
    """`refresh_from_db`, by id *and* tenant (defence in depth: a worker reads nothing of
    another tenant even by a wrong id)."""
    row = statements.select(
        Action,
        statements.attnames(Action),
        {"action_id": action.pk, "tenant_id": statements.Check(action.tenant_id)},
    )
    if not row:
        raise Action.DoesNotExist(f"action {action.pk} is gone")
    return absorb(action, row[0])


def may_be_in_flight(action: Action) -> bool:
    """Whether the action's sender may still land its request — by the database clock, as
    `in_flight_until` was set (its lease plus the tool's timeout): an app host whose clock
    runs ahead must not conclude "not applied" early (that is how duplicates happen)."""
    if action.in_flight_until is None:
        return False
    return Action.objects.filter(
        pk=action.pk, tenant_id=action.tenant_id, in_flight_until__gt=Now()
    ).exists()


def moved_on(run: Run, action: Action) -> str:
    """Why nobody will send a not-applied action again ("" if someone will): its run finished
    (a cancel withdrew the run's unsent actions; no executor writes to it now), or the goal
    was revised since it was prepared (a revision withdrew the older unsent actions;
    dispatch refuses it as stale_goal_rev), or it is an undo only an external executor
    performs (a `client` tool) of a run that has none (a hosted run's)."""
    if run.status in TERMINAL:
        return f"not applied, and the run is {run.status}"
    if action.goal_rev < run.goal_rev:
        return f"not applied, and the goal was revised (goal_rev {run.goal_rev})"
    if action.standalone and not run.external and not tool_of(action).sent_by_holdpoint:
        return f"not applied, and no executor of this run can perform {action.tool}"
    return ""


def withdraw_if_moved_on(run: Run, action: Action, actor: str) -> Action:
    """A not-applied action just put back to `prepared`: withdrawn (`cancelled`, with the
    reason) when nobody will send it again (`moved_on`), as the run's other unsent actions
    were; else sent again with the same key — by its step, or, for an undo (no step drives
    one), by its sender, rung after the caller's commit: left `prepared`, nothing sent it."""
    gone = moved_on(run, action)
    if gone:
        transition(action, S.CANCELLED, actor, last_error=gone)
    elif action.standalone:
        ring_sender(action.action_id)
    return action
