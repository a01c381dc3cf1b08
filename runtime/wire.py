"""Outbound requests on the wire: one request to a vetted address and its whole answer.

runtime.outbound decides where a request may go (the allowed hosts, the public or allowed
addresses a name resolves to); this module sends it there and nowhere else: the connection goes
to the address that was checked, with the real name in `Host` and TLS's SNI, no redirect is
followed, and the answer is read up to a cap within the timeout overall. Kept apart from the
rules so each reads on its own: the rules are pure judgement over names and addresses, the wire
is sockets, pools and HTTP framing.

Pure module: reads settings, knows no model.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import json
import math
import os
import re
import select
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

from audit.canonical import MAX_DEPTH, TOO_DEEP, deeper_than
from runtime import tracing
from runtime.outbound import OutboundRefused, Reach, check_headers, vet
from runtime.storable import storable_escapes, storable_text


@dataclass(frozen=True)
class OutboundResponse:
    status_code: int
    headers: httpx.Headers
    body: bytes

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not — also when it nests deeper than
        MAX_DEPTH, the limit of all JSON Holdpoint takes in. Python's parser reads a little
        deeper than its encoder writes again, so an answer ~940 deep parsed as proof and then
        failed the step's commit that stores it; deeper still, the parser raised
        RecursionError, which no caller expected from a service's answer."""
        try:
            # NaN and ±Infinity (JSON has none; Python's parser takes them) as their text:
            # no database column nor the journal takes them, and the answer is the proof of
            # an effect that happened — refusing it would leave that effect unrecorded.
            # A NUL or a lone surrogate escape as U+FFFD (runtime.storable).
            value = json.loads(storable_escapes(self.body), parse_constant=str)
        except RecursionError:
            raise ValueError(TOO_DEEP) from None
        if deeper_than(value, MAX_DEPTH):
            raise ValueError(TOO_DEEP)
        return value

    @property
    def text(self) -> str:
        """The body as text a column takes (a NUL as U+FFFD: runtime.storable)."""
        match = re.search(r"charset=\"?([\w.:-]+)", self.headers.get("content-type", ""), re.I)
        try:
            text = self.body.decode(match.group(1) if match else "utf-8", errors="replace")
        except LookupError:  # a charset Python does not know
            text = self.body.decode("utf-8", errors="replace")
        return storable_text(text)


# Unless a definition names its own: what a service's logs show for Holdpoint's requests.
USER_AGENT = "Holdpoint-Tools/1"
_IDLE_PER_ORIGIN = 20  # keep-alive connections kept per origin, as httpx's pool keeps
_KEEPALIVE_EXPIRY = 5.0  # seconds an idle connection is kept (httpx's default)
_ORIGIN_LIMIT = 256  # origins come from definitions: keep the table bounded


class _Deadline(io.RawIOBase):
    """The socket's reads, refused once the request's deadline has passed: the whole
    answer — a head that never ends (a header a second, a flood of interim answers or of
    trailers) as much as a body that trickles — is bounded by the timeout overall, not only
    each read by it."""

    def __init__(self, raw: Any, deadline: float) -> None:
        self.raw, self.deadline = raw, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        if time.monotonic() > self.deadline:
            raise TimeoutError("the answer was not complete in time")
        return self.raw.readinto(buffer)  # type: ignore[no-any-return]

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


class _Lines(io.BufferedReader):
    """A line cut short by the end of the stream is an error, not a line: http.client takes
    the end of the stream inside a head (or a chunk's size, or its trailer) for its end, so
    an answer cut after its status line would read as complete."""

    def readline(self, size: int | None = -1) -> bytes:
        line = super().readline(size)
        if not line.endswith(b"\n") and (size is None or size < 0 or len(line) < size):
            raise http.client.IncompleteRead(line)
        return line


class _Answer(http.client.HTTPResponse):
    """http.client's response, read within the request's deadline (`_Deadline`), with no
    line cut short (`_Lines`), and with every interim (1xx) answer before the real one read
    and dropped, as h11 does: http.client skips only `100 Continue`, and would take a
    `103 Early Hints` for the answer — "refused" for a request the service applied, and the
    real answer left in the connection for the next request on it to read."""

    def __init__(
        self,
        sock: Any,
        debuglevel: int = 0,
        method: str | None = None,
        url: Any = None,
        *,
        deadline: float = math.inf,
    ) -> None:
        super().__init__(sock, debuglevel, method, url)
        self.fp.close()  # the reader http.client made: replaced by one that keeps the rules
        self.fp = _Lines(_Deadline(sock.makefile("rb", buffering=0), deadline))

    def _read_status(self) -> tuple[str, int, str]:
        # http.client internals: begin() reads the status line through _read_status and
        # skips only a 100's headers itself; _read_headers reads one header block.
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if status == 101 or not 100 < status < 200:  # a 101 is refused by _read
                return version, status, reason
            http.client._read_headers(self.fp)  # type: ignore[attr-defined]


