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

import json
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Now

from audit.canonical import CanonicalError, canonical_bytes
from runtime import (
    actionkeys,
    gates,
    holds,
    leases,
    ledger,
    observe,
    outcomes,
    stepcommit,
    toolcatalog,
)
from runtime.artifacts import Encoder, collect_refs
from runtime.dispatch import perform
from runtime.errors import (
    ApprovalRequired,
    InvalidParams,
    InvalidTransition,
    NotExternal,
    NotPermitted,
    RunFinished,
    StaleFence,
    StaleGoalRev,
    VersionConflict,
)
from runtime.events import RunEvent, record
from runtime.leases import Lease
from runtime.models import TERMINAL, Action, ActionStatus, Checkpoint, Run, RunStatus
from runtime.models.limits import NOTE_MAX
from runtime.stepcommit import StepCommit
from runtime.tools import Dedup, Tool, get_tool, tool_of

if TYPE_CHECKING:
    from runtime.tenancy import Principal

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


# --- who may execute ---------------------------------------------------------------------------


def authorize(run: Run, principal: Principal) -> None:
    """Whether `principal` may act as `run`'s executor (issue 16 H1), before anything else.

    Only a run created `external` is executed through the protocol: a hosted run's fence is
    on every run object, and an API client writing under it would forge what Holdpoint's
    own workers do (409 not_external). Of an external run, only its executor account — the
    agent that created it, or the one a tenant admin named — may lease it or write under
    its fence; any other agent token, and every person's session, is refused (403).
    """
    if not run.external:
        raise NotExternal(f"run {run.run_id} is executed by Holdpoint's workers")
    if not principal.is_agent or run.executor_account_id != principal.user.pk:
        raise NotPermitted("only the run's executor account may execute it")


def name_executor(run: Run, account: Any, *, actor: str) -> Run:
    """A tenant admin names the agent account that may execute an external run (instead of
    the agent that created it) — the one writer of `executor_account`, journalled in the
    run's stream and, as a human act, in the tenant's. The named account must be an agent
    of the run's tenant: a person never executes, another tenant's agent never sees it."""
    from runtime.accounts import record_tenant_act
    from runtime.models import Membership, Role

    if not run.external:
        raise NotExternal(f"run {run.run_id} is executed by Holdpoint's workers")
    if run.status in TERMINAL:
        raise RunFinished(f"the run is {run.status}: nobody executes it any more")
    agent = Membership.objects.filter(user=account, tenant_id=run.tenant_id, role=Role.AGENT)
    if not agent.exists():
        raise InvalidParams(
            "the executor must be an agent account of the run's tenant",
            errors={"executor_account": ["not an agent account of this tenant"]},
        )
    named = {"run_id": str(run.run_id), "executor_account": account.get_username()}
    with transaction.atomic(durable=True):
        Run.objects.filter(pk=run.run_id, tenant_id=run.tenant_id).update(
            executor_account=account, updated_at=Now()
        )
        record(run, RunEvent.EXECUTOR_NAMED, actor, **named)
        record_tenant_act(run.tenant_id, RunEvent.EXECUTOR_NAMED.value, actor, **named)
    return Run.objects.get(pk=run.run_id, tenant_id=run.tenant_id)


def capped_ttl(ttl: float) -> float:
    """A lease no longer than HOLDPOINT_MAX_LEASE_TTL: a lost executor must not hold its run
    (and lock out its successor) for longer than an operator allows."""
    longest = settings.HOLDPOINT_MAX_LEASE_TTL
    if ttl > longest:
        raise InvalidParams(
            f"ttl_seconds may be at most {longest}",
            errors={"ttl_seconds": [f"at most {longest} seconds"]},
        )
    return ttl


# --- the lease ---------------------------------------------------------------------------------


def take(run: Run, owner: str, ttl: float, *, who: str) -> Lease:
    """Lease an external run (runtime.leases.take_lease, refusing hosted runs in its
    compare-and-swap), then settle what the previous executor left unproven."""
    lease = leases.take_lease(
        run.run_id, owner, capped_ttl(ttl), runnable_only=False, external=True, by=who
    )
    settle_takeover(run, lease)
    return lease


