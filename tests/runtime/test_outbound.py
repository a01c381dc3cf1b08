"""The outbound-safety layer of HTTP tools, against real servers on real sockets.

A tool's URL is typed by a tenant admin and sent by a worker inside the operator's
network, so each refusal here is a probe that must not happen: to a host the operator did
not allow, to a private address, along a redirect, or past the response cap.
"""

from __future__ import annotations

import gzip
import os
import socket
import ssl
import subprocess
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from runtime import outbound, wire
from runtime.outbound import (
    OutboundRefused,
    address_allowed,
    check_patterns,
    check_url,
    host_allowed,
    parse_networks,
)
from runtime.wire import send
from tests.httpservers import Behaviour, Server, answer_json, answer_with, stream_forever

ROOT = Path(__file__).resolve().parents[2]


# --- Host patterns and settings ---------------------------------------------------------


@pytest.mark.parametrize(
    "host, patterns, allowed",
    [
        ("api.example.com", ["api.example.com"], True),
        ("API.Example.COM", ["api.example.com"], True),
        ("api.example.com", ["API.EXAMPLE.COM"], True),
        ("api.example.com.", ["api.example.com"], True),
        ("example.com", ["*.example.com"], False),
        ("a.example.com", ["*.example.com"], True),
        ("a.b.c.example.com", ["*.example.com"], True),
        ("evilexample.com", ["*.example.com"], False),
        ("example.com.evil.net", ["*.example.com", "example.com"], False),
        ("api.example.com", ["example.com"], False),
        ("anything.net", ["*"], False),
        ("localhost", ["*"], False),
        ("a.example.com", ["a.*.com"], False),
        ("127.0.0.1", ["127.0.0.1"], True),
        ("127.0.0.2", ["127.0.0.1"], False),
        ("::1", ["[::1]"], True),
        ("[::1]", ["::1"], True),
        ("[0:0::1]", ["::1"], True),
        ("::2", ["::1"], False),
        ("", ["", "*."], False),
        ("api.example.com", [], False),
    ],
)
def test_host_allowed(host: str, patterns: list[str], allowed: bool) -> None:
    assert host_allowed(host, patterns) is allowed
    assert host_allowed(host, patterns, 8443) is allowed  # a pattern without a port: any


@pytest.mark.parametrize(
    "host, port, patterns, allowed",
    [
        ("api.example.com", 443, ["api.example.com:443"], True),
        ("api.example.com", 8443, ["api.example.com:443"], False),
        ("api.example.com", None, ["api.example.com:443"], False),
        ("api.example.com", 8443, ["api.example.com:443", "api.example.com:8443"], True),
        ("api.example.com", 22, ["api.example.com:443", "api.example.com"], True),
        ("a.example.com", 443, ["*.example.com:443"], True),
        ("a.example.com", 80, ["*.example.com:443"], False),
        ("example.com", 443, ["*.example.com:443"], False),
        ("::1", 8080, ["[::1]:8080"], True),
        ("::1", 8081, ["[::1]:8080"], False),
        ("::1", 8081, ["::1"], True),
        ("127.0.0.1", 8765, ["127.0.0.1:8765"], True),
        ("127.0.0.1", 6379, ["127.0.0.1:8765"], False),
        ("127.0.0.2", 8765, ["127.0.0.1:8765"], False),
    ],
)
def test_a_pattern_with_a_port_allows_that_port_only(
    host: str, port: int | None, patterns: list[str], allowed: bool
) -> None:
    assert host_allowed(host, patterns, port) is allowed


@pytest.mark.parametrize(
    "pattern",
    [
        *("*", "*.", "a.*.com", "*.*.example.com", "*.com", "", "x*"),
        # Would never match a request's host: a scheme, a path, a user.
        *("https://api.example.com", "api.example.com/v1", "u@h.com", "u@h.com:443"),
        # A port that is no port.
        *("api.example.com:0", "api.example.com:65536", "api.example.com:", "h.com:https"),
        *("[::1]:", "[::1]x", "*.example.com:-1", "h.com:٣"),
    ],
)
def test_check_patterns_refuses_what_would_allow_too_much(pattern: str) -> None:
    with pytest.raises(ValueError, match="not allowed"):
        check_patterns(["api.example.com", pattern])


