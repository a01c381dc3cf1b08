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

import functools
import ipaddress
import json
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, quote, unquote, urlsplit

import httpx
from django.conf import settings

from runtime import tracing

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class OutboundRefused(Exception):
    """A request Holdpoint will not send, or an answer it will not take.

    `code` is one of CODES. Raised before connecting (host_not_allowed, private_address,
    bad_url) nothing was sent; raised after (redirect, too_large) the request did reach the
    service, which is why the caller, not this module, decides what that means for the
    effect. `status_code` is the answer's status when there was one.
    """

    CODES = ("host_not_allowed", "private_address", "redirect", "too_large", "bad_url")

    def __init__(self, code: str, detail: str, *, status_code: int | None = None) -> None:
        if code not in self.CODES:
            raise ValueError(f"unknown refusal code {code!r}")
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.status_code = status_code


class TemplateError(ValueError):
    """A URL template that cannot be used (or values it cannot be filled with); the message
    is a sentence a tenant admin can act on, shown as the field's error."""


# --- URL templates ----------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Characters a template may hold outside placeholders: RFC 3986's unreserved and reserved
# ones and '%'. Anything else (spaces, backslashes, non-ASCII) is refused rather than
# guessed at: parsers disagree about them, and a disagreement is how a host check is fooled.
_LITERAL = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_DOT_SEGMENTS = {".", ".."}


@dataclass(frozen=True)
class _Part:
    literal: str
    name: str | None  # the placeholder after the literal, if any


@dataclass(frozen=True)
class UrlTemplate:
    """A tool's URL with `{name}` placeholders filled from the call's params.

    Placeholders may stand only in the path and in query values, and every value is
    percent-encoded whole, so no value can move the request to another scheme, host or
    port, add a path segment or a query parameter, or start a fragment.
    """

    text: str
    parts: tuple[_Part, ...] = field(repr=False)

    @classmethod
    def compile(cls, text: str) -> UrlTemplate:
        parts: list[_Part] = []
        position = 0
        for match in _PLACEHOLDER.finditer(text):
            parts.append(_Part(text[position : match.start()], match.group(1)))
            position = match.end()
        parts.append(_Part(text[position:], None))
        for part in parts:
            if "{" in part.literal or "}" in part.literal:
                raise TemplateError(
                    "Braces are only allowed around a placeholder name, as in {task_id} "
                    "(letters, digits and _, not starting with a digit)."
                )
            if not _LITERAL.fullmatch(part.literal):
                raise TemplateError(
                    "The URL may only contain ASCII letters, digits and URL punctuation: "
                    "percent-encode anything else, and write a non-ASCII host in its xn-- form."
                )
            if _PERCENT.search(part.literal):
                raise TemplateError("A % in the URL must start a percent-encoded byte (%2F).")
        # Braces are neither reserved nor special to urlsplit, so where each placeholder
        # landed can be read off the template as written.
        split = urlsplit(text)
        if split.scheme not in ("http", "https"):
            raise TemplateError("The URL must start with http:// or https://.")
        if "#" in text:
            raise TemplateError("The URL may not have a fragment (#...).")
        if "{" in split.netloc:
            raise TemplateError(
                "Placeholders may only be used in the URL's path and query values, not in "
                "its host, port or user name."
            )
        if "@" in split.netloc:
            raise TemplateError("The URL may not contain a user name or password.")
        try:
            split.port  # noqa: B018 (validates the port)
        except ValueError:
            raise TemplateError("The URL's port must be a number from 0 to 65535.") from None
        if not split.hostname:
            raise TemplateError("The URL must name a host.")
        for pair in split.query.split("&"):
            if "{" in pair.partition("=")[0]:
                raise TemplateError(
                    "Placeholders may be used as query values (?key={name}), not as query keys."
                )
        for segment in split.path.split("/"):
            if "{" not in segment and unquote(segment) in _DOT_SEGMENTS:
                raise TemplateError("A URL path segment may not be '.' or '..'.")
        return cls(text=text, parts=tuple(parts))

    @property
    def _split(self) -> SplitResult:
        return urlsplit(self.text)

    @property
    def scheme(self) -> str:
        return self._split.scheme

    @property
    def host(self) -> str:
        return (self._split.hostname or "").lower()

    @property
    def placeholders(self) -> tuple[str, ...]:
        """Each name once, in order of first appearance."""
        return tuple(dict.fromkeys(part.name for part in self.parts if part.name is not None))

    def render(self, values: Mapping[str, Any]) -> str:
        out: list[str] = []
        for part in self.parts:
            out.append(part.literal)
            if part.name is None:
                continue
            if part.name not in values:
                raise TemplateError(f"The URL needs a value for {{{part.name}}}.")
            out.append(quote(_scalar(part.name, values[part.name]), safe=""))
        url = "".join(out)
        self._check_path(url)
        return url

    @staticmethod
    def _check_path(url: str) -> None:
        # A whole segment "." or ".." (or %2E%2E, which servers and proxies decode) is
        # resolved away by clients and proxies: /tasks/{id} with id ".." would reach /.
        for segment in urlsplit(url).path.split("/"):
            if unquote(segment) in _DOT_SEGMENTS:
                raise TemplateError("A URL path segment may not be '.' or '..'.")


