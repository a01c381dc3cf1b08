"""Leases with fencing tokens: one executor per run at a time.

Taking a lease is a compare-and-swap on the run row using the database clock, bumping
`fence`. Every later executor write is conditional on that fence, so an executor that was
paused past its lease (GC, SIGSTOP, a slow disk) and taken over cannot write anything: a
lease alone never gives mutual exclusion, the fence does.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, transaction
from django.db.models import (
    Case,
    CharField,
    DateTimeField,
    ExpressionWrapper,
    F,
    Q,
    TextField,
    Value,
    When,
)
from django.db.models.expressions import CombinedExpression
from django.db.models.functions import Now
from django.utils.dateparse import parse_datetime

from audit import journal
from audit.journal import run_stream
from audit.models import JournalEntry, StreamHead
from fastsql import statements
from runtime.errors import (
    AlreadyCompleted,
    LeaseHeld,
    NotExternal,
    NotFound,
    RunFinished,
    StaleFence,
)
from runtime.events import RunEvent, record
from runtime.models import RUNNABLE, TERMINAL, Run, RunStatus

log = logging.getLogger("holdpoint.leases")


@dataclass(frozen=True)
class Lease:
    """A lease as its holder knows it. Every check of it names the run, its tenant, the
    fence and the owner — for a worker and for an external executor alike."""

    run_id: Any
    tenant_id: int
    owner: str
    fence: int
    ttl: float
    expires_at: datetime | None
    # Who acts under the lease, for the journal: a worker is its owner; an external
    # executor is the API account that calls (runtime.protocol).
    by: str = ""

    @property
    def actor(self) -> str:
        return f"{self.by or 'worker:' + self.owner}#{self.fence}"


def _held(lease: Lease) -> Any:
    """The run row while `lease` holds it: this run, this tenant, this fence, this owner — and
    an owner at all (a released lease is not revived by its old fence), the run unfinished."""
    return (
        Run.objects.filter(
            statements.tenant_check(lease.tenant_id),
            pk=lease.run_id,
            fence=lease.fence,
            lease_owner=lease.owner,
        )
        .exclude(lease_owner="")
        .exclude(status__in=TERMINAL)
    )


def db_now_plus(seconds: float) -> ExpressionWrapper[CombinedExpression]:
    """`now() + seconds` evaluated by the database: lease time is database time."""
    return ExpressionWrapper(
        Now() + Value(timedelta(seconds=seconds)), output_field=DateTimeField()
    )


def db_now() -> datetime:
    """The database's now as a value (one statement), for a cutoff that must be worked out
    in Python — a retention of days past what SQL's intervals hold — from the clock that
    writes the times it is compared with (updated_at=Now()), not this process's."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT STATEMENT_TIMESTAMP()")  # what Now() is here (Django)
            value = cursor.fetchone()[0]
        else:  # Now() on SQLite: the operating system's clock, to the millisecond, UTC
            cursor.execute("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")
            value = parse_datetime(cursor.fetchone()[0] + "+00:00")
    if not isinstance(value, datetime):
        raise RuntimeError(f"the database's clock read as {value!r}")
    return value


def lease_free() -> Q:
    return Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now())


# Why a run whose external executor vanished needs a person (runtime.sweeper sets it; a new
# lease by an external executor clears it).
EXECUTOR_LOST = "executor_lost"


