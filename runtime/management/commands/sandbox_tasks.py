"""A stand-in for a team's task tracker, run as its own process over a real socket.

The ledger's guarantees are only believable if they hold against a real service at the other
end of a socket, with its own storage that survives our crashes. Tests count duplicates with
`GET /tasks`, which lists every task ever created (with the idempotency key each came with).

Modes: `key` honours Idempotency-Key (a replay returns the first task, 200); `lookup` does not
deduplicate but can be searched with `GET /tasks?key=…`; `none` can do neither.
Fencing: with `Holdpoint-Run` and `Holdpoint-Fence` headers, a request carrying a lower fence
than one already seen for that run is refused (409) and not applied.
Credentials: with `--require-token T` (repeatable) or HOLDPOINT_SANDBOX_TOKENS (comma-separated)
every `/tasks` request must carry `Authorization: Bearer <one of them>`, else 401 and nothing
is applied — as a real tracker's API token would be (Holdpoint sends the tenant's `tasks`
credential). `/healthz`, `/_faults` and `/_reset` stay open.
Faults (`POST /_faults`, or the command's options), each applying to the next N creates:
`fail_before` (503, nothing applied), `drop_after` (applied, then the connection is dropped
without an answer), `error_after` (applied, then 500), and `delay` seconds before applying.
Tracing: each task keeps the W3C `traceparent` its create came with, and `GET /requests` lists
every request received since start (method, path, idempotency key, traceparent) — how a
test sees that the trace reached the tracker, as a real one's request log would.
Reset: `POST /_reset` forgets every task, fence, logged request and armed fault, once no
request is being served (a delayed create of the one before lands first): a test suite
reuses one process for many tests instead of starting one per test, each from empty.
"""

from __future__ import annotations

