"""Small real HTTP servers on 127.0.0.1 for tests of what Holdpoint sends: each request is
recorded before a behaviour answers it (JSON, a redirect, an endless body, ...)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest


@dataclass
class Server:
    url: str
    port: int
    requests: list[dict[str, Any]] = field(default_factory=list)
    written: list[int] = field(default_factory=lambda: [0])  # body bytes the handler sent


Behaviour = Callable[[BaseHTTPRequestHandler, Server], None]


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    """Start an HTTP server on 127.0.0.1 (a free port) in a thread; each request is
    recorded (method, path, headers, body) before `behaviour` answers it. With `tls` (a
    server-side SSLContext) it speaks HTTPS."""
    started: list[ThreadingHTTPServer] = []

    def start(behaviour: Behaviour, tls: ssl.SSLContext | None = None) -> Server:
        holder: list[Server] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def handle_any(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                holder[0].requests.append(
                    {
                        "method": self.command,
                        "client_port": self.client_address[1],
                        "path": self.path,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                        "body": self.rfile.read(length) if length else b"",
                    }
                )
                behaviour(self, holder[0])

            do_GET = do_POST = do_PUT = handle_any

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        port = httpd.server_address[1]
        if tls is not None:  # the handshake happens in accept(); a refused one is dropped
            httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        holder.append(Server(f"{scheme}://127.0.0.1:{port}", int(port)))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return holder[0]

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def answer_json(handler: BaseHTTPRequestHandler, server: Server) -> None:
    body = json.dumps({"id": "T-1", "seen": server.requests[-1]["headers"]}).encode()
    handler.send_response(201)
    handler.send_header("Content-Type", "application/json; charset=utf-8")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def answer_with(
    status: int, body: bytes, *headers: tuple[str, str], content_type: str = "application/json"
) -> Behaviour:
    """Answer every request with `status`, `body` (its Content-Length said) and `headers`
    (a name may come twice), Content-Type JSON unless told otherwise."""

    def behaviour(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response(status)
        for name, value in headers:
            handler.send_header(name, value)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return behaviour


def stream_forever(total: int, *, declare: bool) -> Behaviour:
    """`total` bytes in 64 KiB writes, with or without a Content-Length; counts what it
    managed to write before the client hung up."""

    def behaviour(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        if declare:
            handler.send_header("Content-Length", str(total))
        else:
            handler.send_header("Connection", "close")  # the body ends when the socket does
            handler.close_connection = True
        handler.end_headers()
        chunk = b"x" * 65536
        try:
            while server.written[0] < total:
                handler.wfile.write(chunk)
                server.written[0] += len(chunk)
        except OSError:
            pass  # the client dropped the connection: what this test wants

    return behaviour


def redirect_to(location: str, status: int = 302) -> Behaviour:
    def behaviour(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return behaviour


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[list[str]]]:
    """Names under `.test` answer from this table, one answer per lookup (the last one
    repeats): a DNS server that changes its answer, as a rebinding attacker's does."""
    answers: dict[str, list[list[str]]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host in answers:
            queue = answers[host]
            addresses = queue.pop(0) if len(queue) > 1 else queue[0]
            return [
                (
                    socket.AF_INET6 if ":" in a else socket.AF_INET,
                    socket.SOCK_STREAM,
                    6,
                    "",
                    (a, port, 0, 0) if ":" in a else (a, port),
                )
                for a in addresses
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers


# Hop-by-hop headers, and those httpx rewrites: a proxy does not pass them on as they came.
_HOP = {"host", "connection", "keep-alive", "content-length", "transfer-encoding"}
_HOP_BACK = _HOP | {"content-encoding", "date", "server"}


class Gateway:
    """A reverse proxy's behaviour for `serve`: each request is forwarded to `upstream` and
    its answer relayed, except the ones planned with `fail`, which the gateway answers
    itself with an HTML error page (`status`) — before forwarding (the request never
    reached the upstream) or after it (applied there, the answer lost, as nginx answers 502
    on an upstream reset and 504 on its timeout) — or, with `status` 0, by hanging up.
    Planned with a `code`, the answer is Holdpoint's own problem+json instead (a 500
    `server_error` after a fault, a 503 `service_unavailable` while it refuses work), with
    a `Retry-After` header when planned with `retry_after`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.http = httpx.Client(timeout=60)
        self.plan: list[tuple[str, str, int, bool, str, str]] = []
        self.answered: list[tuple[str, str, int]] = []  # (method, path, status sent back)
        self.stalling: tuple[str, str] | None = None
        self.stalled = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def stall(self, method: str, path_end: str | None) -> None:
        """Hold every request of `method` to a path ending with `path_end` (None: stop
        holding new ones), forwarding nothing, until the gateway closes — then hang up: an
        upstream that stopped answering. A held request stays held after the stall ends."""
        with self._lock:
            self.stalling = None if path_end is None else (method, path_end)

    def fail(
        self,
        method: str,
        path_end: str,
        status: int,
        *,
        forwarded: bool,
        times: int = 1,
        code: str = "",
        retry_after: str = "",
    ) -> None:
        with self._lock:
            self.plan.extend([(method, path_end, status, forwarded, code, retry_after)] * times)

    def count(self, method: str, path_end: str) -> int:
        """Requests of `method` whose path ends with `path_end` that reached the gateway."""
        return sum(1 for m, p, _ in self.answered if m == method and p.endswith(path_end))

    def _planned(self, method: str, path: str) -> tuple[int, bool, str, str] | None:
        with self._lock:
            for index, (m, end, status, forwarded, code, retry_after) in enumerate(self.plan):
                if m == method and path.endswith(end):
                    del self.plan[index]
                    return status, forwarded, code, retry_after
        return None

    def __call__(self, handler: BaseHTTPRequestHandler, server: Server) -> None:
        request = server.requests[-1]
        path = urlsplit(handler.path).path
        with self._lock:
            stall = self.stalling
            held = stall is not None and handler.command == stall[0] and path.endswith(stall[1])
            self.stalled += held
        if held:
            self._closed.wait(120)
            handler.close_connection = True
            return
        fault = self._planned(handler.command, path)
        if fault is None or fault[1]:
            headers = {k: v for k, v in request["headers"].items() if k not in _HOP}
            upstream = self.http.request(
                handler.command, self.upstream + handler.path, headers=headers,
                content=request["body"],
            )  # fmt: skip
        if fault is not None:
            status = fault[0]
            self.answered.append((handler.command, path, status))
            if not status:
                handler.close_connection = True  # no answer at all: the socket closes
                return
            kind, page = _error_page(status, fault[2])
            handler.send_response(status)
            if fault[3]:
                handler.send_header("Retry-After", fault[3])
            handler.send_header("Content-Type", kind)
            handler.send_header("Content-Length", str(len(page)))
            handler.end_headers()
            handler.wfile.write(page)
            return
        self.answered.append((handler.command, path, upstream.status_code))
        handler.send_response(upstream.status_code)
        for name, value in upstream.headers.multi_items():
            if name.lower() not in _HOP_BACK:
                handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(upstream.content)))
        handler.end_headers()
        handler.wfile.write(upstream.content)

    def close(self) -> None:
        self._closed.set()
        self.http.close()


def _error_page(status: int, code: str) -> tuple[str, bytes]:
    """A gateway's HTML page, or with `code` Holdpoint's problem+json (API.md, "Errors")."""
    if not code:
        return "text/html", f"<html><body><h1>{status} Gateway error</h1></body></html>".encode()
    problem = {"type": "about:blank", "title": "Server error", "status": status, "code": code}
    return "application/problem+json", json.dumps({**problem, "detail": code}).encode()