def settle_takeover(run: Run, lease: Lease) -> None:
    """A new lease finds actions `sent` (or `unknown`) by an earlier one: of a tool that can
    neither deduplicate nor be looked up, nothing can ever prove what happened — nor can a
    key alone for an action whose goal was revised since (`_person_settles`) — so each goes
    to a person at once (`manual_review`, the run `needs_reconciliation`) — the executor
    must not call it again. The others keep their status; their `reconcile` says how."""
    open_ = Action.objects.filter(
        tenant_id=run.tenant_id, run_id=run.run_id, status__in=ledger.UNSETTLED
    )
    goal_rev = Run.objects.values_list("goal_rev", flat=True).get(
        pk=run.run_id, tenant_id=run.tenant_id
    )
    unprovable = [(a, why) for a in open_ if (why := _person_settles(a, goal_rev))]
    if not unprovable:
        return
    with transaction.atomic(durable=True):
        ledger.fenced(run.run_id, lease.fence, run.tenant_id)
        for action, why in unprovable:
            reason = f"{why}; its executor changed before it reported an outcome"
            outcomes.to_person(action, lease.fence, lease.actor, reason)


def _person_settles(action: Action, goal_rev: int) -> str:
    """Why only a person can settle an action that may have been sent ("" if its tool's
    contract still can): a tool with neither key nor lookup; or one reconciled by a replay
    with its key whose goal was revised since — the replay would send the old goal's action
    after the revision (invariant 6), as a worker's reconciler refuses too
    (runtime.dispatch._revised_since). A lookup still tells: it sends nothing."""
    mode = tool_of(action).dedup_mode()
    if mode == Dedup.NONE:
        return f"{action.tool} cannot deduplicate or be looked up"
    if mode == Dedup.KEY and action.goal_rev != goal_rev:
        return (
            f"{action.tool} was prepared under goal revision {action.goal_rev}, the goal is now "
            f"at {goal_rev}: a replay with its key would send it after the revision"
        )
    return ""


def hand_over_unproven(run: Run, actor: str, why: str = "the run was cancelled") -> list[Action]:
    """Inside the cancel (or the last checkpoint: `close_ledger`) of an external run: its
    actions that may have happened (sent, unknown) will never be reported now — the executor
    may not write to a finished run's checkpoints, no worker reconciles it — so each goes to
    a person (`manual_review`, the Reconcile page) instead of staying unknown for ever."""
    unproven = Action.objects.filter(
        tenant_id=run.tenant_id, run_id=run.run_id, status__in=ledger.UNSETTLED
    )
    return [
        ledger.transition(
            action,
            S.MANUAL_REVIEW,
            actor,
            last_error=f"{why} before this action's outcome was known",
            reconcile_attempts=action.reconcile_attempts + 1,
        )
        for action in unproven
    ]


