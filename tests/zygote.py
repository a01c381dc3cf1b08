"""Start the product's processes from a zygote that has already imported their libraries.

A test that needs a real worker, web server or sandbox starts `python manage.py …` (or
`python -m uvicorn …`): two seconds of imports before the process does anything, more on a
loaded machine, and the suite starts several hundred. The zygote is one process per test
process that imports those libraries once — Django's, DRF's, psycopg, httpx, structlog … —
and never the product's settings, models or apps. Each start is a fork of it that becomes
the asked-for process: its own session (as `start_new_session`), its own environment, its
output to the given log, then the program run as `python` would (`manage.py` as `__main__`,
or `-m uvicorn`), and the interpreter's normal exit (atexit handlers, flushes). The product's
own code, settings and database connections are made in the child, after the fork, from its
environment, exactly as in a fresh interpreter; what the child shares is imported library
code, as pages of the same files.

The child is a real process: its own pid, SIGKILLed with its group as before (`procs.kill`).
It is the zygote's child, not the test's, so the zygote reaps it and tells its exit status
(`Started.poll`/`wait` ask; a signal's death reads as `-signal`, as Popen's does).

`HOLDPOINT_TEST_ZYGOTE=0` starts every process fresh instead (subprocess.Popen).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Libraries the product's processes import before they do anything, none of which reads
# Django's settings when imported (the zygote has no DJANGO_SETTINGS_MODULE: one that did
# would fail here and be left to the child) or the environment: prometheus_client picks its
# value class from PROMETHEUS_MULTIPROC_DIR and OpenTelemetry its context from OTEL_* as they
# are imported, so they are not here — each child imports them under its own environment.
# The heaviest, by `python -X importtime`.
PRELOAD = (
    "django.db.models",
    "django.http",
    "django.urls",
    "django.forms",
    "django.template",
    "django.core.management",
    "django.core.handlers.asgi",
    "django.core.handlers.wsgi",
    "django.contrib.postgres.fields",
    "django.db.backends.sqlite3.base",
    "rest_framework.fields",
    "rest_framework.serializers",
    "drf_spectacular.plumbing",
    "psycopg",
    "httpx",
    "requests",
    "structlog",
    "jsonschema",
    "jsonpath_ng",
    "cryptography.fernet",
    "uvicorn",
    "uvicorn.main",
    "starlette",
    "pydantic",
    "mcp",
)


def enabled() -> bool:
    return os.environ.get("HOLDPOINT_TEST_ZYGOTE", "1") != "0"


def command(program: str) -> list[str]:
    """What follows `python` to run `program`: a script (`manage.py`, any `.py`) as itself,
    anything else as a module (`-m uvicorn`) — for a fresh start and a fork alike."""
    return [program] if program.endswith(".py") else ["-m", program]


# --- the zygote (python -m tests.zygote FD) -----------------------------------------------


def _preload() -> None:
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    from django.conf import settings

    assert not settings.configured, "a preloaded library configured Django's settings"
    assert threading.active_count() == 1, "a preloaded library started a thread"


def _serve(channel: socket.socket) -> dict[str, Any] | None:
    """Answer requests until the test process goes; in a forked child, the request it was
    forked for (to run after the loop, outside every frame of it)."""
    exited: dict[int, int] = {}
    children: set[int] = set()
    reader = channel.makefile("rb")
    for line in reader:
        request = json.loads(line)
        while children:  # reap what ended: its status is asked for below or later
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            exited[pid] = os.waitstatus_to_exitcode(status)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                reader.close()
                channel.close()
                return request  # type: ignore[no-any-return]
            children.add(pid)
            answer: dict[str, Any] = {"pid": pid}
        else:
            pid = request["pid"]
            answer = {"pid": pid, "code": exited.get(pid), "running": pid in children}
        channel.sendall(json.dumps(answer).encode() + b"\n")
    return None


def _become(request: dict[str, Any]) -> None:
    """In the forked child: the process `python ARGS` would be, from here on."""
    os.setsid()  # the zygote's signal handlers are a fresh interpreter's: nothing to reset
    log = request["log"]
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log else None
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(out if out is not None else null, 1)
    os.dup2(out if out is not None else null, 2)
    os.closerange(3, 1 << 16)
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(request["env"])
    program, args = request["program"], request["args"]
    sys.argv = [program, *args]
    if command(program) == [program]:  # as `python SCRIPT`: it is __main__, argv[0] as given
        script = ROOT / program
        sys.path[0] = str(script.parent)
        main = types.ModuleType("__main__")
        main.__file__ = str(script)
        sys.modules["__main__"] = main
        exec(compile(script.read_bytes(), str(script), "exec"), main.__dict__)  # noqa: S102
    else:  # as `python -m PROGRAM`
        runpy.run_module(program, run_name="__main__", alter_sys=True)


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    request = _serve(channel)
    if request is None:
        return
    _become(request)


# --- the test process's side --------------------------------------------------------------


class Started:
    """The part of subprocess.Popen the tests use, for a process the zygote started."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        every = 0.005
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(every)
            every = min(every * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "tests.zygote", str(theirs.fileno())],
            cwd=ROOT,
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # stderr stays the test's: a zygote that fails says why
            start_new_session=True,
        )
        theirs.close()
        self.channel = ours
        self.reader = ours.makefile("rb")
        self.lock = threading.Lock()
        self.owner = os.getpid()

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.channel.sendall(json.dumps(request).encode() + b"\n")
            line = self.reader.readline()
        if not line:
            raise RuntimeError(f"the test zygote is gone (exit {self.proc.poll()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def start(
        self, program: str, args: list[str], env: dict[str, str], log: Path | None
    ) -> Started:
        answer = self._ask(
            {
                "op": "start",
                "program": program,
                "args": args,
                "env": env,
                "log": str(log) if log else None,
            }
        )
        return Started(self, answer["pid"], [sys.executable, *command(program), *args])

    def status(self, pid: int) -> int | None:
        answer = self._ask({"op": "status", "pid": pid})
        if answer["code"] is not None:
            return int(answer["code"])
        if not answer["running"]:
            raise RuntimeError(f"process {pid} is not the zygote's")
        return None


_zygote: Zygote | None = None
_made = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use (a forked test process gets its own)."""
    global _zygote
    with _made:
        if _zygote is None or _zygote.owner != os.getpid():
            _zygote = Zygote()
        return _zygote


if __name__ == "__main__":
    main()