def test_check_patterns_and_networks_accept_good_values() -> None:
    check_patterns(["api.example.com", "*.example.com", "127.0.0.1", "::1", "[::1]"])
    check_patterns(["api.example.com:8443", "127.0.0.1:80", "[::1]:8080", "*.example.com:443"])
    assert [str(n) for n in parse_networks(["10.0.0.0/8", "::1/128"])] == ["10.0.0.0/8", "::1/128"]
    with pytest.raises(ValueError, match="CIDR"):
        parse_networks(["10.0.0.1/8"])
    with pytest.raises(ValueError, match="CIDR"):
        parse_networks(["ten"])


def _settings_process(**env: str) -> subprocess.CompletedProcess[str]:
    """Import the production settings in a clean process with `env`."""
    base = {
        "PATH": "/usr/bin:/bin",
        "DEBUG": "0",
        "SECRET_KEY": "s" * 60,
        "HOLDPOINT_SECRET_KEYS": "bGVuZ3RoLW9mLXRoaXMta2V5LWlzLTMyLWJ5dGVzISE=",
        "HOLDPOINT_VAR_DIR": str(ROOT / "var" / "test" / "settings-probe"),
    }
    code = (
        "import config.settings as s; "
        "print(s.HOLDPOINT_TOOL_HOSTS, s.HOLDPOINT_TOOL_PRIVATE_NETWORKS, "
        "s.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES)"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=base | env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_settings_default_to_nothing_in_production_and_refuse_bad_values() -> None:
    result = _settings_process()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "[]", "1048576"]
    dev = _settings_process(DEBUG="1")
    assert dev.stdout.strip() == "['127.0.0.1', 'localhost'] ['127.0.0.0/8', '::1/128'] 1048576"
    for name, value in [
        ("HOLDPOINT_TOOL_HOSTS", "api.example.com,*"),
        ("HOLDPOINT_TOOL_HOSTS", "api.example.com:99999"),
        ("HOLDPOINT_TOOL_PRIVATE_NETWORKS", "10.0.0.0/33"),
    ]:
        bad = _settings_process(**{name: value})
        assert bad.returncode != 0
        assert f"EnvError: {name}:" in bad.stderr


def test_check_url(settings: Any) -> None:
    settings.HOLDPOINT_TOOL_HOSTS = ["api.example.com", "*.corp.example", "ops.example:8443"]
    check_url("https://api.example.com/tasks")
    check_url("http://a.b.corp.example:8080/x?y=1")
    check_url("https://ops.example:8443/x")
    for url, code in [
        ("https://other.example.com/", "host_not_allowed"),
        ("https://corp.example/", "host_not_allowed"),
        ("https://ops.example/", "host_not_allowed"),  # 443: not the port allowed
        ("http://ops.example:6379/", "host_not_allowed"),
        ("ftp://api.example.com/", "bad_url"),
        ("https://user:pw@api.example.com/", "bad_url"),
        ("https://api.example.com:99999/", "bad_url"),
        ("https:///path", "bad_url"),
        ("api.example.com/tasks", "bad_url"),
    ]:
        with pytest.raises(OutboundRefused) as refused:
            check_url(url)
        assert refused.value.code == code, url


# --- Addresses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # carrier-grade NAT
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fe80::1%eth0",
        "fc00::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "2001:db8::1",  # documentation
        # Not public either, though the interpreter's tables may say so (`_NOT_PUBLIC`):
        "192.0.0.192",  # IETF protocol assignments; a cloud's legacy metadata address
        "192.0.0.8",  # the IPv4 dummy address
        "3fff::1",  # documentation (RFC 9637)
        "fec0::1",  # site-local (deprecated, still routed inside some networks)
        "168.63.129.16",  # public, but inside an Azure VM its host's WireServer
        "::ffff:168.63.129.16",
    ],
)
def test_private_addresses_are_refused(address: str) -> None:
    assert address_allowed(address, networks=()) is False


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_allowed(address, networks=()) is True


