"""Sending actions and reconciling unknown outcomes: the ledger's network side.

The order is the guarantee: prepare (with the step's checkpoint) → commit `sent` → call the
tool outside any transaction → record what came back — each with a named fault point
between, so tests can kill a real worker in every window. For a tool reconcilable by key or
lookup that no hold point holds, the prepare and the `sent` mark are one commit
(`after_prepare` and `after_sent_mark` are reached one after the other), and a confirmation
is written by the executor's next commit (`Confirmed`); other answers get a checkpoint at
once. Reconciliation follows the tool's dedup contract: replay with the same key, look up by
key, or ask a human.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from fastsql.statements import OneStatement, Part, PartsAfter, Read, tenant_check
from runtime import actionkeys, gates, ledger, observe, outcomes, toolcatalog, tools
from runtime.errors import (
    ApprovalExpired,
    ApprovalRequired,
    HoldpointError,
    InvalidParams,
    Park,
    StaleFence,
    ToolUnavailable,
    ToolWithheld,
    Unwritten,
)
from runtime.faults import FaultPoint, fault
from runtime.graphs import Graph
from runtime.leases import db_now_plus
from runtime.models import Action, ActionStatus, Run, ToolCredential
from runtime.models.limits import NOTE_MAX
from runtime.models.secrets import read_along
from runtime.tools import CallResult, CircuitOpen, Dedup, Tool, get_tool, tool_of

if TYPE_CHECKING:
    from runtime.context import StepContext
    from runtime.leases import Lease

log = logging.getLogger("holdpoint.dispatch")
S = ActionStatus


class ActionFailed(HoldpointError):
    """The service refused the action for good; the step decides what that means."""

    code = "action_failed"
    status = 409
    title = "The action was refused by the service"


class ActionRejected(ActionFailed):
    """A reviewer said no. The step may catch it and finish without the effect."""

    code = "action_rejected"
    title = "The action was rejected by a reviewer"


class ToolNotAllowed(HoldpointError):
    code = "tool_not_allowed"
    status = 422
    title = "The graph does not declare this tool"


@dataclass(frozen=True)
class ActionResult:
    """What a step gets back from `ctx.act`: the proof the effect happened."""

    action_id: str
    external_id: str
    result: Any


@dataclass(frozen=True)
class Confirmed:
    """A call's proof that its effect happened, not committed yet: the executor writes it with
    its next commit — the step's own, or the next checkpoint around a side effect, a park, a
    failure — so an action costs no commit of its own for its outcome. Until then the action
    is `sent`, and a crash leaves it to be settled by the tool's contract (a replay with the
    same key, or a lookup), as a crash right after the response would."""

    action: Action
    result: CallResult
    actor: str
    fence: int

    def write(self) -> None:
        """In the commit's transaction, after its compare-and-swap locked the run row."""
        _, changes = outcome_of(self.result)
        ledger.transition(self.action, S.CONFIRMED, self.actor, **changes)

    def part(self, one: OneStatement, name: str, after: str) -> Part:
        """The same write as a part of the commit's one statement (PostgreSQL), after the
        part named `after` (the run's compare-and-swap, or the confirmation before it)."""
        _, changes = outcome_of(self.result)
        return ledger.transition_part(
            one, name, self.action, S.CONFIRMED, self.actor, after=(after,), **changes
        )

    def late(self) -> None:
        """The commit found the run moved (goal revised, cancelled): kept on the action, inert."""
        keep_late(self.action, self.result, self.fence, self.actor)


def for_a_person(action: Action) -> Park:
    """The park of a run one of whose actions only a person can settle (`manual_review`):
    `needs_reconciliation`, `waiting_for` naming the action — wherever the run meets it."""
    return Park("needs_reconciliation", "an action's outcome needs a human", action=action)


def keep_late(action: Action, result: CallResult, fence: int, actor: str) -> None:
    """A call's answer that arrived after its run moved: it settles the action as it would
    have (runtime.outcomes.record_late_result), fenced, in a transaction of its own; the run
    does not advance on it."""
    target, changes = outcome_of(result)
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence, action.tenant_id)
        outcomes.record_late_result(
            action,
            target,
            actor,
            fence=fence,
            outcome=result.outcome,
            result=result.result,
            external_id=result.external_id,
            last_error=changes.get("last_error", ""),
        )


