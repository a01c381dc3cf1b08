"""What the live-event tests share (G8, tests/api/test_live_*.py): a real web server
(`uvicorn config.asgi`, procs.start_web) per module, and readers of its streams — the
journal in the database is their oracle."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection
from httpx_sse import EventSource

from audit.models import JournalEntry
from runtime.api.serializers import JournalEntrySerializer
from tests import procs
from tests.api import (
    fresh_throttle,  # noqa: F401
    ok,
    post,
)
from tests.conftest import Persona

STREAM = {"stream": "1"}
# The clients of test_200_stream_clients_hold_on_postgresql (more for a figure: above 600 also
# raise HOLDPOINT_API_RATE, one token opens them all).
LIVE_CLIENTS = int(os.environ.get("HOLDPOINT_LIVE_CLIENTS", "200"))
TERMINAL = {"completed", "failed", "cancelled"}
# The keep-alive of the tests' own servers that wait for one: the same code path as the
# default 15 s (HOLDPOINT_SSE_KEEPALIVE), without a test waiting out 15 s of quiet.
KEEPALIVE = 1


@contextlib.contextmanager
def web_server(
    django_db_blocker: Any, log: Path, name: str = "holdpoint-web", **extra: str
) -> Iterator[tuple[procs.Child, str]]:
    """A real web server (`extra`: its environment's additions): its process and base URL.
    On PostgreSQL its connections carry `name`, and its teardown waits until they are gone."""
    env = procs.child_env(**extra)
    if connection.vendor == "postgresql":  # its connections are counted by this name
        env["DATABASE_URL"] += f"?application_name={name}"
    proc, base = procs.start_web(env, log)
    names = (name,)
    try:
        yield proc, base
    finally:
        procs.kill(proc)
        if connection.vendor == "postgresql":  # its backends gone before the test database
            with django_db_blocker.unblock():
                procs.wait_for(lambda: not web_backends(names), timeout=15)
                connection.close()


def web_backends(names: tuple[str, ...]) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = ANY(%s)",
            [list(names)],
        )
        row = cursor.fetchone()
        return int(row[0]) if row else 0


def headers(persona: Persona) -> dict[str, str]:
    return {"Authorization": f"Token {persona.token}"}


def session_cookie(persona: Persona) -> dict[str, str]:
    """A person's session (as the login page makes it), sent as a header: outside DEBUG the
    cookie is Secure, and httpx keeps a Secure cookie off plain http (a browser does not for
    127.0.0.1)."""
    from django.conf import settings
    from django.test import Client as DjangoClient

    django_client = DjangoClient()
    django_client.force_login(persona.user)
    return {"Cookie": f"{settings.SESSION_COOKIE_NAME}={django_client.cookies['sessionid'].value}"}


def journal_json(run_id: str) -> list[dict[str, Any]]:
    """The run's journal as the list endpoint renders it (the stream's oracle)."""
    entries = JournalEntry.objects.filter(stream=f"run:{run_id}").order_by("seq")
    return json.loads(json.dumps(JournalEntrySerializer(entries, many=True).data, default=str))


def as_json(events: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    return [json.loads(data) for _, _, data in events]


def read(
    http: httpx.Client,
    url: str,
    *,
    last: int | None = None,
    until: str | None = None,
    after: int | None = None,
) -> tuple[list[tuple[str, str, str]], bool]:
    """(id, event, data) of each event until the server closes the stream (True), or until
    an event of type `until` arrived (then this client disconnects: False)."""
    extra = {} if last is None else {"Last-Event-ID": str(last)}
    got: list[tuple[str, str, str]] = []
    params = STREAM if after is None else {**STREAM, "after": str(after)}
    with http.stream("GET", url, params=params, headers=extra) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for sse in EventSource(response).iter_sse():
            if not sse.data:  # a comment line (keep-alive): httpx-sse makes it an empty event
                continue
            got.append((sse.id, sse.event, sse.data))
            if sse.event == until:
                return got, False
    return got, True


def finish_external(agent: Persona, run_id: str, fence: int, rev: int) -> None:
    body = {
        "fence": fence,
        "expected_rev": rev,
        "state": {},
        "next_step": "",
        "status": "completed",
    }
    ok(post(agent.api(), f"runs/{run_id}/checkpoints/", body), 201)


def sse_lines(
    http: httpx.Client, url: str, *, last: int | None = None, after: int | None = None
) -> Iterator[tuple[str, str, str]]:
    """(id, event, data) of each block the stream sends — an `id:` alone and a comment line
    too (data empty), each with the last id seen (as EventSource keeps it) — until the caller
    closes it. Read line by line, so a caller's deadline is checked at every keep-alive."""
    extra = {} if last is None else {"Last-Event-ID": str(last)}
    params = STREAM if after is None else {**STREAM, "after": str(after)}
    with http.stream("GET", url, params=params, headers=extra) as response:
        assert response.status_code == 200, response.read()
        id, fields = "", {"event": "", "data": ""}
        for line in response.iter_lines():
            if not line:
                yield id, fields["event"], fields["data"]
                fields = {"event": "", "data": ""}
                continue
            name, _, value = line.partition(":")
            if name == "id":
                id = value.strip()
            elif name in fields:
                fields[name] = value.strip()


