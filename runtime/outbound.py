"""Outbound requests on a tenant's behalf: the checks that keep a tool definition from
turning Holdpoint's workers into a probe of the networks they run in.

A tenant admin types a tool's URL (API.md, "Tools as data"); the worker then sends to it
from inside the operator's network. So every request here is held to three rules, none of
which a definition can loosen: the host must be one the operator allowed
(`HOLDPOINT_TOOL_HOSTS`); every address the name resolves to must be public unless the
operator allowed its network (`HOLDPOINT_TOOL_PRIVATE_NETWORKS`); and the connection goes to
the address that was checked, never to a second DNS answer (rebinding). Redirects are not
followed and answers are read up to a cap, so a service can neither bounce the request
elsewhere nor exhaust a worker's memory.

Pure module: reads settings, knows no model.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import ipaddress
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings

from audit.canonical import MAX_DEPTH, TOO_DEEP, deeper_than
from runtime import tracing
from runtime.storable import storable_escapes, storable_text

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class OutboundRefused(Exception):
    """A request Holdpoint will not send, or an answer it will not take.

    `code` is one of CODES. Raised before connecting (host_not_allowed, private_address,
    bad_url, bad_header) nothing was sent; raised after (redirect, too_large) the request
    did reach the service, which is why the caller, not this module, decides what that
    means for the effect. `status_code` is the answer's status when there was one.
    """

    CODES = (
        "host_not_allowed",
        "private_address",
        "redirect",
        "too_large",
        "bad_url",
        "bad_header",
    )

    def __init__(self, code: str, detail: str, *, status_code: int | None = None) -> None:
        if code not in self.CODES:
            raise ValueError(f"unknown refusal code {code!r}")
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.status_code = status_code


def _normal_host(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))  # one spelling per address (::1 == 0:0::1)
    except ValueError:
        return host.removesuffix(".")


def host_allowed(host: str, patterns: Sequence[str]) -> bool:
    """Whether `host` matches one of the operator's patterns: a host exactly, or
    `*.example.com` for its subdomains at any depth (not example.com itself). A lone `*`
    matches nothing: "anywhere" would include every internal name."""
    name = _normal_host(host)
    if not name:
        return False
    for raw in patterns:
        pattern = raw.strip().lower()
        if pattern.startswith("*."):
            suffix = _normal_host(pattern[2:])
            if suffix and "*" not in suffix and name.endswith("." + suffix):
                return True
        elif pattern and "*" not in pattern and name == _normal_host(pattern):
            return True
    return False


def check_patterns(patterns: Iterable[str]) -> None:
    """Refuse host patterns that would allow more than the operator can have meant (ValueError
    naming the first): `*`, a wildcard anywhere but a leading `*.`, or `*.` before a bare
    top-level name."""
    for raw in patterns:
        pattern = raw.strip().lower()
        rest = pattern[2:] if pattern.startswith("*.") else pattern
        if not rest or "*" in rest or (pattern.startswith("*.") and "." not in rest):
            raise ValueError(
                f"host pattern {raw!r} is not allowed: name hosts exactly or as *.example.com"
            )
        if any(c in rest for c in ":/@[] ") and not _is_address(rest):
            # `api.example.com:8443` or a URL would never match a request's host: refused
            # rather than silently allowing nothing.
            raise ValueError(
                f"host pattern {raw!r} is not allowed: name hosts without a scheme, port or path"
            )


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _allowed_networks() -> tuple[IPNetwork, ...]:
    """HOLDPOINT_TOOL_PRIVATE_NETWORKS, parsed once per value of the setting."""
    return _parsed_networks(tuple(settings.HOLDPOINT_TOOL_PRIVATE_NETWORKS))


@functools.lru_cache(maxsize=16)
def _parsed_networks(cidrs: tuple[str, ...]) -> tuple[IPNetwork, ...]:
    return parse_networks(cidrs)


def parse_networks(cidrs: Iterable[str]) -> tuple[IPNetwork, ...]:
    """The networks in `cidrs` (ValueError naming a malformed one)."""
    networks: list[IPNetwork] = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr.strip(), strict=True))
        except ValueError as exc:
            raise ValueError(f"{cidr!r} is not a network in CIDR form: {exc}") from None
    return tuple(networks)


def check_url(url: str, reach: Reach | None = None) -> None:
    """Static check when a definition (or another URL requests will go to) is saved: a
    well-formed http(s) URL to a host allowed — the tools' hosts, or `reach`'s. No DNS: what
    a name resolves to is judged at send time, every time. A template must be compiled
    first (UrlTemplate.compile): `http://{x}.example.com` would pass here as a subdomain.

    A `reach` that allows any host judges by address alone, so a host written as an address
    is judged here too (a webhook to http://169.254.169.254/ is the form's error, not a
    refusal recorded at every event); the tools' reach names its hosts, and an operator who
    allowed an address there chose it."""
    if reach is None:
        _allowed_host(url)
        return
    host = _judged_url(url, reach.hosts)[0]
    address = host if _is_address(host) else _old_ipv4(host)
    if address is None:
        return  # a name: its addresses are judged when a request goes out
    if not address_allowed(address, reach.networks):
        raise OutboundRefused(
            "private_address", f"{host} is not a public address, nor in a network allowed"
        )


_IPV4_SPELLING = re.compile(r"[0-9a-fx.]+")


def _old_ipv4(host: str) -> str | None:
    """A host in one of the IPv4 spellings the resolver takes as an address though
    `ipaddress` does not — decimal (2852039166), octal (0251.0376.0251.0376), hex
    (0xa9fea9fe), short (127.1) — as its dotted quad; None for a name. inet_aton is the
    resolver's own parser (it stops at a space: only the characters of these spellings
    reach it)."""
    if not _IPV4_SPELLING.fullmatch(host):
        return None
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return None


def _allowed_host(url: str) -> tuple[str, int, str]:
    """(host, port, scheme) of an allowed URL."""
    return _judged_url(url, tuple(settings.HOLDPOINT_TOOL_HOSTS))


@functools.lru_cache(maxsize=1024)
def _judged_url(url: str, hosts: tuple[str, ...] | None) -> tuple[str, int, str]:
    """`_allowed_host`, remembered per URL and allowlist (a tool sends to a few URLs many
    times; the allowlist is part of the key, so a changed setting is judged afresh). A
    refusal is an exception, never remembered. `hosts` None: any well-formed host (a
    `Reach` judged by its addresses alone)."""
    try:
        split = urlsplit(url)
        port = split.port
    except ValueError as exc:
        raise OutboundRefused("bad_url", f"not a valid URL: {exc}") from None
    if split.scheme not in ("http", "https"):
        raise OutboundRefused("bad_url", "the URL must start with http:// or https://")
    if "@" in split.netloc:
        raise OutboundRefused("bad_url", "the URL may not contain a user name or password")
    host = (split.hostname or "").lower()
    if not host:
        raise OutboundRefused("bad_url", "the URL must name a host")
    if not host.isascii():
        raise OutboundRefused("bad_url", "write a non-ASCII host in its xn-- form")
    if hosts is not None and not host_allowed(host, hosts):
        raise OutboundRefused(
            "host_not_allowed", f"{host} is not among the hosts allowed (HOLDPOINT_TOOL_HOSTS)"
        )
    return host, port or (443 if split.scheme == "https" else 80), split.scheme


# What no header value may hold: control characters but the tab (a line break would end the
# header and start another) and anything past Latin-1, the bytes http.client writes.
_NOT_IN_A_HEADER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]|[^\x00-\xff]")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def check_headers(headers: Mapping[str, str]) -> None:
    """OutboundRefused("bad_header") for a header that cannot be sent as it is, naming the
    header and never its value: the HTTP libraries' own errors quote the whole value, and a
    value may be a credential (the message becomes an action's error, which every member of
    the tenant reads, and goes into the journal)."""
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise OutboundRefused("bad_header", f"{name[:100]!r} is not a header name")
        if _NOT_IN_A_HEADER.search(value):
            raise OutboundRefused(
                "bad_header",
                f"the {name} header holds a line break or a character HTTP headers cannot carry"
                " (its value is not shown)",
            )


# --- Addresses --------------------------------------------------------------------------

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Not public, whatever this interpreter's `ipaddress` says: its tables are its release's
# (before 3.11.10 and 3.12.4 all of 192.0.0.0/24 was global — 192.0.0.192 is a cloud's
# metadata address in SSRF payload lists), no release knows the IPv6 documentation range
# (RFC 9637), and the deprecated site-local range is still routed inside some networks.
_NOT_PUBLIC = tuple(
    ipaddress.ip_network(cidr) for cidr in ("192.0.0.0/24", "3fff::/20", "fec0::/10")
)


def _embedded(address: IPAddress) -> list[IPAddress]:
    """The IPv4 addresses an IPv6 address carries (mapped, 6to4, Teredo, NAT64): each
    reaches that IPv4 host, so each is judged too."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    found: list[IPAddress] = []
    if address.ipv4_mapped:
        found.append(address.ipv4_mapped)
    if address.sixtofour:
        found.append(address.sixtofour)
    if address.teredo:
        found.extend(address.teredo)
    if address in _NAT64:
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def _public(address: IPAddress) -> bool:
    return not (
        not address.is_global
        or address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or any(address in network for network in _NOT_PUBLIC)
    ) and all(_public(inner) for inner in _embedded(address))