def close_ledger(run: Run, actor: str, reason: str) -> None:
    """Inside the checkpoint that finishes an external run (`completed`, `failed`): its
    ledger closes as at a cancel. What was never sent is withdrawn with its approval request
    (a reviewer must not approve what nothing will send); what may have happened goes to a
    person (`hand_over_unproven`) — no worker reconciles an external run and the sweeper
    watches only executing ones, so a `sent` action would otherwise stay unproven for ever
    under a run that says it is done."""
    ledger.withdraw_unsent(run, reason, actor)
    hand_over_unproven(run, actor, reason)


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
    """Extend the lease by `ttl` (capped) from database now (runtime.leases.heartbeat), and
    with it the in-flight window of what this fence sent and has not reported: its executor
    may be inside that call for as long as it holds the lease (ledger.extend_in_flight).
    Two statements, not one transaction: a beat whose second one is lost leaves the window
    of the beat before, and the next beat moves it."""
    expires_at = leases.heartbeat(lease_of(run, fence, who, owner=owner, ttl=capped_ttl(ttl)))
    ledger.extend_in_flight(run.run_id, run.tenant_id, fence, expires_at)
    return expires_at


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
    settle: Callable[[Any, bool], None] | None = None,
    prompt: str = "",
) -> Checkpoint:
    """The next checkpoint, compare-and-swap on the fence and `expected_rev`: one step commit
    (runtime.stepcommit), the same row, digest and journal entry as a worker's. `settle`
    records the rev on the request's Idempotency-Key claim in the step commit's transaction
    (which then takes the transaction path, not PostgreSQL's single statement). `prompt`:
    what a `waiting_input` checkpoint asks for — the run's `waiting_for`, as a hosted step's
    `Wait` sets it."""
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
    if prompt and run_status != RunStatus.WAITING_INPUT:
        raise InvalidParams(
            "a prompt goes with status waiting_input only",
            errors={"prompt": ["only with status waiting_input"]},
        )
    encoder = Encoder()
    encoded = encoder.encode(state)
    rev = expected_rev + 1
    # No status an executor writes is needs_attention: a run escalated under its lease (an
    # approval's last expiry) leaves it with this checkpoint, and its reason with it.
    changes: dict[str, Any] = {
        "step_rev": rev,
        "next_step": next_step,
        "status": run_status,
        "attention_reason": "",
        # The input the run was given is the executor's once it writes on (it read it on the
        # run object), as a hosted step's commit takes its `ctx.input`.
        "pending_input": None,
    }
    if run_status == RunStatus.WAITING_INPUT:
        changes["waiting_for"] = {"kind": "input", "prompt": prompt}
    elif run_status in TERMINAL:
        changes["waiting_for"] = None  # a finished run waits for nothing
    if run_status != RunStatus.RUNNING:
        changes.update(lease_owner="", lease_expires_at=None)
        if run_status not in TERMINAL:
            # The lease ends with the checkpoint (waiting for input): its fence with it, as
            # at a release, so a write of the same holder after it is refused as stale —
            # the run waits for its input and the next lease, not for more of this one.
            changes["fence"] = fence + 1
    actor = _actor(who, fence)

    for _ in range(_CHECKPOINT_ATTEMPTS):
        current = _writable(run, fence, expected_rev)
        # `running` says the executor is at it again: a wait for its input is over, not
        # one only a person can end (holds.person_wait) — checked again under the run's
        # row lock, in `within`: a decision or a resolve may land before the commit.
        wait = holds.person_wait(current) if run_status == RunStatus.RUNNING else None
        status, waits = wait or (run_status, changes.get("waiting_for"))

        def within(current: Run = current, wait: Any = wait) -> None:
            if wait is not None and holds.person_wait(current) != wait:
                raise stepcommit.Moved()
            if run_status in TERMINAL:
                close_ledger(run, actor, f"the run {run_status}")
            if settle is not None:
                settle(rev, True)

        commit = StepCommit(
            run=current,
            actor=actor,
            fence=fence,
            step="",
            next_step=next_step,
            status=status,
            state=encoded,
            changes={**changes, "status": status, "waiting_for": waits},
            expect_status=UNFINISHED,
            event=RunEvent.STEP_COMMITTED,
            payload={"refs": len(collect_refs(encoded, set()))},
            artifacts=encoder.new,
            within=within if settle or wait or run_status in TERMINAL else None,
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
    if current.status in TERMINAL:  # as a prepare and a lease are refused
        raise RunFinished(f"the run is {current.status}: nothing more is checkpointed")
    if current.checkpoint_rev != expected_rev:
        raise VersionConflict(f"checkpoint_rev is {current.checkpoint_rev}, not {expected_rev}")
    return current


# --- actions -----------------------------------------------------------------------------------


@observe.phase("prepare", lambda run, fence, tool_name, *_, **__: (None, run, tool_name))
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
    expected_goal_rev: int | None = None,
    settle: Callable[[Any, bool], None] | None = None,
) -> tuple[Action, bool]:
    """Prepare an action for an external executor; (action, created).

    The key is the client's `idempotency_key`, or else the step visit's next call
    (runtime.actionkeys.idempotency_key). Asked again — a retry, or a second request racing the
    first — the same request is the same action: the same key with the same params, or
    without a key the same tool and params in the same visit. The same key with other params
    is refused (422); so is a key another run used. All of it runs under the run's row lock.
    `expected_goal_rev`: the revision the executor last read and keyed the call under — a
    goal revised since is VersionConflict, before anything is looked up or made (the action
    would be the new goal's under the old goal's key, which the executor, once it reads the
    new revision, would not find again: the call made twice).
    `settle` records the action on the request's Idempotency-Key claim in that transaction.
    """
    tool: Tool = get_tool(tool_name, run.tenant_id)
    if not isinstance(params, dict):
        raise InvalidParams("params must be a JSON object", errors={"params": ["not an object"]})
    tool.validate(params)
    canonical = actionkeys.canonical_params(params)
    if idempotency_key and (reserved := actionkeys.reserved_key(idempotency_key, run.run_id)):
        raise IdempotencyKeyReused(f"key {idempotency_key!r}: {reserved}")
    actor = _actor(who, fence)

    def answer(action: Action, created: bool) -> tuple[Action, bool]:
        if settle is not None:
            settle(action.pk, created)
        return action, created

    with transaction.atomic(durable=True):
        # The fence check workers make (and the run row lock that holds the ledger still).
        ledger.fenced(run.run_id, fence, run.tenant_id)
        current = Run.objects.get(pk=run.run_id, tenant_id=run.tenant_id)
        if current.status in TERMINAL:
            raise RunFinished(f"the run is {current.status}")
        if expected_goal_rev is not None and current.goal_rev != expected_goal_rev:
            raise VersionConflict(
                f"goal_rev is {current.goal_rev}, not {expected_goal_rev}: read the run again"
            )
        calls = ledger.visit_actions(current, API_STEP)
        earlier = _asked_before(current, tool, canonical, idempotency_key, calls)
        if earlier is not None:
            return answer(earlier, False)
        toolcatalog.refuse_withheld(tool, current.tenant_id)
        index = max(calls, default=0) + 1
        key = idempotency_key or actionkeys.idempotency_key(current, API_STEP, index)
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
            if taken is not None and _same(taken, current, tool, canonical):
                return answer(taken, False)
            if idempotency_key:
                raise IdempotencyKeyReused(f"key {key!r} is taken") from None
            raise VersionConflict(f"call {index} of this step was taken; try again") from None
        if approval and current.status in holds.PARKABLE:
            holds.park(current, fence, action, actor)
        return answer(action, True)