class RunMoved(Exception):
    """A side-effect checkpoint found the run moved (goal revised or cancelled): the step's
    execution ends here, and nothing it did from now on may advance the run — its executor
    applies the revision (or stops) instead."""


class ActionHost(Protocol):
    """What an `ActionRunner` needs of the executor it runs for — and no more: the run it
    holds, its lease, and a checkpoint around a side effect (the same state, the same step,
    plus the ledger write `within`, in one commit; False if the run moved and `allow_moved`)."""

    run: Run
    lease: Lease

    def checkpoint_action(
        self,
        step: str,
        within: Callable[[], None],
        allow_moved: bool = False,
        within_parts: PartsAfter | None = None,
    ) -> bool: ...

    def commit_later(self, outcome: Confirmed) -> None:
        """Write `outcome` in the host's next commit, whichever it is (or, if that commit
        finds the run moved, as a late result)."""

    def settled(self) -> None:
        """The host's commit still on its way, if any, has landed: RunMoved if it did not
        (the step running meanwhile ran on a state never committed)."""


# (tenant, tool) → until when a prepare of it goes straight to its transaction: a policy
# named the tool when a one-statement prepare last tried it. Only a hint — the guard decides,
# the transaction judges — that spares a tenant whose policies name a tool a statement that
# fails on purpose (and a line in PostgreSQL's log) for each of its actions.
_NAMED: dict[tuple[int, str], float] = {}
NAMED_HINT_SECONDS = 30.0


def _named_lately(tenant_id: int, tool: str) -> bool:
    return _NAMED.get((tenant_id, tool), 0.0) > time.monotonic()


def _remember_named(tenant_id: int, tool: str) -> None:
    if len(_NAMED) >= 10_000:
        _NAMED.clear()
    _NAMED[(tenant_id, tool)] = time.monotonic() + NAMED_HINT_SECONDS


class _GuessedWrong(Unwritten):
    """The tool a prepare guessed current was redefined since (nothing was written)."""


