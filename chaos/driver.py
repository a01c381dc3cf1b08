"""The soak's loop: start runs at a rate, kill workers on a seeded schedule, sweep, play
the humans, and count once every run has settled (see `chaos` for the whole story)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
from django.conf import settings
from django.db.models.functions import Now

from chaos.accounting import ChaosReport, tally
from chaos.config import FAULT_POINTS, GOAL, GRAPH, HUMAN, ChaosAborted, ChaosConfig
from chaos.humans import Humans
from chaos.processes import Fleet, free_port, kill_group, sigterm_unwinds, spawn
from runtime.lifecycle import create_run
from runtime.models import TERMINAL, Action, Run, RunStatus, Tenant
from runtime.queue import _enqueue
from runtime.sweeper import sweep_once

# Statuses nobody in a chaos run will move: a run here has settled. needs_reconciliation is
# not among them, because the driver plays the human who resolves it.
PARKED_FOR_HUMANS = frozenset(
    {RunStatus.NEEDS_ATTENTION, RunStatus.WAITING_APPROVAL, RunStatus.WAITING_INPUT}
)


class Progress:
    """A one-line bar on a terminal (rewritten with \\r), or nothing."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.last = 0.0
        self.drawn = False

    def draw(self, done: int, total: int, extra: str, force: bool = False) -> None:
        if self.stream is None or (not force and time.monotonic() - self.last < 0.2):
            return
        self.last = time.monotonic()
        width = 30
        filled = width * done // max(total, 1)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r[{bar}] {done}/{total} runs done, {extra}\033[K")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.stream is not None and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


