"""runtime.outbound's transport against raw servers that misbehave on the wire.

BaseHTTPRequestHandler cannot send what a broken or hostile service sends: bytes after a
body, a body cut short, a status line that is no status line, headers that never end, an
answer before the request was read, a reset in the middle of a kept connection. Each test
here plays one such service on a raw socket and checks what a caller of `send` relies on:

- `httpx.ConnectError` only when certainly nothing was sent; any other `httpx.HTTPError`
  when the request may have reached the service (tools.HttpTool.call: "unknown");
- an answer is never read as another request's (the pool is shared by every tenant);
- a kept connection is never reused after anything unusual;
- the timeout bounds the whole exchange, headers included.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import trustme

from runtime import outbound, wire
from runtime.outbound import OutboundRefused
from runtime.wire import OutboundResponse, send

# --- A raw server -----------------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    port: int  # the client's port: one per connection


class Peer:
    """One accepted connection, seen from the server: read requests, write bytes."""

    def __init__(self, sock: socket.socket, port: int, server: RawServer) -> None:
        self.sock = sock
        self.port = port
        self.server = server
        self.reader = sock.makefile("rb")

    def request(self, *, body: bool = True) -> Request | None:
        """The next request on this connection (its body too unless `body` is False), or
        None when the client hung up."""
        line = self.reader.readline(65537)
        if not line.strip():
            return None
        method, path, _ = line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while True:
            raw = self.reader.readline(65537)
            if raw in (b"\r\n", b"\n", b""):
                break
            name, _, value = raw.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            data = self._chunks() if body else b""
        else:
            length = int(headers.get("content-length") or 0)
            data = self.reader.read(length) if body and length else b""
        request = Request(method, path, headers, data, self.port)
        with self.server.lock:
            self.server.requests.append(request)
        return request

    def _chunks(self) -> bytes:
        data = b""
        while size := int(self.reader.readline(65537).split(b";")[0], 16):
            data += self.reader.read(size)
            self.reader.readline(65537)
        while self.reader.readline(65537) not in (b"\r\n", b"\n", b""):
            pass  # trailers
        return data

    def drain(self, length: int) -> None:
        self.reader.read(length)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reset(self) -> None:
        """Close with a TCP RST rather than a FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


Handler = Callable[[Peer], None]


@dataclass
class RawServer:
    handle: Handler
    tls: ssl.SSLContext | None = None
    requests: list[Request] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    release: threading.Event = field(default_factory=threading.Event)  # set at teardown
    peers: list[socket.socket] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.05)
        self.port = int(self.listener.getsockname()[1])
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                sock, address = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._run, args=(sock, int(address[1])), daemon=True).start()

    def _run(self, sock: socket.socket, port: int) -> None:
        sock.settimeout(5)
        with self.lock:
            self.peers.append(sock)
        try:
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
            self.handle(Peer(sock, port, self))
        except (OSError, ValueError):
            pass  # the client hung up or sent nothing: what many of these tests want
        except BaseException as exc:  # kept, not swallowed
            self.errors.append(exc)
        finally:
            sock.close()

    def ports(self) -> list[int]:
        with self.lock:
            return [r.port for r in self.requests]

    def close(self) -> None:
        self.stopped = True
        self.release.set()
        self.listener.close()
        with self.lock:
            peers = list(self.peers)
        for sock in peers:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def raw() -> Iterator[Callable[..., RawServer]]:
    started: list[RawServer] = []

    def start(handle: Handler, tls: ssl.SSLContext | None = None) -> RawServer:
        server = RawServer(handle, tls)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture(autouse=True)
def fresh_pool() -> Iterator[None]:
    """Each test starts and ends with no kept connection of an earlier one."""
    yield
    for pool in list(wire._origins.values()):
        pool.close()
    wire._origins.clear()