class ActionRunner:
    """Runs `ctx.act` for one executor: find-or-prepare, send, record, reconcile."""

    def __init__(self, host: ActionHost, graph: Graph) -> None:
        self.host = host
        self.graph = graph
        # The credential the last prepare statement read for its call (`credential_read_along`).
        self.credential: Read | None = None
        # The executor read the run row: its tools need not read the run's tenant again.
        tools.remember_run_tenant(str(host.run.run_id), host.run.tenant_id)

    @property
    def lease(self) -> Lease:
        return self.host.lease

    def act(
        self,
        ctx: StepContext,
        tool_name: str,
        params: dict[str, Any],
        *,
        reason: str,
        target: str,
        call_index: int,
    ) -> ActionResult:
        self.host.settled()  # nothing is prepared before the step's own commit is in
        run = self.host.run
        # A step visit that began with this execution (no checkpoint since the visit began)
        # cannot have prepared anything yet: skip the lookup. The unique key still refuses
        # a second action if that were ever wrong, and the lookup then finds the first.
        # Such a visit also starts from the tool last found current (`guessed`: its version)
        # instead of reading it: its prepare confirms it, or reads it and starts again.
        guessed: int | None = None
        seen = tools.latest_seen(tool_name, run.tenant_id) if ctx.fresh else None
        if seen is not None and self.admits(seen[0], params):
            tool, guessed = seen
        else:
            tool = self.current_tool(tool_name, params)
        canonical = actionkeys.canonical_params(params)
        action = None
        if not ctx.fresh:
            action = ledger.find_action(run, ctx.step, call_index, canonical)
        if action is None:
            # A new action of an inactive MCP server's tool: refused as an unknown tool is,
            # by the rule the API and the gateway follow — prepared, it would ask a reviewer
            # to approve what is never sent. One prepared before is found above and driven.
            toolcatalog.refuse_withheld(tool, run.tenant_id)
            fault(FaultPoint.BEFORE_PREPARE)
            prepared = (params, reason, target, call_index, canonical)
            try:
                try:
                    action = self.prepare(ctx, tool, *prepared, guessed=guessed)
                except _GuessedWrong:  # nothing written: as the current version says
                    tool = self.current_tool(tool_name, params)
                    action = self.prepare(ctx, tool, *prepared)
            except IntegrityError:
                action = ledger.find_action(run, ctx.step, call_index, canonical)
                if action is None:
                    raise
            else:
                fault(FaultPoint.AFTER_PREPARE)
                if action.status == S.SENT:  # prepared and marked sent in one commit
                    fault(FaultPoint.AFTER_SENT_MARK)
                    with self.credential_read_along(tool):
                        action = self.call(tool, action)
        return self.drive(ctx, tool, action)

    def current_tool(self, name: str, params: dict[str, Any]) -> Tool:
        """The tool's current version (read), which must admit the call (else raises)."""
        tool = get_tool(name, self.host.run.tenant_id)
        self.check(tool, params)
        return tool

    def check(self, tool: Tool, params: dict[str, Any]) -> None:
        if self.graph.tools and tool.name not in self.graph.tools:
            raise ToolNotAllowed(f"graph {self.graph.name} does not declare {tool.name}")
        if not tool.sent_by_holdpoint:  # an external executor performs it; a worker cannot
            raise ToolNotAllowed(f"{tool.name} is performed by an external executor (client)")
        tool.validate(params)  # invalid params never reach the service

    def admits(self, tool: Tool, params: dict[str, Any]) -> bool:
        """Whether `tool` would take the call; a refusal by a version that may be out of
        date is not said: the current version is asked (`current_tool`)."""
        try:
            self.check(tool, params)
        except (ToolNotAllowed, InvalidParams):
            return False
        return True

    def credential_read_along(self, tool: Tool) -> AbstractContextManager[None]:
        """The credential the prepare statement read for the call, if it did (else its call
        reads it, as every call did)."""
        found, self.credential = self.credential, None
        if found is None or not found.done:
            return nullcontext()
        return read_along(self.host.run.tenant_id, tool.credential, found.value)

    @observe.phase("prepare", lambda self, ctx, tool, *_, **__: (None, self.host.run, tool.name))
    def prepare(
        self,
        ctx: StepContext,
        tool: Tool,
        params: dict[str, Any],
        reason: str,
        target: str,
        call_index: int,
        canonical: actionkeys.Canonical,
        *,
        guessed: int | None = None,
    ) -> Action:
        """Insert the action with a checkpoint (the same state, the same step, the prepared
        action — one commit). An action of a tool reconcilable by key or lookup that no
        hold point holds is marked `sent` in that same commit: a crash before its request
        leaves is then settled by a replay or a lookup, as after any `sent` mark. A `none`
        tool's action stays `prepared` on its own commit (a crash there must not cost a
        person); a held one waits for its approval.

        On PostgreSQL the commit is first tried as one statement (`parts`) in which a guard
        stands for the hold points' answer: it writes only while no active policy names the
        tool. Where a policy does, or the tool may be held otherwise, the transaction
        (`insert`) asks the hold points themselves. A `guessed` tool (the version last seen,
        not read) is confirmed the same way — a guard part that no newer version exists, a
        read in the transaction — or _GuessedWrong is raised with nothing written. The
        statement also reads the tool's credential for the call that follows."""
        run, lease = self.host.run, self.lease
        self.credential = None
        send_ttl = self.send_at_prepare(tool, params)
        created: list[Action] = []
        about: dict[str, Any] = {
            "step": ctx.step,
            "call_index": call_index,
            "reason": reason,
            "target": target,
            "actor": lease.actor,
            "canonical": canonical,
        }

        def parts(one: OneStatement, after: str) -> list[Part] | None:
            # PostgreSQL, one statement: the hold points' "no" as a guard part read in the
            # statement's snapshot, after its compare-and-swap locked the run row (None: they
            # may hold it; the transaction below asks them).
            if _named_lately(run.tenant_id, tool.name):
                return None
            lead: list[Part] = []
            if guessed is not None:  # no newer version of the tool: the guess holds
                lead.append(tools.unchanged_part(one, run.tenant_id, tool.name, guessed, after))
            guard = gates.unheld_parts(one, tool, params, run, lead[-1].name if lead else after)
            if guard is None:
                return None
            lead += guard
            action, part = ledger.create_action_part(
                one,
                "action_prepared",
                run,
                lease.fence,
                tool,
                params,
                send_ttl=send_ttl,
                after=lead[-1].name if lead else after,
                **about,
            )
            created.append(action)
            if send_ttl is not None and tool.credential:  # the call follows: its credential
                where = {"tenant_id": run.tenant_id, "service": tool.credential}
                self.credential = one.read(ToolCredential, "ciphertext", where)
            return [*lead, part]

        def insert() -> None:
            if guessed is not None and get_tool(tool.name, run.tenant_id) is not tool:
                raise _GuessedWrong()  # redefined since: this transaction writes nothing
            # Asked inside the commit, after its compare-and-swap locked the run row, so this
            # is also the dispatch re-check of an action marked `sent` here (a new action has
            # no approval request: the hold points' answer is the same question).
            approval = gates.needs_approval(tool, params, run, target)
            created.append(
                ledger.create_action(
                    run,
                    lease.fence,
                    tool,
                    params,
                    needs_approval=approval,
                    send_ttl=None if approval else send_ttl,
                    **about,
                )
            )

        self.host.checkpoint_action(ctx.step, insert, within_parts=parts)
        if len(created) > 1:  # the statement's guard refused: a policy names the tool
            _remember_named(run.tenant_id, tool.name)
        return created[-1]  # the one written: a statement that did not write came before

    def send_at_prepare(self, tool: Tool, params: dict[str, Any]) -> float | None:
        """The lease TTL to mark `sent` with at prepare, or None (prepare only): the tool must
        be reconcilable by key or lookup, pass its precheck and be admitted by its breaker —
        the checks `send` makes before its own mark."""
        if tool.dedup_mode() == Dedup.NONE:
            return None
        if tool.precheck is not None:
            tool.precheck(params)
        try:
            tool.breaker.admit()
        except CircuitOpen:
            return None  # prepared only; `send` raises ToolUnavailable as it always did
        return self.lease.ttl

    def drive(self, ctx: StepContext, tool: Tool, action: Action) -> ActionResult:
        """Take an action from wherever it is to a result, a wait, or a parked run."""
        for _ in range(4):
            status = action.status
            if status == S.CONFIRMED:
                return ActionResult(str(action.action_id), action.external_id, action.result)
            if status == S.CANCELLED and action.last_error.startswith("rejected"):
                raise ActionRejected(action.last_error)
            if status in (S.FAILED, S.CANCELLED, S.COMPENSATED):
                raise ActionFailed(f"{action.tool} is {status}: {action.last_error}".strip(": "))
            if status == S.AWAITING_APPROVAL:
                with transaction.atomic(durable=True):
                    gates.hold(action, self.host.run, self.lease.actor)  # idempotent
                raise Park("waiting_approval", f"{action.tool} needs approval", action=action)
            if status == S.MANUAL_REVIEW:
                raise for_a_person(action)
            if status in ledger.UNSETTLED:
                action = self.reconcile(action)
                continue
            action = self.send(tool, action)
        raise Park("needs_reconciliation", f"{action.tool} did not settle", action=action)

    def send(self, tool: Tool, action: Action) -> Action:
        if tool.precheck is not None:
            tool.precheck(_params(action))
        try:
            tool.breaker.admit()
        except CircuitOpen as exc:
            raise ToolUnavailable(f"{tool.name}: {exc}") from None
        try:
            action = ledger.mark_sent(
                action, self.lease.fence, self.lease.ttl, tool, self.lease.actor
            )
        except (ApprovalRequired, ApprovalExpired) as refused:
            ledger.reload(action)
            if action.status == S.CANCELLED:  # rejected at expiry (ledger.reject_lapsed)
                raise ActionRejected(action.last_error) from None
            raise Park("waiting_approval", refused.detail, action=action) from None
        except ToolWithheld as withheld:
            # Nothing was written: the action keeps its approval. Only a person can turn the
            # server on again, so the run waits for one — not a failure, nothing to retry.
            ledger.reload(action)
            reason = (
                f"{withheld.detail}; kept {action.status}, it is sent once the server is "
                "active again and the run is resumed"
            )
            raise Park("needs_attention", reason, action=action) from None
        fault(FaultPoint.AFTER_SENT_MARK)
        return self.call(tool, action)

    def call(self, tool: Tool, action: Action) -> Action:
        """The request of an action whose `sent` is committed, and what came back, recorded."""
        with observe.sending(action):
            result = tool.call(
                action.params,
                key=action.idempotency_key,
                fence=self.lease.fence,
                run_id=str(action.run_id),
            )
        tool.breaker.record(not result.service_failed)
        fault(FaultPoint.AFTER_TOOL_RESPONSE)
        return self.record(action, result)  # a confirmation: after_confirm follows its commit

    @observe.phase("outcome", lambda self, action, result: (action, None, action.tool))
    def record(self, action: Action, result: CallResult) -> Action:
        """Write what the call said, with a checkpoint; an old revision's result is kept
        on the action but advances nothing."""
        actor = self.lease.actor
        result = settle_fence_claim(action, self.lease.fence, result)
        target, changes = outcome_of(result)
        if target == S.CONFIRMED:
            self.host.commit_later(Confirmed(action, result, actor, self.lease.fence))
            # What the step is told now (the row says it from the host's next commit on); the
            # instance the commit writes from keeps what the row says now.
            return _told(
                action, status=S.CONFIRMED, external_id=result.external_id, result=result.result
            )

        def write() -> None:
            ledger.transition(action, target, actor, **changes)  # refreshes `action`

        if not self.host.checkpoint_action(action.step, write, allow_moved=True):
            # Settled as a late answer; the step must not go on with it (a reconcile of the
            # old revision's action, a failure that escalates the new revision's run).
            keep_late(action, result, self.lease.fence, actor)
            raise RunMoved(f"{action.tool}: the run moved while the request was out")
        if target == S.PREPARED:
            raise ToolUnavailable(f"{action.tool}: {result.detail}")
        fault(FaultPoint.AFTER_CONFIRM)  # recorded at once (unknown, failed): reached here
        return action

    def reconcile(self, action: Action) -> Action:
        """Settle a sent/unknown action by the tool's contract; park the run if we cannot."""
        verdict = reconcile_action(action, self.lease.fence, self.lease.actor)
        if verdict.until is not None:
            raise Park("retrying", verdict.reason, until=verdict.until, action=action)
        return action  # settled: the transition refreshed it