def test_allowed_private_networks() -> None:
    networks = parse_networks(["127.0.0.0/8", "10.1.0.0/16"])
    assert address_allowed("127.0.0.1", networks)
    assert address_allowed("::ffff:127.0.0.1", networks)  # the same host, mapped
    assert address_allowed("10.1.2.3", networks)
    assert not address_allowed("10.2.0.1", networks)
    assert not address_allowed("169.254.169.254", networks)
    assert not address_allowed("::1", networks)


# --- Sending ----------------------------------------------------------------------------


def test_send_delivers_with_the_original_host_header(serve: Any) -> None:
    server = serve(answer_json)
    response = send(
        "POST",
        f"http://localhost:{server.port}/tasks?x=1",
        content=b'{"title": "t"}',
        headers={"Content-Type": "application/json", "Idempotency-Key": "k1", "Host": "evil"},
        timeout=5,
    )
    assert response.status_code == 201
    assert response.json()["id"] == "T-1"
    assert "T-1" in response.text
    assert response.headers["content-type"].startswith("application/json")
    [request] = server.requests
    assert request["method"] == "POST"
    assert request["path"] == "/tasks?x=1"
    assert request["body"] == b'{"title": "t"}'
    assert request["headers"]["host"] == f"localhost:{server.port}"
    assert request["headers"]["idempotency-key"] == "k1"
    assert request["headers"]["accept-encoding"] == "identity"
    assert request["headers"]["user-agent"] == wire.USER_AGENT
    assert "cookie" not in request["headers"]


def test_a_user_agent_the_caller_names_is_kept(serve: Any) -> None:
    server = serve(answer_json)
    send("GET", server.url + "/", content=None, headers={"User-Agent": "acme/2"}, timeout=5)
    assert server.requests[0]["headers"]["user-agent"] == "acme/2"