class Chaos:
    """One soak: its seed, its log directory, the fleet, the humans, the history."""

    def __init__(
        self,
        config: ChaosConfig,
        *,
        progress: TextIO | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.seed = (
            config.seed if config.seed is not None else random.SystemRandom().getrandbits(32)
        )
        self.rng = random.Random(self.seed)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.log_dir = config.log_dir or Path(settings.VAR_DIR) / "chaos" / f"{stamp}-{self.seed}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.progress = Progress(progress)
        self.echo = echo
        self.started = time.monotonic()
        self.events = open(self.log_dir / "events.jsonl", "a")  # noqa: SIM115 (closed in run)
        self.rung: dict[str, float] = {}
        self.injected = 0
        self.sweep_errors: Counter[str] = Counter()
        self.seen: dict[str, str] = {}
        self.sandbox: subprocess.Popen[bytes] | None = None
        self.tasks_url = (config.tasks_url or "").rstrip("/")
        self.fleet: Fleet | None = None
        self.humans = Humans(self.note, self.fetch_tasks)

    def note(self, event: str, **data: Any) -> None:
        """One line of the history (events.jsonl): kills, restarts, run transitions."""
        line = {"t": round(time.monotonic() - self.started, 3), "event": event, **data}
        self.events.write(json.dumps(line, default=str) + "\n")
        self.events.flush()
        if self.echo is not None and event not in ("run", "run_created"):
            self.echo(" ".join(f"{k}={v}" for k, v in line.items() if v not in ("", None)))

    def child_env(self) -> dict[str, str]:
        env = self.config.env
        base = env() if callable(env) else (env if env is not None else os.environ)
        return {
            **base,
            "HOLDPOINT_TASKS_URL": self.tasks_url,
            "HOLDPOINT_TASKS_DEDUP": self.config.mode,
            # One sweep tick per scheduled task: a graceful stop never waits on a sweep
            # window, and the driver sweeps every half second anyway.
            "HOLDPOINT_SWEEP_WINDOW": "0",
            "PYTHONUNBUFFERED": "1",
        }

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        config = self.config
        report = ChaosReport(
            runs=config.runs,
            mode=config.mode,
            workers=config.workers,
            seed=self.seed,
            kill_every=config.kill_every,
            rate=config.rate,
            service_delay=config.service_delay,
            log_dir=str(self.log_dir),
        )
        run_ids: list[str] = []
        try:
            with sigterm_unwinds():
                if not self.tasks_url:
                    self.start_sandbox()
                env = self.child_env()
                self.fleet = Fleet(env, self.log_dir, self.note)
                for slot in range(config.workers):
                    self.fleet.start(slot)
                tenant, created = Tenant.objects.get_or_create(
                    slug=config.tenant, defaults={"name": config.tenant}
                )
                if created:
                    self.note("tenant_created", slug=tenant.slug)
                report.timed_out = not self.drive(tenant, run_ids)
                self.fleet.stop_all()
                self.note("workers_stopped")
                tasks = self.fetch_tasks()
                (self.log_dir / "tasks.json").write_text(json.dumps(tasks, indent=1))
                self.tally(report, run_ids, tasks)
        finally:
            self.progress.close()
            if self.fleet is not None:
                self.fleet.stop_all()
            if self.sandbox is not None:
                kill_group(self.sandbox)
            self.events.close()
        report.elapsed_seconds = round(time.monotonic() - self.started, 1)
        (self.log_dir / "report.json").write_text(json.dumps(report.as_dict(), indent=1))
        return report

    def drive(self, tenant: Tenant, run_ids: list[str]) -> bool:
        """Start runs at the configured rate; kill, restart, sweep and resolve until every
        run settled. False on timeout. `run_ids` fills up as runs start."""
        assert self.fleet is not None
        config = self.config
        deadline = self.started + config.timeout
        begun = time.monotonic()
        next_kill = begun + self.jitter()
        next_sweep = 0.0
        while True:
            now = time.monotonic()
            due = config.runs if not config.rate else 1 + int((now - begun) * config.rate)
            while len(run_ids) < min(due, config.runs):
                run = create_run(
                    tenant, GRAPH, GOAL, actor=HUMAN, metadata={"chaos_seed": self.seed}
                )
                run_ids.append(str(run.run_id))
                self.note("run_created", run_id=run_ids[-1])
            self.fleet.reap()
            if self.sandbox is not None and self.sandbox.poll() is not None:
                raise ChaosAborted(f"the sandbox died; see {self.log_dir}/sandbox.log")
            if now >= next_kill:
                self.inject(run_ids)
                next_kill = now + self.jitter()
            if now >= next_sweep:
                self.sweep()
                next_sweep = now + config.sweep_interval
            statuses = self.observe(run_ids)
            acted = self.humans.play_reviewer(run_ids)
            if statuses[RunStatus.NEEDS_RECONCILIATION]:
                acted += self.humans.play_human(run_ids)
            settled = sum(n for s, n in statuses.items() if s in TERMINAL | PARKED_FOR_HUMANS)
            done = sum(n for s, n in statuses.items() if s in TERMINAL)
            kills = sum(self.fleet.kills.values())
            # A human act just now may have woken a run that looked settled: look again.
            finished = len(run_ids) == config.runs and settled == config.runs and not acted
            self.progress.draw(
                done,
                config.runs,
                f"kills {kills}, reconciling {statuses[RunStatus.NEEDS_RECONCILIATION]}, "
                f"{now - self.started:.0f}s",
                force=finished,
            )
            if finished:
                return True
            if now >= deadline:
                self.note("timeout", after=config.timeout)
                return False
            time.sleep(0.2)

    def jitter(self) -> float:
        return self.config.kill_every * self.rng.uniform(0.5, 1.5)

    def inject(self, run_ids: list[str]) -> None:
        """Kill one worker: mostly SIGKILL at a random moment, half of those restarted armed
        with a named fault point; every 10th a graceful SIGTERM (SIGKILL after the grace)."""
        assert self.fleet is not None
        candidates = sorted(self.fleet.candidates(), key=lambda w: w.slot)
        if not candidates:
            return
        # An armed worker is spared for a while so it can reach its point; an idle worker's
        # death tests nothing, so one that holds a run's lease now is preferred.
        spare_until = time.monotonic() - 3 * self.config.kill_every
        eligible = [w for w in candidates if not w.armed or w.started_at < spare_until]
        busy = self.busy_slots(run_ids)
        pool = eligible or candidates
        worker = self.rng.choice([w for w in pool if w.slot in busy] or pool)
        self.injected += 1
        if self.injected % 10 == 0:
            self.fleet.sigterm(worker, self.config.grace)
        elif self.rng.random() < 0.5:
            self.fleet.sigkill(worker)
        else:
            self.fleet.sigkill(worker, armed_next=self.rng.choice(FAULT_POINTS))

    def busy_slots(self, run_ids: list[str]) -> set[int]:
        """Slots whose process group holds a live lease on one of our runs (lease owners are
        "host:pid" of a cluster's worker process, which is in its qcluster's group)."""
        assert self.fleet is not None
        owners = Run.objects.filter(
            pk__in=run_ids, status=RunStatus.RUNNING, lease_expires_at__gt=Now()
        ).values_list("lease_owner", flat=True)
        groups: set[int] = set()
        host = socket.gethostname()
        for owner in owners:
            name, _, pid = owner.rpartition(":")
            if name != host or not pid.isdigit():
                continue
            try:
                groups.add(os.getpgid(int(pid)))
            except (ProcessLookupError, PermissionError):
                continue
        return {w.slot for w in self.fleet.workers.values() if w.proc.pid in groups}

    def sweep(self) -> None:
        """Ring due runs. A failing sweep (it also runs the hold points' periodic work) is
        counted and shown, not fatal: the soak is about the runs, and the rings of the tick
        went out before that work began."""
        try:
            sweep_once(ring=self.ring)
        except Exception as exc:  # counted, shown once per kind, reported
            error = f"{type(exc).__name__}: {exc}"
            if error not in self.sweep_errors:
                self.note("sweep_failed", error=error)
            self.sweep_errors[error] += 1

    def ring(self, run_id: str) -> None:
        now = time.monotonic()
        if now - self.rung.get(run_id, -1e9) < self.config.ring_gap:
            return
        self.rung[run_id] = now
        _enqueue(run_id)

    def observe(self, run_ids: list[str]) -> Counter[str]:
        statuses: Counter[str] = Counter()
        for run_id, status in Run.objects.filter(pk__in=run_ids).values_list("run_id", "status"):
            statuses[status] += 1
            key = str(run_id)
            if self.seen.get(key) != status:
                self.seen[key] = status
                self.note("run", run_id=key, status=status)
        return statuses

    # --- the humans -------------------------------------------------------------------------

    # --- the service ------------------------------------------------------------------------
    def start_sandbox(self) -> None:
        port = free_port()
        data = self.log_dir / "sandbox.sqlite3"
        self.sandbox = spawn(
            [
                "sandbox_tasks",
                *("--port", str(port), "--mode", self.config.mode, "--data", str(data)),
                *("--delay", str(self.config.service_delay)),
            ],
            self.child_env(),
            self.log_dir / "sandbox.log",
        )
        self.tasks_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.tasks_url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.sandbox.poll() is not None or time.monotonic() > deadline:
                raise ChaosAborted(f"the sandbox did not start; see {self.log_dir}/sandbox.log")
            time.sleep(0.1)
        self.note("sandbox_started", url=self.tasks_url, mode=self.config.mode)

    def fetch_tasks(self) -> list[dict[str, Any]]:
        response = httpx.get(self.tasks_url + "/tasks", timeout=30)
        response.raise_for_status()
        return list(response.json())

    # --- accounting -------------------------------------------------------------------------
    def tally(self, report: ChaosReport, run_ids: list[str], tasks: list[dict[str, Any]]) -> None:
        assert self.fleet is not None
        runs = list(Run.objects.filter(pk__in=run_ids).values("run_id", "status", "fence"))
        actions = list(
            Action.objects.filter(run_id__in=run_ids, tool="tasks.create").values(
                "run_id", "idempotency_key", "status", "external_id"
            )
        )
        tally(report, runs, actions, tasks)
        report.kills = dict(sorted(self.fleet.kills.items()))
        report.kills_total = sum(self.fleet.kills.values())
        report.armed = dict(sorted(self.fleet.armed.items()))
        report.graceful = dict(sorted(self.fleet.graceful.items()))
        report.unexpected_exits = self.fleet.unexpected_exits
        report.human_resolutions = dict(sorted(self.humans.resolutions.items()))
        report.approvals = dict(sorted(self.humans.approvals.items()))
        report.sweep_errors = dict(self.sweep_errors)
        report.worker_task_errors = dict(self.fleet.task_errors().most_common())


def run_chaos(
    config: ChaosConfig,
    *,
    progress: TextIO | None = None,
    echo: Callable[[str], None] | None = None,
) -> ChaosReport:
    """Start everything, drive, stop everything, count. Never leaves a child behind."""
    return Chaos(config, progress=progress, echo=echo).run()