@pytest.fixture
def tls(monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A server context for 127.0.0.1 that this process's tool requests trust."""
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    monkeypatch.setitem(wire._ssl_contexts, os.getpid(), client)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    return server


def answer(
    body: bytes = b"",
    *headers: str,
    status: str = "200 OK",
    version: str = "HTTP/1.1",
    length: bool = True,
) -> bytes:
    lines = [f"{version} {status}", *headers]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def echo(request: Request) -> bytes:
    """The request's path and its X-Echo header, as the answer's body."""
    body = json.dumps({"path": request.path, "echo": request.headers.get("x-echo")})
    return answer(body.encode(), "Content-Type: application/json")


WRONG = answer(b'{"path": "WRONG: an answer on a connection that should be closed"}')


def get(
    server: RawServer,
    path: str = "/",
    *,
    timeout: float = 2.0,
    max_bytes: int | None = None,
    method: str = "GET",
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> OutboundResponse:
    return send(
        method,
        server.url + path,
        content=content,
        headers=headers or {},
        timeout=timeout,
        max_bytes=max_bytes,
    )


def path_of(response: OutboundResponse) -> str:
    return str(response.json()["path"])


def _first_then_second(
    server: RawServer, answered: threading.Event, misbehaved: threading.Event
) -> None:
    """GET /first and read its answer; let the server misbehave after it (`answered`), wait
    until it has (`misbehaved`) and its bytes reached the client's socket; then GET /second
    must get /second's own answer."""
    assert path_of(get(server, "/first")) == "/first"
    answered.set()
    assert misbehaved.wait(3)
    time.sleep(0.05)
    assert path_of(get(server, "/second")) == "/second"


def sent_maybe(exc: BaseException) -> None:
    """What a caller needs of an error after the request may have reached the service: an
    httpx error (tools.HttpTool.call knows them), and not ConnectError ("nothing sent")."""
    assert isinstance(exc, httpx.HTTPError), repr(exc)
    assert not isinstance(exc, httpx.ConnectError), repr(exc)


def first_then_echo(first: Callable[[Peer, Request], bool]) -> Handler:
    """The first request the server gets is answered by `first` (which returns whether to
    go on serving its connection); any later request on that connection gets WRONG, and
    every request on another connection its echo."""
    seen = threading.Event()

    def handle(peer: Peer) -> None:
        mine = not seen.is_set()
        seen.set()
        request = peer.request()
        if request is None:
            return
        if mine:
            if not first(peer, request):
                return
            while peer.request() is not None:
                peer.send(WRONG)
            return
        peer.send(echo(request))
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    return handle


# --- Bytes that nobody asked for --------------------------------------------------------


def _aligned_answer() -> bytes:
    """An answer exactly 8192 bytes long: the size of the buffer http.client reads the
    socket with, so whatever follows it is not in that buffer when the answer ends."""
    length = 8192
    while True:
        head = answer(b"", "Content-Type: text/plain", length=False)[:-2]
        head += b"Content-Length: %d\r\n\r\n" % length
        if len(head) + length == 8192:
            return head + b"a" * length
        length = 8192 - len(head)


STALE = answer(b'{"path": "STALE", "id": "T-other-tenant"}', status="201 Created")


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("aligned", [False, True], ids=["small", "aligned-8192"])
def test_bytes_after_the_body_in_the_same_write_never_become_the_next_answer(
    raw: Callable[..., RawServer], tls: ssl.SSLContext, scheme: str, aligned: bool
) -> None:
    """A service writes its answer and, in the same write, a second answer nobody asked for
    (a buggy proxy, a double write). The next request on the connection — perhaps another
    tenant's — must get its own answer, never the leftover."""

    def handle(peer: Peer) -> None:
        request = peer.request()
        if request is None:
            return
        if request.path == "/first":
            first = _aligned_answer() if aligned else echo(request)
            peer.send(first + STALE)  # one write: with TLS, one record
        else:
            peer.send(echo(request))
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    server = raw(handle, tls if scheme == "https" else None)
    first = get(server, "/first")
    assert first.status_code == 200 and len(first.body) > 10
    second = get(server, "/second")
    assert path_of(second) == "/second", second.body
    third = get(server, "/third")
    assert path_of(third) == "/third", third.body


def test_bytes_sent_while_the_connection_is_idle_are_never_an_answer(
    raw: Callable[..., RawServer],
) -> None:
    answered = threading.Event()
    stale_sent = threading.Event()

    def handle(peer: Peer) -> None:
        request = peer.request()
        assert request is not None
        peer.send(echo(request))
        if answered.wait(3):
            peer.send(STALE)
            stale_sent.set()
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    server = raw(handle)
    _first_then_second(server, answered, stale_sent)
    first_port, second_port = server.ports()
    assert first_port != second_port  # the connection that spoke out of turn was dropped


@pytest.mark.parametrize("status", ["204 No Content", "200 OK"])
def test_a_body_after_an_answer_that_has_none_is_never_the_next_answer(
    raw: Callable[..., RawServer], status: str
) -> None:
    """A 204 (or an answer to HEAD) has no body whatever its headers say; bytes a service
    sends after it anyway must not be read as the next request's answer."""

    def handle(peer: Peer) -> None:
        request = peer.request()
        assert request is not None
        peer.send(answer(b"", status=status, length=False).replace(b"\r\n\r\n", b"") + b"\r\n")
        peer.send(b"Content-Length: %d\r\n\r\n" % len(STALE) + STALE)
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    server = raw(handle)
    method = "HEAD" if status == "200 OK" else "GET"
    response = get(server, "/first", method=method)
    assert response.status_code == int(status[:3])
    assert response.body == b""
    assert path_of(get(server, "/second")) == "/second"


@pytest.mark.parametrize("status", [204, 200])
def test_an_answer_without_a_body_leaves_its_connection_ready_for_the_next(
    raw: Callable[..., RawServer], status: int
) -> None:
    def handle(peer: Peer) -> None:
        while (request := peer.request()) is not None:
            if request.path == "/none":
                reason = "No Content" if status == 204 else "OK"
                peer.send(answer(b"", status=f"{status} {reason}", length=status != 204))
            else:
                peer.send(echo(request))

    server = raw(handle)
    for _ in range(2):
        assert get(server, "/none").status_code == status
        assert path_of(get(server, "/after")) == "/after"
    assert len(set(server.ports())) == 1  # a clean answer keeps its connection


def test_a_304_is_refused_and_its_connection_not_reused(raw: Callable[..., RawServer]) -> None:
    def first(peer: Peer, request: Request) -> bool:
        peer.send(answer(b"", 'ETag: "x"', status="304 Not Modified", length=False))
        return True

    server = raw(first_then_echo(first))
    with pytest.raises(OutboundRefused) as refused:
        get(server, "/cached", headers={"If-None-Match": '"x"'})
    assert refused.value.code == "redirect" and refused.value.status_code == 304
    assert path_of(get(server, "/next")) == "/next"
    assert len(set(server.ports())) == 2


# --- Answers cut short or too long ------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_body_cut_short_by_a_close_is_an_error_not_an_answer(
    raw: Callable[..., RawServer], tls: ssl.SSLContext, scheme: str
) -> None:
    """Content-Length says 64 bytes; the service sends a JSON object that happens to be
    whole in the first 19 and hangs up. Taken as the answer it is an "applied" with an id —
    of a request whose answer never arrived. It must be an error (the outcome unknown)."""
    whole = b'{"id": "T-partial"}' + b" " * 45

    def first(peer: Peer, request: Request) -> bool:
        peer.send(answer(b"", status="201 Created", length=False)[:-2])
        peer.send(b"Content-Length: %d\r\n\r\n" % len(whole) + whole[:19])
        peer.close()
        return False

    server = raw(first_then_echo(first), tls if scheme == "https" else None)
    with pytest.raises(Exception) as raised:
        response = get(server, "/tasks", method="POST", content=b"{}")
        pytest.fail(f"a truncated answer was returned as whole: {response}")
    sent_maybe(raised.value)
    assert path_of(get(server, "/next")) == "/next"


def test_a_body_shorter_than_declared_on_an_open_connection_times_out(
    raw: Callable[..., RawServer],
) -> None:
    def first(peer: Peer, request: Request) -> bool:
        peer.send(answer(b"x" * 100)[:-60])
        peer.server.release.wait(4)
        return False

    server = raw(first_then_echo(first))
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        get(server, timeout=0.5)
    assert time.monotonic() - started < 1.6
    assert path_of(get(server, "/next")) == "/next"
    assert len(set(server.ports())) == 2


LENGTHS: dict[str, tuple[bytes, bool]] = {  # what the server sends, and whether it hangs up
    "conflicting": (
        b"HTTP/1.1 201 Created\r\nContent-Length: 13\r\nContent-Length: 53\r\n\r\n"
        + b'{"id": "T-1"}'
        + b"x" * 40,
        False,
    ),
    "not-a-number": (b'HTTP/1.1 201 Created\r\nContent-Length: 13x\r\n\r\n{"id": "T-1"}', True),
    "negative": (b'HTTP/1.1 201 Created\r\nContent-Length: -13\r\n\r\n{"id": "T-1"}', True),
}


def _answer_once(data: bytes, hang_up: bool) -> Callable[[Peer, Request], bool]:
    """The first request's answer: `data` as it is, then a hang-up if `hang_up`."""

    def first(peer: Peer, request: Request) -> bool:
        peer.send(data)
        if hang_up:
            peer.close()
        return not hang_up

    return first


@pytest.mark.parametrize("case", list(LENGTHS))
def test_a_content_length_that_frames_nothing_is_a_protocol_error(
    raw: Callable[..., RawServer], case: str
) -> None:
    """Two Content-Lengths that disagree, or one that is no length (RFC 9112 6.3: an
    unrecoverable error). Which bytes are the body is then a guess, and a guess is how one
    answer's tail becomes the next one's head. httpx (h11) refused such an answer: it must
    not be taken for one ("applied" with an id)."""
    data, hang_up = LENGTHS[case]

    server = raw(first_then_echo(_answer_once(data, hang_up)))
    with pytest.raises(Exception) as raised:
        response = get(server, "/tasks")
        pytest.fail(f"an answer framed by a guess was taken: {response.body!r}")
    sent_maybe(raised.value)
    assert path_of(get(server, "/next")) == "/next"


@pytest.mark.parametrize("framing", ["declared", "chunked", "until-close"])
def test_a_too_large_answer_drops_its_connection(
    raw: Callable[..., RawServer], framing: str
) -> None:
    body = b"y" * 500

    def first(peer: Peer, request: Request) -> bool:
        if framing == "declared":
            peer.send(answer(body))
        elif framing == "chunked":
            peer.send(answer(b"", "Transfer-Encoding: chunked", length=False))
            peer.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        else:
            peer.send(answer(body, "Connection: close", length=False))
            return False
        return True

    server = raw(first_then_echo(first))
    with pytest.raises(OutboundRefused) as refused:
        get(server, "/big", max_bytes=100)
    assert refused.value.code == "too_large"
    assert path_of(get(server, "/next", max_bytes=100)) == "/next"
    assert len(set(server.ports())) == 2


def test_a_redirect_drops_its_connection(raw: Callable[..., RawServer]) -> None:
    def first(peer: Peer, request: Request) -> bool:
        peer.send(answer(b"moved elsewhere", "Location: http://127.0.0.1:1/x", status="302 Found"))
        return True

    server = raw(first_then_echo(first))
    with pytest.raises(OutboundRefused) as refused:
        get(server, "/r")
    assert refused.value.code == "redirect"
    assert path_of(get(server, "/next")) == "/next"
    assert len(set(server.ports())) == 2


# --- Answers that are no answers --------------------------------------------------------

MALFORMED: dict[str, tuple[bytes, bool]] = {  # what the server sends, and whether it hangs up
    "status-not-a-number": (b"HTTP/1.1 2OO OK\r\nContent-Length: 0\r\n\r\n", False),
    "not-http": (b"SSH-2.0-OpenSSH_9.6\r\n", False),
    "unknown-version": (b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
    "status-line-too-long": (b"HTTP/1.1 200 " + b"O" * 70000 + b"\r\n\r\n", False),
    "header-line-too-long": (
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70000 + b"\r\nContent-Length: 0\r\n\r\n",
        False,
    ),
    "too-many-headers": (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"X-H%d: 1\r\n" % i for i in range(150))
        + b"Content-Length: 0\r\n\r\n",
        False,
    ),
    "bad-chunk-size": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        False,
    ),
    "chunk-size-line-too-long": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 70000 + b"5\r\n",
        False,
    ),
    "chunk-cut-short": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nhello", True),
    "chunks-end-without-last": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        True,
    ),
    "nothing-then-close": (b"", True),
    "half-a-status-line": (b"HTTP/1.1 20", True),
    "headers-cut-short": (b"HTTP/1.1 200 OK\r\nContent-Len", True),
    "head-never-ends": (b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n", True),
    "interim-then-close": (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", True),
    "switching-protocols": (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", False),
    "gzip-that-is-not": (
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 10\r\n\r\nnot-gzip!!",
        False,
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_answer_is_an_error_and_its_connection_is_dropped(
    raw: Callable[..., RawServer], case: str
) -> None:
    data, hang_up = MALFORMED[case]

    server = raw(first_then_echo(_answer_once(data, hang_up)))
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        response = get(server, "/tasks", method="POST", content=b"{}", timeout=2)
        pytest.fail(f"a malformed answer was taken: {response}")
    assert time.monotonic() - started < 1.5
    sent_maybe(raised.value)
    assert path_of(get(server, "/next")) == "/next"
    assert len(set(server.ports())) == 2


# --- Answers before the request was read ------------------------------------------------


def test_an_answer_before_the_body_was_read_then_a_hang_up(
    raw: Callable[..., RawServer],
) -> None:
    """A service refuses a large body after its headers (413) and hangs up without reading
    the rest: whether the caller reads the 413 or fails writing, the request did reach the
    service — never ConnectError."""

    def head_only(peer: Peer) -> None:
        if peer.request(body=False) is not None:
            peer.send(answer(b"too big", "Connection: close", status="413 Content Too Large"))
            peer.reset()  # with the body unread

    server = raw(head_only)
    try:
        response = get(server, "/upload", method="POST", content=b"z" * (8 * 1024 * 1024))
    except Exception as exc:  # either outcome is checked
        sent_maybe(exc)
    else:
        assert response.status_code == 413
    assert server.requests and server.requests[0].path == "/upload"


def test_an_early_answer_then_the_body_drained_keeps_answers_in_order(
    raw: Callable[..., RawServer],
) -> None:
    def handle(peer: Peer) -> None:
        request = peer.request(body=False)
        assert request is not None
        peer.send(answer(b'{"path": "/early"}', status="413 Content Too Large"))
        peer.drain(int(request.headers["content-length"]))
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    server = raw(handle)
    refused = get(server, "/upload", method="POST", content=b"z" * 200_000)
    assert refused.status_code == 413 and path_of(refused) == "/early"
    assert path_of(get(server, "/next")) == "/next"


# --- HTTP/1.0 and Connection: close -----------------------------------------------------


@pytest.mark.parametrize(
    "headers, version, reusable",
    [
        ((), "HTTP/1.0", False),
        (("Connection: keep-alive",), "HTTP/1.0", True),
        (("Connection: close",), "HTTP/1.1", False),
        (("Connection: Close, Foo",), "HTTP/1.1", False),
    ],
    ids=["1.0", "1.0-keep-alive", "1.1-close", "1.1-close-listed"],
)
def test_an_answer_that_closes_its_connection_is_honoured_even_if_the_socket_stays_open(
    raw: Callable[..., RawServer], headers: tuple[str, ...], version: str, reusable: bool
) -> None:
    """The server says the connection ends (HTTP/1.0 by default, `Connection: close`) but
    leaves the socket open and would answer WRONG on it: the client must not send there."""

    def handle(peer: Peer) -> None:
        request = peer.request()
        assert request is not None
        body = json.dumps({"path": request.path}).encode()
        peer.send(answer(body, *headers, version=version))
        while (request := peer.request()) is not None:
            peer.send(echo(request) if reusable else WRONG)

    server = raw(handle)
    assert path_of(get(server, "/first")) == "/first"
    assert path_of(get(server, "/second")) == "/second"
    if not reusable:
        assert len(set(server.ports())) == 2


def test_an_http_1_0_body_until_close_is_read_whole(raw: Callable[..., RawServer]) -> None:
    def handle(peer: Peer) -> None:
        request = peer.request()
        assert request is not None
        peer.send(answer(b"", version="HTTP/1.0", length=False))
        for piece in (b'{"path": ', b'"/whole"', b"}"):
            peer.send(piece)
            time.sleep(0.02)
        peer.close()

    server = raw(handle)
    assert path_of(get(server, "/whole")) == "/whole"


# --- Silence, resets and hang-ups -------------------------------------------------------


def test_a_server_that_never_answers_times_out_within_the_timeout(
    raw: Callable[..., RawServer],
) -> None:
    def handle(peer: Peer) -> None:
        peer.request()
        peer.server.release.wait(5)

    server = raw(handle)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        get(server, "/tasks", method="POST", content=b"{}", timeout=0.5)
    elapsed = time.monotonic() - started
    assert 0.4 < elapsed < 1.5
    assert len(server.requests) == 1  # it was sent: ReadTimeout, not ConnectTimeout


def test_a_late_answer_after_a_timeout_never_reaches_the_next_request(
    raw: Callable[..., RawServer],
) -> None:
    timed_out = threading.Event()

    def handle(peer: Peer) -> None:
        while (request := peer.request()) is not None:
            if request.path == "/slow":
                timed_out.wait(3)
                peer.send(STALE)  # the answer, late
            else:
                peer.send(echo(request))

    server = raw(handle)
    assert path_of(get(server, "/first")) == "/first"
    with pytest.raises(httpx.ReadTimeout):
        get(server, "/slow", timeout=0.3)
    timed_out.set()
    time.sleep(0.05)
    assert path_of(get(server, "/next")) == "/next"
    ports = server.ports()
    assert ports[0] == ports[1] != ports[2]


def _drop(peer: Peer, how: str) -> None:
    if how == "reset":
        peer.reset()
    else:
        peer.close()


@pytest.mark.parametrize("how", ["reset", "close"])
def test_a_kept_connection_that_fails_on_its_second_request_is_not_a_connect_error(
    raw: Callable[..., RawServer], how: str
) -> None:
    """The second request went out on a kept connection and the server dropped it without
    an answer: the request may have been applied, so this is never ConnectError (which a
    caller takes for "certainly not sent", and would settle as refused)."""

    def handle(peer: Peer) -> None:
        request = peer.request()
        if request is None:
            return
        if len(peer.server.requests) > 1:  # a later connection
            peer.send(echo(request))
            while (request := peer.request()) is not None:
                peer.send(echo(request))
            return
        peer.send(echo(request))
        if peer.request() is not None:  # the second request arrived whole
            _drop(peer, how)

    server = raw(handle)
    assert path_of(get(server, "/first")) == "/first"
    with pytest.raises(Exception) as raised:
        get(server, "/second", method="POST", content=b"{}")
    sent_maybe(raised.value)
    assert [r.path for r in server.requests] == ["/first", "/second"]
    assert path_of(get(server, "/third")) == "/third"
    ports = server.ports()
    assert ports[0] == ports[1] != ports[2]


@pytest.mark.parametrize("how", ["reset", "close"])
def test_a_kept_connection_the_server_dropped_while_idle_is_not_used(
    raw: Callable[..., RawServer], how: str
) -> None:
    answered = threading.Event()
    dropped = threading.Event()

    def handle(peer: Peer) -> None:
        request = peer.request()
        if request is None:
            return
        peer.send(echo(request))
        if len(peer.server.requests) == 1 and answered.wait(3):
            _drop(peer, how)
            dropped.set()
            return
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    server = raw(handle)
    _first_then_second(server, answered, dropped)
    assert len(set(server.ports())) == 2


# --- The timeout bounds the whole exchange ----------------------------------------------


def _dribble(pieces: Callable[[int], bytes], end: bytes, *, pause: float) -> Handler:
    """Answer with pieces(i) every `pause` seconds for up to 3 s, then `end`: each piece
    well within the read timeout, the whole far past it."""

    def handle(peer: Peer) -> None:
        request = peer.request()
        if request is None:
            return
        stop = time.monotonic() + 3
        i = 0
        while time.monotonic() < stop:
            peer.send(pieces(i))
            i += 1
            if pause:
                time.sleep(pause)
        peer.send(end)
        peer.server.release.wait(2)

    return handle


DRIBBLES: dict[str, tuple[Callable[[int], bytes], bytes, float]] = {
    "header-lines": (
        lambda i: (b"HTTP/1.1 200 OK\r\n" if i == 0 else b"") + b"X-Slow-%d: 1\r\n" % (i % 90),
        b"Content-Length: 2\r\n\r\n{}",
        0.1,
    ),
    "status-line-bytes": (
        lambda i: b"HTTP/1.1 200 " if i == 0 else b"O",
        b"\r\nContent-Length: 2\r\n\r\n{}",
        0.1,
    ),
    "interim-answers": (
        lambda i: b"HTTP/1.1 103 Early Hints\r\nLink: </%d>\r\n\r\n" % i,
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        0.1,
    ),
    "interim-answers-flood": (
        lambda i: b"HTTP/1.1 103 Early Hints\r\n\r\n" * 64,
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        0.0,
    ),
    "trailer-flood": (
        lambda i: (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
            if i == 0
            else b"X-Trailer: 1\r\n" * 64
        ),
        b"\r\n",
        0.0,
    ),
}


@pytest.mark.parametrize("case", list(DRIBBLES))
def test_an_answer_whose_head_never_ends_is_bounded_by_the_timeout(
    raw: Callable[..., RawServer], case: str
) -> None:
    """The body is read within `timeout` overall (the deadline); the status line, headers,
    interim answers and trailers must be too: each read within the per-read timeout, the
    whole head dribbled over seconds, or streamed without end."""
    pieces, end, pause = DRIBBLES[case]
    server = raw(_dribble(pieces, end, pause=pause))
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        response = get(server, "/tasks", timeout=0.5)
        pytest.fail(
            f"answered {response.status_code} after {time.monotonic() - started:.1f}s "
            "with a 0.5s timeout"
        )
    elapsed = time.monotonic() - started
    sent_maybe(raised.value)
    assert isinstance(raised.value, httpx.TimeoutException), repr(raised.value)
    assert elapsed < 1.6, f"{elapsed:.1f}s with a 0.5s timeout"


# --- What the caller passes cannot reframe the request ----------------------------------


@pytest.mark.parametrize(
    "framing, content",
    [
        ({"Content-Length": "2"}, b"{}GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"),
        (
            {"Transfer-Encoding": "chunked"},
            b"2\r\n{}\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
    ],
    ids=["content-length", "transfer-encoding"],
)
def test_the_caller_cannot_reframe_the_body_into_a_second_request(
    raw: Callable[..., RawServer], framing: dict[str, str], content: bytes
) -> None:
    """Framing is send's: a Content-Length or Transfer-Encoding in `headers` that does not
    describe `content` makes the rest of the body a second request on the connection, and
    its answer a stray one waiting on the kept connection for the next caller. Tool
    definitions reserve these headers (tooldefs.RESERVED_HEADERS); send, the public entry,
    must not depend on every caller having been checked: it refuses, or frames the body
    itself."""

    def handle(peer: Peer) -> None:
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    server = raw(handle)
    try:
        get(server, "/tasks", method="POST", content=content, headers=framing)
    except httpx.HTTPError:
        assert server.requests == []  # refused before sending: fine
        return
    time.sleep(0.1)  # a smuggled request reaches the server
    assert [(r.path, r.body) for r in server.requests] == [("/tasks", content)]


def test_a_header_that_would_inject_lines_sends_nothing(raw: Callable[..., RawServer]) -> None:
    def handle(peer: Peer) -> None:
        while (request := peer.request()) is not None:
            peer.send(echo(request))

    server = raw(handle)
    with pytest.raises(outbound.OutboundRefused, match="bad_header") as refused:
        get(server, "/x", headers={"X-A": "1\r\nX-Injected: 1"})
    assert "Injected" not in str(refused.value)  # a value is never quoted: it may be a secret
    with pytest.raises(outbound.OutboundRefused, match="bad_header"):
        get(server, "/x", headers={"X-A\r\nX-Injected": "1"})
    assert path_of(get(server, "/next")) == "/next"
    assert [r.path for r in server.requests] == ["/next"]


# --- Many threads, one origin -----------------------------------------------------------


def test_concurrent_sends_to_one_origin_each_get_their_own_answer(
    raw: Callable[..., RawServer],
) -> None:
    """Threads (tenants) share the origin's pool: each answer reaches the request it
    answers, also while some connections fail under them."""

    def handle(peer: Peer) -> None:
        while (request := peer.request()) is not None:
            tag = request.headers.get("x-echo", "")
            time.sleep(0.001 * (hash(tag) % 4))
            if tag.endswith("-bad"):
                peer.send(b"NOT HTTP AT ALL\r\n")
                return
            peer.send(echo(request))

    server = raw(handle)

    def worker(n: int) -> list[str]:
        problems: list[str] = []
        for i in range(12):
            tag = f"t{n}-r{i}" + ("-bad" if (n + i) % 5 == 0 else "")
            try:
                response = get(server, f"/{tag}", headers={"X-Echo": tag})
            except httpx.HTTPError as exc:
                if not tag.endswith("-bad") or isinstance(exc, httpx.ConnectError):
                    problems.append(f"{tag}: {exc!r}")
                continue
            body: dict[str, Any] = response.json()
            if tag.endswith("-bad") or body != {"path": f"/{tag}", "echo": tag}:
                problems.append(f"{tag}: got {body}")
        return problems

    with ThreadPoolExecutor(8) as pool:
        problems = [p for found in pool.map(worker, range(8)) for p in found]
    assert problems == []
    assert len(server.requests) == 96


# --- The table of origins ---------------------------------------------------------------


def serve_echo(peer: Peer) -> None:
    while (request := peer.request()) is not None:
        peer.send(echo(request))


def test_a_busy_origin_keeps_its_connection_while_others_come_and_go(
    raw: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table of pools is bounded; past its limit the pool used longest ago goes, not
    every pool: a tool sending all the time keeps its kept-alive connection while one-off
    origins (other tenants' webhook receivers) pass through."""
    monkeypatch.setattr(wire, "_ORIGIN_LIMIT", 3)
    busy = raw(serve_echo)
    passing = [raw(serve_echo) for _ in range(6)]
    assert path_of(get(busy, "/0")) == "/0"
    for n, other in enumerate(passing, start=1):
        assert path_of(get(other, "/once")) == "/once"
        assert path_of(get(busy, f"/{n}")) == f"/{n}"
        assert len(wire._origins) <= 3
    assert len(busy.ports()) == 7
    assert len(set(busy.ports())) == 1  # one connection for all seven requests
    # The first passing origins were retired, and their kept connections closed with them:
    # asked again, each connects anew.
    assert path_of(get(passing[0], "/again")) == "/again"
    assert len(set(passing[0].ports())) == 2