def until_seen(
    lines: Iterator[tuple[str, str, str]], seen: list[tuple[int, str, str]], wanted: set[Any]
) -> int:
    """Read `lines` into `seen` (id, approval id, status) until every (approval id, status)
    of `wanted` came; the last id the stream gave (what a client resumes from)."""
    deadline, got, last = time.monotonic() + 20, set(), ""
    for id, event, data in lines:
        last = id
        if data:
            assert event == "approval"
            approval = json.loads(data)
            seen.append((int(id), approval["id"], approval["status"]))
            got.add((approval["id"], approval["status"]))
        if wanted <= got:
            return int(last)
        assert time.monotonic() < deadline, f"waited for {wanted - got}; seen {seen}"
    raise AssertionError(f"the stream ended; waited for {wanted - got}")


class CuttingProxy:
    """A TCP proxy to the web server that hangs up on its first connection as soon as it has
    passed on an event of type `cut_after` — a lost connection mid-stream, as a client sees
    one — and passes every later connection whole. `requests`: what each connection sent."""

    def __init__(self, upstream: str, cut_after: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.marker = f"event: {cut_after}\n".encode()
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            index = len(self.requests)
            self.requests.append(b"")
            threading.Thread(target=self._serve, args=(down, index), daemon=True).start()

    def _serve(self, down: socket.socket, index: int) -> None:
        cut = index == 0
        up = socket.create_connection(self.upstream)

        def upward() -> None:
            with contextlib.suppress(OSError):
                while chunk := down.recv(65536):
                    self.requests[index] += chunk
                    up.sendall(chunk)

        threading.Thread(target=upward, daemon=True).start()
        seen = b""
        with contextlib.suppress(OSError), down, up:
            while chunk := up.recv(65536):
                down.sendall(chunk)
                seen += chunk
                at = seen.find(self.marker)
                if cut and at >= 0 and seen.find(b"\n\n", at) >= 0:  # that event is out
                    down.shutdown(socket.SHUT_RDWR)
                    return

    def close(self) -> None:
        self.listener.close()


def last_event_ids(proxy: CuttingProxy) -> list[str | None]:
    """The Last-Event-ID each connection through the proxy sent (None: none)."""
    found = []
    for raw in proxy.requests:
        header = [line for line in raw.split(b"\r\n") if line.lower().startswith(b"last-event-id:")]
        found.append(header[0].split(b":", 1)[1].strip().decode() if header else None)
    return found


def server_threads(proc: procs.Child) -> int:
    """The web server process's threads (Linux: one /proc task each)."""
    return len(os.listdir(f"/proc/{proc.pid}/task"))


def ended_after(web: str, url: str, sent: dict[str, str], lift: Callable[[], None]) -> float:
    """Open a stream with `sent`, take two comment lines, `lift` what authenticated it, and
    read on until the server ends the stream (it fails once ten keep-alive intervals passed
    without the end). Seconds from the lift to the end."""
    with httpx.stream("GET", web + url, params=STREAM, headers=sent, timeout=30) as answer:
        assert answer.status_code == 200, answer.read()
        comments, lifted = 0, None
        for line in answer.iter_lines():
            comments += line.startswith(":")
            if lifted is None and comments == 2:
                lift()
                lifted = time.monotonic()
            elif lifted is not None and time.monotonic() - lifted > KEEPALIVE * 10:
                pytest.fail(f"the stream still runs {KEEPALIVE * 10} s after its credentials")
    assert lifted is not None
    return time.monotonic() - lifted