class _Pinned(http.client.HTTPConnection):
    """A connection that only ever uses the socket `Origin` opened to the vetted address.
    http.client reconnects by itself when its socket is gone (to `host`, without TLS): here
    that is refused, so a closed connection can never be reopened but by `Origin`."""

    response_class = _Answer

    def connect(self) -> None:
        raise httpx.ConnectError("the connection was closed; not reopened outside Origin")


class Origin:
    """Keep-alive connections from this process to one vetted address of one host.

    Keyed by scheme, host, address and port — not by address alone: two names on one
    address (a CDN, a shared ingress) must not share a TLS connection verified for the
    first name only. A connection serves one request at a time; an idle one is reused while
    it is fresh and the server has not closed it, else dropped.

    The standard library's http.client, not httpx's pool: for the one request/answer shape
    tools need it costs a third less CPU per call (no h11 state machine, headers and body
    in one write, the socket's timeout set once rather than before every read), and what an
    httpx Client would add is each wrong here anyway (a cookie jar shared by every tenant
    sending to the host, redirects, proxies from the environment). Where http.client is
    laxer than h11 it is held to h11's rules (`_Answer`, `_read`, `_pending`; each pinned by
    tests/runtime/test_outbound_wire.py against a raw misbehaving server). Errors are raised as
    httpx's, with httpx's meaning: ConnectError (and only it) means nothing was sent.
    """

    def __init__(self, scheme: str, host: str, address: str, port: int) -> None:
        self.scheme, self.host, self.address, self.port = scheme, host, address, port
        self._idle: list[tuple[_Pinned, float]] = []
        self._lock = threading.Lock()
        self.retired = False
        self.used = time.monotonic()  # when `origin` last handed it out (the table's LRU)

    def exchange(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        content: bytes | None,
        *,
        timeout: float,
        limit: int,
        deadline: float,
    ) -> OutboundResponse:
        """One request on a connection of this origin (reused, or opened to the address);
        the whole answer. The connection goes back to the pool only after a complete answer
        that leaves it open; on anything else it is closed."""
        conn = self._reuse(timeout) or self._connect(timeout)
        conn.response_class = functools.partial(_Answer, deadline=deadline)  # type: ignore[assignment]
        # The framing is http.client's: a caller's Content-Length or Transfer-Encoding could
        # make part of the body a second request on the kept connection.
        sent = {k: v for k, v in headers.items() if k.lower() not in _FRAMING}
        keep = False
        try:
            try:
                conn.request(method, target, body=content, headers=sent)
            except TimeoutError:
                raise httpx.WriteTimeout(f"sending to {self.host} timed out") from None
            except (ValueError, http.client.HTTPException) as exc:  # an illegal header
                raise httpx.LocalProtocolError(str(exc)) from None
            except OSError as exc:
                raise httpx.WriteError(f"sending to {self.host} failed: {exc}") from None
            with self._reading(timeout):
                response = conn.getresponse()
                answer = self._read(response, limit)
            keep = not response.will_close and conn.sock is not None and not _pending(conn.sock)
            return answer
        finally:
            if keep:
                self._release(conn)
            else:
                conn.close()  # unread or unusable: dropped, never returned to the pool

    @contextlib.contextmanager
    def _reading(self, timeout: float) -> Iterator[None]:
        """The answer's errors as httpx's: the request may have reached the service. A
        timeout is the socket's for one read or `_Deadline`'s for the whole answer."""
        try:
            yield
        except TimeoutError:
            raise httpx.ReadTimeout(
                f"no complete answer from {self.host} within {timeout:g}s"
            ) from None
        except http.client.HTTPException as exc:  # a head or a body cut short, a bad chunk
            raise httpx.RemoteProtocolError(f"bad answer from {self.host}: {exc!r}") from None
        except OSError as exc:
            raise httpx.ReadError(f"reading from {self.host} failed: {exc}") from None

    def _read(self, response: http.client.HTTPResponse, limit: int) -> OutboundResponse:
        """The whole answer, within `limit` bytes; the exchange's deadline bounds every read
        of it (`_Deadline`)."""
        status = response.status
        if status < 200:  # 101: a switch of protocols nobody asked for (other 1xx skipped)
            raise httpx.RemoteProtocolError(f"{self.host} answered HTTP {status} to a request")
        # http.client decodes header bytes as Latin-1; kept so, any byte reads back as sent.
        headers = httpx.Headers(response.getheaders(), encoding="iso-8859-1")
        if 300 <= status < 400:
            location = headers.get("location", "")
            raise OutboundRefused(
                "redirect",
                f"HTTP {status} redirect to {location or '(no Location)'} (not followed)",
                status_code=status,
            )
        lengths = set(headers.get_list("content-length", split_commas=True))
        framed = len(lengths) == 1 and next(iter(lengths)).isdigit()
        if lengths and not response.chunked and not framed:
            # Two lengths, or one that is no number: http.client would frame the body by a
            # guess (the first, or until the connection closes); h11 refused it.
            raise httpx.RemoteProtocolError(f"an answer framed by Content-Length {lengths}")
        declared = next(iter(lengths), "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(status, limit)
        inflate = _Inflate.chain(headers.get_list("content-encoding", split_commas=True))
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := response.read1(65536):
                for step in inflate:  # never more than the room left: a bomb stops here
                    chunk = step.feed(chunk, limit - size)
                size += len(chunk)
                if size > limit:
                    raise _too_large(status, limit)
                chunks.append(chunk)
        except _PastTheCap:
            raise _too_large(status, limit) from None
        except zlib.error as exc:
            raise httpx.DecodingError(f"the answer does not decode: {exc}") from None
        if response.length:  # bytes still owed: the connection ended before the body
            raise httpx.RemoteProtocolError(
                f"{self.host} closed the connection {response.length} bytes before the"
                " end of the answer"
            )
        if inflate and not inflate[0].ended:
            raise httpx.DecodingError(f"the {inflate[0].coding} answer ended early")
        response.close()  # read to its end: the connection may take the next request
        return OutboundResponse(status, headers, b"".join(chunks))

    def _connect(self, timeout: float) -> _Pinned:
        try:
            sock = socket.create_connection((self.address, self.port), timeout=timeout)
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"connecting to {self.host} ({self.address}) timed out"
            ) from None
        except OSError as exc:
            raise httpx.ConnectError(
                f"connecting to {self.host} ({self.address}) failed: {exc}"
            ) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.scheme == "https":  # SNI and the certificate check: the host's name
                sock = _ssl_context().wrap_socket(sock, server_hostname=self.host)
        except TimeoutError:
            sock.close()
            raise httpx.ConnectTimeout(f"TLS with {self.host} timed out") from None
        except OSError as exc:  # ssl.SSLError among them: a certificate refused
            sock.close()
            raise httpx.ConnectError(f"TLS with {self.host} failed: {exc}") from None
        conn = _Pinned(self.address, self.port, timeout=timeout)
        conn.sock = sock
        return conn

    def _reuse(self, timeout: float) -> _Pinned | None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn, since = self._idle.pop()
            sock = conn.sock
            if sock is None or now - since > _KEEPALIVE_EXPIRY or _readable(sock) or _pending(sock):
                conn.close()  # expired, or the server closed it (or sent what nobody asked)
                continue
            if conn.timeout != timeout:
                conn.timeout = timeout
                sock.settimeout(timeout)
            return conn

    def _release(self, conn: _Pinned) -> None:
        with self._lock:
            if not self.retired and len(self._idle) < _IDLE_PER_ORIGIN:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; one in use is closed when its request ends."""
        with self._lock:
            self.retired = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


class _Inflate:
    """A `Content-Encoding` of gzip or deflate undone as the answer is read, as httpx did —
    the answer is asked for as identity, but a definition may ask for compression and a
    service may compress anyway. Each call inflates at most one byte more than the room left
    under the cap, so a small compressed chunk cannot grow a thousandfold in memory before
    the cap is checked (a step that would have to inflate more is refused as too large). A
    coding it does not know (br, zstd) leaves the bytes as they came, as httpx does for a
    coding it cannot decode."""

    CODINGS = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.first = True
        self.z = zlib.decompressobj(self.CODINGS[coding])

    @classmethod
    def chain(cls, codings: list[str]) -> list[_Inflate]:
        """Decoders in the order the bytes go through them (the last coding applied first)."""
        names = [c.strip().lower() for c in codings]
        return [cls(name) for name in reversed(names) if name in cls.CODINGS]

    @property
    def ended(self) -> bool:
        return self.z.eof

    def feed(self, data: bytes, room: int) -> bytes:
        try:
            out = self.z.decompress(data, max(room, 0) + 1)
        except zlib.error:
            if not (self.first and self.coding == "deflate"):
                raise
            # "deflate" without its zlib header, as some servers send it (httpx retries so).
            self.z = zlib.decompressobj(-zlib.MAX_WBITS)
            self.coding = "raw deflate"
            out = self.z.decompress(data, max(room, 0) + 1)
        self.first = False
        if self.z.unconsumed_tail:  # it inflates past the room left: refused as too large
            raise _PastTheCap()
        return out


class _PastTheCap(Exception):
    pass


def _pending(sock: socket.socket) -> bool:
    """Bytes the TLS layer has already decrypted and nobody asked for: the socket does not
    show them (poll sees only what the kernel holds)."""
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})


def _readable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


_origins: dict[tuple[int, str, str, str, int], Origin] = {}
_ssl_contexts: dict[int, ssl.SSLContext] = {}
_lock = threading.Lock()


def _ssl_context() -> ssl.SSLContext:
    """The CA bundle httpx would use (certifi's, not the environment's), loaded once per
    process and shared (a fresh one per call is about 20 ms of CPU)."""
    pid = os.getpid()
    context = _ssl_contexts.get(pid)
    if context is None:
        with _lock:
            context = _ssl_contexts.get(pid)
            if context is None:
                context = _ssl_contexts[pid] = httpx.create_ssl_context(trust_env=False)
    return context


def origin(scheme: str, host: str, address: str, port: int) -> Origin:
    """This process's connection pool for `host` at the vetted `address` (a forked worker
    gets its own: sockets are never shared across processes)."""
    key = (os.getpid(), scheme, host, address, port)
    found = _origins.get(key)
    if found is None:
        with _lock:
            found = _origins.get(key)
            if found is None:
                if len(_origins) >= _ORIGIN_LIMIT:
                    _retire_least_recent()
                found = _origins[key] = Origin(scheme, host, address, port)
    found.used = time.monotonic()
    return found


def _retire_least_recent() -> None:
    """Make room for one origin (under `_lock`): the one used longest ago is closed — not
    every pool at once, so origins that come and go (many tenants' webhook receivers, a
    tool per customer host) do not cost the busy ones their kept connections. A caller
    still holding the retired pool finishes its request; the connection is then closed."""
    oldest = min(_origins, key=lambda key: _origins[key].used)
    _origins.pop(oldest).close()


def send(
    method: str,
    url: str,
    *,
    content: bytes | None,
    headers: Mapping[str, str],
    timeout: float,
    max_bytes: int | None = None,
    reach: Reach | None = None,
) -> OutboundResponse:
    """Send one request to an allowed host at a vetted address; the whole answer, or a
    refusal.

    The allowlist is checked again (settings may have changed since the definition was
    saved), the name is resolved once, and the connection goes to that address with the
    real name in `Host` and in TLS's SNI (so the certificate is still checked against it).
    A 3xx is OutboundRefused("redirect") and nothing goes to its Location. The body is read
    up to `max_bytes` (HOLDPOINT_TOOL_MAX_RESPONSE_BYTES) and within `timeout` overall; past
    either the connection is dropped. httpx's errors are raised: ConnectError means nothing
    was sent, the others that the caller cannot know. `reach`: where a request that is not
    a tool's may go (the tools' settings otherwise).
    """
    vetted = vet(url, reach)
    host, port, scheme = vetted.host, vetted.port, vetted.scheme
    limit = settings.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES if max_bytes is None else max_bytes
    target, host_header = _target(url)
    sent_headers = {k: v for k, v in headers.items() if k.lower() != "host"}
    check_headers(sent_headers)
    sent_headers["Host"] = host_header  # host[:port] as the URL gave it
    # Identity unless the caller asks otherwise: nothing to inflate at all. A compressed
    # answer is still read, inflated within the cap (`_Inflate`).
    if not any(k.lower() == "accept-encoding" for k in sent_headers):
        sent_headers["Accept-Encoding"] = "identity"
    # The current (send, runtime.observe.sending) span's traceparent; nothing when tracing is off.
    # tracing, not observe: settings imports this module before the apps (observe needs them).
    tracing.inject(sent_headers)
    if not any(k.lower() == "user-agent" for k in sent_headers):
        sent_headers["User-Agent"] = USER_AGENT
    deadline = time.monotonic() + timeout
    error: httpx.ConnectError | None = None
    for address in vetted.addresses:
        try:
            return origin(scheme, host, address, port).exchange(
                method,
                target,
                sent_headers,
                content,
                timeout=timeout,
                limit=limit,
                deadline=deadline,
            )
        except httpx.ConnectError as exc:  # nothing sent: the next address may answer
            error = exc
    assert error is not None  # resolve() returns at least one address or raises
    raise error


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, str]:
    """The request target (path and query, as a connection sends it) and the `Host`
    header of `url` — parsed once per URL."""
    parsed = httpx.URL(url)
    return parsed.raw_path.decode("ascii"), parsed.netloc.decode("ascii")


def _too_large(status: int, limit: int) -> OutboundRefused:
    return OutboundRefused(
        "too_large",
        f"the answer is larger than {limit} bytes (HOLDPOINT_TOOL_MAX_RESPONSE_BYTES)",
        status_code=status,
    )