def take_lease(
    run_id: Any,
    owner: str,
    ttl: float,
    *,
    runnable_only: bool = True,
    external: bool = False,
    by: str = "",
) -> Lease:
    """Take the run's lease if nobody holds a live one; fence += 1. Raises LeaseHeld & co.

    `runnable_only` (workers): only runs that are due — queued, running with a dead lease,
    retrying or a timer whose time has come. Otherwise any unfinished run; with `external`
    (the executor protocol, runtime.protocol.take) only a run created external — a hosted
    run is refused with NotExternal in the same compare-and-swap — and a run whose executor
    was declared lost is running again. `by`: who acts under the lease, for the journal.
    """
    if runnable_only:
        return take_due(run_id, owner, ttl)[0]
    with transaction.atomic(durable=True):
        # The one read by id alone: it is how an executor, knowing a bare run id, learns the
        # run's tenant. Every later statement names the tenant too (defence in depth).
        before = (
            Run.objects.filter(pk=run_id)
            .values("lease_owner", "status", "tenant_id", "attention_reason")
            .first()
        )
        if before is None:
            raise NotFound()
        tenant_id = before["tenant_id"]
        previous_owner = before["lease_owner"]
        if (before["status"], before["attention_reason"]) == (
            RunStatus.NEEDS_ATTENTION,
            EXECUTOR_LOST,
        ):
            previous_owner = _lost_owner(run_id, tenant_id)
        due = Run.objects.filter(pk=run_id, tenant_id=tenant_id).filter(lease_free())
        due = due.exclude(status__in=TERMINAL)
        if external:
            due = due.filter(external=True)
        changes: dict[str, Any] = {
            "lease_owner": owner,
            "lease_expires_at": db_now_plus(ttl),
            "fence": F("fence") + 1,
            "updated_at": Now(),
        }
        # An external executor that leases a queued or retrying run is now running it;
        # so is one whose lost executor is back (or replaced).
        lost = Q(status=RunStatus.NEEDS_ATTENTION, attention_reason=EXECUTOR_LOST)
        changes["status"] = Case(
            When(status__in=[RunStatus.QUEUED, RunStatus.RETRYING], then=Value(RunStatus.RUNNING)),
            When(lost, then=Value(RunStatus.RUNNING)),
            default=F("status"),
            output_field=CharField(),
        )
        changes["attention_reason"] = Case(
            When(lost, then=Value("")), default=F("attention_reason"), output_field=TextField()
        )
        if due.update(**changes) != 1:
            _refuse(run_id, tenant_id, external=external)
        run = Run.objects.only("tenant_id", "fence", "lease_expires_at", "status").get(
            pk=run_id, tenant_id=tenant_id
        )
        lease = Lease(run_id, run.tenant_id, owner, run.fence, ttl, run.lease_expires_at, by=by)
        assert run.lease_expires_at is not None  # set by the update above
        record(
            run,
            RunEvent.LEASE_TAKEN,
            lease.actor,
            owner=owner,
            fence=run.fence,
            expires_at=run.lease_expires_at.isoformat(),
            previous_owner=previous_owner,
            takeover=bool(previous_owner) and previous_owner != owner,
            status=run.status,
        )
        return lease


def _lost_owner(run_id: Any, tenant_id: int) -> str:
    """The owner whose lease the sweeper found expired and cleared (runtime.sweeper,
    `executor_lost`, journalled with it): the next lease takes the run from that executor —
    a takeover, unless it is the same one back ("" once the purge redacted the entry)."""
    payload = (
        JournalEntry.objects.filter(
            tenant_id=tenant_id, stream=run_stream(run_id), type=RunEvent.ESCALATED
        )
        .order_by("-seq")
        .values_list("payload", flat=True)
        .first()
    )
    if not isinstance(payload, dict) or payload.get("reason") != EXECUTOR_LOST:
        return ""
    return str(payload.get("lease_owner") or "")


# A worker's lease read: the whole run row (the executor runs on it: no second read), then
# the database clock's verdicts on it — lease free, wake time come — and, for the one-statement
# take, the clock itself and the lease's end by it.
_ROW = statements.attnames(Run)
_VERDICTS = (statements.Elapsed("lease_expires_at"), statements.Elapsed("wake_at", inclusive=True))


def _lease_view(run_id: Any) -> tuple[Run, bool, bool] | None:
    """The run as the database clock sees it, row-locked: (the run, lease free?, wake time
    come?). The one read by id alone — how a worker rung with a bare run id learns the run's
    tenant; every later statement names it."""
    rows = statements.select(Run, _ROW + _VERDICTS, {"run_id": run_id}, for_update=True)
    if not rows:
        return None
    *values, free, due = rows[0]
    return _run(values), bool(free), bool(due)


def _run(values: list[Any]) -> Run:
    run: Run = Run.from_db(DEFAULT_DB_ALIAS, list(_ROW), values)
    return run


def take_due(run_id: Any, owner: str, ttl: float) -> tuple[Lease, Run]:
    """A worker's `take_lease`, and the run as the lease left it — the executor's first read
    (runtime.executor), made by the lease's own statements.

    On PostgreSQL, outside a transaction, in two round trips (`_take_at_once`); else, or
    when that found the run or its stream moved meanwhile, in one short transaction: the run
    row read and locked with the database clock's verdict (lease free, wake time come), then
    the fence bumped by a compare-and-swap on the fence it read."""
    taken = _take_at_once(run_id, owner, ttl)
    if taken is not None:
        return taken
    with transaction.atomic(durable=True):
        view = _lease_view(run_id)
        if view is None:
            raise NotFound()
        run, free, due = view
        _refuse_unless_due(run, free, due)
        previous_owner = run.lease_owner
        taken_row = statements.update(
            Run,
            _lease_changes(owner, statements.DbNow(ttl), statements.Add(1), statements.NOW),
            {"run_id": run_id, "tenant_id": statements.Check(run.tenant_id), "fence": run.fence},
            returning=("fence", "lease_expires_at", "updated_at"),
        )
        if len(taken_row) != 1:  # cannot happen under the row lock
            _refuse(run_id, run.tenant_id)
        fence, expires_at, now = taken_row[0]
        lease = _hold(run, run_id, ttl, _lease_changes(owner, expires_at, fence, now))
        _record_taken(run, lease, previous_owner)
        return lease, run