def perform(
    action: Action,
    fence: int,
    tool: Tool,
    actor: str,
    *,
    ttl: float = 0.0,
    then: Callable[[Action], None] | None = None,
) -> Action:
    """Send an action no worker step drives, now, in this process: a compensation, or an
    external executor's action of a tool Holdpoint sends itself (an API client never says
    what came back from such a request). The same order as a step's `send` — `sent`
    committed first, the call outside any transaction, the outcome fenced — and a `sent` or
    `unknown` action is reconciled by the tool's contract instead of being sent again."""
    if action.status in ledger.UNSETTLED:
        reconcile_action(action, fence, actor)
        return ledger.reload(action)
    try:
        tool.breaker.admit()
    except CircuitOpen as exc:
        raise ToolUnavailable(f"{tool.name}: {exc}") from None
    action = ledger.mark_sent(action, fence, ttl, tool, actor, then=then)
    fault(FaultPoint.AFTER_SENT_MARK)
    with observe.sending(action):
        result = tool.call(
            action.params, key=action.idempotency_key, fence=fence, run_id=str(action.run_id)
        )
    tool.breaker.record(not result.service_failed)
    fault(FaultPoint.AFTER_TOOL_RESPONSE)
    result = settle_fence_claim(action, fence, result)
    target, changes = outcome_of(result)
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence, action.tenant_id)
        ledger.transition(action, target, actor, **changes)
    fault(FaultPoint.AFTER_CONFIRM)
    if target == S.PREPARED:  # certainly not applied: the caller may try again later
        raise ToolUnavailable(f"{action.tool}: {result.detail}")
    return action


