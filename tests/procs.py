"""Real processes for the slow layer: start in their own session, poll with a bound, kill.

Each child gets its own process group (start_new_session) so killing it — SIGKILL to the
whole group, as a machine crash would — cannot take pytest down with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from django.conf import settings
from django.db import connection

from tests import zygote

ROOT = zygote.ROOT
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def accepting(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:`port` — the cheap question asked before
    `owns_port`: a refused connect costs microseconds, where reading the kernel's TCP table
    walks every bucket of its hash (40 ms a read on a loaded two-core machine). Asked every
    50 ms while a server starts, owns_port alone took a sixth of a test process's CPU."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def owns_port(pid: int, port: int) -> bool:
    """Linux: whether process `pid` holds the socket listening on `port`. A port from
    free_port() is only a guess: the other CI suite, running beside this one, may take it
    first, and then a health check on it is answered by that suite's server, not ours."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                listening = fields[3] == "0A"  # TCP_LISTEN
                if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    if fields[9] in sockets:
                        return True
    return False


def test_database_url() -> str:
    """A DATABASE_URL naming the database pytest-django created, for child processes."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDPOINT_FAULTS")}
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings_test",
        DATABASE_URL=test_database_url(),
        HOLDPOINT_VAR_DIR=str(settings.VAR_DIR),
        PYTHONUNBUFFERED="1",
        # One sweep tick per scheduled task: a graceful stop then never waits for a sweep.
        HOLDPOINT_SWEEP_WINDOW="0",
        HOLDPOINT_HEARTBEAT_THREAD="1",
    )
    env.update(extra)
    return env


class Child(Protocol):
    """A process `start` started: a subprocess.Popen, or the zygote's `Started` (the same
    questions answered the same way)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def start(
    args: list[str], env: dict[str, str], log: Path | None = None, *, program: str = "manage.py"
) -> Child:
    """Start `python manage.py ARGS` (a script: `PROGRAM` ending in .py; else `python -m
    PROGRAM ARGS`) in its own session: forked from this test process's zygote
    (tests/zygote.py), its libraries already imported."""
    if zygote.enabled():
        return zygote.zygote().start(program, args, env, log)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed by the child)
    return subprocess.Popen(
        [sys.executable, *zygote.command(program), *args],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill(proc: Child, sig: int = signal.SIGKILL) -> None:
    """Signal the whole process group (a qcluster's children too) and reap the leader."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_for(check: Callable[[], T | None], timeout: float = 30.0, every: float = 0.1) -> T:
    """Poll `check` until it returns something truthy, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(every)


def start_listening(
    args: Callable[[int], list[str]],
    env: dict[str, str] | Callable[[int], dict[str, str]],
    log: Path | None = None,
    *,
    program: str = "manage.py",
    port: int | None = None,
    ready: Callable[[str], bool] | None = None,
    timeout: float = 60.0,
) -> tuple[Child, str]:
    """A server process started with `args(port)` on `port` or a free one, and its base URL,
    once *it* holds the listening socket (`owns_port`) and `ready(url)` (if given) says so. A
    free port the other CI suite took first makes ours exit ("address in use"), and then it
    starts again on another; a given port (a restart on the same address, as a client that
    reconnects sees) gets no retry, no other will do. `env`: the server's environment, or a
    function of the port that makes it (a server told its own address: HOLDPOINT_BASE_URL)."""
    for _ in range(1 if port else 3):
        chosen = port or free_port()
        server = start(args(chosen), env(chosen) if callable(env) else env, log, program=program)
        url = f"http://127.0.0.1:{chosen}"

        def up(server: Child = server, chosen: int = chosen, url: str = url) -> str:
            if server.poll() is not None:
                return "exited"
            if not (accepting(chosen) and owns_port(server.pid, chosen)):
                return ""
            return "ours" if ready is None or ready(url) else ""

        try:
            state = wait_for(up, timeout=timeout, every=0.05)
        except BaseException:
            kill(server)
            raise
        if state == "ours":
            return server, url
    raise RuntimeError(f"{program} {args(chosen)[0]} exited: {server.returncode} (log: {log})")


def start_web(
    env: dict[str, str] | Callable[[int], dict[str, str]],
    log: Path | None = None,
    *,
    port: int | None = None,
) -> tuple[Child, str]:
    """The production web server (`uvicorn config.asgi:application`) and its base URL (see
    `start_listening`) — for the tests that need a real ASGI server (live event streams, the
    MCP gateway), where pytest-django's threaded WSGI live_server will not do. `port`: a given
    one — a restart on the same address."""
    return start_listening(
        lambda chosen: [
            "config.asgi:application",
            *("--host", "127.0.0.1", "--port", str(chosen), "--lifespan", "on"),
        ],
        env,
        log,
        program="uvicorn",
        port=port,
    )
