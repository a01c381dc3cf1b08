"""`Executor`: an external agent's loop on a leased run, safe against its own crash.

An agent process can die at any instant — between marking an action `sent` and calling the
tool, or after the tool answered and before the outcome was recorded. Everything this class
needs to carry on is therefore kept by the server, never in the process:

- the lease (heartbeated from a background thread) and its fence, which every write
  carries, so a paused or half-dead predecessor cannot write after a takeover;
- the latest checkpoint, which says which step comes next (`load`);
- the action ledger, found again by an idempotency key derived from the run, the goal
  revision and the call's label — never from the process — so `act` after a restart meets
  the action the dead process prepared and continues it from its recorded status.

A `sent` or `unknown` action is never "just called again" on the client's say-so. The
server knows each tool's dedup contract and says on the action what happens next
(`reconcile`, API.md "External executors"): `replay_same_key` — dispatched again (the
server refuses it to a stale fence, a finished run or an old goal revision), then `perform`
again with the *same* idempotency key, which the service answers with the first result;
`lookup` — the
agent's `lookup` asks the service by key (found: confirmed; not found: reported, and the
server lets it be sent again once the first request can no longer be in flight);
`manual_review` — a person resolves it, and the executor waits for their answer. The client
has no replay-safety setting of its own to get wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Generic, TypedDict, TypeVar, Unpack

from holdpoint_client import calls
from holdpoint_client.client import Client
from holdpoint_client.errors import (
    ActionCancelled,
    ActionFailed,
    ActionWithdrawn,
    ApprovalExpired,
    ApprovalRequired,
    ApprovalTimeout,
    ExecutorError,
    HoldpointError,
    InvalidTransition,
    LeaseHeld,
    LeaseLost,
    OutcomeUnknown,
    Rejected,
    ServerError,
    StaleFence,
    StaleGoalRev,
    ToolRefused,
    ToolUnavailable,
    TransportError,
    VersionConflict,
)
from holdpoint_client.faults import fault
from holdpoint_client.flow import Flow, ask, call_agent, drive, invoke, pause, refuse_async
from holdpoint_client.models import Action, Checkpoint, LeaseGrant, Run
from holdpoint_client.toolcall import Lookup, Perform, ToolCall, refusal_of

log = logging.getLogger("holdpoint_client.executor")
MAX_KEY = 255
# The tool-call contract (holdpoint_client.toolcall) stays importable from here too, where
# agents' code has imported `Perform` and `Lookup` from.
__all__ = [
    "MAX_KEY",
    "ActOptions",
    "Executor",
    "ExecutorCore",
    "Lookup",
    "Perform",
    "ToolCall",
    "refusal_of",
]

C = TypeVar("C")


class ActOptions(TypedDict, total=False):
    """`act`'s optional keywords (see Executor.act), shared by every face of it."""

    reason: str
    target: str
    lookup: Lookup | None
    approval_timeout: float | None
    resolution_timeout: float | None