def _asked_before(
    run: Run,
    tool: Tool,
    canonical: actionkeys.Canonical,
    idempotency_key: str | None,
    calls: dict[int, Action],
) -> Action | None:
    """The action this request made before, if any (see `prepare`); `calls`: the visit's."""
    if not idempotency_key:
        same = (calls[i] for i in sorted(calls) if _same(calls[i], run, tool, canonical))
        return next(same, None)
    existing = ledger.by_key(run.tenant_id, idempotency_key)
    if existing is not None and not _same(existing, run, tool, canonical):
        raise IdempotencyKeyReused(
            f"key {idempotency_key!r} was prepared with other params or for another run"
        )
    return existing


def _same(action: Action, run: Run, tool: Tool, canonical: actionkeys.Canonical) -> bool:
    return (
        action.run_id == run.run_id
        and action.tool == tool.name
        and ledger.same_request(action, canonical)
    )


def dispatch(action: Action, fence: int, who: str) -> Action:
    """Mark `sent` (runtime.ledger.mark_sent: every check of API.md's dispatch refusals). A
    `client` tool's agent then calls the service itself; a tool Holdpoint sends (`http`) is
    sent here, now, and the action comes back with its outcome — a `sent` or `unknown` one
    reconciled by the tool's contract instead. A run parked for this action's approval runs
    again — in the same transaction as the mark, so the two commit together or not at all."""
    tool = get_tool(action.tool, action.tenant_id)  # the current version: it is what is sent
    ttl = _lease_left(action)
    if action.status == S.AWAITING_APPROVAL:
        _holds(action, fence)  # a stale holder learns it lost the lease, not to wait
        raise ApprovalRequired(f"{action.tool} is waiting for approval")
    actor = _actor(who, fence)

    def resume(sent: Action) -> None:
        holds.align(sent, fence, actor)

    if tool.sent_by_holdpoint:
        if action.status not in (S.PREPARED, S.APPROVED):
            # A retried dispatch — of a settled action (or a person's), answered with it; of
            # a sent/unknown one, reconciled by a replay or a lookup — is the lease holder's
            # only: nothing goes to the service for, nor is answered to, a stale fence.
            _holds(action, fence)
        if action.status in (S.CONFIRMED, S.FAILED, S.COMPENSATED, S.MANUAL_REVIEW):
            return action
        sent = perform(action, fence, tool, actor, ttl=ttl, then=resume)
        if sent.status in ledger.UNSETTLED and tool.dedup_mode() == Dedup.NONE:
            return _lost_answer(sent, fence, tool, actor)
        return sent
    if action.status in ledger.UNSETTLED:
        # Sent under its version: a redefinition since does not change how it is
        # reconciled (its `reconcile` says the same), so that version's contract decides.
        return _dispatch_again(action, fence, ttl, tool_of(action), actor)
    return ledger.mark_sent(action, fence, ttl, tool, actor, then=resume)