def _refuse_unless_due(run: Run, free: bool, due: bool) -> None:
    """Refused (LeaseHeld & co.) unless the clock's verdicts say the run is the worker's to
    take: its lease free, its wake time come, its status runnable, and hosted."""
    if not (free and due and run.status in RUNNABLE and not run.external):
        _refuse(run.run_id, run.tenant_id)


def _lease_changes(owner: str, expires_at: Any, fence: Any, now: Any) -> dict[str, Any]:
    """What taking a worker's lease sets on the run row — as database expressions (the
    transaction) or as the values they came to (the one statement, the run in memory): one
    list of columns for both."""
    return {
        "lease_owner": owner,
        "lease_expires_at": expires_at,
        "fence": fence,
        "updated_at": now,
        "status": RunStatus.RUNNING,
        "wake_at": None,
    }


def _hold(run: Run, run_id: Any, ttl: float, held: dict[str, Any]) -> Lease:
    """The run as the lease left it (`held`: `_lease_changes`' values, as written), and
    the lease."""
    for name, value in held.items():
        setattr(run, name, value)
    return Lease(run_id, run.tenant_id, run.lease_owner, run.fence, ttl, run.lease_expires_at)


def _record_taken(run: Run, lease: Lease, previous_owner: str) -> None:
    assert lease.expires_at is not None  # a worker's lease always ends
    record(
        run,
        RunEvent.LEASE_TAKEN,
        lease.actor,
        owner=lease.owner,
        fence=lease.fence,
        expires_at=lease.expires_at.isoformat(),
        previous_owner=previous_owner,
        takeover=bool(previous_owner) and previous_owner != lease.owner,
        status=RunStatus.RUNNING,
    )