class ExecutorCore(Generic[C]):
    """The lease and the ledger logic of an executor, as flows (holdpoint_client.flow).

    `Executor` drives them with blocking calls and a heartbeat thread, `AsyncExecutor`
    (holdpoint_client.aio) on the event loop with a heartbeat task: one copy of the logic.
    `ttl` is the lease length in seconds, renewed every ttl/3. If the lease is taken over
    (stale fence) the executor marks itself `lost` and every later call raises `LeaseLost`:
    the process must stop. On entry it waits up to `lease_timeout` seconds for a lease
    someone else holds — typically the dead predecessor's, which expires `ttl` seconds after
    its last heartbeat.
    """

    def __init__(
        self,
        client: C,
        run_id: str,
        owner: str,
        ttl: int = 30,
        *,
        lease_timeout: float = 120.0,
        replay_attempts: int = 5,
        retry_pause: float = 1.0,
    ) -> None:
        if ttl < 2:  # the server caps it (HOLDPOINT_MAX_LEASE_TTL, 300 s by default)
            raise ValueError("ttl must be at least 2 seconds")
        self.client = client
        self.run_id = str(run_id)
        self.owner = owner
        self.ttl = ttl
        self.lease_timeout = lease_timeout
        self.replay_attempts = max(1, replay_attempts)
        self.retry_pause = retry_pause
        self.fence = 0
        self.rev = 0
        self.next_step = ""
        self._run: Run | None = None
        self._lost = threading.Event()
        self._finished = False

    # --- driver hooks (heartbeats run outside the flows) -----------------------------------

    def _start_beats(self) -> Any:
        raise NotImplementedError

    def _stop_beats(self) -> Any:
        raise NotImplementedError

    # --- the lease -------------------------------------------------------------------------

    def _acquire_flow(self) -> Flow[LeaseGrant]:
        """Take the lease, waiting out a live one; AlreadyCompleted/RunFinished propagate."""
        deadline = time.monotonic() + self.lease_timeout
        while True:
            try:
                grant = yield from ask(calls.lease(self.run_id, self.owner, self.ttl))
                break
            except (LeaseHeld, TransportError) as exc:
                # A lease whose answer was lost may be ours, unknown fence and all: asked
                # again, it is held (by us) until it expires, then ours with a new fence.
                ambiguous = isinstance(exc, TransportError) and exc.may_have_applied
                if time.monotonic() >= deadline or not (ambiguous or isinstance(exc, LeaseHeld)):
                    raise
                yield from pause(max(0.2, min(2.0, self.ttl / 6)))
        self.fence = grant.fence
        self._lost.clear()
        try:
            yield from self._refresh_flow()
            yield from invoke(self._start_beats)
        except Exception:
            yield from self._close_flow()  # not kept (and heartbeated) for nobody
            raise
        log.info("leased run %s as %s (fence %d)", self.run_id, self.owner, self.fence)
        return grant

    def _close_flow(self) -> Flow[None]:
        """Stop heartbeating and hand the lease back, so a successor need not wait it out."""
        yield from invoke(self._stop_beats)
        if self.fence and not self._finished and not self._lost.is_set():
            try:
                yield from ask(calls.release(self.run_id, self.fence))
            except HoldpointError as exc:  # the lease expires on its own anyway
                log.warning("could not release run %s: %s", self.run_id, exc)

    def _beat_flow(self) -> Flow[bool]:
        """One heartbeat; False once the lease is lost (a stale fence, met by this beat or
        by any other call): nothing is renewed for a lease another executor holds. Every
        other failure is logged and the next beat tries again — one that ended the
        heartbeat would let the lease lapse with nobody told."""
        if self._lost.is_set():
            return False
        try:
            yield from ask(calls.heartbeat(self.run_id, self.fence, self.ttl))
        except StaleFence:
            log.error("run %s: lease lost (fence %d is stale)", self.run_id, self.fence)
            self._lost.set()
            return False
        except HoldpointError as exc:
            log.warning("run %s: heartbeat failed: %s", self.run_id, exc)
        except Exception:  # not the API's (a transport's own OSError, a malformed answer)
            log.exception("run %s: heartbeat failed; the next one tries again", self.run_id)
        return True

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def _check(self) -> None:
        if self._lost.is_set():
            raise LeaseLost(f"run {self.run_id} was taken over; fence {self.fence} is stale")
        if not self.fence:
            raise ExecutorError("no lease: use the executor as a context manager")

    def _lose(self, exc: StaleFence) -> LeaseLost:
        self._lost.set()
        return LeaseLost(f"run {self.run_id}: {exc.detail}")

    # --- state -----------------------------------------------------------------------------

    def _refresh_flow(self) -> Flow[Run]:
        """Re-read the run (goal, revisions, checkpoint rev) from the server."""
        self._run = yield from ask(calls.get_run(self.run_id))
        self.rev = self._run.checkpoint_rev
        self.next_step = self._run.next_step
        return self._run

    def _load_flow(self) -> Flow[dict[str, Any]]:
        """The state of the run's latest checkpoint (artifacts inlined), {} before the first;
        `next_step` is set from it, so the agent knows where to continue."""
        run = yield from self._refresh_flow()
        if run.checkpoint_rev == 0:
            return {}
        checkpoint = yield from ask(
            calls.get_checkpoint(self.run_id, run.checkpoint_rev, inline=True)
        )
        self.next_step = checkpoint.next_step
        state = checkpoint.state
        return dict(state) if isinstance(state, Mapping) else {}

    def _checkpoint_flow(
        self, state: Mapping[str, Any], next_step: str, status: str = "running", prompt: str = ""
    ) -> Flow[Checkpoint]:
        """Write the next checkpoint (compare-and-swap on the rev this executor last saw).

        A status other than `running` ends the lease on the server, and a heartbeat that
        arrived after it would be refused as stale: heartbeats stop before such a write
        (and start again if it fails).
        """
        self._check()
        ending = status != "running"
        if ending:
            yield from invoke(self._stop_beats)
        try:
            checkpoint = yield from ask(
                calls.write_checkpoint(
                    self.run_id,
                    fence=self.fence,
                    expected_rev=self.rev,
                    state=state,
                    next_step=next_step,
                    status=status,
                    prompt=prompt,
                )
            )
        except StaleFence as exc:
            raise self._lose(exc) from exc
        except Exception:
            if ending:
                yield from invoke(self._start_beats)
            raise
        self.rev = checkpoint.rev
        self.next_step = next_step
        self._finished = ending
        return checkpoint

    # --- actions ---------------------------------------------------------------------------

    @property
    def goal_rev(self) -> int:
        """The goal revision the run was last read at: the one `key_for` keys calls under."""
        if self._run is None:
            raise ExecutorError("no lease: use the executor as a context manager")
        return self._run.goal_rev

    def key_for(self, call: str, goal_rev: int | None = None) -> str:
        """The ledger key of one call: the same after any number of restarts of the agent,
        new when the goal is revised (an old revision's work is never reused blindly).
        `goal_rev`: the key a call had under that revision (default: the current one)."""
        if not call or not call.isprintable():
            raise ValueError("call must be a non-empty printable label")
        rev = self.goal_rev if goal_rev is None else goal_rev
        key = f"{self.run_id}:{rev}:ext:{call}"
        if len(key) > MAX_KEY:
            raise ValueError(f"call label too long: the key would exceed {MAX_KEY} characters")
        return key

    def _act_flow(
        self,
        tool: str,
        params: Mapping[str, Any],
        *,
        call: str,
        perform: Perform | None,
        reason: str = "",
        target: str = "",
        lookup: Lookup | None = None,
        approval_timeout: float | None = None,
        resolution_timeout: float | None = None,
    ) -> Flow[Action]:
        """Prepare → (wait for approval) → dispatch → perform → record; exactly once.

        `perform` None: the server sends the tool itself (executor `http`) and the
        dispatched action's status is its outcome; this flow waits for it to settle.
        """
        action = yield from self.find_or_prepare(tool, params, call, reason, target)
        approval_deadline = _deadline(approval_timeout)
        resolution_deadline = _deadline(resolution_timeout)
        performed = 0
        while True:
            self._check()
            status = action.status
            if status in ("confirmed", "compensated"):
                return action
            if status == "awaiting_approval":
                action = yield from self._await_decision(action, approval_deadline)
            elif status in ("prepared", "approved"):
                action = yield from self._dispatch(action)
                if action.status == "sent" and perform is not None:
                    action = yield from self._perform(action, perform, replay=performed > 0)
                    performed += 1
            elif status in ("sent", "unknown") and perform is None:
                action = yield from self._await_settled(action, resolution_deadline)
            elif status in ("sent", "unknown"):
                assert perform is not None
                if performed >= self.replay_attempts:
                    raise OutcomeUnknown(
                        f"{tool}: no verifiable result after {performed} attempts; the "
                        "server reconciles it",
                        action=action,
                    )
                action = yield from self._reconcile(action, perform, lookup, attempt=performed)
                performed += 1
            elif status == "failed":
                reason = refusal_of(action)
                raise ActionFailed(f"{tool} failed: {reason}", action=action, reason=reason)
            elif status == "cancelled":
                raise (yield from self._cancelled(action))
            elif status == "manual_review":
                action = yield from self._await_resolution(action, resolution_deadline)
            else:
                raise ExecutorError(f"{tool}: unexpected action status {status!r}", action=action)

    def find_or_prepare(
        self, tool: str, params: Mapping[str, Any], call: str, reason: str = "", target: str = ""
    ) -> Flow[Action]:
        """The call's action, found by its ledger key or prepared now — nothing is sent:
        the hold point (if any) is raised with the prepare, so its status says whether a
        reviewer must decide first."""
        self._check()
        goal_rev = self.goal_rev
        key = self.key_for(call, goal_rev)
        found = yield from ask(calls.actions_page(idempotency_key=key))
        if found.results and found.results[0].params == dict(params):
            action = found.results[0]
            log.info("run %s: %s found as %s (%s)", self.run_id, call, action.status, key)
            return action
        # New, or found with other params: a reviewer's edit (the server matches the params
        # first asked for and returns the action) or an agent that changed its mind under
        # the same label (refused: IdempotencyKeyReused).
        return (yield from self._prepare(key, tool, params, reason, target, goal_rev=goal_rev))

    def _prepare(
        self,
        key: str,
        tool: str,
        params: Mapping[str, Any],
        reason: str,
        target: str,
        *,
        goal_rev: int,
    ) -> Flow[Action]:
        """Prepare the call keyed `key` under goal revision `goal_rev` — sent along, so that
        a goal revised since (the server's version_conflict) prepares nothing: the action
        would be the new goal's under the old goal's key, and after a restart, keyed under
        the new revision, the call would be made again."""
        try:
            return (
                yield from ask(
                    calls.prepare_action(
                        self.run_id,
                        fence=self.fence,
                        tool=tool,
                        params=params,
                        reason=reason,
                        target=target,
                        idempotency_key=key,
                        expected_goal_rev=goal_rev,
                    )
                )
            )
        except StaleFence as exc:
            raise self._lose(exc) from exc
        except VersionConflict as exc:
            raise (yield from self._revised(exc.detail)) from exc

    def _revised(self, detail: str, action: Action | None = None) -> Flow[ActionWithdrawn]:
        """The server says the goal was revised since this executor read the run (a
        prepare's version_conflict, a dispatch's stale_goal_rev): the run is read again —
        the agent's next call is keyed under the new revision — and the call is withdrawn,
        for the agent to decide anew under the new goal."""
        yield from self._refresh_flow()
        return ActionWithdrawn(f"the goal was revised: {detail}", action=action)

    def _cancelled(self, action: Action) -> Flow[ExecutorError]:
        """A rejection (found again after a restart, too) or another withdrawal — then the
        run is read again: a revision withdraws what was held or unsent, and the agent's
        next call must be keyed under the new goal revision, not the one read before."""
        if action.approval is not None:
            approval = yield from ask(calls.get_approval(action.approval))
            if approval.status == "rejected":
                return Rejected(
                    f"{action.tool} was rejected: {approval.decision_reason}",
                    action=action,
                    reason=approval.decision_reason,
                )
        yield from self._refresh_flow()
        return ActionWithdrawn(f"{action.tool} was cancelled: {action.last_error}", action=action)

    def _await_decision(self, action: Action, deadline: float | None) -> Flow[Action]:
        """Long-poll the approval until it is decided; the lease stays renewed meanwhile.

        The first read does not wait: the server's long poll answers on a *change*, and an
        approval decided before we asked would otherwise cost a full wait.
        """
        while True:
            self._check()
            if action.approval is None:  # the request is raised in the same transaction
                yield from pause(self.retry_pause)
                action = yield from ask(calls.get_action(action.action_id))
                continue
            approval = yield from ask(calls.get_approval(action.approval))
            if approval.pending:
                fault("awaiting_approval")
            while approval.pending:
                self._check()
                wait = float(min(30, self.ttl))
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ApprovalTimeout(
                            f"{action.tool}: no decision yet on approval {approval.id}; "
                            "everything is kept — run the agent again to go on waiting",
                            action=action,
                        )
                    wait = max(1.0, min(wait, left))
                approval = yield from ask(calls.get_approval(approval.id, wait))
            action = yield from ask(calls.get_action(action.action_id))
            if action.status != "awaiting_approval" or action.approval != approval.id:
                fault("after_decision")
                return action  # approved, cancelled (rejected, expired) or held anew
            yield from pause(self.retry_pause)

    def _dispatch(self, action: Action) -> Flow[Action]:
        """Mark `sent`. A refusal or an ambiguous failure (a lost connection, a gateway's
        502/504, Holdpoint's own 500 or 503 `service_unavailable` — a fault, or its database
        lost, that may come after `sent` was committed) is settled by re-reading the action:
        its status, not our guess, decides what happens next. Found still unsent, it is
        dispatched again after a pause, `replay_attempts` times in all; then the failure is
        raised. A 503 `tool_unavailable` is not ambiguous (nothing was applied), and was
        retried already."""
        for attempt in range(self.replay_attempts):
            if attempt:
                yield from pause(self._backoff(attempt))
            try:
                return (yield from self._dispatch_once(action))
            except TransportError as exc:
                if not exc.may_have_applied or attempt + 1 == self.replay_attempts:
                    raise
            except ServerError as exc:
                if isinstance(exc, ToolUnavailable) or attempt + 1 == self.replay_attempts:
                    raise
            reread = yield from ask(calls.get_action(action.action_id))
            if reread.status not in ("prepared", "approved"):
                return reread  # it was applied (or settled otherwise): the loop decides
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _dispatch_once(self, action: Action) -> Flow[Action]:
        try:
            return (yield from ask(calls.dispatch(action.action_id, self.fence)))
        except StaleFence as exc:
            raise self._lose(exc) from exc
        except StaleGoalRev as exc:
            # Withdrawn only if it never left; a replay refused (the action sent or unknown)
            # may have applied: the server hands it to a person, and the loop waits for them.
            reread = yield from ask(calls.get_action(action.action_id))
            if reread.status in ("prepared", "approved", "cancelled"):
                raise (yield from self._revised(exc.detail, reread)) from exc
            return reread
        except (ApprovalRequired, ApprovalExpired):
            # The server holds the action again under a new request: wait for that one.
            reread = yield from ask(calls.get_action(action.action_id))
            if reread.status in ("prepared", "approved"):
                raise  # refused with nothing to wait for: never loop on it
            return reread
        except (ActionCancelled, InvalidTransition):
            return (yield from ask(calls.get_action(action.action_id)))

    def _backoff(self, attempt: int) -> float:
        """The pause before attempt `attempt` (from 1) of something that failed before."""
        return float(self.retry_pause * 2.0 ** min(attempt - 1, 5))

    def _perform(self, action: Action, perform: Perform, *, replay: bool) -> Flow[Action]:
        """Call the tool once and report what came of it; the server applies the tool's
        contract to the report (an `unknown` of a tool it cannot reconcile goes to a
        person at once) and the returned action says what happens next."""
        call = ToolCall(action=action, run_id=self.run_id, fence=self.fence, replay=replay)
        fault("after_sent_mark")
        try:
            effect = yield from call_agent(perform, call)
        except ToolRefused as exc:
            refusal = str(exc) or type(exc).__name__  # never an empty reason (ActionFailed)
            return (yield from self._record(action, "failed", result={"error": refusal}))
        except Exception as exc:  # the request may have applied: never a clean failure
            log.warning("run %s: %s: %r", self.run_id, action.tool, exc)
            error = {"error": repr(exc)[:2000]}
            return (yield from self._record(action, "unknown", result=error))
        fault("after_tool_response")
        return (yield from self._confirm(action, effect))

    def _reconcile(
        self, action: Action, perform: Perform, lookup: Lookup | None, *, attempt: int
    ) -> Flow[Action]:
        """Settle an action that may have happened, as the server's `reconcile` says."""
        how = action.reconcile
        if not how:
            how = (yield from ask(calls.get_action(action.action_id))).reconcile
        if attempt:
            yield from pause(self._backoff(attempt))
        if how == "replay_same_key":
            # Dispatched again first: the server re-marks it `sent` only for the lease's
            # holder, on a run still going, under the goal revision it was prepared for
            # (a revision meanwhile: StaleGoalRev, never a send of the old goal's action).
            action = yield from self._dispatch(action)
            if action.status != "sent":
                return action  # settled or withdrawn meanwhile: the caller's loop decides
            return (yield from self._perform(action, perform, replay=True))
        if how == "lookup":
            if lookup is None:
                raise ExecutorError(
                    f"{action.tool} is reconciled by looking it up: pass lookup= to act",
                    action=action,
                )
            return (yield from self._look_up(action, lookup))
        # manual_review (or a server that names no way): say we cannot tell; the server
        # hands it to a person.
        error = {"error": "the outcome is not known"}
        return (yield from self._record(action, "unknown", result=error))

    def _look_up(self, action: Action, lookup: Lookup) -> Flow[Action]:
        """Ask the service by key: found, confirmed; not found, reported — which the server
        accepts only once the first request can no longer be in flight
        (`reconcile.not_found_after`). A refusal before then concludes nothing, so it is no
        attempt (`replay_attempts` counts what could settle the action): wait for that
        moment and look again — the late request may have landed meanwhile. Only a window
        that keeps moving (its sender's lease renewed) is handed back to the caller's
        count, as any other refusal is."""
        first_after: datetime | None = None
        while True:
            self._check()
            call = ToolCall(action=action, run_id=self.run_id, fence=self.fence, replay=True)
            found = yield from call_agent(lookup, call)
            if found is not None:
                return (yield from self._confirm(action, found))
            try:
                return (yield from self._record(action, "not_found"))
            except InvalidTransition:
                reread = yield from ask(calls.get_action(action.action_id))
            after = reread.not_found_after
            if (
                reread.status not in ("sent", "unknown")
                or reread.reconcile != "lookup"
                or after is None
                or (first_after is not None and after > first_after)
            ):
                return reread  # settled, or not a matter of waiting: the caller's loop decides
            first_after, action = after, reread
            log.info("run %s: %s: not found; too early until %s", self.run_id, action.tool, after)
            wait = (after - datetime.now(UTC)).total_seconds() + 0.2
            yield from pause(min(max(wait, 0.2), float(self.ttl)))

    def _await_resolution(self, action: Action, deadline: float | None) -> Flow[Action]:
        """A person resolves the action (API `resolve`, the Reconcile page): applied makes
        it confirmed, not applied sends it again with the same key. Long-poll the run (it
        leaves needs_reconciliation when they answer); the lease stays renewed meanwhile."""
        log.info("run %s: %s waits for a person to resolve it", self.run_id, action.tool)
        return (yield from self._await_leaving(action, "manual_review", deadline))

    def _await_settled(self, action: Action, deadline: float | None) -> Flow[Action]:
        """A tool the server sends itself (executor `http`): its answer settles the action;
        until then (or while the server reconciles it) wait on the run."""
        return (yield from self._await_leaving(action, action.status, deadline))

    def _await_leaving(self, action: Action, status: str, deadline: float | None) -> Flow[Action]:
        while True:
            self._check()
            if deadline is not None and time.monotonic() >= deadline:
                raise OutcomeUnknown(f"{action.tool} is still {status}", action=action)
            action = yield from ask(calls.get_action(action.action_id))
            if action.status != status:
                return action
            wait = float(min(30, self.ttl))
            if deadline is not None:
                wait = max(1.0, min(wait, deadline - time.monotonic()))
            yield from ask(calls.get_run(self.run_id, wait))

    def _confirm(self, action: Action, effect: Any) -> Flow[Action]:
        external_id, result = effect
        if not str(external_id).strip():  # confirmed needs proof (DESIGN.md invariant 2)
            action = yield from self._record(action, "unknown", result=result)
            raise OutcomeUnknown(f"{action.tool} answered without an external id", action=action)
        return (
            yield from self._record(
                action, "confirmed", external_id=str(external_id), result=result
            )
        )

    def _record(
        self, action: Action, outcome: str, *, external_id: str = "", result: Any = None
    ) -> Flow[Action]:
        """Record the outcome; after an ambiguous failure, sent again after a pause,
        `replay_attempts` times in all. A report that landed the first time is answered
        again by the server with the action as it is now (200: the same fence and the same
        report — outcome, external id and result, which is why each attempt sends the very
        same one), so repeating it can neither apply it twice nor be mistaken for a
        refusal; a 409 `invalid_transition` is then a real one (another report settled the
        action) and is raised, never repeated.

        A 5xx is such an ambiguous failure even when Holdpoint itself wrote it (its own
        500 `server_error`, a 503 `service_unavailable` it kept answering): the POST may
        have been recorded before the fault, or not at all.

        Not recorded in the end, it is OutcomeUnknown, not a bare failure: the effect may
        well have happened (`unrecorded` says what the tool answered), and only the ledger
        can settle it — the agent run again meets the action still `sent` and reconciles
        it — so a caller must not simply do it again."""
        failure: TransportError | ServerError | None = None
        for attempt in range(self.replay_attempts):
            if attempt:
                yield from pause(self._backoff(attempt))
            try:
                return (
                    yield from ask(
                        calls.record_outcome(
                            action.action_id,
                            fence=self.fence,
                            outcome=outcome,
                            external_id=external_id,
                            result=result,
                        )
                    )
                )
            except StaleFence as exc:
                raise self._lose(exc) from exc
            except (TransportError, ServerError) as exc:
                failure = exc
                if isinstance(exc, TransportError) and not exc.may_have_applied:
                    break
        raise OutcomeUnknown(
            f"{action.tool}: could not record {outcome} for {action.action_id} ({failure}): "
            "the server does not know what came of it — do not do it again yourself; "
            "running the agent again settles it from the ledger",
            action=action,
            unrecorded=outcome,
        ) from failure