def settle_fence_claim(action: Action, fence: int, result: CallResult) -> CallResult:
    """A call's answer with a `stale` claim settled by the database (invariant 4). The
    service said it refused `fence` (a 409 naming a fence): if the run's fence moved on,
    it did, and this sender lost the run (StaleFence: it stops, the action stays for the
    new holder). If `fence` is still the run's, nobody holds a later one for the service
    to have seen: the service refused the request for a reason of its own ("fence post
    already ordered"), a refusal like any other 4xx — stopping here would leave the action
    `sent` for the next holder to meet the same answer. Reads the run only on this path."""
    if result.outcome != "stale":
        return result
    if ledger.fence_moved(action.run_id, fence):
        raise StaleFence(f"{action.tool} refused fence {fence}: {result.detail}")
    return replace(result, outcome="refused", transient=False)


def outcome_of(result: CallResult) -> tuple[str, dict[str, Any]]:
    """The status and fields a call's answer gives its action (`stale` is settled first,
    `settle_fence_claim`)."""
    if result.outcome == "applied":
        return S.CONFIRMED, {
            "external_id": result.external_id,
            "result": result.result,
            "last_error": "",
        }
    if result.outcome == "refused":
        return (S.PREPARED if result.transient else S.FAILED), {
            "last_error": result.detail[:NOTE_MAX]
        }
    return S.UNKNOWN, {"last_error": result.detail[:NOTE_MAX]}


