"""Recovery after a worker is killed, and a storm of 2,000 runs left by a crashed fleet.

Workers are real `manage.py qcluster` processes (through bench/djrun.py, so the debug cursor
is off), started in their own session and killed with SIGKILL to the whole group — what a
machine crash does; the lease TTL is `LEASE_TTL` seconds (HOLDPOINT_LEASE_TTL).

**Kill → next committed step.** A `bench-slow` run (steps of 50 ms, until cancelled) is
advanced by a cluster. Once the current worker has committed 10 steps, the bench SIGKILLs
its cluster, starts a new one at once and waits for the run's first checkpoint written
under a newer fence. Recovery = that checkpoint's `created_at` − the moment of the kill;
also split into kill → lease expiry (the dead worker's last commit or heartbeat + TTL),
expiry → takeover (`lease_taken` of the new fence: sweeper tick, doorbell, broker poll)
and takeover → commit (load + one step). The new cluster becomes the next sample's victim.
The sweeper runs in the bench process at its configured pace: `sweep_once()` every
HOLDPOINT_SWEEP_INTERVAL seconds ×U(0.75, 1.25), or sooner when a lease ends before then
(`runtime.sweeper.pause`), exactly the loop of `sweep_for`, which the scheduled task runs;
the django-q2 schedules in the bench database are pushed a day ahead so nothing else sweeps.

The clusters of these samples run without their worker processes' own sweeper loops
(HOLDPOINT_SWEEP_THREAD=0), so the bench's loop is the only sweeper.

**As deployed** (one sample, `as_deployed=True`): the same kill, but nobody sweeps except
the new cluster itself: each of its worker processes runs a sweeper loop (every
HOLDPOINT_SWEEP_INTERVAL, taking turns with the others through `SweeperTurn`), and its
django-q2 scheduler has the sweeper schedule due (django-q2 calls its scheduler 30 s after
a cluster starts and every 30 s after that: before the loops, that was the recovery time).

**Storm.** 2,000 runs across 20 tenants are inserted in bulk as a crashed fleet leaves them:
`running`, leased by one of 8 dead workers with the lease expired 30–90 s ago, fence 1,
with their `run_created` and `lease_taken` journal entries (hash-chained like `append()`
does) and stream heads. Each is a `bench-noop` run with one step left. One cluster is
started (warmed by one ordinary run), then the sweeper ticks at its configured pace until
every storm run is completed. Drain time is from the first tick; the configured rate is
HOLDPOINT_SWEEP_BATCH runs per HOLDPOINT_SWEEP_INTERVAL (at most
HOLDPOINT_SWEEP_PER_TENANT per tenant per tick). Errors: failed django-q2 tasks,
"Traceback"/"ERROR" lines in the cluster's log, storm runs not completed.
"""

from __future__ import annotations

import math
import random
import re
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import ROOT, bench_env, kill_group, log, start_process, summary, wait_for

LEASE_TTL = 5
STEP_SLEEP = 0.05
STEPS_BEFORE_KILL = 10
STORM_RUNS = 2000
STORM_TENANTS = 20


class Sweeper:
    """sweep_once() at the configured pace, as `runtime.sweeper.sweep_for` does."""

    def __init__(self) -> None:
        from django.conf import settings

        self.interval = float(settings.HOLDPOINT_SWEEP_INTERVAL)
        self.next_at = 0.0
        self.ticks = 0
        self.rung = 0
        self.first_tick: float | None = None

    def tick_if_due(self) -> None:
        from runtime.sweeper import look_ahead, pause, sweep_once

        now = time.monotonic()
        if now < self.next_at:
            return
        if self.first_tick is None:
            self.first_tick = time.time()
        result = sweep_once(look_ahead=look_ahead(self.interval))
        self.rung += result.rung
        self.ticks += 1
        self.next_at = now + pause(self.interval, result)