def _holds(action: Action, fence: int) -> None:
    """A dispatch that writes nothing still answers only the lease's holder: StaleFence
    for any other fence, before whatever else it would have said."""
    held = Run.objects.filter(pk=action.run_id, tenant_id=action.tenant_id, fence=fence)
    if not held.exists():
        raise StaleFence(f"fence {fence} no longer owns run {action.run_id}")


def _lost_answer(action: Action, fence: int, tool: Tool, actor: str) -> Action:
    """A request Holdpoint sent whose answer was lost (a timeout, a dropped connection), of a
    tool with neither key nor lookup: nothing will ever prove what happened, so it goes to a
    person at once — as a client's `unknown` does (record_outcome) — not left `unknown` for
    an executor that may never call again (an MCP client that got no answer)."""
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence, action.tenant_id)
        action = ledger.reload(action)  # its status now, under the run's row lock
        if action.status not in ledger.UNSETTLED:
            return action
        reason = f"{tool.name} cannot deduplicate or be looked up; last error: {action.last_error}"
        return outcomes.to_person(action, fence, actor, reason)


def _lease_left(action: Action) -> float:
    """Seconds the sender's lease still runs (by the database clock): it may start its call
    until then, so the in-flight window (`not_found_after`) lasts that long plus the tool's
    timeout — as a worker's does with its own lease. A stale or missing lease gives 0; the
    dispatch's fence check refuses it anyway."""
    left = (
        Run.objects.filter(pk=action.run_id, tenant_id=action.tenant_id)
        .annotate(left=F("lease_expires_at") - Now())
        .values_list("left", flat=True)
        .first()
    )
    return max(0.0, left.total_seconds()) if left is not None else 0.0


def _dispatch_again(action: Action, fence: int, ttl: float, tool: Tool, actor: str) -> Action:
    """Reconcile `replay_same_key`: a tool that honours its key may be sent again with it
    (API.md); any other mode is refused — its `reconcile` says what to do instead."""
    how = RECONCILE[tool.dedup_mode()]
    if how != "replay_same_key":
        raise InvalidTransition(f"action is {action.status}; reconcile it by {how}")
    with transaction.atomic(durable=True):
        # The refusals in the order a first dispatch gives them (ledger.check_dispatchable),
        # under the run's row lock, as a goal revision takes it.
        status, goal_rev, run_fence = (
            Run.objects.select_for_update()
            .filter(pk=action.run_id, tenant_id=action.tenant_id)
            .values_list("status", "goal_rev", "fence")
            .get()
        )
        if run_fence != fence:
            raise StaleFence("the run was taken over by another executor")
        if status in TERMINAL:
            raise RunFinished(f"the run is {status}: nothing more is sent for it")
        revised = _person_settles(action, goal_rev)
        if not revised:
            return ledger.mark_resent(action, fence, ttl, tool, actor)
        if ledger.reload(action).status == S.UNKNOWN:
            # Its executor said it cannot tell, and the replay that would tell is refused:
            # a person says whether it applied (committed with the refusal that follows),
            # not left `unknown` for a replay nobody may make. A `sent` one still takes its
            # sender's late outcome (and goes to a person at a takeover or an `unknown`).
            outcomes.to_person(action, fence, actor, revised)
    raise StaleGoalRev(
        f"prepared under goal_rev {action.goal_rev}, run is at {goal_rev}: not sent again"
    )


