"""The sweeper: re-drive runs from database truth, boundedly.

The queue can lose messages (Redis has no receipts; a worker may die holding one), so
nothing relies on it: each tick finds runs that are due — an expired lease on a runnable
run, a retry or timer whose time came — and rings their doorbell. A tick is bounded overall
and per tenant, and rings in random order, so recovering ten thousand runs after an outage
neither stampedes the database and the tools nor lets one tenant starve the others.
Ringing twice is harmless: the second delivery finds the lease held. It is not free,
though: in a storm (thousands of runs due at once) every tick would ring the same runs again
while they wait in the queue, and workers would spend their time on doorbells that find the
lease held. So while the queue is backed up (at least a tick's batch of messages waiting), a
run this process rang is not rung again for HOLDPOINT_SWEEP_REDRIVE seconds unless something
happened to it since (its fence, checkpoint or status moved: a worker took it). A crashed
worker's run is still rung as soon as its lease ends; and with a short queue every tick rings
every due run as before, because then a doorbell may have been swallowed (a hung cluster's
pusher holds messages its frozen workers never run) and ringing again is what rescues it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import DurationField, ExpressionWrapper, F, Q
from django.db.models.functions import Now

from runtime import compensation, gates
from runtime.agents import mcp_session
from runtime.events import RunEvent, record
from runtime.leases import EXECUTOR_LOST, db_now_plus, lease_free
from runtime.models import RUNNABLE, Run, RunStatus, SweeperTurn
from runtime.queue import _enqueue


@dataclass(frozen=True)
class SweepResult:
    rung: int
    due: int
    # Seconds until the next run becomes due (a held lease ends, a timer comes), when that
    # is sooner than the look-ahead the sweep was asked for; else None.
    next_due: float | None = None


# A loop that wakes for a lease's end sleeps this much past it: `lease_free` is strict.
SETTLE = 0.05
# A sweeper loop's tick comes every interval × U(JITTER); a sweep looks ahead to the latest.
JITTER = (0.75, 1.25)


def look_ahead(interval: float) -> float:
    """How far a loop's sweep looks for a run becoming due: up to its next tick at the
    latest."""
    return interval * JITTER[1]


# run_id -> (when this process rang it, the run's (fence, checkpoint_rev, status) then)
_rung: dict[str, tuple[float, tuple[Any, ...]]] = {}
clock = time.monotonic  # module attributes so tests can move them
log = logging.getLogger("holdpoint.sweeper")


def queue_backlog() -> int:
    """Messages waiting in the broker (not those a cluster already holds)."""
    from django_q.brokers import get_broker

    try:
        return int(get_broker().queue_size() or 0)
    except Exception:  # noqa: BLE001 - any broker failure: act as if the queue were short
        return 0


backlog = queue_backlog


def due_runs(limit: int, skip: set[str] | frozenset[str] = frozenset()) -> list[tuple[Any, ...]]:
    """(run_id, tenant_id, fence, checkpoint_rev, status) of runs a worker should pick up now
    (uses the sweep indexes), leaving out `skip`."""
    runnable = Run.objects.filter(status__in=RUNNABLE, external=False).filter(lease_free())
    due = runnable.filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
    if skip:
        due = due.exclude(run_id__in=list(skip))
    fields = ("run_id", "tenant_id", "fence", "checkpoint_rev", "status")
    return list(due.order_by("updated_at").values_list(*fields)[:limit])


def next_due_in(horizon: float) -> float | None:
    """Seconds (database clock) until the soonest run a sweep would ring becomes due — a
    held lease of a runnable run ends, or its timer comes — if within `horizon`, else None.
    Each is one probe of a sweep index. A healthy lease is extended every ttl/3, so it is
    never this close to its end unless its holder stopped: in a quiet fleet both probes
    come back empty."""
    soon = db_now_plus(horizon)
    runnable = Run.objects.filter(status__in=RUNNABLE, external=False)
    found: list[timedelta] = []
    for field in ("lease_expires_at", "wake_at"):
        left = ExpressionWrapper(F(field) - Now(), output_field=DurationField())
        upcoming = runnable.filter(**{f"{field}__gt": Now(), f"{field}__lte": soon})
        if field == "wake_at":
            upcoming = upcoming.filter(lease_free())
        found += upcoming.order_by(field).annotate(left=left).values_list("left", flat=True)[:1]
    return min((max(d.total_seconds(), 0.0) for d in found), default=None)


def pause(interval: float, result: SweepResult | None = None) -> float:
    """How long a sweeper loop waits before its next tick: the jittered interval, or less
    when a run becomes due before then. A crashed worker's run is then rung right as its
    lease ends, not up to an interval later (issue 22: kill → next step, as deployed)."""
    wait = interval * random.uniform(*JITTER)
    if result is not None and result.next_due is not None:
        wait = min(wait, result.next_due + SETTLE)
    return wait


def _still_waiting(now: float, backed_up: bool) -> set[str]:
    """Runs rung within the redrive window that nobody has touched since (still queued);
    none unless the queue is backed up."""
    window = settings.HOLDPOINT_SWEEP_REDRIVE
    for run_id in [r for r, (at, _) in _rung.items() if now - at >= window]:
        del _rung[run_id]
    if not _rung or not backed_up:
        return set()
    now_seen = {
        str(run_id): (fence, rev, status)
        for run_id, fence, rev, status in Run.objects.filter(run_id__in=list(_rung)).values_list(
            "run_id", "fence", "checkpoint_rev", "status"
        )
    }
    for run_id in [r for r, (_, seen) in _rung.items() if now_seen.get(r) != seen]:
        del _rung[run_id]  # taken, advanced, finished or gone: judge it afresh
    return set(_rung)


def sweep_once(
    *,
    batch: int | None = None,
    per_tenant: int | None = None,
    ring: Any = _enqueue,
    look_ahead: float = 0.0,
) -> SweepResult:
    """One tick: ring the due runs (bounded overall and per tenant), run the hold points'
    timers, flag lost external executors, ring the compensations due another send (their
    last could not reach the tool: `compensation.ring_due_resends`) or a reconciliation
    (their outcome not known: `compensation.ring_due_reconciles`), close idle MCP
    sessions; with `look_ahead`, also say when the next run becomes due within that many
    seconds (`next_due_in`), for a loop to wake then."""
    batch = batch or settings.HOLDPOINT_SWEEP_BATCH
    per_tenant = per_tenant or settings.HOLDPOINT_SWEEP_PER_TENANT
    now = clock()
    found = due_runs(batch * 4, skip=_still_waiting(now, backlog() >= batch))
    by_tenant: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for row in found:
        if len(by_tenant[row[1]]) < per_tenant:
            by_tenant[row[1]].append(row)
    chosen = [row for rows in by_tenant.values() for row in rows]
    random.shuffle(chosen)
    chosen = chosen[:batch]
    for run_id, _tenant, fence, rev, status in chosen:
        ring(str(run_id))
        _rung[str(run_id)] = (now, (fence, rev, status))
    gates.sweep()  # hold points: expiry, reminders, escalation
    flag_lost_executors(batch)
    compensation.ring_due_resends(batch)  # compensations whose send could not reach its tool
    compensation.ring_due_reconciles(batch)  # compensations whose outcome is not known
    mcp_session.close_idle(batch)  # MCP sessions their host left without closing
    next_due = next_due_in(look_ahead) if look_ahead > 0 else None
    return SweepResult(rung=len(chosen), due=len(found), next_due=next_due)


# An external run in these statuses is being executed: its lease says someone is at it.
EXECUTING = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.RETRYING)


def flag_lost_executors(limit: int) -> int:
    """External runs whose executor's lease expired and was not renewed within
    HOLDPOINT_EXECUTOR_GRACE: no worker will ever pick them up, so a person must know —
    `needs_attention`, attention_reason `executor_lost`, the dead lease cleared and its fence
    revoked (fence + 1: every executor write is conditional on the fence alone, so only this
    refuses the holder's writes from now on), journalled. A new lease takes the run back
    (runtime.leases.take_lease). Each is a compare-and-swap on the fence it read, so an
    executor that renewed meanwhile, or a successor's lease, is never flagged."""
    grace = db_now_plus(-settings.HOLDPOINT_EXECUTOR_GRACE)
    lost = Run.objects.filter(
        external=True, status__in=EXECUTING, lease_expires_at__lt=grace
    ).values_list("run_id", "tenant_id", "fence", "lease_owner")[:limit]
    flagged = 0
    for run_id, tenant_id, fence, owner in list(lost):
        with transaction.atomic(durable=True):
            moved = Run.objects.filter(
                pk=run_id,
                tenant_id=tenant_id,
                fence=fence,
                status__in=EXECUTING,
                lease_expires_at__lt=grace,
            ).update(
                status=RunStatus.NEEDS_ATTENTION,
                attention_reason=EXECUTOR_LOST,
                fence=F("fence") + 1,
                lease_owner="",
                lease_expires_at=None,
                updated_at=Now(),
            )
            if moved:
                record(
                    Run(run_id=run_id, tenant_id=tenant_id),
                    RunEvent.ESCALATED,
                    "sweeper",
                    reason=EXECUTOR_LOST,
                    lease_owner=owner,
                    fence=fence,
                    status=RunStatus.NEEDS_ATTENTION,
                )
                flagged += 1
    return flagged


TURN = "sweeper"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def take_turn(interval: float, holder: str = "") -> bool:
    """True if this tick is the fleet's sweep: it moved the turn's `next_at` from the past
    to about `interval` from now (database clock: hosts' clocks may disagree). 0.8 of the
    interval, so that the next jittered tick (at least 0.75 of it later) of any process
    finds the turn free: the fleet sweeps about once per interval."""
    later = db_now_plus(interval * 0.8)
    for _ in range(2):
        moved = SweeperTurn.objects.filter(name=TURN, next_at__lte=Now()).update(
            next_at=later, holder=holder[:200]
        )
        if moved:
            return True
        _, created = SweeperTurn.objects.get_or_create(name=TURN, defaults={"next_at": _EPOCH})
        if not created:
            return False
    return False


def sweep_turn(interval: float, holder: str = "") -> SweepResult | None:
    """A sweep if it is this process's turn, else None. When a run becomes due before the
    turn would come round again, the turn comes round then instead (`next_at` moved back),
    so whichever process ticks first after that moment sweeps — the sweeper itself wakes
    for it (`pause`)."""
    if not take_turn(interval, holder):
        return None
    result = sweep_once(look_ahead=look_ahead(interval))
    if result.next_due is not None:
        at = db_now_plus(result.next_due)
        SweeperTurn.objects.filter(name=TURN, next_at__gt=at).update(next_at=at)
    prune_task_history(settings.HOLDPOINT_QUEUE_HISTORY)
    return result


def prune_task_history(keep: int) -> int:
    """Forget successful queue tasks beyond the newest `keep` (django-q2's own pruning is
    turned off: settings.Q_CLUSTER says why). Returns how many were deleted."""
    from django_q.models import Success

    newest = Success.objects.order_by("-stopped").values_list("stopped", flat=True)
    cutoff = list(newest[keep : keep + 1])
    if not cutoff:
        return 0
    deleted: int  # django-q2 has no type information
    deleted, _ = Success.objects.filter(stopped__lte=cutoff[0]).delete()
    return deleted


class SweeperThread(threading.Thread):
    """The sweeper loop inside a worker process: tick every interval (jittered), sweep when
    it is this process's turn (`take_turn`). Started for each django-q2 worker process
    (`start_in_worker`), so recovery does not wait for the scheduler; the scheduled task
    takes turns the same way and is only the fallback."""

    def __init__(self, interval: float, holder: str) -> None:
        super().__init__(name="holdpoint-sweeper", daemon=True)
        self.interval = interval
        self.holder = holder
        self.stop = threading.Event()

    def run(self) -> None:
        from django.db import close_old_connections, connection

        result: SweepResult | None = None
        try:
            while not self.stop.wait(pause(self.interval, result)):
                try:
                    close_old_connections()
                    result = sweep_turn(self.interval, self.holder)
                except Exception:  # noqa: BLE001 - the loop must outlive a bad tick
                    result = None
                    log.exception("sweeper tick failed; trying again next tick")
                    connection.close()
        finally:
            connection.close()


_thread: SweeperThread | None = None


def start_in_worker(**_: Any) -> None:
    """django-q2's post_spawn (sent in each new worker process): start its sweeper loop."""
    global _thread
    if not settings.HOLDPOINT_SWEEP_THREAD or (_thread is not None and _thread.is_alive()):
        return
    from runtime.executor import worker_id

    _thread = SweeperThread(settings.HOLDPOINT_SWEEP_INTERVAL, f"sweeper:{worker_id()}")
    _thread.start()


def sweep_for(seconds: float, interval: float, *, turns: bool = False) -> int:
    """Tick every `interval` (with jitter) for about `seconds`; returns how many were rung.

    django-q2 schedules have minute granularity; a crashed worker's run must be picked up
    within seconds of its lease expiring, so the scheduled task keeps ticking for most of
    the minute instead of ticking once. The window stays well under the minute because a
    cluster's graceful stop waits for running tasks: a long window would delay redeploys.
    With `turns`, a tick sweeps only on the fleet's turn (`take_turn`): the worker
    processes' own sweeper loops then do not sweep a second time beside it.
    """
    deadline = time.monotonic() + seconds

    def tick() -> SweepResult | None:
        if turns:
            return sweep_turn(interval, "sweeper:scheduled")
        return sweep_once(look_ahead=look_ahead(interval))

    result = tick()
    rung = result.rung if result else 0
    while time.monotonic() + interval < deadline:
        time.sleep(pause(interval, result))
        result = tick()
        rung += result.rung if result else 0
    return rung
