"""Compensation: undoing a confirmed effect with the tool's compensating tool.

A compensation is a new ledger action of its own — its own idempotency key, its own hold
point under the tenant's policy — linked to the original. The original becomes `compensated`
only once the compensation is confirmed, and by the same commit, whichever path confirms it
(its sender, a reconciliation, a person's resolution, an executor's report: all through
`ledger.transition`); until then it stays what it was: confirmed. One that ends without
effect (ENDED_UNSENT) leaves it confirmed, and another may be asked for.

No step drives a compensation and no run waits for it, so its sender is rung
(`runtime.queue.ring_sender`) here (when it is asked for, sent again, or due again), by the
decision that approves it when a policy held it (`approvals.requests.after_decision`), and by
a person's "not applied" (`ledger.withdraw_if_moved_on`): nothing else would ever send it.
For the same reason the sweeper rings the sender of one whose outcome is not known (`sent`,
`unknown`) once its send is out of flight (`ring_due_reconciles`): the sender reconciles it
by its tool's contract — also after its run finished, when no executor of the run ever looks
at it again.

An undo whose tool only an external executor performs (a `client` tool) is never sent by a
worker, which cannot call it: it waits for the run's executor (the executor protocol's
dispatch and outcome) while the run has a live one, and otherwise — a finished run, which no
executor may lease again, or a hosted run — goes to a person (`manual_review`), who undoes it
in the service and resolves it (`_for_a_person`).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from runtime import actionkeys, gates, ledger, unsent
from runtime.dispatch import perform, reconcile_action, reconcile_delay
from runtime.errors import (
    ApprovalExpired,
    ApprovalRequired,
    InvalidParams,
    InvalidTransition,
    NotFound,
    ToolUnavailable,
)
from runtime.events import RunEvent, record
from runtime.leases import db_now_plus
from runtime.models import SENDABLE, STANDALONE, TERMINAL, Action, ActionStatus, Run
from runtime.queue import SENDER, enqueue_task, ring_sender
from runtime.tools import Dedup, Tool, get_tool, tool_of

S = ActionStatus
# The longest reason a compensation keeps (on the action, and sent to an undo tool that takes
# a `reason` as long as that): the run page's form refuses a longer one rather than cutting
# it silently. An undo tool whose schema bounds its `reason` shorter (tasks.close: 2000) gets
# the reason's first that many characters, the most it accepts; the action keeps it whole.
REASON_MAX = 5000
# An unsent standalone action whose send met a tool it could not reach is rung again by the
# sweeper after resend_delay(its failures so far): 30 s, doubling, at most an hour apart.
RESEND_FIRST = 30.0
RESEND_CAP = 3600.0
# How long the sweeper's claim on a due resend lasts: a ring lost on the way is rung again
# after this; a send that fails again sets its own next time.
RESEND_HOLD = 120.0
# An undo whose outcome is not known is rung again no sooner than this after its last write
# (nor sooner than the reconcilers' back-off, `dispatch.reconcile_delay`): the sweeper's claim
# on it, so a ring waiting in the queue is not rung again at every tick.
RECONCILE_HOLD = 30.0
# A standalone action's sender (runtime.queue.SENDER) is rung only for one it may send
# (runtime.models.SENDABLE): one `awaiting_approval` is rung by nobody — not asked again, not
# sent again, not resent by the sweeper — until its request is decided.
# A compensation that ended without effect — rejected or withdrawn before it was sent
# (`cancelled`), or refused by its undo tool (`failed`): the effect is still in place, and
# the undo may be asked for again (`compensate`).
ENDED_UNSENT = frozenset({S.CANCELLED, S.FAILED})


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
    """Prepare the compensating action for a confirmed one and ring its dispatcher; one that
    a hold point holds waits, with its approval request, for a reviewer instead.

    One live compensation per action: asking again while one is under way answers that one.
    One that ended without effect (ENDED_UNSENT: rejected, withdrawn, refused by the undo
    tool) leaves the effect in place, so the undo may be asked for again — a new action with
    a key of its own (`<original key>:undo:<n>`, the n-th asked for; the first is
    `<original key>:undo`), under the tenant's hold points like the first, its reason a new
    one. The original's row lock makes two concurrent asks one.

    The run is locked before the original, the order of every writer of a run and its
    actions — the retention purge above all, which locks due runs and then deletes their
    actions: in the opposite order each waited for the other's row and PostgreSQL aborted
    one ("deadlock detected"). Holding the run while the undo is created is also what lets
    the purge see it: it re-reads under the runs' locks which of them still qualify
    (`retention._purge_batch`). A run purged meanwhile took the action with it: NotFound."""
    try:
        action.refresh_from_db()
    except Action.DoesNotExist:
        raise _purged() from None
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
    forms = actionkeys.canonical_params(params)
    text, fingerprint = forms.text, forms.fingerprint
    with transaction.atomic(durable=True):
        scope = {"tenant_id": action.tenant_id}
        run = Run.objects.select_for_update().filter(pk=action.run_id, **scope).first()
        original = Action.objects.select_for_update().filter(pk=action.pk, **scope).first()
        if run is None or original is None:
            raise _purged()
        if original.status != S.CONFIRMED:
            raise InvalidTransition(
                f"only a confirmed action can be compensated ({original.status})"
            )
        earlier = Action.objects.filter(compensates=original)
        existing = earlier.exclude(status__in=ENDED_UNSENT).first()
        if existing is not None:
            # Asking twice is the same compensation. One still unsent (its send met a tool
            # that could not be reached: the circuit open, the server down or switched off)
            # is rung again: nothing else ever sends it, and asking again is how a person
            # says "now". The compare-and-swap to `sent` keeps two rings to one send.
            if existing.status in SENDABLE:
                ring_sender(existing.action_id)
            elif existing.status == S.AWAITING_APPROVAL:
                # Its open request (raised with it) stays the one; one held before requests
                # were raised for compensations gets its request now (idempotent per action).
                gates.hold(existing, run, actor)
            return existing
        attempt = earlier.count() + 1
        created = Action.objects.create(
            tenant_id=run.tenant_id,
            run=run,
            idempotency_key=actionkeys.undo_key(original.idempotency_key, attempt),
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
            # The sweeper's next try, from the start: the ring below goes to the queue after
            # this commit, and one lost on the way (a worker dead between the two, a broker
            # that dropped it) is rung again RESEND_HOLD on; a send takes it out of the
            # sweeper's index first (unsent.claim_resends). One held for a reviewer is rung by
            # the decision, and by the sweeper after it, should that ring be lost too.
            send_retry_at=db_now_plus(RESEND_HOLD),
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
            attempt=attempt,
            action_status=created.status,
        )
        if created.status == S.AWAITING_APPROVAL:
            gates.hold(created, run, actor)  # its request, bound to its hash, in this commit
        else:
            ring_sender(created.action_id)
    return created


def dispatch_standalone(action_id: Any, *, actor: str = "worker:standalone") -> Action:
    """Send an action that no step drives (a compensation), under the run's current fence.

    The compare-and-swap to `sent` is the lock: of two dispatchers, one wins, the other finds
    the action already sent. An unknown outcome is reconciled by the tool's contract.
    """
    action = Action.objects.get(pk=action_id)
    if action.status not in (*ledger.UNSETTLED, *SENDABLE):
        return action
    tool = get_tool(action.tool, action.tenant_id)
    run = Run.objects.only("fence", "external", "status").get(
        pk=action.run_id, tenant_id=action.tenant_id
    )
    if not (tool_of(action) if action.status in ledger.UNSETTLED else tool).sent_by_holdpoint:
        if _executor_performs(run):
            return action  # its executor dispatches it and reports what came back
        return _for_a_person(action, actor)
    fence = run.fence
    try:
        action = perform(action, fence, tool, actor)
    except InvalidTransition:
        return Action.objects.get(pk=action_id)
    except (ApprovalRequired, ApprovalExpired):
        # Its approval stopped binding before the send (expired, changed, a decider lost the
        # permission): the ledger held it again, with a new request, and nothing was sent.
        # The decision on that request rings it again.
        return Action.objects.get(pk=action_id)
    except ToolUnavailable as unreachable:
        # Nothing applied; a circuit open or an inactive MCP server wrote nothing at all. Kept
        # on the row (no run parks on a standalone action to say it), so the run page tells it
        # from one still queued, and the sweeper tries again later.
        stuck = Action.objects.get(pk=action_id)
        delay = resend_delay(stuck.send_failures + 1)
        return unsent.note_unsent(stuck, unreachable.detail, actor, retry_in=delay)
    if action.status == S.UNKNOWN and tool_of(action).dedup_mode() == Dedup.NONE:
        # Nothing will ever prove what happened: a person's now, as a step's action of such
        # a tool is (`reconcile_action`), not after the sweeper's next ring.
        reconcile_action(action, fence, actor)
        return ledger.reload(action)
    return action  # if confirmed, its original became `compensated` in that same commit


def _executor_performs(run: Run) -> bool:
    """Whether an external executor may still perform the run's `client` actions: a run
    created external and not finished (a finished one can no longer be leased)."""
    return bool(run.external) and run.status not in TERMINAL


def _for_a_person(action: Action, actor: str) -> Action:
    """An undo of a `client` tool that no executor can perform now: to `manual_review`, for a
    person to undo in the service and resolve (applied, with the id; or not applied, which
    withdraws it: `ledger.moved_on`) — instead of `sent` with no request behind it. The run
    is locked first (run, then its actions) and read again under the lock: an executor that
    took its lease meanwhile has the undo instead. The run's status is not touched: no run
    waits for an undo, nor parks on one waiting for a person (holds.holds_its_run)."""
    with transaction.atomic(durable=True):
        scope = {"tenant_id": action.tenant_id}
        run = (
            Run.objects.select_for_update()
            .only("external", "status")
            .get(pk=action.run_id, **scope)
        )
        current = ledger.reload(action)
        if _executor_performs(run) or current.status not in (*ledger.UNSETTLED, *SENDABLE):
            return current
        reason = (
            f"{current.tool} is performed by an external executor, and no executor can "
            f"perform it for this run (it is {run.status}, "
            f"{'external' if run.external else 'hosted'}): undo it in the service, then "
            "resolve it applied with the id, or not applied to withdraw it"
        )
        return ledger.transition(current, S.MANUAL_REVIEW, actor, last_error=reason)


def resend_delay(failures: int) -> float:
    """Seconds from a standalone action's `failures`-th failed send to the sweeper's next."""
    return min(RESEND_CAP, RESEND_FIRST * 2.0 ** min(max(failures - 1, 0), 16))


def send_again(action: Action, *, actor: str) -> Action:
    """A person's "send it now" for a compensation whose send could not reach its tool: ring
    its dispatcher (after the caller's commit). Nothing is written here — the send is the
    write, and its compare-and-swap to `sent` keeps this ring and the sweeper's to one send;
    the compensation was authorised when it was asked for, and its send still meets the
    tenant's hold points. One no longer unsent, or never failed, is refused: there is
    nothing to send again (a queued one is on its way)."""
    current = Action.objects.get(pk=action.pk, tenant_id=action.tenant_id)
    if current.compensates_id is None or not current.standalone:
        raise InvalidTransition("only a compensation is sent again from here")
    if current.status not in SENDABLE:
        raise InvalidTransition(f"the compensation is {current.status}: nothing to send again")
    if current.send_failed_at is None:
        raise InvalidTransition("the compensation has not failed to send: it is on its way")
    ring_sender(current.action_id)
    return current


def ring_due_resends(limit: int) -> int:
    """The sweeper's part: ring the dispatcher of each standalone action whose send failed and
    whose back-off is over (`unsent.claim_resends` claims each first, so a tick does not ring
    it again while its ring waits). How many were rung."""
    claimed = unsent.claim_resends(limit, RESEND_HOLD)
    for action_id, _tenant in claimed:
        enqueue_task(SENDER, action_id)
    return len(claimed)


def ring_due_reconciles(limit: int) -> int:
    """The sweeper's part for undos whose outcome is not known (`sent`, `unknown`): ring the
    sender of each whose send can no longer be in flight (its sender's window, by the
    database clock) and whose last write is RECONCILE_HOLD (or the reconcilers' back-off)
    past; the sender reconciles it by its tool's contract (`dispatch.perform`). Each is
    claimed first — a compare-and-swap moving its updated_at to now — so that the next tick
    does not ring it again while its ring waits. One a `client` tool's executor still
    performs is claimed and not rung: its executor reconciles it (its `reconcile`). How
    many were rung. Read through the partial index runtime_action_unsettled."""
    out_of_flight = Q(in_flight_until__isnull=True) | Q(in_flight_until__lte=Now())
    due = (
        Action.objects.filter(step=STANDALONE, status__in=ledger.UNSETTLED)
        .filter(out_of_flight, updated_at__lte=db_now_plus(-RECONCILE_HOLD))
        .order_by("updated_at")
    )
    fields = ("action_id", "tenant_id", "run", "tool", "tool_version", "reconcile_attempts")
    rung = 0
    found = due.select_related("run").only(*fields, "run__external", "run__status")
    for action in list(found[:limit]):
        hold = max(RECONCILE_HOLD, reconcile_delay(action.reconcile_attempts))
        claimed = Action.objects.filter(
            pk=action.pk,
            tenant_id=action.tenant_id,
            status__in=ledger.UNSETTLED,
            updated_at__lte=db_now_plus(-hold),
        ).update(updated_at=Now())
        if claimed and _sent_by_a_worker(tool_of(action), action.run):
            enqueue_task(SENDER, str(action.action_id))
            rung += 1
    return rung


def _sent_by_a_worker(tool: Tool, run: Run) -> bool:
    """Whether a worker's sender settles an undo of `tool` (else its run's executor does)."""
    return tool.sent_by_holdpoint or not _executor_performs(run)


def _purged() -> NotFound:
    return NotFound("the action is gone: its run was purged by retention")
