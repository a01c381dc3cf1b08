"""A stand-in for a team's task tracker, run as its own process over a real socket.

The ledger's guarantees are only believable if they hold against a real service on the other
end of a socket, with its own storage that survives our crashes. Tests count duplicates with
`GET /tasks`, which lists every task ever created.

Modes: `key` honours Idempotency-Key (replay returns the first task); `lookup` ignores the
header on create but can be searched with `GET /tasks?key=…`; `none` can do neither.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

SCHEMA = """CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY, seq INTEGER, idem_key TEXT, title TEXT, body TEXT, created_at TEXT
)"""


class TaskStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(SCHEMA)
        self.lock = threading.Lock()

    def create(self, body: dict[str, Any], key: str | None, honour_key: bool) -> tuple[int, dict]:
        with self.lock:
            if honour_key and key:
                found = self.find(key)
                if found:
                    return 200, found[0]
            task = {
                "id": str(uuid.uuid4()),
                "title": str(body.get("title", "")),
                "body": body,
                "idempotency_key": key,
            }
            self.db.execute(
                "INSERT INTO tasks VALUES (?, (SELECT COUNT(*) + 1 FROM tasks), ?, ?, ?, "
                "datetime('now'))",
                (task["id"], key, task["title"], json.dumps(body)),
            )
            return 201, task

    def find(self, key: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT id, idem_key, title, body FROM tasks"
        rows = (
            self.db.execute(sql + " WHERE idem_key = ? ORDER BY seq", (key,))
            if key is not None
            else self.db.execute(sql + " ORDER BY seq")
        )
        return [
            {"id": r[0], "idempotency_key": r[1], "title": r[2], "body": json.loads(r[3])}
            for r in rows
        ]


def make_handler(store: TaskStore, mode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet by default
            pass

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlparse(self.path)
            if url.path == "/healthz":
                return self._send(200, {"status": "ok", "mode": mode})
            if url.path != "/tasks":
                return self._send(404, {"error": "not found"})
            key = parse_qs(url.query).get("key", [None])[0]
            if key is not None and mode == "none":
                return self._send(400, {"error": "lookup by key not supported in mode none"})
            return self._send(200, store.find(key))

        def do_POST(self) -> None:  # noqa: N802
            if urlparse(self.path).path != "/tasks":
                return self._send(404, {"error": "not found"})
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self._send(400, {"error": "invalid JSON"})
            key = self.headers.get("Idempotency-Key")
            status, task = store.create(body, key, honour_key=mode == "key")
            return self._send(status, task)

    return Handler


class Command(BaseCommand):
    help = "Run the sandbox task service (a stand-in task tracker) on 127.0.0.1."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=8765)
        parser.add_argument("--mode", choices=["key", "lookup", "none"], default="key")
        parser.add_argument("--data", default=None, help="SQLite file for the tasks")

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["data"] or settings.VAR_DIR / f"sandbox-{options['port']}.sqlite3")
        store = TaskStore(path)
        server = ThreadingHTTPServer(
            ("127.0.0.1", options["port"]), make_handler(store, options["mode"])
        )
        self.stdout.write(
            f"sandbox task service on http://127.0.0.1:{options['port']} "
            f"(mode {options['mode']}, data {path})"
        )
        self.stdout.flush()
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
