"""The soak's child processes: spawned in their own sessions, killed as whole groups.

Every child is a `manage.py` process in its own process group, so killing a group (a
qcluster and all its workers at once, as a machine crash would) spares the driver.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from chaos.config import ChaosAborted

# A worker that cannot start (bad settings, a broken import) would otherwise be restarted
# in a tight loop until the timeout; past this many exits nobody asked for, the soak stops.
MAX_UNEXPECTED_EXITS = 20


# Every child ever started, until reaped: atexit kills what a crash of the driver's own
# code would otherwise leave behind (try/finally covers the normal and the error paths).
_LIVE: set[subprocess.Popen[bytes]] = set()
_LIVE_LOCK = threading.Lock()


def kill_all_children() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for proc in procs:
        kill_group(proc)


atexit.register(kill_all_children)


def spawn(args: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
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


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the whole group (a qcluster's children too) and reap the leader.

    Also sent after the leader exited on its own: a group member may outlive it. Only
    once per child: after that the pid may belong to someone else.
    """
    with _LIVE_LOCK:
        if proc not in _LIVE:
            return
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover (a SIGKILLed leader always goes)
        pass
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
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
        proc = spawn(["qcluster"], env, log)
        worker = Worker(slot, proc, armed, log, offset)
        self.workers[slot] = worker
        self.note("worker_started", slot=slot, pid=proc.pid, armed=armed)
        return worker

    def candidates(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.kill_at is None and w.proc.poll() is None]

    def sigkill(self, worker: Worker, armed_next: str = "") -> None:
        kill_group(worker.proc)
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
                kill_group(worker.proc)
                self.graceful[how] += 1
                self.note("graceful_stop", slot=worker.slot, pid=worker.proc.pid, how=how)
                self.start(worker.slot)
                continue
            if code is None:
                continue
            kill_group(worker.proc)
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
            kill_group(worker.proc)

    def task_errors(self) -> Counter[str]:
        """Queue tasks that raised, by message, from the worker logs. A run can look merely
        slow while every attempt at it fails (a schema out of date, a bug): say so."""
        errors: Counter[str] = Counter()
        for log in sorted(self.log_dir.glob("worker-*.log")):
            for line in log.read_text("utf-8", "replace").splitlines():
                if " ERROR django-q Failed " in line:
                    errors[line.partition(") - ")[2][:160] or line[-160:]] += 1
        return errors