import errno
import hmac
import json
import socket
import sqlite3
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS tasks (
        id TEXT PRIMARY KEY, seq INTEGER, idem_key TEXT, run_id TEXT, fence INTEGER,
        title TEXT, body TEXT, status TEXT DEFAULT 'open', created_at TEXT,
        traceparent TEXT DEFAULT '')""",
    "CREATE INDEX IF NOT EXISTS tasks_key ON tasks (idem_key)",
    "CREATE TABLE IF NOT EXISTS fences (run_id TEXT PRIMARY KEY, fence INTEGER)",
]
FAULTS = ("fail_before", "drop_after", "error_after")
REQUEST_LOG = 1000


class TaskStore:
    def __init__(self, path: Path, armed: dict[str, float] | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        for statement in SCHEMA:
            self.db.execute(statement)
        columns = [row[1] for row in self.db.execute("PRAGMA table_info(tasks)")]
        if "traceparent" not in columns:  # a data file from before tracing
            self.db.execute("ALTER TABLE tasks ADD COLUMN traceparent TEXT DEFAULT ''")
        self.lock = threading.Lock()
        # Every request received (in memory, the latest REQUEST_LOG): GET /requests.
        self.requests: list[dict[str, Any]] = []
        # Armed faults: the command's options at start, and again after each reset.
        self.started_with = {"delay": 0.0, **dict.fromkeys(FAULTS, 0), **(armed or {})}
        self.faults = dict(self.started_with)
        # Requests being served now, and when the last one began (`reset` waits for quiet).
        self.serving = 0
        self.last_begun = 0.0

    def begin(self) -> None:
        with self.lock:
            self.serving += 1
            self.last_begun = time.monotonic()

    def end(self) -> None:
        with self.lock:
            self.serving -= 1

    def reset(self, quiet: float = 0.05, timeout: float = 60.0) -> bool:
        """Forget tasks, fences, the request log and the armed faults (back to the command's
        options), once nothing is being served and nothing began for `quiet` seconds — a
        request still in progress (a delayed create) finishes before, not after. False if it
        never got quiet within `timeout` (then nothing was forgotten)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.serving == 0 and time.monotonic() - self.last_begun >= quiet:
                    self.db.execute("DELETE FROM tasks")
                    self.db.execute("DELETE FROM fences")
                    self.requests.clear()
                    self.faults = dict(self.started_with)
                    return True
            time.sleep(0.01)
        return False

    def take_fault(self, name: str) -> bool:
        with self.lock:
            if self.faults[name] > 0:
                self.faults[name] -= 1
                return True
            return False

    def fence_ok(self, run_id: str | None, fence: int | None) -> bool:
        """Refuse a lower fence than seen for the run; remember the highest. Caller locks."""
        if not run_id or fence is None:
            return True
        row = self.db.execute("SELECT fence FROM fences WHERE run_id = ?", (run_id,)).fetchone()
        if row and fence < row[0]:
            return False
        self.db.execute(
            "INSERT INTO fences VALUES (?, ?) ON CONFLICT(run_id) DO UPDATE SET fence = "
            "max(fence, excluded.fence)",
            (run_id, fence),
        )
        return True

    def received(self, method: str, path: str, headers: Any) -> None:
        with self.lock:
            if len(self.requests) >= REQUEST_LOG:
                del self.requests[0]
            self.requests.append(
                {
                    "method": method,
                    "path": path,
                    "idempotency_key": headers.get("Idempotency-Key"),
                    "traceparent": headers.get("traceparent"),
                    "tracestate": headers.get("tracestate"),
                }
            )

    def create(
        self,
        body: dict[str, Any],
        key: str | None,
        mode: str,
        run_id: str | None,
        fence: int | None,
        traceparent: str = "",
    ) -> tuple[int, dict[str, Any]]:
        with self.lock:
            if not self.fence_ok(run_id, fence):
                return 409, {"error": "stale fence", "run": run_id, "fence": fence}
            if mode == "key" and key:
                found = self.find(key)
                if found:
                    return 200, found[0]
            task_id = str(uuid.uuid4())
            self.db.execute(
                "INSERT INTO tasks (id, seq, idem_key, run_id, fence, title, body, created_at, "
                "traceparent) VALUES (?, (SELECT COUNT(*) + 1 FROM tasks), ?, ?, ?, ?, ?, "
                "datetime('now'), ?)",
                (
                    task_id,
                    key,
                    run_id,
                    fence,
                    str(body.get("title", "")),
                    json.dumps(body),
                    traceparent,
                ),
            )
            return 201, self.get(task_id) or {}

    def close(self, task_id: str, run_id: str | None, fence: int | None) -> tuple[int, Any]:
        with self.lock:
            if not self.fence_ok(run_id, fence):
                return 409, {"error": "stale fence"}
            if self.get(task_id) is None:
                return 404, {"error": "no such task"}
            self.db.execute("UPDATE tasks SET status = 'closed' WHERE id = ?", (task_id,))
            return 200, self.get(task_id)

    def get(self, task_id: str) -> dict[str, Any] | None:
        rows = self._rows("WHERE id = ?", (task_id,))
        return rows[0] if rows else None

    def find(self, key: str | None = None) -> list[dict[str, Any]]:
        if key is None:
            return self._rows("", ())
        return self._rows("WHERE idem_key = ?", (key,))

    def _rows(self, where: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        sql = "SELECT id, idem_key, title, body, status, run_id, fence, seq, traceparent "
        sql += "FROM tasks "
        return [
            {
                "id": r[0],
                "idempotency_key": r[1],
                "title": r[2],
                "body": json.loads(r[3]),
                "status": r[4],
                "run_id": r[5],
                "fence": r[6],
                "seq": r[7],
                "traceparent": r[8] or "",
            }
            for r in self.db.execute(sql + where + " ORDER BY seq", args)
        ]


def make_handler(
    store: TaskStore, mode: str, tokens: tuple[str, ...] = ()
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; with Nagle on, a keep-alive client waits
        # for the delayed ACK (~40 ms) on every call.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # quiet by default
            pass

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}")

        def _fence(self) -> tuple[str | None, int | None]:
            raw = self.headers.get("Holdpoint-Fence")
            try:
                return self.headers.get("Holdpoint-Run"), int(raw) if raw else None
            except ValueError:
                return self.headers.get("Holdpoint-Run"), None

        def _refused(self) -> bool:
            """Answer 401 unless the request carries one of the required tokens."""
            if not tokens or not urlparse(self.path).path.startswith("/tasks"):
                return False
            presented = self.headers.get("Authorization", "")
            scheme, _, value = presented.partition(" ")
            ok = scheme.lower() == "bearer" and any(
                hmac.compare_digest(value.encode(), token.encode()) for token in tokens
            )
            if not ok:
                # Read the body anyway: left unread, it would be parsed as the next request.
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = b'{"error": "missing or wrong bearer token"}'
                self.send_response(401)
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            return not ok

        def _drop(self) -> None:
            """Applied, but the answer never arrives: the client cannot know."""
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            store.begin()
            try:
                self._get()
            finally:
                store.end()

        def do_POST(self) -> None:  # noqa: N802
            if urlparse(self.path).path == "/_reset":  # not counted: it waits for the rest
                self._body()
                if store.reset():
                    return self._send(200, {"status": "reset"})
                return self._send(503, {"error": "requests still in progress"})
            store.begin()
            try:
                self._post()
            finally:
                store.end()

        def _get(self) -> None:
            url = urlparse(self.path)
            if url.path == "/healthz":
                return self._send(200, {"status": "ok", "mode": mode})
            if url.path == "/_faults":
                return self._send(200, store.faults)
            if url.path == "/requests":
                with store.lock:
                    return self._send(200, list(store.requests))
            store.received("GET", url.path, self.headers)
            if self._refused():
                return None
            if url.path != "/tasks":
                return self._send(404, {"error": "not found"})
            key = parse_qs(url.query).get("key", [None])[0]
            if key is not None and mode == "none":
                return self._send(400, {"error": "lookup by key not supported in mode none"})
            return self._send(200, store.find(key))

        def _post(self) -> None:
            path = urlparse(self.path).path
            if path != "/_faults":
                store.received("POST", path, self.headers)
            if self._refused():
                return None
            try:
                body = self._body()
            except ValueError:
                return self._send(400, {"error": "invalid JSON"})
            if path == "/_faults":
                with store.lock:
                    for name, value in body.items():
                        if name in store.faults:
                            store.faults[name] = float(value)
                return self._send(200, store.faults)
            run_id, fence = self._fence()
            if path.startswith("/tasks/") and path.endswith("/close"):
                status, task = store.close(path.split("/")[2], run_id, fence)
                return self._send(status, task)
            if path != "/tasks" or not isinstance(body, dict):
                return self._send(404 if path != "/tasks" else 400, {"error": "bad request"})
            if store.faults["delay"]:
                time.sleep(store.faults["delay"])
            if store.take_fault("fail_before"):
                return self._send(503, {"error": "unavailable (nothing applied)"})
            key = self.headers.get("Idempotency-Key")
            traceparent = self.headers.get("traceparent") or ""
            status, task = store.create(body, key, mode, run_id, fence, traceparent)
            if status in (200, 201) and store.take_fault("drop_after"):
                return self._drop()
            if status in (200, 201) and store.take_fault("error_after"):
                return self._send(500, {"error": "internal error (after applying)"})
            return self._send(status, task)

    return Handler


class Command(BaseCommand):
    help = "Run the sandbox task service (a stand-in task tracker) on 127.0.0.1."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=8765)
        parser.add_argument("--mode", choices=["key", "lookup", "none"], default="key")
        parser.add_argument("--data", default=None, help="SQLite file for the tasks")
        parser.add_argument("--delay", type=float, default=0.0, help="seconds before applying")
        parser.add_argument(
            "--require-token",
            action="append",
            default=None,
            help="require Authorization: Bearer TOKEN on /tasks (repeatable; "
            "default: HOLDPOINT_SANDBOX_TOKENS)",
        )
        for fault in FAULTS:
            parser.add_argument(
                f"--{fault.replace('_', '-')}",
                type=int,
                default=0,
                help=f"the next N creates: {fault.replace('_', ' ')}",
            )

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["data"] or settings.VAR_DIR / f"sandbox-{options['port']}.sqlite3")
        armed = {"delay": options["delay"], **{fault: options[fault] for fault in FAULTS}}
        store = TaskStore(path, armed)
        tokens = tuple(options["require_token"] or settings.HOLDPOINT_SANDBOX_TOKENS)
        handler = make_handler(store, options["mode"], tokens)
        try:
            server = ThreadingHTTPServer(("127.0.0.1", options["port"]), handler)
        except OSError as exc:  # a traceback told a first-hour user nothing
            if exc.errno != errno.EADDRINUSE:
                raise
            raise CommandError(
                f"port {options['port']} is already in use on 127.0.0.1 — another sandbox "
                "(`make run` starts one on 8765) or another service; pick another --port"
            ) from None
        server.daemon_threads = True
        self.stdout.write(
            f"sandbox task service on http://127.0.0.1:{options['port']} "
            f"(mode {options['mode']}, data {path}"
            + (f", {len(tokens)} token(s) required" if tokens else "")
            + ")"
        )
        self.stdout.flush()
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
