"""The sweeper: re-drive runs from database truth, boundedly.

The queue can lose messages (Redis has no receipts; a worker may die holding one), so
nothing relies on it: each tick finds runs that are due — an expired lease on a runnable
run, a retry or timer whose time came — and rings their doorbell. A tick is bounded overall
and per tenant, and rings in random order, so recovering ten thousand runs after an outage
neither stampedes the database and the tools nor lets one tenant starve the others.
Ringing twice is harmless: the second delivery finds the lease held.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.db.models.functions import Now

from runtime import gates
from runtime.leases import lease_free
from runtime.models import RUNNABLE, Run
from runtime.queue import _enqueue


@dataclass(frozen=True)
class SweepResult:
    rung: int
    due: int


def due_runs(limit: int) -> list[tuple[Any, int]]:
    """(run_id, tenant_id) of runs a worker should pick up now (uses the sweep indexes)."""
    runnable = Run.objects.filter(status__in=RUNNABLE, external=False).filter(lease_free())
    due = runnable.filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
    return list(due.order_by("updated_at").values_list("run_id", "tenant_id")[:limit])


def sweep_once(
    *, batch: int | None = None, per_tenant: int | None = None, ring: Any = _enqueue
) -> SweepResult:
    batch = batch or settings.HOLDPOINT_SWEEP_BATCH
    per_tenant = per_tenant or settings.HOLDPOINT_SWEEP_PER_TENANT
    found = due_runs(batch * 4)
    by_tenant: dict[int, list[Any]] = defaultdict(list)
    for run_id, tenant_id in found:
        if len(by_tenant[tenant_id]) < per_tenant:
            by_tenant[tenant_id].append(run_id)
    chosen = [run_id for ids in by_tenant.values() for run_id in ids]
    random.shuffle(chosen)
    chosen = chosen[:batch]
    for run_id in chosen:
        ring(str(run_id))
    gates.sweep()  # hold points: expiry, reminders, escalation
    return SweepResult(rung=len(chosen), due=len(found))


def sweep_for(seconds: float, interval: float) -> int:
    """Tick every `interval` (with jitter) for about `seconds`; returns how many were rung.

    django-q2 schedules have minute granularity; a crashed worker's run must be picked up
    within seconds of its lease expiring, so the scheduled task keeps ticking for most of
    the minute instead of ticking once. The window stays well under the minute because a
    cluster's graceful stop waits for running tasks: a long window would delay redeploys.
    """
    deadline = time.monotonic() + seconds
    rung = sweep_once().rung
    while time.monotonic() + interval < deadline:
        time.sleep(interval * random.uniform(0.75, 1.25))
        rung += sweep_once().rung
    return rung