def address_allowed(address: str, networks: Sequence[IPNetwork] | None = None) -> bool:
    """Whether Holdpoint may connect to `address`: a public one, or one inside a network
    the operator allowed (`networks`, by default HOLDPOINT_TOOL_PRIVATE_NETWORKS)."""
    return _judged_address(address, tuple(_allowed_networks() if networks is None else networks))


@functools.lru_cache(maxsize=1024)
def _judged_address(address: str, networks: tuple[IPNetwork, ...]) -> bool:
    """`address_allowed`, remembered per address and set of networks allowed (an address is
    judged the same way every time; which addresses a name resolves to is not remembered)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    candidates = [ip, *([ip.ipv4_mapped] if isinstance(ip, ipaddress.IPv6Address) else [])]
    if any(c is not None and c in net for c in candidates for net in networks):
        return True
    return _public(ip)


def resolve(host: str, port: int, networks: Sequence[IPNetwork] | None = None) -> list[str]:
    """Every address `host` resolves to, each refused unless allowed — public, or inside
    `networks` (by default HOLDPOINT_TOOL_PRIVATE_NETWORKS) — all must be: which one the
    connection would use is not ours to predict. A name that does not resolve is an
    httpx.ConnectError, as httpx itself would raise: certainly nothing was sent."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise httpx.ConnectError(f"DNS lookup of {host} failed: {exc}") from None
    if networks is None:
        networks = _allowed_networks()
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        if not address_allowed(address, networks):
            raise OutboundRefused(
                "private_address", f"{host} resolves to {address}, which is not public"
            )
    return addresses