def test_redirect_is_refused_and_never_followed(serve: Any) -> None:
    second = serve(answer_json)

    def redirect(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response(302)
        handler.send_header("Location", second.url + "/stolen")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    first = serve(redirect)
    with pytest.raises(OutboundRefused) as refused:
        send("POST", first.url + "/tasks", content=b"{}", headers={}, timeout=5)
    assert refused.value.code == "redirect"
    assert refused.value.status_code == 302
    assert second.url + "/stolen" in refused.value.detail
    assert len(first.requests) == 1
    assert second.requests == []


def test_a_cookie_one_answer_sets_is_never_sent_again(serve: Any) -> None:
    """Requests to a host share one pooled client whatever tenant or tool sends them: a
    cookie kept from one answer (a session a service hands out on login) would ride on the
    next request to that host — another tenant's — and speak as the first. Nothing is
    kept."""

    server = serve(
        answer_with(
            201,
            b'{"id": "T-1"}',
            ("Set-Cookie", "session=tenant-a-secret; Path=/"),
            ("Set-Cookie", "other=x; Path=/; Max-Age=3600"),
        )
    )
    for url in (server.url + "/login", f"http://localhost:{server.port}/login"):
        for _ in range(2):
            send("POST", url, content=b"{}", headers={}, timeout=5)
    assert len(server.requests) == 4
    assert [r["headers"].get("cookie") for r in server.requests] == [None] * 4


@pytest.mark.parametrize("declare", [False, True], ids=["streamed", "content-length"])
def test_an_answer_past_the_cap_is_cut_off(serve: Any, settings: Any, declare: bool) -> None:
    total = 50 * 1024 * 1024
    server = serve(stream_forever(total, declare=declare))
    assert settings.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES == 1024 * 1024
    started = time.monotonic()
    with pytest.raises(OutboundRefused) as refused:
        send("GET", server.url + "/big", content=None, headers={}, timeout=30)
    elapsed = time.monotonic() - started
    assert refused.value.code == "too_large"
    assert refused.value.status_code == 200
    assert elapsed < 5
    # Give the handler a moment to notice the hang-up: it must have been far from done.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        before = server.written[0]
        time.sleep(0.2)
        if server.written[0] == before:
            break
    assert server.written[0] < total // 4


def test_max_bytes_argument_overrides_the_setting(serve: Any) -> None:
    server = serve(answer_json)
    with pytest.raises(OutboundRefused) as refused:
        send("GET", server.url, content=None, headers={}, timeout=5, max_bytes=10)
    assert refused.value.code == "too_large"


def test_a_trickling_answer_is_bounded_by_the_timeout_overall(serve: Any) -> None:
    def trickle(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        try:
            for _ in range(1000):  # each byte well within the read timeout
                handler.wfile.write(b"x")
                handler.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    server = serve(trickle)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        send("GET", server.url, content=None, headers={}, timeout=1)
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_is_refused_unless_its_network_is_allowed(
    serve: Any, settings: Any, host: str
) -> None:
    server = serve(answer_json)
    settings.HOLDPOINT_TOOL_PRIVATE_NETWORKS = ["10.0.0.0/8"]
    with pytest.raises(OutboundRefused) as refused:
        send("GET", f"http://{host}:{server.port}/", content=None, headers={}, timeout=5)
    assert refused.value.code == "private_address"
    assert server.requests == []


def test_send_rechecks_the_host_allowlist(serve: Any, settings: Any) -> None:
    server = serve(answer_json)
    settings.HOLDPOINT_TOOL_HOSTS = ["localhost"]
    with pytest.raises(OutboundRefused) as refused:
        send("GET", server.url, content=None, headers={}, timeout=5)
    assert refused.value.code == "host_not_allowed"
    assert server.requests == []


def test_connect_failure_is_an_httpx_connect_error(settings: Any) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(httpx.ConnectError):
        send("GET", f"http://127.0.0.1:{port}/", content=None, headers={}, timeout=5)
    settings.HOLDPOINT_TOOL_HOSTS = ["no-such-host.invalid"]
    with pytest.raises(httpx.ConnectError, match="DNS"):
        send("GET", "http://no-such-host.invalid/", content=None, headers={}, timeout=5)


def test_the_connection_goes_to_the_vetted_address(
    serve: Any, settings: Any, dns: dict[str, list[list[str]]]
) -> None:
    server = serve(answer_json)
    settings.HOLDPOINT_TOOL_HOSTS = ["rebind.test"]
    # Checked: loopback (allowed in tests). Any later lookup: the metadata service.
    dns["rebind.test"] = [["127.0.0.1"], ["169.254.169.254"]]
    response = send(
        "GET", f"http://rebind.test:{server.port}/x", content=None, headers={}, timeout=3
    )
    assert response.status_code == 201
    assert server.requests[0]["headers"]["host"] == f"rebind.test:{server.port}"


def test_an_address_the_interpreter_calls_global_but_is_not_is_refused_before_connecting(
    settings: Any, dns: dict[str, list[list[str]]]
) -> None:
    """`ipaddress` judges by its Python release's tables: before 3.11.10 and 3.12.4 all of
    192.0.0.0/24 was global (192.0.0.192 is in SSRF payload lists as a cloud's metadata
    address), and no release knows the IPv6 documentation range 3fff::/20 — so whether a
    tool could reach them depended on the interpreter a worker ran. Azure's WireServer
    (168.63.129.16) is public to every release. `vet` (what an MCP
    session and `send` check before connecting) refuses them, and so does a webhook's form."""
    settings.HOLDPOINT_TOOL_HOSTS = ["imds.test"]
    for address in ("192.0.0.192", "3fff::1", "fec0::1", "168.63.129.16"):
        dns["imds.test"] = [[address]]
        with pytest.raises(OutboundRefused) as refused:
            outbound.vet("http://imds.test/latest/meta-data/")
        assert refused.value.code == "private_address", address
    webhooks = outbound.Reach(hosts=None, networks=())
    with pytest.raises(OutboundRefused) as refused:
        check_url("http://192.0.0.192/latest/user-data/", webhooks)
    assert refused.value.code == "private_address"


@pytest.mark.parametrize(
    "host",
    ["2852039166", "0xa9fea9fe", "0251.0376.0251.0376", "169.254.43518", "0x7f.1", "0"],
)
def test_an_address_in_an_old_spelling_is_judged_when_a_webhook_is_saved(host: str) -> None:
    """The resolver takes decimal, octal, hex and short IPv4 spellings as addresses
    (2852039166 is 169.254.169.254, a cloud's metadata service; 0x7f.1 is 127.0.0.1): a
    webhook form judges them as it judges the dotted form, instead of passing them as names
    to be refused at every delivery."""
    webhooks = outbound.Reach(hosts=None, networks=())
    with pytest.raises(OutboundRefused) as refused:
        check_url(f"http://{host}/latest/meta-data/", webhooks)
    assert refused.value.code == "private_address"
    check_url("http://134744072/", webhooks)  # 8.8.8.8: public, however it is written
    check_url("http://0x1e100.example/", webhooks)  # a name, judged when a request goes out


def test_one_private_address_among_public_ones_is_refused(
    serve: Any, settings: Any, dns: dict[str, list[list[str]]]
) -> None:
    settings.HOLDPOINT_TOOL_HOSTS = ["mixed.test"]
    dns["mixed.test"] = [["8.8.8.8", "10.0.0.1"]]
    with pytest.raises(OutboundRefused) as refused:
        send("GET", "http://mixed.test/", content=None, headers={}, timeout=3)
    assert refused.value.code == "private_address"
    assert "10.0.0.1" in refused.value.detail


def test_a_kept_connection_the_server_closed_is_not_used_again(serve: Any) -> None:
    """A service may close an idle keep-alive connection whenever it likes. Sending on it
    would make an applied-or-not question of a request that never arrived: a connection
    the server closed is dropped before the next request, which goes on a new one."""

    def answer_then_hang_up(handler: BaseHTTPRequestHandler, server: Server) -> None:
        answer_json(handler, server)
        handler.close_connection = True  # no Connection: close said: the client must notice

    server = serve(answer_then_hang_up)
    for _ in range(3):
        assert send("POST", server.url + "/x", content=b"{}", headers={}, timeout=5).body
        time.sleep(0.1)  # the hang-up reaches the client
    assert len({r["client_port"] for r in server.requests}) == 3


def _compressed(body: bytes, coding: str) -> Behaviour:
    return answer_with(200, body, ("Content-Encoding", coding))


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("coding", "pack"),
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", _raw_deflate)],
    ids=["gzip", "deflate", "raw-deflate"],
)
def test_a_compressed_answer_is_read_decoded(serve: Any, coding: str, pack: Any) -> None:
    """A service may compress although identity was asked for (or a definition asks for
    compression): the answer is read as what it says, as before."""
    server = serve(_compressed(pack(b'{"id": "T-7"}'), coding))
    response = send("GET", server.url + "/x", content=None, headers={}, timeout=5)
    assert response.json() == {"id": "T-7"}


def test_a_compressed_answer_is_capped_as_it_inflates(serve: Any) -> None:
    """64 MB of zeros are 64 KB of gzip: refused at the cap, and never inflated whole."""
    import tracemalloc

    server = serve(_compressed(gzip.compress(bytes(64 * 1024 * 1024)), "gzip"))
    tracemalloc.start()
    try:
        with pytest.raises(OutboundRefused) as refused:
            send("GET", server.url + "/x", content=None, headers={}, timeout=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.code == "too_large"
    assert peak < 8 * 1024 * 1024  # the cap is 1 MB; nothing near 64 MB was held


def test_a_compressed_answer_cut_short_proves_nothing(serve: Any) -> None:
    whole = gzip.compress(b'{"id": "T-7", "pad": "' + b"x" * 5000 + b'"}')
    server = serve(_compressed(whole[: len(whole) // 2], "gzip"))
    with pytest.raises(httpx.DecodingError):
        send("GET", server.url + "/x", content=None, headers={}, timeout=5)


def test_an_interim_answer_is_skipped_and_never_taken_for_the_answer(serve: Any) -> None:
    """A 1xx (here 103 Early Hints) comes before the real answer on the same connection.
    Taken as the answer, it would say "refused" of a request the service applied, and leave
    the real answer in the connection for the next request — another tenant's — to read."""

    def hints_first(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response_only(103)
        handler.send_header("Link", "</style.css>; rel=preload")
        handler.end_headers()
        answer_json(handler, server)

    server = serve(hints_first)
    for title in ("first", "second"):
        response = send("POST", server.url + f"/{title}", content=b"{}", headers={}, timeout=5)
        assert response.status_code == 201 and response.json()["id"] == "T-1"
    assert [r["path"] for r in server.requests] == ["/first", "/second"]
    assert len({r["client_port"] for r in server.requests}) == 1


def test_a_switch_of_protocols_nobody_asked_for_proves_nothing(serve: Any) -> None:
    def switch(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response_only(101)
        handler.send_header("Upgrade", "websocket")
        handler.end_headers()
        handler.close_connection = True

    server = serve(switch)
    with pytest.raises(httpx.RemoteProtocolError):
        send("POST", server.url + "/x", content=b"{}", headers={}, timeout=5)


def test_a_header_that_is_not_ascii_is_read_as_sent(serve: Any) -> None:
    """HTTP header values are bytes; a service may send Latin-1 in one (a file name). The
    answer is read, not refused as an encoding error that would leave the call unsettled."""

    disposition = 'attachment; filename="caf\u00e9.txt"'
    server = serve(answer_with(201, b'{"id": "T-1"}', ("Content-Disposition", disposition)))
    response = send("POST", server.url + "/x", content=b"{}", headers={}, timeout=5)
    assert response.json() == {"id": "T-1"}
    assert response.headers["content-disposition"] == 'attachment; filename="caf\u00e9.txt"'


def test_a_chunked_answer_is_read_whole_and_its_connection_kept(serve: Any) -> None:
    def chunked(handler: BaseHTTPRequestHandler, server: Server) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for piece in (b'{"id": ', b'"T-', b'9"}'):
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            handler.wfile.flush()
        handler.wfile.write(b"0\r\n\r\n")

    server = serve(chunked)
    for _ in range(2):
        response = send("GET", server.url + "/x", content=None, headers={}, timeout=5)
        assert response.json() == {"id": "T-9"}
    assert len({r["client_port"] for r in server.requests}) == 1


@pytest.fixture
def tls(monkeypatch: pytest.MonkeyPatch) -> tuple[trustme.CA, list[str]]:
    """A CA this process's tool requests trust (instead of the public bundle), and the
    server names (SNI) the servers made with `served_as` were asked for."""
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    monkeypatch.setitem(wire._ssl_contexts, os.getpid(), client)
    return ca, []


def served_as(tls: tuple[trustme.CA, list[str]], *names: str) -> ssl.SSLContext:
    ca, seen = tls
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(server)
    server.sni_callback = lambda _sock, name, _ctx: seen.append(name)  # type: ignore[assignment,misc,unused-ignore]
    return server


def test_https_goes_to_the_vetted_address_and_checks_the_certificate_against_the_name(
    serve: Any, settings: Any, dns: dict[str, list[list[str]]], tls: Any
) -> None:
    server = serve(answer_json, tls=served_as(tls, "tls.test"))
    settings.HOLDPOINT_TOOL_HOSTS = ["tls.test"]
    for answers in ([["127.0.0.1"], ["169.254.169.254"]], [["127.0.0.1"]]):
        dns["tls.test"] = answers  # the first send: a second lookup would get the metadata IP
        response = send(
            "GET", f"https://tls.test:{server.port}/x", content=None, headers={}, timeout=5
        )
        assert response.status_code == 201
    assert [r["headers"]["host"] for r in server.requests] == [f"tls.test:{server.port}"] * 2
    assert tls[1] == ["tls.test"]  # one handshake, named for the host: the second reused it
    assert len({r["client_port"] for r in server.requests}) == 1


def test_a_certificate_for_another_name_is_refused_before_anything_is_sent(
    serve: Any, settings: Any, dns: dict[str, list[list[str]]], tls: Any
) -> None:
    server = serve(answer_json, tls=served_as(tls, "other.test"))
    settings.HOLDPOINT_TOOL_HOSTS = ["tls.test"]
    dns["tls.test"] = [["127.0.0.1"]]
    with pytest.raises(httpx.ConnectError, match="certificate"):
        send("GET", f"https://tls.test:{server.port}/x", content=None, headers={}, timeout=5)
    assert server.requests == []


def test_a_connection_verified_for_one_name_never_serves_another_on_the_same_address(
    serve: Any, settings: Any, dns: dict[str, list[list[str]]], tls: Any
) -> None:
    """Two names on one address (a shared ingress): the pooled connection whose
    certificate was checked for the first must not carry a request for the second."""
    server = serve(answer_json, tls=served_as(tls, "tls.test"))
    settings.HOLDPOINT_TOOL_HOSTS = ["tls.test", "alias.test"]
    dns["tls.test"] = dns["alias.test"] = [["127.0.0.1"]]
    url = f"https://{{}}:{server.port}/x"
    assert send("GET", url.format("tls.test"), content=None, headers={}, timeout=5).body
    with pytest.raises(httpx.ConnectError, match="certificate"):
        send("GET", url.format("alias.test"), content=None, headers={}, timeout=5)
    assert len(server.requests) == 1
    assert tls[1] == ["tls.test", "alias.test"]


def test_connections_are_pooled_per_process_host_and_address() -> None:
    pool = wire.origin("https", "a.example", "192.0.2.1", 443)
    assert wire.origin("https", "a.example", "192.0.2.1", 443) is pool
    # Another name on the same address: a TLS connection verified for a.example only.
    assert wire.origin("https", "b.example", "192.0.2.1", 443) is not pool
    assert wire.origin("https", "a.example", "192.0.2.2", 443) is not pool
    assert wire.origin("http", "a.example", "192.0.2.1", 443) is not pool


def test_one_connection_serves_consecutive_requests_to_a_host(serve: Any) -> None:
    server = serve(answer_json)
    for _ in range(3):
        assert send("GET", server.url + "/x", content=None, headers={}, timeout=5).body
    assert len({r["client_port"] for r in server.requests}) == 1


def test_a_refusal_says_whether_the_host_or_only_its_port_is_not_allowed(settings: Any) -> None:
    settings.HOLDPOINT_TOOL_HOSTS = ["ops.example:8443"]
    with pytest.raises(OutboundRefused, match="port 6379 of ops.example is not among"):
        check_url("http://ops.example:6379/")
    with pytest.raises(OutboundRefused, match="other.example is not among the hosts"):
        check_url("https://other.example:8443/")


def test_a_port_not_allowed_is_refused_before_anything_is_sent(settings: Any, serve: Any) -> None:
    """The operator allowed this machine on one port only: a request to another of its
    ports is refused at send time, and the service there never hears of it."""
    server, other = serve(answer_json), serve(answer_json)
    settings.HOLDPOINT_TOOL_HOSTS = [f"127.0.0.1:{server.port}"]
    assert send("GET", server.url + "/x", content=None, headers={}, timeout=5).body
    with pytest.raises(OutboundRefused) as refused:
        send("GET", other.url + "/x", content=None, headers={}, timeout=5)
    assert refused.value.code == "host_not_allowed"
    assert len(server.requests) == 1 and other.requests == []


def test_a_built_in_tracker_on_a_host_not_allowed_stops_start_up() -> None:
    refused = _settings_process(HOLDPOINT_TASKS_URL="http://tracker.internal:8765")
    assert refused.returncode != 0
    assert "EnvError: HOLDPOINT_TASKS_URL: its host 'tracker.internal'" in refused.stderr
    allowed = _settings_process(
        HOLDPOINT_TASKS_URL="http://tracker.internal:8765",
        HOLDPOINT_TOOL_HOSTS="tracker.internal",
    )
    assert allowed.returncode == 0, allowed.stderr
    on_its_port = _settings_process(
        HOLDPOINT_TASKS_URL="http://tracker.internal:8765",
        HOLDPOINT_TOOL_HOSTS="tracker.internal:8765",
    )
    assert on_its_port.returncode == 0, on_its_port.stderr
    other_port = _settings_process(
        HOLDPOINT_TASKS_URL="http://tracker.internal:8765",
        HOLDPOINT_TOOL_HOSTS="tracker.internal:80",
    )
    assert "its host 'tracker.internal' (port 8765) is not" in other_port.stderr