@dataclass(frozen=True)
class Verdict:
    status: str
    reason: str = ""
    until: datetime | None = None


@observe.phase("reconcile", lambda action, *_: (action, None, action.tool))
def reconcile_action(action: Action, fence: int, actor: str) -> Verdict:
    """Recovery checks before it acts (invariant 3), by dedup mode:

    key    → replay with the *same* key: the service answers with the first effect;
    lookup → ask by key: found → confirmed (id backfilled); provably absent → prepared, but
             only once the sender can no longer be in flight;
    none   → manual_review: nothing can prove the outcome, a human must say.
    Bounded attempts, then manual_review.
    """
    tool = tool_of(action)
    mode = tool.dedup_mode()
    if mode == Dedup.NONE:
        return _settle(
            action,
            fence,
            actor,
            S.MANUAL_REVIEW,
            f"{tool.name} cannot deduplicate or be looked up; "
            f"last error: {action.last_error or 'none'}",
        )
    if mode == Dedup.KEY:
        revised = _revised_since(action)
        if revised:  # a replay would be a send of an old revision's action (invariant 6)
            return _settle(action, fence, actor, S.MANUAL_REVIEW, revised)
        result = tool.call(
            action.params, key=action.idempotency_key, fence=fence, run_id=str(action.run_id)
        )
        fault(FaultPoint.DURING_RECONCILE)
        if result.outcome == "applied":
            return _settle(
                action,
                fence,
                actor,
                S.CONFIRMED,
                "replayed with the same key",
                external_id=result.external_id,
                result=result.result,
            )
        result = settle_fence_claim(action, fence, result)
        if result.outcome == "refused" and not (result.transient or result.unsent):
            return _settle(action, fence, actor, S.FAILED, result.detail)
        # Not sent this time (refused here, or not reached): the first request may still
        # have applied, so the action is not failed; it is asked again, then a person.
        return _again(action, fence, actor, result.detail)
    found = tool.lookup(action.idempotency_key, action.params, run_id=str(action.run_id))
    fault(FaultPoint.DURING_RECONCILE)
    if found.found:
        return _settle(
            action,
            fence,
            actor,
            S.CONFIRMED,
            "found by key",
            external_id=found.external_id,
            result=found.result,
        )
    if found.found is None:
        return _again(action, fence, actor, found.detail)
    if ledger.may_be_in_flight(action):
        # Absent *now*, but the sender may still be in flight: concluding "not applied"
        # here is how duplicates happen. Look again once it cannot be.
        return Verdict("wait", "the sender may still be in flight", until=action.in_flight_until)
    return _absent(action, fence, actor)


def _absent(action: Action, fence: int, actor: str) -> Verdict:
    """A lookup proved the action never applied: back to `prepared` for its step to send
    with the same key — or withdrawn when no step will (its goal was revised since, its run
    finished: `ledger.withdraw_if_moved_on`), not left `prepared` for a send nobody makes."""

    def withdraw_if_moved_on() -> None:
        run = Run.objects.only("status", "goal_rev", "external").get(
            pk=action.run_id, tenant_id=action.tenant_id
        )
        ledger.withdraw_if_moved_on(run, action, actor)

    reason = "provably absent: safe to send again"
    return _settle(action, fence, actor, S.PREPARED, reason, then=withdraw_if_moved_on)