@dataclass(frozen=True)
class Reach:
    """Where one kind of request may go, when not a tool's (HOLDPOINT_TOOL_HOSTS and
    HOLDPOINT_TOOL_PRIVATE_NETWORKS): `hosts`, the host patterns allowed (None: any host,
    judged by its addresses alone — a webhook receiver its tenant typed), and the networks
    allowed beside public addresses. The other rules hold whatever the reach: the connection
    goes to the address that was checked, no redirect is followed, the answer is capped."""

    hosts: tuple[str, ...] | None
    networks: tuple[IPNetwork, ...]


# Every address: a Reach's networks when its operator allows private addresses altogether.
EVERYWHERE: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("0.0.0.0/0"),
    ipaddress.ip_network("::/0"),
)


@dataclass(frozen=True)
class Vetted:
    """Where one connection may go: an allowed host and the addresses it resolved to, every
    one allowed. A client connects to these, never to a second DNS answer."""

    host: str
    port: int
    scheme: str
    addresses: tuple[str, ...]


def vet(url: str) -> Vetted:
    """The checks `send` makes before connecting, for a caller with its own client (an MCP
    session): OutboundRefused (nothing sent), or httpx.ConnectError if the name does not
    resolve (nothing sent either)."""
    host, port, scheme = _allowed_host(url)
    return Vetted(host, port, scheme, tuple(resolve(host, port)))


# --- Sending ----------------------------------------------------------------------------


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
    if reach is None:
        host, port, scheme = _allowed_host(url)
        addresses = resolve(host, port)
    else:
        host, port, scheme = _judged_url(url, reach.hosts)
        addresses = resolve(host, port, reach.networks)
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
    for address in addresses:
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