OUTCOMES = {
    "confirmed": S.CONFIRMED,
    "failed": S.FAILED,
    "unknown": S.UNKNOWN,
    "not_found": S.PREPARED,
}
# What an action that may have happened asks of its executor (API.md, "External executors"),
# by the tool's dedup mode.
RECONCILE = {Dedup.KEY: "replay_same_key", Dedup.LOOKUP: "lookup", Dedup.NONE: "manual_review"}


def reconcile_instruction(action: Action) -> dict[str, Any] | None:
    """`reconcile` on an action object: what happens next to an action nobody has proven
    (sent, unknown, or waiting for a person), from the server's knowledge of the tool —
    never the client's. None for every other status."""
    if action.status == S.MANUAL_REVIEW:
        return {"how": "manual_review"}
    if action.status not in ledger.UNSETTLED:
        return None
    how = RECONCILE[tool_of(action).dedup_mode()]
    if how == "replay_same_key" and _person_settles(action, action.run.goal_rev):
        # The replay would be refused (stale_goal_rev) and hands the action to a person.
        return {"how": "manual_review"}
    if how == "lookup":
        # "not_found" is accepted only once the sender can no longer be in flight.
        return {"how": how, "not_found_after": action.in_flight_until}
    return {"how": how}


@observe.phase("outcome", lambda action, *_, **__: (action, None, action.tool))
def record_outcome(
    action: Action,
    fence: int,
    outcome: str,
    *,
    who: str,
    owner: str = "",
    external_id: str = "",
    result: Any = None,
) -> Action:
    """What the service said, reported by an external executor, applied by the tool's dedup
    contract (the server's, not the client's): `unknown` of a tool with neither key nor
    lookup goes to a person at once, as does the HOLDPOINT_RECONCILE_ATTEMPTS-th `unknown`;
    `not_found` (a lookup's answer) puts the action back to `prepared` for a send with the
    same key, once the sender can no longer be in flight. Only `client` tools: what came
    back from a request Holdpoint sent itself is never an API client's to say. An old
    revision's result settles its action all the same (runtime.outcomes.record_late_result:
    a failure is failed, a proved absence withdrawn, an unknown of a `none` tool a person's)
    but advances nothing. The same report again — outcome, external id and result (its
    answer lost: runtime.outcomes.repeated) — answers the action as it is now and writes
    nothing; any other report of an action a report settled is InvalidTransition."""
    tool = tool_of(action)
    if tool.sent_by_holdpoint:
        raise NotPermitted(
            f"{tool.name} is sent by Holdpoint (executor {tool.executor}); "
            "only Holdpoint records its outcome"
        )
    mode = _check_outcome(tool, outcome, external_id, result)
    actor = _actor(who, fence)
    reported = outcomes.report(who, owner, outcome, external_id, result)
    with transaction.atomic(durable=True):
        ledger.fenced(action.run_id, fence, action.tenant_id)
        goal_rev = (
            Run.objects.filter(pk=action.run_id, tenant_id=action.tenant_id)
            .values_list("goal_rev", flat=True)
            .get()
        )
        action = ledger.reload(action)  # its status now, under the run's row lock
        if outcomes.repeated(action, actor, outcome, external_id, result):
            return action  # its answer was lost: the same answer again, nothing written
        settled_from = action.status
        settled = _apply_outcome(
            action, fence, outcome, actor, mode, reported, goal_rev, external_id, result
        )
    observe.answer_reported(settled, settled_from)
    return settled


