"""The executor: advance one run under a lease until it waits, ends, fails or its slice ends.

Recovery, step by step (DESIGN.md): take the lease (fence += 1), check the graph version
(migrate or escalate: runtime.revising), reconcile the ledger, then continue from the last
committed step.
Every write is conditional on the fence; a refused write stops the executor at once.
One step's commit — run row CAS + artifacts + checkpoint + journal, all or nothing — is
`runtime.stepcommit`'s, shared with external executors (`runtime.protocol`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from audit import journal
from audit.canonical import canonical
from fastsql import statements
from runtime import holds, metrics, observe, revising, stepcommit
from runtime.artifacts import Encoder, resolve
from runtime.context import RecordedCalls, StepContext
from runtime.dispatch import ActionRunner, Confirmed, RunMoved, for_a_person
from runtime.errors import (
    AlreadyCompleted,
    HoldpointError,
    LeaseHeld,
    NotFound,
    Park,
    RunFinished,
    StaleFence,
    Unwritten,
)
from runtime.events import RunEvent, record
from runtime.faults import FaultPoint, fault
from runtime.graphs import Complete, Fail, Graph, Next, Outcome, Wait, unstorable
from runtime.leases import (
    Heartbeater,
    Lease,
    db_now_plus,
    refuse_stale,
    release,
    take_due,
)
from runtime.models import TERMINAL, Action, ActionStatus, Checkpoint, Run, RunStatus
from runtime.models.limits import NOTE_MAX
from runtime.stepclock import StepClock
from runtime.stepcommit import StepCommit
from runtime.stepoutcomes import ADVANCE_OUTCOME, outcome_changes, park_changes

log = logging.getLogger("holdpoint.executor")


@dataclass(frozen=True)
class AdvanceResult:
    # completed|waiting|failed|retrying|needs_attention|yielded|skipped|stale|stopped
    outcome: str
    steps: int = 0
    detail: str = ""


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def advance_run(
    run_id: Any,
    owner: str | None = None,
    *,
    ttl: float | None = None,
    slice_seconds: float | None = None,
) -> AdvanceResult:
    """Take the run's lease and execute steps; harmless to call for a run that is not due."""
    owner = owner or worker_id()
    ttl = float(ttl or settings.HOLDPOINT_LEASE_TTL)
    # Owning the run's stream from the lease on: the lease's journal entry already gives the
    # executor the head it carries through its commits (audit.journal.owning).
    with journal.owning(journal.run_stream(run_id)):
        taking = time.monotonic()  # before the statement: the lease's age errs high
        try:
            lease, run = take_due(run_id, owner, ttl)
        except (LeaseHeld, RunFinished, AlreadyCompleted, NotFound) as exc:
            return AdvanceResult("skipped", detail=exc.code)
        observe.lease_taken(lease)
        executor = Executor(lease, run, extended_at=taking)
        try:
            return executor.execute(float(slice_seconds or settings.HOLDPOINT_SLICE_SECONDS))
        except StaleFence as exc:
            log.warning("run %s: executor %s stopped: %s", run_id, lease.actor, exc)
            return AdvanceResult("stale", executor.steps, str(exc))