def _scalar(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # as the params' JSON spells it
    if isinstance(value, str | int | float):
        return str(value)
    what = "null" if value is None else type(value).__name__
    raise TemplateError(f"{{{name}}} must be a string or a number to go into the URL, not {what}.")


# --- Hosts ------------------------------------------------------------------------------


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


def check_url(url: str) -> None:
    """Static check when a definition is saved: a well-formed http(s) URL to an allowed
    host. No DNS: what a name resolves to is judged at send time, every time. A template
    must be compiled first (UrlTemplate.compile): `http://{x}.example.com` would pass here
    as a subdomain."""
    _allowed_host(url)


def _allowed_host(url: str) -> tuple[str, int, str]:
    """(host, port, scheme) of an allowed URL."""
    return _judged_url(url, tuple(settings.HOLDPOINT_TOOL_HOSTS))


@functools.lru_cache(maxsize=1024)
def _judged_url(url: str, hosts: tuple[str, ...]) -> tuple[str, int, str]:
    """`_allowed_host`, remembered per URL and allowlist (a tool sends to a few URLs many
    times; the allowlist is part of the key, so a changed setting is judged afresh). A
    refusal is an exception, never remembered."""
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
    if not host_allowed(host, hosts):
        raise OutboundRefused(
            "host_not_allowed", f"{host} is not among the hosts allowed (HOLDPOINT_TOOL_HOSTS)"
        )
    return host, port or (443 if split.scheme == "https" else 80), split.scheme


# --- Addresses --------------------------------------------------------------------------

_NAT64 = ipaddress.ip_network("64:ff9b::/96")


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


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, each refused unless allowed (all must be: which
    one the connection would use is not ours to predict). A name that does not resolve is
    an httpx.ConnectError, as httpx itself would raise: certainly nothing was sent."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise httpx.ConnectError(f"DNS lookup of {host} failed: {exc}") from None
    networks = _allowed_networks()
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        if not address_allowed(address, networks):
            raise OutboundRefused(
                "private_address", f"{host} resolves to {address}, which is not public"
            )
    return addresses


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
        return json.loads(self.body)

    @property
    def text(self) -> str:
        match = re.search(r"charset=\"?([\w.:-]+)", self.headers.get("content-type", ""), re.I)
        try:
            return self.body.decode(match.group(1) if match else "utf-8", errors="replace")
        except LookupError:  # a charset Python does not know
            return self.body.decode("utf-8", errors="replace")


_tool_transports: dict[tuple[int, str], httpx.HTTPTransport] = {}
_ssl_contexts: dict[int, ssl.SSLContext] = {}
_lock = threading.Lock()
# Unless a definition names its own: what a service's logs show for Holdpoint's requests.
USER_AGENT = "Holdpoint-Tools/1"


def tool_transport(host: str) -> httpx.HTTPTransport:
    """The connection pool for requests to `host` from this process.

    One per host, not one per process: requests go to the vetted IP, and httpx pools
    connections by (scheme, IP, port), so two names on one address (a CDN, a shared
    ingress) would otherwise share a TLS connection that was verified for the first name
    only. The CA bundle is loaded once per process and shared (a fresh one per call is
    about 20 ms of CPU).

    A transport, not an httpx.Client: a client's extras are each wrong here or unused. Its
    cookie jar is shared by every tenant and tool sending to the host, so a session one
    answer set would ride on another tenant's next request; it would follow redirects and
    read proxies from the environment (which resolve the name again) unless told not to;
    it logs every request's URL at INFO. What is left — build the request, send, read — is
    `send`'s, at about a quarter less CPU per call.
    """
    pid = os.getpid()
    transport = _tool_transports.get((pid, host))
    if transport is None:
        with _lock:
            context = _ssl_contexts.get(pid)
            if context is None:
                context = _ssl_contexts[pid] = httpx.create_ssl_context(trust_env=False)
            if len(_tool_transports) >= 256:  # hosts come from definitions: keep it bounded
                _tool_transports.clear()
            transport = _tool_transports[(pid, host)] = httpx.HTTPTransport(
                verify=context, trust_env=False
            )
    return transport


def send(
    method: str,
    url: str,
    *,
    content: bytes | None,
    headers: Mapping[str, str],
    timeout: float,
    max_bytes: int | None = None,
) -> OutboundResponse:
    """Send one request to an allowed host at a vetted address; the whole answer, or a
    refusal.

    The allowlist is checked again (settings may have changed since the definition was
    saved), the name is resolved once, and the connection goes to that address with the
    real name in `Host` and in TLS's SNI (so the certificate is still checked against it).
    A 3xx is OutboundRefused("redirect") and nothing goes to its Location. The body is read
    up to `max_bytes` (HOLDPOINT_TOOL_MAX_RESPONSE_BYTES) and within `timeout` overall; past
    either the connection is dropped. httpx's own errors propagate: ConnectError means
    nothing was sent, the others that the caller cannot know.
    """
    host, port, scheme = _allowed_host(url)
    limit = settings.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES if max_bytes is None else max_bytes
    addresses = resolve(host, port)
    sent_headers = {k: v for k, v in headers.items() if k.lower() != "host"}
    sent_headers["Host"] = _target(url, None)[1]  # host[:port] as the URL gave it
    # Identity unless the caller asks otherwise: a compressed answer is capped after
    # decompression, but one chunk could still inflate a thousandfold in memory.
    if not any(k.lower() == "accept-encoding" for k in sent_headers):
        sent_headers["Accept-Encoding"] = "identity"
    # The current (send, runtime.observe.sending) span's traceparent; nothing when tracing is off.
    # tracing, not observe: settings imports this module before the apps (observe needs them).
    tracing.inject(sent_headers)
    if not any(k.lower() == "user-agent" for k in sent_headers):
        sent_headers["User-Agent"] = USER_AGENT
    extensions: dict[str, Any] = {"timeout": httpx.Timeout(timeout).as_dict()}
    if scheme == "https":
        extensions["sni_hostname"] = host
    transport = tool_transport(host)
    deadline = time.monotonic() + timeout
    error: httpx.ConnectError | None = None
    for address in addresses:
        request = httpx.Request(
            method,
            _target(url, address)[0],
            content=content,
            headers=sent_headers,
            extensions=extensions,
        )
        try:
            return _exchange(transport, request, limit, deadline, timeout)
        except httpx.ConnectError as exc:  # nothing sent: the next address may answer
            error = exc
    assert error is not None  # resolve() returns at least one address or raises
    raise error


@functools.lru_cache(maxsize=1024)
def _target(url: str, address: str | None) -> tuple[httpx.URL, str]:
    """`url` with the host replaced by `address` (as a connection goes to it), and the
    `Host` header it is sent with — parsed once per URL and address."""
    parsed = httpx.URL(url)
    target = parsed if address is None else parsed.copy_with(host=address.split("%", 1)[0])
    return target, parsed.netloc.decode("ascii")


def _exchange(
    transport: httpx.HTTPTransport,
    request: httpx.Request,
    limit: int,
    deadline: float,
    timeout: float,
) -> OutboundResponse:
    try:
        response = transport.handle_request(request)
    except httpx.TransportError as exc:
        exc.request = request  # as a client would: the error names what was being sent
        raise
    response.request = request
    try:
        if 300 <= response.status_code < 400:
            location = response.headers.get("location", "")
            raise OutboundRefused(
                "redirect",
                f"HTTP {response.status_code} redirect to {location or '(no Location)'}"
                " (not followed)",
                status_code=response.status_code,
            )
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(response, limit)
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise _too_large(response, limit)
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(
                    f"the answer was not complete within {timeout:g}s", request=request
                )
        return OutboundResponse(response.status_code, response.headers, b"".join(chunks))
    finally:
        response.close()  # unread: the connection is dropped, not returned to the pool


def _too_large(response: httpx.Response, limit: int) -> OutboundRefused:
    return OutboundRefused(
        "too_large",
        f"the answer is larger than {limit} bytes (HOLDPOINT_TOOL_MAX_RESPONSE_BYTES)",
        status_code=response.status_code,
    )