def _apply_outcome(
    action: Action,
    fence: int,
    outcome: str,
    actor: str,
    mode: str,
    reported: dict[str, Any],
    goal_rev: int,
    external_id: str,
    result: Any,
) -> Action:
    """Inside record_outcome's transaction, the run row locked: the report applied."""
    if action.status == S.MANUAL_REVIEW:
        raise InvalidTransition("the action waits for a person to resolve it")
    if action.goal_rev != goal_rev:
        # Settles the action as the report says, advancing nothing (outcomes.py).
        if outcome == "not_found":
            _absent_after_flight(action)
        return outcomes.record_late_result(
            action,
            OUTCOMES[outcome],
            actor,
            fence=fence,
            outcome=outcome,
            result=result,
            external_id=external_id,
            last_error="looked up by key: not found"
            if outcome == "not_found"
            else _reported_error(outcome, result),
            journal_extra=reported,
        )
    if outcome == "not_found":
        return _not_found(action, actor, reported)
    if outcome == "unknown" and action.status in ledger.UNSETTLED:
        return outcomes.settle_unknown(
            action, fence, actor, mode, journal_extra=reported, result=result
        )
    changes: dict[str, Any] = {"result": result}
    if outcome == "confirmed":
        changes["external_id"] = external_id.strip()
    elif outcome == "failed":
        changes["last_error"] = _reported_error(outcome, result)
    return ledger.transition(action, OUTCOMES[outcome], actor, journal_extra=reported, **changes)


def _reported_error(outcome: str, result: Any) -> str:
    """The error an executor reported with a `failed` outcome (`result.error`), as the
    action's `last_error` — what the run page, the API and the timeline show of why it
    failed, as for a tool Holdpoint sends (runtime.dispatch keeps as much)."""
    error = result.get("error") if outcome == "failed" and isinstance(result, dict) else None
    if error is None or error == "":
        return ""
    return (error if isinstance(error, str) else json.dumps(error))[:NOTE_MAX]


def _check_outcome(tool: Tool, outcome: str, external_id: str, result: Any) -> str:
    """The report's own validity; returns the tool's dedup mode."""
    if outcome not in OUTCOMES:
        raise InvalidParams(
            "outcome must be confirmed, failed, unknown or not_found",
            errors={"outcome": ["confirmed, failed, unknown or not_found"]},
        )
    if outcome == "confirmed" and not external_id.strip():
        raise InvalidParams(
            "confirmed needs the external id that proves it",
            errors={"external_id": ["required when confirmed"]},
        )
    mode = tool.dedup_mode()
    if outcome == "not_found" and mode != Dedup.LOOKUP:
        raise InvalidTransition(
            f"not_found answers a lookup; {tool.name} is reconciled by {RECONCILE[mode]}"
        )
    if result is not None:
        try:
            canonical_bytes(result)
        except CanonicalError as exc:
            raise InvalidParams(str(exc), errors={"result": [str(exc)]}) from None
    return mode


def _absent_after_flight(action: Action) -> None:
    """A lookup's "not found" is proof of absence only for an action that may have been sent
    and only once its sender cannot still be in flight (its lease plus the tool's timeout,
    by the database clock); else InvalidTransition."""
    if action.status not in ledger.UNSETTLED:
        raise InvalidTransition(f"action is {action.status}; not_found answers sent or unknown")
    if ledger.may_be_in_flight(action):
        raise InvalidTransition(
            f"the sender may still be in flight until {action.in_flight_until}; "
            "look up again after that"
        )


def _not_found(action: Action, actor: str, reported: dict[str, Any]) -> Action:
    """A lookup by key found nothing (and its sender is no longer in flight): the action goes
    back to `prepared`, for a send with the same key."""
    _absent_after_flight(action)
    return ledger.transition(
        action,
        S.PREPARED,
        actor,
        journal_extra=reported,
        last_error="looked up by key: not found; safe to send again with the same key",
        reconcile_attempts=action.reconcile_attempts + 1,
    )