def _revised_since(action: Action) -> str:
    """Why a replay of `action` may not go out ("" when it may): the goal was revised since it
    was prepared. A replay with its key is a send — where the first request never arrived it
    makes the effect, now, for a goal the user has since changed — and nothing prepared under
    an older revision is sent afterwards (DESIGN.md invariant 6). A lookup can still tell
    (it sends nothing); a key alone cannot, so a person says whether it applied."""
    now_at = Run.objects.filter(pk=action.run_id, tenant_id=action.tenant_id).values_list(
        "goal_rev", flat=True
    )
    current = now_at.first()
    if current is None or current == action.goal_rev:
        return ""
    return (
        f"prepared under goal revision {action.goal_rev}, the goal is now at {current}: a "
        "replay with its key would send it after the revision, so a person says whether it "
        f"applied; last error: {action.last_error or 'none'}"
    )


def _again(action: Action, fence: int, actor: str, detail: str) -> Verdict:
    attempts = action.reconcile_attempts + 1
    if attempts >= settings.HOLDPOINT_RECONCILE_ATTEMPTS:
        return _settle(
            action,
            fence,
            actor,
            S.MANUAL_REVIEW,
            f"{attempts} reconciliation attempts failed: {detail}",
        )
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence, action.tenant_id)
        ledger.transition(
            action, S.UNKNOWN, actor, reconcile_attempts=attempts, last_error=detail[:NOTE_MAX]
        )
    return Verdict(
        "wait",
        f"reconcile again ({attempts}): {detail}",
        until=timezone.now() + timedelta(seconds=reconcile_delay(attempts)),
    )


def reconcile_delay(attempts: int) -> float:
    """The back-off after the `attempts`-th reconciliation that could not tell: the one
    schedule of every reconciler — a worker parks its run for it, the MCP gateway's wait loop
    (gateway.calls) does not ask again before it — so a briefly failing lookup gets the same
    minutes wherever its action is driven, not HOLDPOINT_RECONCILE_ATTEMPTS polls in a row."""
    return min(60.0, 0.5 * 2.0 ** min(attempts, 8))  # 2**8 past the cap: no float overflow


def reconcile_due(action: Action) -> bool:
    """Whether `action`'s back-off (`reconcile_delay`, counted from its last reconciliation's
    write, by the database clock) is over; at once before any attempt."""
    if action.reconcile_attempts == 0:
        return True
    since = db_now_plus(-reconcile_delay(action.reconcile_attempts))
    return Action.objects.filter(
        pk=action.pk, tenant_id=action.tenant_id, updated_at__lte=since
    ).exists()


def _settle(
    action: Action,
    fence: int,
    actor: str,
    target: str,
    reason: str,
    *,
    then: Callable[[], None] | None = None,
    **changes: Any,
) -> Verdict:
    """Move a reconciled action to `target`, fenced, in a transaction of its own; `then`
    runs in it after the move and may move the action on (the verdict says where it is)."""
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence, action.tenant_id)
        if target != S.CONFIRMED:
            changes["last_error"] = reason[:NOTE_MAX]
        ledger.transition(
            action, target, actor, reconcile_attempts=action.reconcile_attempts + 1, **changes
        )
        if then is not None:
            then()
    if action.status != target:
        return Verdict(action.status, action.last_error)
    return Verdict(target, reason)


def _params(action: Action) -> dict[str, Any]:
    import json

    params: dict[str, Any] = json.loads(action.params)
    return params


def unsettled(run: Run) -> list[Action]:
    actions = Action.objects.filter(
        tenant_check(run.tenant_id), run=run, status__in=ledger.UNSETTLED
    )
    return list(actions.order_by("created_at"))


def _told(action: Action, **changes: Any) -> Action:
    """A copy of `action` with `changes`: what copy.copy gives (its own ModelState and fields
    cache, the same field values), without the pickle protocol's round trip that copy.copy
    takes for a model — a sixtieth of an action's CPU."""
    told = Action.__new__(Action)
    told.__dict__.update(action.__dict__, **changes)
    told._state = copy.copy(action._state)
    told._state.fields_cache = action._state.fields_cache.copy()
    return told
