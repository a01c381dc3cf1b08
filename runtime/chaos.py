"""Chaos soak: real workers killed at random and named points while api-review runs create
tasks; the sandbox's own list of tasks is the oracle (TEST-MATRIX.md, A1/A2).

The driver is the calling process (`manage.py chaos`, or a test): it starts a sandbox task
service (unless it is pointed at an operator's own), K `qcluster` workers each in its own
process group, creates N runs, and then, until every run has settled or time is up:

- every ~S seconds (seeded jitter) kills a worker: SIGKILL of its whole group at once (a
  crash at a random instruction), or SIGKILL and a restart armed with HOLDPOINT_FAULTS so the
  replacement dies at a named point; every 10th kill is a graceful SIGTERM, with SIGKILL
  after a grace (a redeploy). Dead workers are restarted at once;
- rings due runs itself every ~0.5 s (the scheduled sweeper has minute granularity);
- plays the reviewer: approves every pending hold point of its runs as soon as it appears
  (a reviewer watching the inbox), through the approvals app's own `decide`;
- plays the human for runs in needs_reconciliation: looks the idempotency key up in the
  service and resolves applied (with the task id) or, once the sender can no longer be in
  flight, not applied. Apart from these two human acts, nothing is moved by hand.

Then it stops every process it started and counts, from GET /tasks and the database:
duplicates, false completions, lost and stuck runs. Nothing here asserts; the caller
decides what a failure is (the command exits 1, the test asserts).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
from django.apps import apps as django_apps
from django.conf import settings
from django.db.models.functions import Now
from django.utils import timezone

from runtime.errors import HoldpointError, InvalidTransition
from runtime.ledger import resolve
from runtime.lifecycle import create_run
from runtime.models import TERMINAL, Action, ActionStatus, Run, RunStatus, Tenant
from runtime.queue import _enqueue
from runtime.sweeper import sweep_once

GRAPH = "api-review"
GOAL: dict[str, Any] = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
HUMAN = "user:chaos"
FAULT_POINTS = (
    "before_prepare",
    "after_prepare",
    "after_sent_mark",
    "after_tool_response",
    "after_confirm",
    "after_checkpoint",
    "during_reconcile",
    "after_record",
)
MODES = ("key", "lookup", "none")
# Statuses nobody in a chaos run will move: a run here has settled. needs_reconciliation is
# not among them, because the driver plays the human who resolves it.
PARKED_FOR_HUMANS = frozenset(
    {RunStatus.NEEDS_ATTENTION, RunStatus.WAITING_APPROVAL, RunStatus.WAITING_INPUT}
)
# Not lost although not terminal: a human's turn. (A run waiting for approval is not lost
# either while one of its actions still awaits a decision: nobody may have been allowed
# to decide. Waiting with nothing left to decide, it is lost: nothing will wake it.)
NOT_LOST = TERMINAL | {RunStatus.NEEDS_RECONCILIATION}
ChildEnv = Mapping[str, str] | Callable[[], Mapping[str, str]]
# A worker that cannot start (bad settings, a broken import) would otherwise be restarted
# in a tight loop until the timeout; past this many exits nobody asked for, the soak stops.
MAX_UNEXPECTED_EXITS = 20


class ChaosAborted(RuntimeError):
    """The harness itself cannot go on (the sandbox or the workers do not run)."""


@dataclass
class ChaosConfig:
    runs: int
    kill_every: float
    mode: str = "key"
    workers: int = 2
    tenant: str = "demo"
    seed: int | None = None
    timeout: float = 600.0
    # Runs started per second (0: all at once). A run takes a second or two, so started all
    # at once they would be done before the first kill; spread out, kills land mid-run.
    rate: float = 1.0
    # Seconds our sandbox waits before applying each create: widens the window between
    # `sent` and the reply, where a kill leaves an outcome only reconciliation can settle.
    service_delay: float = 0.0
    # An operator's own task service: then only GET /tasks is used, no sandbox is started.
    tasks_url: str | None = None
    # The environment of every child process (os.environ when None); tests pass
    # tests.procs.child_env so workers use the test database.
    env: ChildEnv | None = None
    log_dir: Path | None = None
    sweep_interval: float = 0.5
    grace: float = 5.0
    # A run is rung again at most this often: a queued run's doorbell is usually still in
    # the queue, and a flood of duplicates only delays the real work behind them.
    ring_gap: float = 3.0

    def __post_init__(self) -> None:
        if self.runs < 1 or self.workers < 1:
            raise ValueError("runs and workers must be at least 1")
        if self.kill_every <= 0:
            raise ValueError("kill_every must be positive")
        if min(self.rate, self.service_delay, self.grace) < 0:
            raise ValueError("rate, service_delay and grace must not be negative")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")


@dataclass
class ChaosReport:
    runs: int
    mode: str
    workers: int
    seed: int
    kill_every: float
    rate: float = 0.0
    service_delay: float = 0.0
    completed: int = 0
    needs_reconciliation: int = 0
    waiting_approval: int = 0
    stuck: int = 0  # neither completed, nor needs_reconciliation, nor waiting for approval
    by_status: dict[str, int] = field(default_factory=dict)
    tasks_created: int = 0
    tasks_expected: int = 0
    tasks_in_service: int = 0
    duplicates: int = 0
    unexpected_tasks: int = 0  # carry one of our run ids but no key of our actions
    false_confirmations: int = 0
    false_run_completions: int = 0
    false_completions: int = 0
    lost: int = 0
    kills: dict[str, int] = field(default_factory=dict)
    kills_total: int = 0
    armed: dict[str, int] = field(default_factory=dict)
    graceful: dict[str, int] = field(default_factory=dict)
    unexpected_exits: int = 0
    sweep_errors: dict[str, int] = field(default_factory=dict)
    worker_task_errors: dict[str, int] = field(default_factory=dict)
    human_resolutions: dict[str, int] = field(default_factory=dict)
    approvals: dict[str, int] = field(default_factory=dict)
    max_fence: int = 0
    max_fence_run: str = ""
    timed_out: bool = False
    elapsed_seconds: float = 0.0
    log_dir: str = ""
    # One line per run that broke an invariant or did not finish: where to start looking.
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.false_completions or self.lost)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# --- child processes ------------------------------------------------------------------------
# Every child ever started, until reaped: atexit kills what a crash of the driver's own
# code would otherwise leave behind (try/finally covers the normal and the error paths).
_LIVE: set[subprocess.Popen[bytes]] = set()
_LIVE_LOCK = threading.Lock()


def _kill_all_children() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for proc in procs:
        _kill_group(proc)


atexit.register(_kill_all_children)


def _spawn(args: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`python manage.py ARGS` in its own session, so killing its group spares the driver."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=settings.BASE_DIR,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the whole group (a qcluster's children too) and reap the leader.

    Also sent after the leader exited on its own: a group member may outlive it. Only
    once per child: after that the pid may belong to someone else.
    """
    with _LIVE_LOCK:
        if proc not in _LIVE:
            return
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover (a SIGKILLed leader always goes)
        pass
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM to the driver runs its finally blocks (the default would skip them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Worker:
    slot: int
    proc: subprocess.Popen[bytes]
    armed: str
    log: Path
    log_offset: int
    started_at: float = field(default_factory=time.monotonic)
    # Set when SIGTERM was sent: the monotonic time at which SIGKILL follows.
    kill_at: float | None = None


class Fleet:
    """K worker slots, each always occupied by a live qcluster (or one being stopped)."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, note: Callable[..., None]) -> None:
        self.env = env
        self.log_dir = log_dir
        self.note = note
        self.workers: dict[int, Worker] = {}
        self.kills: Counter[str] = Counter()
        self.armed: Counter[str] = Counter()
        self.graceful: Counter[str] = Counter()
        self.unexpected_exits = 0

    def start(self, slot: int, armed: str = "") -> Worker:
        log = self.log_dir / f"worker-{slot}.log"
        env = {k: v for k, v in self.env.items() if k != "HOLDPOINT_FAULTS"}
        if armed:
            env["HOLDPOINT_FAULTS"] = armed
            self.armed[armed] += 1
        with open(log, "ab") as out:
            out.write(f"\n=== chaos: starting worker {slot} armed={armed or '-'} ===\n".encode())
        offset = log.stat().st_size
        proc = _spawn(["qcluster"], env, log)
        worker = Worker(slot, proc, armed, log, offset)
        self.workers[slot] = worker
        self.note("worker_started", slot=slot, pid=proc.pid, armed=armed)
        return worker

    def candidates(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.kill_at is None and w.proc.poll() is None]

    def sigkill(self, worker: Worker, armed_next: str = "") -> None:
        _kill_group(worker.proc)
        self.kills["sigkill"] += 1
        self.note("kill", kind="sigkill", slot=worker.slot, pid=worker.proc.pid, then=armed_next)
        self.start(worker.slot, armed_next)

    def sigterm(self, worker: Worker, grace: float) -> None:
        """A redeploy: SIGTERM to the qcluster main process, as a supervisor or a container
        runtime sends it. Not to the whole group: django-q2's children die of it on their own
        and the cluster then waits for them forever (seen: still up 40 s later), where the
        main process alone stops its cluster in about a second."""
        worker.proc.send_signal(signal.SIGTERM)
        worker.kill_at = time.monotonic() + grace
        self.kills["sigterm"] += 1
        self.note("kill", kind="sigterm", slot=worker.slot, pid=worker.proc.pid, grace=grace)

    def reap(self) -> None:
        """Finish graceful stops, notice workers that died (at their fault point or not),
        and restart every empty slot at once."""
        now = time.monotonic()
        for worker in list(self.workers.values()):
            code = worker.proc.poll()
            if worker.kill_at is not None:
                if code is None and now < worker.kill_at:
                    continue
                how = "exited" if code is not None else "killed_after_grace"
                _kill_group(worker.proc)
                self.graceful[how] += 1
                self.note("graceful_stop", slot=worker.slot, pid=worker.proc.pid, how=how)
                self.start(worker.slot)
                continue
            if code is None:
                continue
            _kill_group(worker.proc)
            point = worker.armed if worker.armed and self._reached(worker) else ""
            if point:
                self.kills[f"fault:{point}"] += 1
                self.note("kill", kind="fault", point=point, slot=worker.slot, pid=worker.proc.pid)
            else:
                self.unexpected_exits += 1
                self.note("unexpected_exit", slot=worker.slot, pid=worker.proc.pid, code=code)
                if self.unexpected_exits > MAX_UNEXPECTED_EXITS:
                    raise ChaosAborted(
                        f"workers keep exiting by themselves ({self.unexpected_exits} times); "
                        f"see {worker.log}"
                    )
            self.start(worker.slot)

    def _reached(self, worker: Worker) -> bool:
        with open(worker.log, "rb") as log:
            log.seek(worker.log_offset)
            text = log.read().decode("utf-8", "replace")
        return f"fault point reached: {worker.armed}" in text

    def stop_all(self) -> None:
        for worker in self.workers.values():
            _kill_group(worker.proc)

    def task_errors(self) -> Counter[str]:
        """Queue tasks that raised, by message, from the worker logs. A run can look merely
        slow while every attempt at it fails (a schema out of date, a bug): say so."""
        errors: Counter[str] = Counter()
        for log in sorted(self.log_dir.glob("worker-*.log")):
            for line in log.read_text("utf-8", "replace").splitlines():
                if " ERROR django-q Failed " in line:
                    errors[line.partition(") - ")[2][:160] or line[-160:]] += 1
        return errors


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


# --- the driver -----------------------------------------------------------------------------
class Chaos:
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
        self.resolutions: Counter[str] = Counter()
        self.approvals: Counter[str] = Counter()
        self.no_reviewer: set[Any] = set()
        self.sweep_errors: Counter[str] = Counter()
        self.seen: dict[str, str] = {}
        self.sandbox: subprocess.Popen[bytes] | None = None
        self.tasks_url = (config.tasks_url or "").rstrip("/")
        self.fleet: Fleet | None = None

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
            with _sigterm_unwinds():
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
                _kill_group(self.sandbox)
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
            acted = self.play_reviewer(run_ids)
            if statuses[RunStatus.NEEDS_RECONCILIATION]:
                acted += self.play_human(run_ids)
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
    def play_reviewer(self, run_ids: list[str]) -> int:
        """Approve every pending approval request of our runs, as a reviewer who watches the
        inbox would: at once, possibly before the run has even parked. Returns how many.

        Through approvals' own `decide`, as the reviewer page calls it (chaos is a harness
        above both apps; runtime proper never imports approvals). The reviewer is the first
        member allowed to decide under the request's policy who has not voted yet; with
        nobody allowed, the run stays waiting and is reported so.
        """
        if not django_apps.is_installed("approvals"):
            return 0
        from approvals.decisions import decide
        from approvals.models import ApprovalRequest, ApprovalStatus
        from approvals.policies import deciders

        pending = ApprovalRequest.objects.filter(
            run_id__in=run_ids, status=ApprovalStatus.PENDING
        ).select_related("policy")
        acted = 0
        for request in pending:
            voted = set(request.votes.values_list("user_id", flat=True))
            allowed = deciders(request.policy, escalated=request.escalated)
            users = [user for user in allowed if user.pk not in voted]
            if not users:
                if request.policy_id not in self.no_reviewer:
                    self.no_reviewer.add(request.policy_id)
                    self.note("no_reviewer", policy=request.policy.name, run_id=request.run_id)
                continue
            try:
                decide(
                    request.pk,
                    users[0],
                    "approve",
                    request.action_hash,
                    reason="chaos: approved as a reviewer would",
                )
            except HoldpointError as exc:  # decided, superseded or expired meanwhile
                self.approvals[f"refused:{exc.code}"] += 1
                self.note("approval_refused", run_id=str(request.run_id), code=exc.code)
                continue
            acted += 1
            self.approvals["approved"] += 1
            self.note(
                "approved",
                run_id=str(request.run_id),
                action_id=str(request.action_id),
                reviewer=users[0].get_username(),
            )
        return acted

    def play_human(self, run_ids: list[str]) -> int:
        """Resolve manual_review actions as a reviewer would, by looking in the tracker.

        "Not applied" only once the sender's in-flight window had passed *before* we looked:
        a request still in flight could land after an empty answer.
        """
        waiting = Action.objects.filter(
            run_id__in=run_ids,
            run__status=RunStatus.NEEDS_RECONCILIATION,
            status=ActionStatus.MANUAL_REVIEW,
        )
        actions = list(waiting)
        if not actions:
            return 0
        looked_at = timezone.now()
        try:
            tasks = self.fetch_tasks()
        except httpx.HTTPError as exc:
            self.note("human_lookup_failed", error=str(exc))
            return 0
        acted = 0
        by_key: dict[str, list[dict[str, Any]]] = {}
        for task in tasks:
            by_key.setdefault(str(task.get("idempotency_key")), []).append(task)
        for action in actions:
            found = by_key.get(action.idempotency_key, [])
            try:
                if found:
                    resolve(
                        action,
                        "applied",
                        actor=HUMAN,
                        external_id=str(found[0]["id"]),
                        note="chaos: the task exists in the tracker",
                    )
                    outcome = "applied"
                elif action.in_flight_until is None or action.in_flight_until <= looked_at:
                    resolve(
                        action,
                        "not_applied",
                        actor=HUMAN,
                        note="chaos: no task with this key, sender no longer in flight",
                    )
                    outcome = "not_applied"
                else:
                    continue
            except InvalidTransition as exc:  # moved meanwhile, or still in flight
                self.note("human_refused", action_id=str(action.action_id), detail=str(exc))
                continue
            acted += 1
            self.resolutions[outcome] += 1
            self.note(
                "human_resolved",
                run_id=str(action.run_id),
                action_id=str(action.action_id),
                outcome=outcome,
                tasks=len(found),
            )
        return acted

    # --- the service ------------------------------------------------------------------------
    def start_sandbox(self) -> None:
        port = _free_port()
        data = self.log_dir / "sandbox.sqlite3"
        self.sandbox = _spawn(
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
        report.human_resolutions = dict(sorted(self.resolutions.items()))
        report.approvals = dict(sorted(self.approvals.items()))
        report.sweep_errors = dict(self.sweep_errors)
        report.worker_task_errors = dict(self.fleet.task_errors().most_common())


def tally(
    report: ChaosReport,
    runs: list[dict[str, Any]],
    actions: list[dict[str, Any]],
    tasks: list[dict[str, Any]],
) -> ChaosReport:
    """The oracle's arithmetic, on plain rows (so it can be checked without processes).

    runs: run_id, status, fence; actions (tasks.create only): run_id, idempotency_key,
    status, external_id; tasks: GET /tasks rows (id, idempotency_key, run_id).
    """
    run_ids = {str(r["run_id"]) for r in runs}
    keys = {a["idempotency_key"] for a in actions}
    tasks_by_key: dict[str, list[str]] = {}
    mine = 0
    for task in tasks:
        key, run_id = task.get("idempotency_key"), str(task.get("run_id") or "")
        if key in keys:
            tasks_by_key.setdefault(key, []).append(str(task["id"]))
            mine += 1
        elif run_id in run_ids:
            mine += 1
            report.unexpected_tasks += 1
            report.problems.append({"kind": "unexpected_task", "run_id": run_id, "task": task})
    report.tasks_in_service = len(tasks)
    report.tasks_created = mine
    report.tasks_expected = len(runs)
    for key, ids in tasks_by_key.items():
        if len(ids) > 1:
            report.duplicates += len(ids) - 1
            run_id = next(str(a["run_id"]) for a in actions if a["idempotency_key"] == key)
            report.problems.append(
                {"kind": "duplicate", "run_id": run_id, "key": key, "tasks": ids}
            )

    actions_by_run: dict[str, list[dict[str, Any]]] = {}
    for action in actions:
        actions_by_run.setdefault(str(action["run_id"]), []).append(action)
        ids = tasks_by_key.get(action["idempotency_key"], [])
        # Confirmed must name an effect the service has under that key: no task, or a
        # different one, is a completion nobody can verify.
        if action["status"] == ActionStatus.CONFIRMED and action["external_id"] not in ids:
            report.false_confirmations += 1
            report.problems.append(
                {
                    "kind": "confirmed_without_task",
                    "run_id": str(action["run_id"]),
                    "key": action["idempotency_key"],
                    "external_id": action["external_id"],
                    "tasks": ids,
                }
            )

    statuses: Counter[str] = Counter()
    for run in runs:
        run_id, status = str(run["run_id"]), run["status"]
        statuses[status] += 1
        if run["fence"] > report.max_fence:
            report.max_fence, report.max_fence_run = run["fence"], run_id
        own = actions_by_run.get(run_id, [])
        has_task = any(tasks_by_key.get(a["idempotency_key"]) for a in own)
        if status == RunStatus.COMPLETED and not has_task:
            report.false_run_completions += 1
            report.problems.append(
                {
                    "kind": "completed_without_task",
                    "run_id": run_id,
                    "actions": [(a["idempotency_key"], a["status"]) for a in own],
                }
            )
        deciding = any(a["status"] == ActionStatus.AWAITING_APPROVAL for a in own)
        if status not in NOT_LOST and not (status == RunStatus.WAITING_APPROVAL and deciding):
            report.lost += 1
            report.problems.append(
                {
                    "kind": "lost",
                    "run_id": run_id,
                    "status": status,
                    "actions": [a["status"] for a in own],
                }
            )
    report.false_completions = report.false_confirmations + report.false_run_completions
    report.by_status = dict(sorted(statuses.items()))
    report.completed = statuses[RunStatus.COMPLETED]
    report.needs_reconciliation = statuses[RunStatus.NEEDS_RECONCILIATION]
    report.waiting_approval = statuses[RunStatus.WAITING_APPROVAL]
    report.stuck = len(runs) - (
        report.completed + report.needs_reconciliation + report.waiting_approval
    )
    return report


def run_chaos(
    config: ChaosConfig,
    *,
    progress: TextIO | None = None,
    echo: Callable[[str], None] | None = None,
) -> ChaosReport:
    """Start everything, drive, stop everything, count. Never leaves a child behind."""
    return Chaos(config, progress=progress, echo=echo).run()


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def _errors(errors: Mapping[str, int]) -> str:
    if not errors:
        return "0"
    message, count = next(iter(errors.items()))
    return f"{sum(errors.values())}  (most often, {count}x: {message[:100]})"


def table(report: ChaosReport) -> str:
    """The report as an aligned two-column table (what the command prints)."""
    rows: list[tuple[str, str]] = [
        ("runs completed", f"{report.completed} / {report.runs}"),
        ("runs in needs_reconciliation", str(report.needs_reconciliation)),
        ("runs waiting for approval", str(report.waiting_approval)),
        ("runs stuck (other)", f"{report.stuck}  ({_counts(report.by_status)})"),
        ("tasks created / expected", f"{report.tasks_created} / {report.tasks_expected}"),
        ("duplicates", str(report.duplicates)),
        (
            "false completions",
            f"{report.false_completions}  (confirmed without task {report.false_confirmations}"
            f", completed run without task {report.false_run_completions})",
        ),
        ("lost", str(report.lost)),
        ("unexpected tasks", str(report.unexpected_tasks)),
        ("kills injected", f"{report.kills_total}  ({_counts(report.kills)})"),
        ("restarts armed", _counts(report.armed)),
        ("graceful stops", _counts(report.graceful)),
        ("unexpected worker exits", str(report.unexpected_exits)),
        ("driver sweep errors", _counts(report.sweep_errors)),
        ("worker task errors", _errors(report.worker_task_errors)),
        ("approvals given", _counts(report.approvals)),
        (
            "human resolutions",
            f"{sum(report.human_resolutions.values())}  ({_counts(report.human_resolutions)})",
        ),
        ("max fence", f"{report.max_fence}  (run {report.max_fence_run or '-'})"),
        ("timed out", "yes" if report.timed_out else "no"),
        ("elapsed", f"{report.elapsed_seconds:.1f} s"),
        ("seed", str(report.seed)),
        ("logs", report.log_dir),
    ]
    width = max(len(label) for label, _ in rows)
    head = (
        f"chaos: {report.runs} api-review runs, mode {report.mode}, {report.workers} workers, "
        f"a kill every ~{report.kill_every:g}s, "
        + (f"{report.rate:g} runs/s" if report.rate else "all runs at once")
        + (f", service delay {report.service_delay:g}s" if report.service_delay else "")
    )
    lines = [head, "-" * len(head)]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    for problem in report.problems[:20]:
        lines.append("! " + json.dumps(problem, default=str))
    if len(report.problems) > 20:
        lines.append(f"! … {len(report.problems) - 20} more in {report.log_dir}/report.json")
    lines.append("result: " + ("OK" if report.ok else "FAILED"))
    return "\n".join(lines)