class RecoveryBench:
    def __init__(self, bench: Any, database_url: str, var_dir: str) -> None:
        self.bench = bench
        self.database_url = database_url
        self.var_dir = Path(var_dir)
        self.clusters = 0
        self.logs: list[Path] = []

    # --- clusters ------------------------------------------------------------------------
    def start_cluster(self, as_deployed: bool = False) -> Any:
        """A cluster; unless `as_deployed`, without its worker processes' own sweeper loops
        (HOLDPOINT_SWEEP_THREAD=0): the bench process is then the only sweeper, at the
        configured pace, and counts its ticks and doorbells."""
        self.clusters += 1
        path = self.var_dir / f"qcluster-{self.clusters}.log"
        self.logs.append(path)
        env = bench_env(
            self.database_url,
            str(self.var_dir),
            HOLDPOINT_LEASE_TTL=str(LEASE_TTL),
            HOLDPOINT_SWEEP_THREAD="1" if as_deployed else "0",
            LOG_LEVEL="WARNING",
        )
        return start_process(
            [sys.executable, str(ROOT / "bench" / "djrun.py"), "qcluster"], env, path
        )

    def quiet_schedules(self, due_sweeper: bool = False) -> None:
        """Push django-q2's schedules a day ahead (the bench sweeps), or make the sweeper's
        schedule due now (as deployed)."""
        from django.utils import timezone
        from django_q.models import OrmQ, Schedule

        OrmQ.objects.all().delete()  # doorbells of earlier parts' runs, long since done
        Schedule.objects.update(next_run=timezone.now() + timedelta(days=1))
        if due_sweeper:
            Schedule.objects.filter(func="runtime.tasks.sweep").update(
                next_run=timezone.now() - timedelta(seconds=1)
            )

    def log_errors(self, paths: list[Path]) -> tuple[list[str], list[str]]:
        """(error lines of these clusters' logs, the first few tracebacks in full)."""
        found, tracebacks = [], []
        for path in paths:
            if not path.exists():
                continue
            lines = path.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if re.search(r"Traceback|\bERROR\b|\bCRITICAL\b", line):
                    found.append(f"{path.name}: {line[:300]}")
                if line.startswith("Traceback") and len(tracebacks) < 3:
                    block = [line]
                    for more in lines[i + 1 : i + 80]:
                        block.append(more)
                        if more and not more.startswith((" ", "Traceback", "During", "The ")):
                            break
                    tracebacks.append("\n".join(block))
        return found, tracebacks

    def wait(self, check: Any, timeout: float, what: str) -> Any:
        """bench.common.wait_for, and on a timeout the clusters' first traceback in the error
        (the engine under test may have raised in the worker)."""
        try:
            return wait_for(check, timeout, what=what)
        except TimeoutError as exc:
            _lines, tracebacks = self.log_errors(self.logs)
            if tracebacks:
                raise TimeoutError(f"{exc}; worker log: {tracebacks[0][-1200:]}") from None
            raise

    # --- kill → next committed step --------------------------------------------------------
    def kill_samples(self, samples: int, as_deployed: bool) -> dict[str, Any]:
        from audit.models import JournalEntry
        from runtime.lifecycle import cancel_run, create_run
        from runtime.models import Checkpoint, Run

        self.quiet_schedules()
        sweeper = Sweeper()
        run = None
        first_log = len(self.logs)
        cluster = self.start_cluster()
        rows: list[dict[str, Any]] = []
        deployed: dict[str, Any] | None = None
        try:
            run = create_run(
                self.bench.tenant,
                "bench-slow",
                {"steps": 1_000_000, "sleep": STEP_SLEEP},
                actor="bench",
            )
            run_id = run.run_id

            def fence_steps(fence: int) -> int:
                return Checkpoint.objects.filter(run_id=run_id, fence=fence).count()

            for sample in range(1, samples + 1 + (1 if as_deployed else 0)):
                last = sample == samples + 1

                def going() -> int | None:
                    """The current fence, once its worker committed STEPS_BEFORE_KILL steps."""
                    sweeper.tick_if_due()
                    f = Run.objects.values_list("fence", flat=True).get(pk=run_id)
                    return f if f and fence_steps(f) >= STEPS_BEFORE_KILL else None

                fence = self.wait(going, 90, f"run {run_id} did not progress under a worker")
                time.sleep(random.uniform(0, STEP_SLEEP * 2))  # anywhere in a step
                killed_at = time.time()
                kill_group(cluster)
                if last:  # as deployed: the cluster's own sweeping, nobody else's
                    self.quiet_schedules(due_sweeper=True)
                cluster = self.start_cluster(as_deployed=last)
                state = Run.objects.values("lease_expires_at", "fence").get(pk=run_id)
                assert state["fence"] == fence, "the run moved on after the kill"
                last_commit = (
                    Checkpoint.objects.filter(run_id=run_id, fence=fence)
                    .order_by("-rev")
                    .values_list("created_at", flat=True)
                    .first()
                )

                def recovered(last: bool = last, fence: int = fence) -> Any:
                    if not last:
                        sweeper.tick_if_due()
                    return (
                        Checkpoint.objects.filter(run_id=run_id, fence__gt=fence)
                        .order_by("rev")
                        .values("created_at", "fence", "rev")
                        .first()
                    )

                first = self.wait(recovered, 150 if last else 60, f"run {run_id} not recovered")
                taken = (
                    JournalEntry.objects.filter(
                        stream=f"run:{run_id}", type="lease_taken", payload__fence=first["fence"]
                    )
                    .values_list("created_at", flat=True)
                    .first()
                )
                expires = state["lease_expires_at"].timestamp()
                row = {
                    "sample": sample,
                    "recovery_seconds": first["created_at"].timestamp() - killed_at,
                    "kill_to_lease_expiry": expires - killed_at,
                    "expiry_to_takeover": (taken.timestamp() - expires) if taken else None,
                    "takeover_to_commit": (first["created_at"].timestamp() - taken.timestamp())
                    if taken
                    else None,
                    "last_commit_before_kill": killed_at - last_commit.timestamp()
                    if last_commit
                    else None,
                    "old_fence": fence,
                    "new_fence": first["fence"],
                }
                log(
                    f"[{self.bench.backend}] recovery {'as deployed' if last else sample}: "
                    f"{row['recovery_seconds']:.2f}s (lease expiry "
                    f"+{row['kill_to_lease_expiry']:.2f}s, "
                    f"takeover +{row['expiry_to_takeover'] or 0:.2f}s, "
                    f"commit +{row['takeover_to_commit'] or 0:.2f}s)"
                )
                if last:
                    deployed = row
                else:
                    rows.append(row)
        finally:
            if run is not None:
                try:
                    cancel_run(Run.objects.get(pk=run.run_id), "benchmark over", actor="bench")
                except Exception as exc:  # the run may have ended otherwise
                    log(f"cancel: {exc}")
            kill_group(cluster)
        from django.conf import settings

        values = [r["recovery_seconds"] for r in rows]
        out: dict[str, Any] = {
            "lease_ttl_seconds": LEASE_TTL,
            "sweep_interval_seconds": settings.HOLDPOINT_SWEEP_INTERVAL,
            "step_seconds": STEP_SLEEP,
            "samples": rows,
            "recovery_seconds": summary(values),
            "target_seconds": LEASE_TTL + 2,
            "met": max(values) <= LEASE_TTL + 2,
            "sweeper_ticks": sweeper.ticks,
        }
        lines, tracebacks = self.log_errors(self.logs[first_log:])
        out["log_errors"], out["tracebacks"] = lines[:20], tracebacks
        if deployed is not None:
            deployed["sweep_window_seconds"] = settings.HOLDPOINT_SWEEP_WINDOW
            out["as_deployed"] = deployed
        return out

    # --- the storm ---------------------------------------------------------------------------
    def insert_crashed_fleet(self, runs: int) -> list[Any]:
        """Runs as a crashed fleet leaves them, in bulk, with their journal and heads."""
        from django.db import transaction
        from django.utils import timezone

        from audit.chain import GENESIS, entry_hash
        from audit.models import JournalEntry, StreamHead
        from runtime.graphs import registry
        from runtime.models import Run, RunStatus, Tenant

        graph = registry.latest("bench-noop")
        tag = uuid.uuid4().hex[:6]
        tenants = [
            Tenant.objects.create(slug=f"storm-{tag}-{k:02d}", name=f"Storm {k}")
            for k in range(STORM_TENANTS)
        ]
        now = timezone.now()
        run_rows, entries, heads = [], [], []
        for k in range(runs):
            tenant = tenants[k % len(tenants)]
            owner = f"crashed-host:{1000 + k % 8}"
            run_id = uuid.uuid4()
            created = now - timedelta(seconds=120 + k % 60)
            run_rows.append(
                Run(
                    run_id=run_id,
                    tenant=tenant,
                    thread_id=str(uuid.uuid4()),
                    graph=graph.name,
                    graph_version=graph.version,
                    state_version=graph.state_version,
                    goal={"steps": 1},
                    status=RunStatus.RUNNING,
                    next_step=graph.start,
                    lease_owner=owner,
                    lease_expires_at=now - timedelta(seconds=30 + k % 60),
                    fence=1,
                    metadata={"tools": list(graph.tools)},
                    created_by="agent:storm",
                )
            )
            stream, prev = f"run:{run_id}", GENESIS
            events = [
                (
                    "run_created",
                    "agent:storm",
                    {
                        "graph": graph.name,
                        "graph_version": graph.version,
                        "goal_rev": 1,
                        "external": False,
                        "status": "queued",
                    },
                ),
                (
                    "lease_taken",
                    f"worker:{owner}#1",
                    {
                        "owner": owner,
                        "fence": 1,
                        "previous_owner": "",
                        "takeover": False,
                        "status": "running",
                    },
                ),
            ]
            for seq, (kind, actor, payload) in enumerate(events, 1):
                fields: dict[str, Any] = {
                    "stream": stream,
                    "seq": seq,
                    "tenant_id": tenant.pk,
                    "type": kind,
                    "actor": actor,
                    "object_ref": stream,
                    "payload": payload,
                    "created_at": created + timedelta(milliseconds=seq),
                }
                digest = entry_hash(prev, **fields)
                entries.append(JournalEntry(**fields, prev_hash=prev, hash=digest))
                prev = digest
            heads.append(StreamHead(stream=stream, tenant_id=tenant.pk, seq=2, hash=prev))
        with transaction.atomic():
            Run.objects.bulk_create(run_rows, batch_size=500)
            JournalEntry.objects.bulk_create(entries, batch_size=500)
            StreamHead.objects.bulk_create(heads, batch_size=500)
            # auto_now fields: make the rows as old as a crashed fleet's
            Run.objects.filter(tenant__in=tenants).update(updated_at=now - timedelta(seconds=60))
        return tenants

    def storm(self, runs: int = STORM_RUNS, timeout: float | None = None) -> dict[str, Any]:
        """Insert the crashed fleet, sweep until all completed; give up after `timeout`
        (default: 4 × the ideal drain time, at least 60 s) and report how far it got."""
        from django.conf import settings
        from django.db.models import Count
        from django_q.models import OrmQ, Task

        from runtime.lifecycle import create_run
        from runtime.models import Run, RunStatus

        batch = settings.HOLDPOINT_SWEEP_BATCH
        per_tenant = settings.HOLDPOINT_SWEEP_PER_TENANT
        interval = float(settings.HOLDPOINT_SWEEP_INTERVAL)
        per_tick = min(batch, per_tenant * STORM_TENANTS)
        ideal = math.ceil(runs / per_tick) * interval
        timeout = timeout or max(60.0, 4 * ideal)
        self.quiet_schedules()
        failed_before = Task.objects.filter(success=False).count()
        started = time.perf_counter()
        tenants = self.insert_crashed_fleet(runs)
        insert_s = time.perf_counter() - started
        storm_runs = Run.objects.filter(tenant__in=tenants)
        log(f"[{self.bench.backend}] storm: {runs} crashed runs inserted in {insert_s:.1f}s")
        first_log = len(self.logs)
        cluster = self.start_cluster()
        sweeper = Sweeper()
        timeline: list[tuple[float, int, int]] = []  # (s, runs completed, doorbells queued)
        try:
            probe = create_run(self.bench.tenant, "bench-noop", {"steps": 1}, actor="bench")
            self.wait(
                lambda: Run.objects.filter(pk=probe.run_id, status=RunStatus.COMPLETED).exists(),
                60,
                "the storm's cluster did not start",
            )
            t0 = time.time()
            deadline = time.monotonic() + timeout
            done = 0
            while done < runs and time.monotonic() < deadline:
                sweeper.tick_if_due()
                done = storm_runs.filter(status=RunStatus.COMPLETED).count()
                timeline.append((time.time() - t0, done, OrmQ.objects.count()))
                time.sleep(0.2)
            drain = timeline[-1][0] if done == runs else None
        finally:
            kill_group(cluster)
        statuses = dict(storm_runs.order_by().values_list("status").annotate(n=Count("pk")))
        fences = dict(storm_runs.order_by().values_list("fence").annotate(n=Count("pk")))
        failed = Task.objects.filter(success=False).count() - failed_before
        log_errors, tracebacks = self.log_errors(self.logs[first_log:])
        errors = (
            failed
            + len(log_errors)
            + sum(
                n
                for status, n in statuses.items()
                if status not in (RunStatus.COMPLETED, RunStatus.RUNNING, RunStatus.QUEUED)
            )
        )
        out = {
            "runs": runs,
            "tenants": len(tenants),
            "insert_seconds": insert_s,
            "drain_seconds": drain,
            "configured": {
                "sweep_interval_seconds": interval,
                "sweep_batch": batch,
                "sweep_per_tenant": per_tenant,
                "runs_per_second": per_tick / interval,
            },
            "ideal_drain_seconds": ideal,
            "timeout_seconds": timeout,
            "completed": statuses.get(RunStatus.COMPLETED, 0),
            "completed_per_second": statuses.get(RunStatus.COMPLETED, 0)
            / max(1e-9, timeline[-1][0] if timeline else 1.0),
            "drain_over_ideal": (drain / ideal) if drain else None,
            "achieved_runs_per_second": (runs / drain) if drain else None,
            "sweeper_ticks": sweeper.ticks,
            "doorbells_rung": sweeper.rung,
            "statuses": {str(k): v for k, v in statuses.items()},
            "failed_task_examples": list(
                Task.objects.filter(success=False)
                .order_by("-stopped")
                .values_list("func", "result")[:3]
            ),
            "fences": {str(k): v for k, v in sorted(fences.items())},
            "failed_tasks": failed,
            "log_error_lines": len(log_errors),
            "log_errors": log_errors[:20],
            "tracebacks": tracebacks,
            "errors": errors,
            "met": drain is not None and drain <= ideal + interval and errors == 0,
            "timeline": [
                (round(t, 2), n, q) for t, n, q in timeline[:: max(1, len(timeline) // 300)]
            ],
            "max_doorbells_queued": max((q for *_, q in timeline), default=0),
        }
        done = statuses.get(RunStatus.COMPLETED, 0)
        drain_text = f"{drain:.1f}s" if drain else f"NOT DRAINED in {timeout:.0f}s ({done} done)"
        log(
            f"[{self.bench.backend}] storm: {runs} runs drained in {drain_text} (configured "
            f"{per_tick / interval:.0f} runs/s → ideal {ideal:.0f}s), {sweeper.ticks} ticks, "
            f"{sweeper.rung} doorbells, {errors} errors"
        )
        return out