def backoff_seconds(graph: Graph, failures: int) -> float:
    """Exponential backoff with "equal jitter": half fixed, half random."""
    ceiling: float = min(graph.retry_max, graph.retry_base * 2 ** (failures - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass
class _InFlight:
    """A step's commit on its way (`Executor.commit`, overlap): the function that takes its
    answer, what the executor held before it (the state, how it is stored, its goal rev) —
    back to that if it does not land — and the step's watch, counted when it lands."""

    answer: Callable[[], None]
    step: str
    before: tuple[dict[str, Any], Any, int]
    landed: tuple[Any, float] | None = None


class Executor:
    def __init__(
        self, lease: Lease, run: Run | None = None, extended_at: float = float("-inf")
    ) -> None:
        """`run`: the run row as `lease` left it (leases.take_due reads it), else read here.
        `extended_at`: when the lease's expiry was last set (time.monotonic(), taken before
        that statement), if the caller knows — a lease just taken needs no extension by the
        first commit, which would rewrite the sweeper's index entry for nothing."""
        self.lease = lease
        self.steps = 0
        self.run = run if run is not None else self._fetch(lease.run_id, lease.tenant_id)
        self.stream = journal.run_stream(self.run.run_id)
        self.encoder = Encoder()
        self.state: dict[str, Any] = {}
        # How the committed `state` is stored in its checkpoint (None: not known yet). A
        # checkpoint around a side effect keeps the same state: it refers to this.
        self.stored: Any = None
        self.state_goal_rev = self.run.goal_rev
        self.recorded: dict[str, Any] = RecordedCalls(self.run.run_id, self.run.tenant_id)
        # When this executor last pushed its lease out (time.monotonic(), taken *before* the
        # statement, so the estimate errs early); -inf: the first commit extends it.
        self.extended_at = extended_at
        self.calls_made = 0
        self.calls_reused = 0
        self.runner: ActionRunner | None = None
        # Confirmed outcomes the next commit writes (ActionRunner.record defers them).
        self.confirmed: list[Confirmed] = []
        # A step's commit sent and not yet answered (`commit`, overlap): the next step runs
        # meanwhile, and nothing else of the run leaves the process until `settle`.
        self.in_flight: _InFlight | None = None
        # A commit in flight did not land since the step that is running began (`settle`):
        # that step ran on a state that was never committed, and its outcome is dropped.
        self.lost = False
        # A commit in flight the database refused with an error (`settle`): its step failed,
        # counted as a failure of that step at the loop's next turn.
        self.refused: tuple[str, Exception] | None = None
        # Steps that raised while the commit before them was on its way (`steps_until`): a
        # commit whose next step is one of them is waited for, so that step runs once.
        self.wait_before: set[str] = set()

    # --- the loop ------------------------------------------------------------------------
    def execute(self, slice_seconds: float) -> AdvanceResult:
        # While it runs, this executor is the run stream's writer: its appends carry the head
        # through instead of re-reading it (audit.journal.owning).
        with journal.owning(self.stream), observe.advancing(self.run):
            try:
                return self._execute(slice_seconds)
            finally:
                if self.in_flight is not None:  # left by an exception: take its answer
                    self.drain()

    def _execute(self, slice_seconds: float) -> AdvanceResult:
        graph = revising.compatible_graph(self)
        if graph is None:
            if self.run.status != RunStatus.NEEDS_ATTENTION:
                return self.stopped()  # cancelled meanwhile: not the version's doing
            return AdvanceResult("needs_attention", detail=self.run.attention_reason)
        self.load()
        self.runner = ActionRunner(self, graph)
        # A revision made since the last checkpoint is applied before the reconcile: a park
        # there commits a checkpoint stamped with the run's goal_rev, which must not carry
        # the old revision's state (the hook would never run for it).
        if self.state_goal_rev != self.run.goal_rev and not revising.apply_revision(self, graph):
            return self.stopped()
        parked = self.reconcile()
        if parked is not None:
            return parked
        if not settings.HOLDPOINT_HEARTBEAT_THREAD:
            return self.loop(graph, slice_seconds, None)
        with Heartbeater(self.lease) as beater:
            return self.loop(graph, slice_seconds, beater)

    def loop(self, graph: Graph, slice_seconds: float, beater: Heartbeater | None) -> AdvanceResult:
        with StepClock(graph.step_timeout) as clock:
            return self.steps_until(graph, time.monotonic() + slice_seconds, beater, clock)

    def steps_until(
        self, graph: Graph, deadline: float, beater: Heartbeater | None, clock: StepClock
    ) -> AdvanceResult:
        while True:
            if self.refused is not None:  # a step whose commit failed, found after it ran
                (failed_step, error), self.refused = self.refused, None
                self.check_lease(beater)
                return self.fail(graph, failed_step, error)
            if self.run.status != RunStatus.RUNNING:  # a commit in flight found it moved
                return self.stopped()
            if self.in_flight is not None and time.monotonic() > deadline:
                if not self.settle():
                    continue
                release(self.lease, requeue=True)
                return AdvanceResult("yielded", self.steps)
            if self.state_goal_rev != self.run.goal_rev:
                if not revising.apply_revision(self, graph):
                    return self.stopped()
                # An old revision's action whose answer came late (RunMoved) may be left
                # unknown: settled by its contract before the new revision acts (step 4).
                parked = self.reconcile()
                if parked is not None:
                    return parked
                continue
            step = graph.steps.get(self.run.next_step)
            if step is None:
                if not self.settle():
                    continue
                self.escalate(
                    f"graph {graph.name}@{graph.version} has no step {self.run.next_step!r}"
                )
                return AdvanceResult("needs_attention", self.steps, self.run.attention_reason)
            ctx = self.context(self.run.next_step)
            step_watch = observe.step_begins(ctx, quiet=(Park, RunMoved))
            self.lost = False
            failure: Exception | None = None
            try:
                with step_watch, self.queries_settle():
                    outcome = clock.call(step, ctx)
                if not isinstance(outcome, Next | Wait | Complete | Fail):
                    raise TypeError(f"step returned {type(outcome).__name__}, not an outcome")
            except StaleFence:
                raise
            except Exception as exc:
                failure = exc
            self.absorb(ctx)
            if failure is not None:
                # The commit the step ran on, if still in flight, is answered first: a step
                # that ran on a state never committed is dropped, whatever it raised. One that
                # raised while that commit was still on its way (it opened a transaction of its
                # own — the connection is busy until the answer is in — or its clock went off
                # while it waited) runs again once it has landed; only then does what it
                # raises count. (A query of its own waits for the answer: `queries_settle`.)
                speculative = self.in_flight is not None
                if not self.settle() or self.lost:
                    continue
                if speculative:  # and the commits before this step are waited for from now on
                    self.wait_before.add(ctx.step)
                    continue
                if isinstance(failure, Park):
                    return self.park(failure, ctx.step)
                if isinstance(failure, RunMoved):
                    if self.run.status != RunStatus.RUNNING:
                        return self.stopped()
                    continue  # the goal moved under a side effect: apply the revision, again
                self.check_lease(beater)  # a step's failure is data: retry, then escalate
                return self.fail(graph, ctx.step, failure)
            self.check_lease(beater)
            try:
                committed = self.commit_outcome(ctx, outcome)
            except StaleFence:
                raise
            except Exception as exc:  # a result that cannot be committed is a step failure
                if not self.settle() or self.lost:
                    continue
                return self.fail(graph, ctx.step, unstorable(outcome, exc))
            if not committed:
                if self.run.status != RunStatus.RUNNING:
                    return self.stopped()
                continue  # the goal moved under the step: apply the revision, go again
            if self.in_flight is not None:  # counted when it lands (`settle`)
                self.in_flight.landed = (step_watch, metrics.clock())
                continue
            self.stepped(step_watch)
            if self.run.status != RunStatus.RUNNING:
                return AdvanceResult(ADVANCE_OUTCOME[self.run.status], self.steps)
            if time.monotonic() > deadline:
                release(self.lease, requeue=True)
                return AdvanceResult("yielded", self.steps)

    def stepped(self, step_watch: Any, sent_at: float | None = None) -> None:
        """A step's commit landed (`sent_at`: sent then, its answer taken only now)."""
        self.steps += 1
        observe.step_done(step_watch, sent_at)
        fault(FaultPoint.AFTER_CHECKPOINT)

    def settle(self) -> bool:
        """Wait for the answer to the commit in flight, if any. False if it did not land (the
        run moved — cancelled, revised, or another executor took it: StaleFence): this copy
        of the run is read again, the state is the last committed one, `lost` is set, and
        the step that ran meanwhile must be dropped."""
        sent, self.in_flight = self.in_flight, None
        if sent is None:
            return True
        try:
            sent.answer()
        except (stepcommit.Moved, DatabaseError) as exc:
            self.state, self.stored, self.state_goal_rev = sent.before
            self.lost = True
            self.extended_at = float("-inf")  # if it pushed the lease out, it did not: now
            if isinstance(exc, DatabaseError):  # refused whole: a failure of that step
                self.refused = (sent.step, exc)
            self.reload()  # StaleFence if another executor holds the run
            return False
        except BaseException:  # interrupted while it waited (the step's clock): still on its way
            self.in_flight = sent
            raise
        if sent.landed is not None:
            self.stepped(*sent.landed)
        return True

    def queries_settle(self) -> contextlib.AbstractContextManager[Any]:
        """While a commit is on its way, a step's own query (one that reaches the database
        through Django, not through `ctx`) first takes its answer — the connection is busy
        until then, and a query that met it busy would fail the step's run. Only around the
        step: the step's commit after it is split only where nobody watches the statements
        (`fastsql.statements.sends`)."""
        if self.in_flight is None:
            return contextlib.nullcontext()
        wrapped: contextlib.AbstractContextManager[Any] = (
            transaction.get_connection().execute_wrapper(self._settle_first)
        )
        return wrapped

    def _settle_first(
        self, execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any
    ) -> Any:
        if self.in_flight is not None:
            self.settled()  # RunMoved if it did not land: the step is dropped unqueried
        return execute(sql, params, many, context)

    def settled(self) -> None:
        """`settle` for a commit or a step's call that is about to write: RunMoved if the
        commit in flight did not land (nothing of what follows may be written)."""
        if not self.settle():
            raise RunMoved("the run moved under the step's commit")

    def drain(self) -> None:
        """Take the answer of a commit left in flight by an exception on its way out, so the
        connection is free again; whether it landed, the next holder reads."""
        sent, self.in_flight = self.in_flight, None
        try:
            if sent is not None:
                sent.answer()
        except Exception:  # the exception on its way out is the one to report
            log.warning("run %s: a step commit's answer was lost", self.run.run_id, exc_info=True)

    def check_lease(self, beater: Heartbeater | None) -> None:
        if beater is not None and beater.lost.is_set():
            refuse_stale(self.lease, "step result")

    def stopped(self) -> AdvanceResult:
        release(self.lease, requeue=True, if_held=True)  # at once, not when it expires
        return AdvanceResult("stopped", self.steps, f"run is {self.run.status}")

    def context(self, step: str) -> StepContext:
        return StepContext(
            run_id=self.run.run_id,
            tenant_id=self.run.tenant_id,
            step=step,
            state=dict(self.state),
            goal=self.run.goal,
            goal_rev=self.run.goal_rev,
            checkpoint_rev=self.run.checkpoint_rev,
            lease=self.lease,
            input=self.run.pending_input,
            metadata=self.run.metadata,
            recorded=self.recorded,
            runner=self.runner,
            fresh=self.run.checkpoint_rev == self.run.step_rev,
            visit_rev=self.run.step_rev,
        )

    def absorb(self, ctx: StepContext) -> None:
        self.calls_made += ctx.calls_made
        self.calls_reused += ctx.calls_reused

    # --- loading -------------------------------------------------------------------------
    def load(self) -> None:
        self.stored = None
        if self.run.checkpoint_rev == 0:
            self.state, self.state_goal_rev = {}, self.run.goal_rev
            return
        checkpoint = Checkpoint.objects.only("state", "goal_rev").get(
            run_id=self.run.run_id, tenant_id=self.run.tenant_id, rev=self.run.checkpoint_rev
        )
        cache: dict[str, Any] = {}
        self.state = resolve(self.run.tenant_id, checkpoint.state, cache)
        self.encoder.known.update(cache)
        self.state_goal_rev = checkpoint.goal_rev

    def reconcile(self) -> AdvanceResult | None:
        """Settle `sent`/`unknown` actions before anything else (recovery, step 4).

        Returns a result when the run cannot go on now (a human must look, or the sender of
        an action could still be in flight), else None.
        """
        # One read for both questions, on the partial index of unsettled actions.
        open_actions = statements.load_all(
            Action,
            {
                "run_id": self.run.run_id,
                "tenant_id": statements.Check(self.run.tenant_id),
                "status": (ActionStatus.SENT, ActionStatus.UNKNOWN, ActionStatus.MANUAL_REVIEW),
            },
            order_by=("created_at",),
        )
        waiting = self.wait_for_a_person(open_actions)  # nothing is replayed meanwhile
        if waiting is not None:
            return waiting
        assert self.runner is not None  # made by _execute before it reconciles
        for action in open_actions:
            if action.status == ActionStatus.MANUAL_REVIEW:
                continue  # an undo a person settles: it holds no run (holds.holds_its_run)
            try:
                self.runner.reconcile(action)
            except Park as parked:
                return self.park(parked, self.run.next_step)
        # Settled to a person's verdict just now (a tool with neither key nor lookup, an old
        # revision's keyed action): the run waits for them, before its step acts.
        return self.wait_for_a_person(open_actions)

    def wait_for_a_person(self, actions: list[Action]) -> AdvanceResult | None:
        """Park on the first of `actions` that holds the run for a person (refreshed by
        reconcile's transitions: `holds.holds_its_run` — not an undo), as a step that meets
        one parks; None if there is none."""
        for action in actions:
            if holds.holds_its_run(action):
                return self.park(for_a_person(action), self.run.next_step)
        return None

    def commit_later(self, outcome: Confirmed) -> None:
        self.confirmed.append(outcome)

    def write_confirmed(self) -> None:
        """The deferred confirmations' writes, inside the commit that carries them."""
        for outcome in self.confirmed:
            outcome.write()

    def confirmed_parts(self, one: statements.OneStatement, after: str) -> list[statements.Part]:
        """The same writes as parts of the commit's one statement, each after the one before
        it (the first after the run's compare-and-swap, `after`), so the last writes only if
        every one did."""
        parts: list[statements.Part] = []
        for index, outcome in enumerate(self.confirmed):
            parts.append(
                outcome.part(one, f"confirmed_{index}", parts[-1].name if parts else after)
            )
        return parts

    def confirmed_written(self, written: bool) -> None:
        """After a commit that carried the deferred confirmations: done, or (the run moved)
        each kept as a late result. after_confirm: an outcome is committed, nothing else yet."""
        confirmed, self.confirmed = self.confirmed, []
        if not confirmed:
            return
        if written:
            fault(FaultPoint.AFTER_CONFIRM)
            return
        for outcome in confirmed:
            outcome.late()

    def checkpoint_action(
        self,
        step: str,
        within: Callable[[], None],
        allow_moved: bool = False,
        within_parts: statements.PartsAfter | None = None,
    ) -> bool:
        """A checkpoint around a side effect: same state, same step, plus the ledger write
        (`within`, or as parts of one statement: `within_parts`, see runtime.stepcommit)."""
        done = self.commit(
            step,
            self.state,
            RunStatus.RUNNING,
            step,
            {},
            RunEvent.ACTION_CHECKPOINT,
            within=within,
            within_parts=within_parts,
        )
        if not done and not allow_moved:
            raise RunMoved("the run moved under a side-effect checkpoint")
        return done

    def park(self, parked: Park, step: str) -> AdvanceResult:
        """Stop here for an approval, a reconciliation or a human; the step re-runs later."""
        if parked.status == RunStatus.NEEDS_ATTENTION:
            # A person must act first (turn an MCP server on again) and then resume the run:
            # an escalation, written as every escalation is; it waits for nothing that comes
            # by itself, and the step re-runs from the action's own checkpoint.
            self.escalate(parked.reason)
            return AdvanceResult("needs_attention", self.steps, self.run.attention_reason)
        changes = park_changes(parked)
        if not self.commit(
            step, self.state, parked.status, step, changes, RunEvent.PARKED, reason=parked.reason
        ):
            return self.stopped()
        if parked.status == RunStatus.WAITING_APPROVAL and parked.action is not None:
            self.wake_if_decided(parked.action.pk)
        return AdvanceResult(ADVANCE_OUTCOME[self.run.status], self.steps, parked.reason)

    def wake_if_decided(self, action_id: Any) -> None:
        """The decision may have landed while we were parking (it saw the run `running` and
        woke nobody): look once more, after our commit, and wake the run ourselves."""
        still_held = Action.objects.filter(
            pk=action_id, tenant_id=self.run.tenant_id, status=ActionStatus.AWAITING_APPROVAL
        ).exists()
        if not still_held:
            with transaction.atomic(durable=True):
                holds.wake(self.run, self.lease.actor, "decided while parking")
            self.refetch()

    @staticmethod
    def _fetch(run_id: Any, tenant_id: int) -> Run:
        """The run row, always by id *and* tenant (defence in depth)."""
        run = statements.load(Run, {"run_id": run_id, "tenant_id": statements.Check(tenant_id)})
        if run is None:
            raise Run.DoesNotExist(f"run {run_id} is gone")
        return run  # type: ignore[return-value]

    def refetch(self) -> None:
        """Read the run row again."""
        self.run = self._fetch(self.run.run_id, self.run.tenant_id)

    def reload(self) -> None:
        self.refetch()
        if self.run.fence != self.lease.fence:
            refuse_stale(self.lease, "commit")

    # --- commits -------------------------------------------------------------------------
    def commit_outcome(self, ctx: StepContext, outcome: Outcome) -> bool:
        state = {**self.state, **outcome.update}
        status, next_step, changes = outcome_changes(outcome)
        if ctx.input is not None:
            changes["pending_input"] = None
        return self.commit(
            ctx.step,
            state,
            status,
            next_step,
            changes,
            RunEvent.STEP_COMMITTED,
        )

    def commit(
        self,
        step: str,
        state: dict[str, Any],
        status: str,
        next_step: str,
        changes: dict[str, Any],
        event: RunEvent,
        *,
        within: Callable[[], None] | None = None,
        within_parts: statements.PartsAfter | None = None,
        state_goal_rev: int | None = None,
        **payload: Any,
    ) -> bool:
        """One step commit (runtime.stepcommit): run CAS, new artifacts, checkpoint, journal.
        False if the run moved (cancelled, or goal revised) — raises StaleFence if another
        executor holds it. `state_goal_rev`: the goal revision `state` belongs to, when it is
        not the run's (a migration's)."""
        before = (self.state, self.stored, self.state_goal_rev)
        encoded = self.unchanged() if state is self.state else self.encoder.encode(state)
        # A step boundary (or a revision's jump) starts a new step visit; checkpoints around a
        # side effect, a parked step and a graph migration do not: the step runs again from
        # its start in the same visit, so it derives the same idempotency keys and finds what
        # it prepared, sent or confirmed before — on the old version too (DESIGN.md).
        new_visit = event in (RunEvent.STEP_COMMITTED, RunEvent.REVISION_APPLIED)
        update, extended = self.run_changes(status, next_step, changes, new_visit)
        # A step's commit that leaves the run running, with nothing of the ledger or of new
        # artifacts in it, is sent and not waited for: the next step runs while it is on its
        # way (`settle` waits for its answer before anything else is written or called).
        overlap = (
            event == RunEvent.STEP_COMMITTED
            and status == RunStatus.RUNNING
            and within is None
            and not self.confirmed
            and not self.encoder.new
            and next_step not in self.wait_before
            and settings.HOLDPOINT_OVERLAP_COMMITS
        )
        try:
            answer = (stepcommit.send if overlap else stepcommit.write)(
                StepCommit(
                    run=self.run,
                    actor=self.lease.actor,
                    fence=self.lease.fence,
                    step=step,
                    next_step=next_step,
                    status=status,
                    state=encoded,
                    changes=update,
                    expect_status=RunStatus.RUNNING,
                    event=event,
                    payload=payload,
                    artifacts=self.encoder.new,
                    within=within,
                    within_parts=within_parts,
                    before=self.write_confirmed if self.confirmed else None,
                    before_parts=self.confirmed_parts if self.confirmed else None,
                    state_goal_rev=state_goal_rev,
                ),
                before_send=self.settled,
            )
        except stepcommit.Moved:
            self.reload()  # StaleFence: the confirmations stay `sent` for the run's new holder
            self.confirmed_written(False)
            return False
        except Unwritten:
            raise  # undone whole by its own write: the confirmations ride on the next commit
        except BaseException:
            self.confirmed = []  # rolled back with the commit: `sent`, settled by the contract
            raise
        if answer is not None:
            self.in_flight = _InFlight(answer, step, before)
        self.confirmed_written(True)
        if extended is not None:
            self.extended_at = extended
        self.committed(status, next_step, changes, new_visit)
        if state is not self.state:
            self.state, self.stored = state, None
        self.state_goal_rev = self.run.goal_rev if state_goal_rev is None else state_goal_rev
        return True

    def unchanged(self) -> Any:
        """How a checkpoint that keeps the committed state stores it (computed once per state):
        a state whose inline form is more than a few bytes becomes one reference to its
        content-addressed blob — stored once — instead of another copy per checkpoint."""
        if self.stored is None:
            encoded = self.encoder.encode(self.state)
            if len(canonical(encoded)) > _UNCHANGED_INLINE:
                encoded = self.encoder.reference(encoded)
            self.stored = encoded
        return self.stored

    def run_changes(
        self, status: str, next_step: str, changes: dict[str, Any], new_visit: bool
    ) -> tuple[dict[str, Any], float | None]:
        """The run columns a commit sets besides its rev — only what changes: the CAS pins the
        rest (status running, this fence, rev and goal_rev), and nobody else writes these
        columns while the fence holds — and when the lease was extended (None: it was not)."""
        run, rev = self.run, self.run.checkpoint_rev + 1
        update: dict[str, Any] = {}
        if new_visit:
            update["step_rev"] = rev
        if next_step != run.next_step:
            update["next_step"] = next_step
        if status != RunStatus.RUNNING:
            update["status"] = status
        if run.consecutive_failures:
            update["consecutive_failures"] = 0
        for name, value in changes.items():
            if value is not None or getattr(run, name, None) is not None:
                update[name] = value  # (clearing what is already clear is no change)
        extended = None
        if status != RunStatus.RUNNING:
            update.update(lease_owner="", lease_expires_at=None)
        elif time.monotonic() - self.extended_at > self.lease.ttl / 3:
            # A commit is a heartbeat — but only every ttl/3, like the heartbeat thread: a
            # commit that moves the lease's expiry rewrites the run's sweeper index entry,
            # one that leaves it can update the row in place. After any commit at least 2/3
            # of the lease is left. (The time is taken before the statement: it errs early.)
            extended = time.monotonic()
            update["lease_expires_at"] = statements.DbNow(self.lease.ttl)
        return update, extended

    def committed(
        self, status: str, next_step: str, changes: dict[str, Any], new_visit: bool
    ) -> None:
        """Bring this executor's copy of the run row up to the commit it just made."""
        run = self.run
        run.checkpoint_rev, run.next_step, run.status = run.checkpoint_rev + 1, next_step, status
        run.consecutive_failures = 0
        if new_visit:
            run.step_rev = run.checkpoint_rev
        for name in ("waiting_for", "wake_at", "pending_input", "last_error"):
            if name in changes:
                setattr(run, name, changes[name])
        self.encoder.committed()

    # --- failure, escalation -------------------------------------------------------------
    def fail(self, graph: Graph, step: str, exc: BaseException) -> AdvanceResult:
        failures = self.run.consecutive_failures + 1
        error = f"{type(exc).__name__}: {exc}"[:NOTE_MAX]
        escalate = failures >= graph.max_failures or (
            isinstance(exc, HoldpointError) and not exc.transient
        )
        delay = 0.0 if escalate else backoff_seconds(graph, failures)
        update: dict[str, Any] = {
            "consecutive_failures": failures,
            "attempts": F("attempts") + 1,
            "last_error": error,
        }
        if escalate:
            status = RunStatus.NEEDS_ATTENTION
            reason = f"{failures} consecutive failure(s) at step {step}: {error}"[:NOTE_MAX]
            update.update(status=status, attention_reason=reason, wake_at=None)
        else:
            status = RunStatus.RETRYING
            update.update(status=status, wake_at=db_now_plus(delay))
        failed = (
            RunEvent.STEP_FAILED,
            {
                "step": step,
                "error": error,
                "failures": failures,
                "status": status,
                "retry_in_seconds": round(delay, 3) if not escalate else None,
            },
        )
        escalated = [(RunEvent.ESCALATED, {"reason": reason, "status": status})] if escalate else []
        if not self.end_turn(Q(status=RunStatus.RUNNING), update, failed, *escalated):
            return self.stopped()
        log.info(
            "run %s step %s failed (%s/%s): %s",
            self.run.run_id,
            step,
            failures,
            graph.max_failures,
            error,
        )
        return AdvanceResult(ADVANCE_OUTCOME[status], self.steps, error)

    def escalate(self, reason: str, event: RunEvent = RunEvent.ESCALATED) -> None:
        update = {"status": RunStatus.NEEDS_ATTENTION, "attention_reason": reason[:NOTE_MAX]}
        entry = {"reason": reason, "status": RunStatus.NEEDS_ATTENTION}
        self.end_turn(~Q(status__in=TERMINAL), update, (event, entry))

    def end_turn(
        self, status: Q, update: dict[str, Any], *entries: tuple[RunEvent, dict[str, Any]]
    ) -> bool:
        """The fenced compare-and-swap that takes the run out of this executor's hands (a
        failure to retry, an escalation): its status and the lease given up, with the journal
        entries that say why, in one transaction. False if the run had moved (then reloaded:
        StaleFence if another executor holds it); True with the run row read again."""
        with transaction.atomic(durable=True):
            mine = Run.objects.filter(
                status,
                statements.tenant_check(self.run.tenant_id),
                pk=self.run.run_id,
                fence=self.lease.fence,
            )
            changes = {"lease_owner": "", "lease_expires_at": None, "updated_at": Now()}
            done = mine.update(**update, **changes) == 1
            if done:
                self.write_confirmed()
                for event, payload in entries:
                    record(self.run, event, self.lease.actor, **payload)
        if not done:
            self.reload()
            self.confirmed_written(False)
            return False
        self.confirmed_written(True)
        self.refetch()
        return True


# An unchanged state whose inline form is longer than this is checkpointed as a reference.
_UNCHANGED_INLINE = 128