def _take_at_once(run_id: Any, owner: str, ttl: float) -> tuple[Lease, Run] | None:
    """PostgreSQL, outside a transaction: the worker's lease in two round trips where the
    transaction takes six (BEGIN, the locked read, the swap, the head's read, the journal's
    write, COMMIT) — a fixed cost of every run a worker advances.

    1. One read, unlocked: the run row, the clock's verdicts, the clock itself (the lease ends
       at its reading + ttl, so the journal entry can say when before it is written) and the
       run stream's head. A lease refused is refused here, as the transaction would.
    2. One autocommit statement (fastsql.statements.OneStatement): the compare-and-swap on
       everything the verdicts were drawn from — fence, status, lease end, wake time, all as
       read — so a lease taken, renewed or released, a wake time moved or a status changed
       in between writes nothing; and with it the lease's journal entry, chained onto the
       head read (audit.journal.parts_after).

    None when this path does not apply or wrote nothing (the run or its stream moved in
    between): the caller takes the transaction, which then decides under the row lock."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return None
    stream = run_stream(run_id)
    # The run's own stream, and only if it is the run's tenant's: as the swap will check.
    where = {"stream": stream, "tenant_id": statements.Outer(Run, "tenant_id")}
    head = (
        statements.scalar(StreamHead, "seq", where),
        statements.scalar(StreamHead, "hash", where),
    )
    names = _ROW + _VERDICTS + (statements.NOW, statements.DbNow(ttl))
    rows = statements.select(Run, names, {"run_id": run_id}, reads=head)
    if not rows:
        raise NotFound()
    *values, free, due, now, expires_at, seq, head_hash = rows[0]
    run = _run(values)
    _refuse_unless_due(run, free, due)
    if seq is None:  # no head row (a run's is made with it): the transaction makes one
        return None
    previous_owner = run.lease_owner
    read = {
        "run_id": run_id,
        "tenant_id": statements.Check(run.tenant_id),
        "fence": run.fence,
        "status": run.status,
        "lease_expires_at": run.lease_expires_at,
        "wake_at": run.wake_at,
        "external": False,
    }
    held = _lease_changes(owner, expires_at, run.fence + 1, now)
    lease = _hold(run, run_id, ttl, held)  # after `read`: that is the run as it was read
    one = statements.OneStatement()
    lead = [one.update("changed", Run, held, read)]
    with journal.batched(stream, deferred=True) as pending:
        _record_taken(run, lease, previous_owner)
    known = journal.Head(int(seq), head_hash)
    parts = journal.parts_after(stream, run.tenant_id, pending, known, lead, one)
    if journal.append_after(stream, pending, known, parts, one) != "written":
        return None  # moved meanwhile: nothing was written
    return lease, run


def _refuse(run_id: Any, tenant_id: int, *, external: bool = False) -> None:
    run = Run.objects.only("status", "external").get(pk=run_id, tenant_id=tenant_id)
    if external and not run.external:
        raise NotExternal("the run is executed by Holdpoint's workers; lease an external run")
    if run.status == RunStatus.COMPLETED:
        raise AlreadyCompleted()
    if run.status in TERMINAL:
        raise RunFinished(f"the run is {run.status}")
    raise LeaseHeld(f"the run is {run.status} and not available to this executor")


def heartbeat(lease: Lease) -> datetime:
    """Extend the lease from now; StaleFence if another executor took the run."""
    if _held(lease).update(lease_expires_at=db_now_plus(lease.ttl)) != 1:
        refuse_stale(lease, "heartbeat")
    expires_at = Run.objects.values_list("lease_expires_at", flat=True).get(
        pk=lease.run_id, tenant_id=lease.tenant_id
    )
    assert expires_at is not None  # set by the update above
    return expires_at


def release(lease: Lease, *, requeue: bool = False, if_held: bool = False) -> None:
    """Give the lease up (graceful stop), journalled. A running run goes back to queued for
    the next one (`requeue`: and its doorbell rings); a waiting one keeps waiting.

    The fence moves on with it: every executor write is conditional on the fence alone, so
    a holder that gave its lease up — an external agent's stray checkpoint, prepare or
    dispatch after its release — is refused as stale, not written on a run nobody holds.
    `if_held`: a lease already gone (the run cancelled, or taken over) is no refusal — a
    worker that stops because its run moved gives up the lease it may still hold."""
    with transaction.atomic(durable=True):
        mine = _held(lease)
        changes: dict[str, Any] = {
            "lease_owner": "",
            "lease_expires_at": None,
            "fence": F("fence") + 1,
        }
        entry: dict[str, Any] = {"fence": lease.fence}
        released = mine.filter(status=RunStatus.RUNNING).update(status=RunStatus.QUEUED, **changes)
        if released:
            entry["status"] = RunStatus.QUEUED
        else:
            released = mine.update(**changes)
        if released:
            run = Run(run_id=lease.run_id, tenant_id=lease.tenant_id)
            record(run, RunEvent.LEASE_RELEASED, lease.actor, **entry)
            if requeue and entry.get("status") == RunStatus.QUEUED:
                from runtime.queue import ring

                ring(lease.run_id)
    if not released and not if_held and not _released_before(lease):
        refuse_stale(lease, "release")


def _released_before(lease: Lease) -> bool:
    """Whether this fence's release already happened and nothing came after it: the run's
    fence is the next one (a release moves it on by one; a lease by another executor would
    have moved it again), nobody holds it, and the journal has this fence's release. A
    client repeating a release whose answer it lost then hears what the first heard."""
    after = Run.objects.filter(
        pk=lease.run_id, tenant_id=lease.tenant_id, fence=lease.fence + 1, lease_owner=""
    )
    return (
        after.exists()
        and JournalEntry.objects.filter(
            tenant_id=lease.tenant_id,
            stream=run_stream(lease.run_id),
            type=RunEvent.LEASE_RELEASED,
            payload__fence=lease.fence,
        ).exists()
    )


def refuse_stale(lease: Lease, what: str) -> None:
    """Journal the refused write (outside the failed transaction), then raise StaleFence."""
    run = Run.objects.filter(pk=lease.run_id, tenant_id=lease.tenant_id).first()
    if run is not None:
        with transaction.atomic():
            record(
                run,
                RunEvent.STALE_WRITE_REFUSED,
                lease.actor,
                attempted=what,
                stale_fence=lease.fence,
                current_fence=run.fence,
            )
    raise StaleFence(f"fence {lease.fence} is stale ({what} refused)")


class Heartbeater:
    """Keeps a lease alive from a side thread while a step runs longer than TTL/3.

    Step commits extend the lease too; this covers the long step (a slow model call) that
    would otherwise lose its run to another worker mid-step. The thread has its own database
    connection. If a heartbeat is refused the lease is lost: `lost` is set and the executor
    stops at its next check (its writes would be refused by the fence anyway).
    """

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="holdpoint-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeater:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        try:
            while not self._stop.wait(self.lease.ttl / 3):
                try:
                    heartbeat(self.lease)
                except StaleFence:
                    self.lost.set()
                    return
                except Exception:  # a passing database error: the next beat may succeed
                    log.exception("heartbeat for run %s failed", self.lease.run_id)
        finally:
            connection.close()
