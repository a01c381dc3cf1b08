"""Outbound requests on a tenant's behalf: the checks that keep a tool definition from
turning Holdpoint's workers into a probe of the networks they run in.

A tenant admin types a tool's URL (API.md, "Tools as data"); the worker then sends to it
from inside the operator's network. So every request here is held to three rules, none of
which a definition can loosen: the host must be one the operator allowed
(`HOLDPOINT_TOOL_HOSTS`); every address the name resolves to must be public unless the
operator allowed its network (`HOLDPOINT_TOOL_PRIVATE_NETWORKS`); and the connection goes to
the address that was checked, never to a second DNS answer (rebinding; `vet` hands the
checked addresses to runtime.wire, which connects to nothing else). There redirects are not
followed and answers are read up to a cap, so a service can neither bounce the request
elsewhere nor exhaust a worker's memory.

Pure module: reads settings, knows no model.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from django.conf import settings

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


def host_allowed(host: str, patterns: Sequence[str], port: int | None = None) -> bool:
    """Whether `host` (and `port`) matches one of the operator's patterns: a host exactly, or
    `*.example.com` for its subdomains at any depth (not example.com itself), either of them
    optionally with a port (`api.example.com:443`, `[::1]:8080`) that allows only that port
    — without one, every port. A lone `*` matches nothing: "anywhere" would include every
    internal name. `port` None: a pattern that names a port never matches."""
    name = _normal_host(host)
    if not name:
        return False
    for raw in patterns:
        pattern, only = split_port(raw.strip().lower())
        if only is not None and only != port:
            continue
        if pattern.startswith("*."):
            suffix = _normal_host(pattern[2:])
            if suffix and "*" not in suffix and name.endswith("." + suffix):
                return True
        elif pattern and "*" not in pattern and name == _normal_host(pattern):
            return True
    return False


def split_port(pattern: str) -> tuple[str, int | None]:
    """A host pattern and the port it names (None: none). ValueError for a port that is not
    a number from 1 to 65535. A bare IPv6 address (`::1`, several colons) names no port;
    one with a port is written in brackets (`[::1]:8080`)."""
    if pattern.startswith("["):
        end = pattern.find("]")
        if end < 0 or not pattern[end + 1 :]:
            return pattern, None
        host, tail = pattern[: end + 1], pattern[end + 1 :]
        if not tail.startswith(":"):
            raise ValueError("after an address in brackets only a port may follow")
        number = tail[1:]
    elif pattern.count(":") == 1:
        host, _, number = pattern.partition(":")
    else:
        return pattern, None
    if not (number.isascii() and number.isdigit() and 1 <= int(number) <= 65535):
        raise ValueError(f"the port in {pattern!r} is not a number from 1 to 65535")
    return host, int(number)


def check_patterns(patterns: Iterable[str]) -> None:
    """Refuse host patterns that would allow more than the operator can have meant, or
    nothing (ValueError naming the first): `*`, a wildcard anywhere but a leading `*.`, `*.`
    before a bare top-level name, a scheme, a path, a user, a port out of range."""
    for raw in patterns:
        try:
            pattern, _ = split_port(raw.strip().lower())
        except ValueError as exc:
            raise ValueError(f"host pattern {raw!r} is not allowed: {exc}") from None
        rest = pattern[2:] if pattern.startswith("*.") else pattern
        if not rest or "*" in rest or (pattern.startswith("*.") and "." not in rest):
            raise ValueError(
                f"host pattern {raw!r} is not allowed: name hosts exactly or as *.example.com"
            )
        if any(c in rest for c in ":/@[] ") and not _is_address(rest):
            # A URL, a path or a user would never match a request's host: refused rather
            # than silently allowing nothing.
            raise ValueError(
                f"host pattern {raw!r} is not allowed: name hosts (and a port) without a"
                " scheme, user or path"
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
    port = port or (443 if split.scheme == "https" else 80)
    if hosts is not None and not host_allowed(host, hosts, port):
        raise OutboundRefused("host_not_allowed", _not_allowed(host, port, hosts))
    return host, port, split.scheme


def _not_allowed(host: str, port: int, hosts: tuple[str, ...]) -> str:
    """Why `host_not_allowed`: the host, or only this port of it."""
    if host_allowed(host, [split_port(p.strip().lower())[0] for p in hosts], port):
        return f"port {port} of {host} is not among the ports allowed (HOLDPOINT_TOOL_HOSTS)"
    return f"{host} is not among the hosts allowed (HOLDPOINT_TOOL_HOSTS)"


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
# 168.63.129.16 is a public address Microsoft owns, answered inside every Azure VM by the host
# (the WireServer: the VM agent's configuration, extension settings with their secrets, DNS):
# in SSRF payload lists beside 169.254.169.254, and never a tool's service.
_NOT_PUBLIC = tuple(
    ipaddress.ip_network(cidr)
    for cidr in ("192.0.0.0/24", "3fff::/20", "fec0::/10", "168.63.129.16/32")
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


def vet(url: str, reach: Reach | None = None) -> Vetted:
    """The checks made before connecting (runtime.wire.send's, and a caller's with its own
    client, an MCP session's): OutboundRefused (nothing sent), or httpx.ConnectError if the
    name does not resolve (nothing sent either). `reach`: where a request that is not a
    tool's may go (the tools' settings otherwise)."""
    if reach is None:
        host, port, scheme = _allowed_host(url)
        return Vetted(host, port, scheme, tuple(resolve(host, port)))
    host, port, scheme = _judged_url(url, reach.hosts)
    return Vetted(host, port, scheme, tuple(resolve(host, port, reach.networks)))