class Executor(ExecutorCore[Client]):
    """Hold a run's lease for the length of a `with` block and execute under it, blocking
    (see ExecutorCore: `Executor(client, run_id, owner, ttl)`); a thread heartbeats."""

    _beats: threading.Thread | None = None
    _stop: threading.Event | None = None

    def __enter__(self) -> Executor:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def acquire(self) -> LeaseGrant:
        return drive(self._acquire_flow(), self.client)

    def close(self) -> None:
        drive(self._close_flow(), self.client)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.ttl / 3):
            if not drive(self._beat_flow(), self.client):
                return

    def _start_beats(self) -> None:
        self._stop = threading.Event()
        self._beats = threading.Thread(
            target=self._heartbeat,
            args=(self._stop,),
            name=f"holdpoint-lease-{self.run_id}",
            daemon=True,
        )
        self._beats.start()

    def _stop_beats(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._beats is not None and self._beats is not threading.current_thread():
            self._beats.join(timeout=self.client.timeout + 1)
        self._beats = None

    def _lose(self, exc: StaleFence) -> LeaseLost:
        if self._stop is not None:
            self._stop.set()
        return super()._lose(exc)

    @property
    def run(self) -> Run:
        if self._run is None:
            self._run = self.client.get_run(self.run_id)
        return self._run

    @property
    def goal(self) -> Any:
        return self.run.goal

    def refresh(self) -> Run:
        return drive(self._refresh_flow(), self.client)

    def load(self) -> dict[str, Any]:
        return drive(self._load_flow(), self.client)

    def checkpoint(
        self, state: Mapping[str, Any], next_step: str, status: str = "running", prompt: str = ""
    ) -> Checkpoint:
        """Write the next checkpoint; `prompt` goes with status `waiting_input`: what the
        agent asks a person for (they give it with `provide_input`; `run.input` after the
        next lease)."""
        return drive(self._checkpoint_flow(state, next_step, status, prompt), self.client)

    def act(
        self,
        tool: str,
        params: Mapping[str, Any],
        *,
        call: str,
        perform: Perform | None,
        **options: Unpack[ActOptions],
    ) -> Action:
        """Prepare → (wait for approval) → dispatch → perform → record; exactly once.

        `call` names this call within the run (e.g. the step name); it must be the same
        when the agent comes back to this point after a restart. `perform` does the effect
        of a tool the agent performs itself (executor `client`); None for a tool the server
        sends (executor `http`). An action that may have happened is settled as the
        server's `reconcile` says — `perform` again with the same key, `lookup` (required
        for a tool the server reconciles by lookup), or a person's answer, waited for up to
        `resolution_timeout` seconds (None: as long as it takes; the lease is renewed
        meanwhile); `approval_timeout` bounds the wait for a reviewer. Returns the confirmed
        action; raises Rejected (an ActionRejected), ApprovalTimeout, ActionWithdrawn,
        ActionFailed, OutcomeUnknown or LeaseLost.
        """
        refuse_async(perform, options.get("lookup"))
        flow = self._act_flow(tool, params, call=call, perform=perform, **options)
        return drive(flow, self.client)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout
