"""The suite's own process starters (tests/procs.py, tests/sandbox.py) when the free port they
picked is taken first — by CI's other suite, running beside this one: each must hand back
its own server, never the one that answered on that port. A real listener holds the port."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import procs
from tests.sandbox import start_sandbox


@pytest.fixture
def taken_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A port another process listens on (and answers), which free_port() hands out first;
    then free ports as usual."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(8)
    port = squatter.getsockname()[1]
    real = procs.free_port
    handed = iter([port])
    monkeypatch.setattr(procs, "free_port", lambda: next(handed, None) or real())
    yield port
    squatter.close()


def test_start_web_never_hands_back_a_port_it_does_not_hold(
    taken_port: int, tmp_path: Path
) -> None:
    server, base = procs.start_web(procs.child_env(), tmp_path / "web.log")
    try:
        assert base != f"http://127.0.0.1:{taken_port}"
        port = int(base.rsplit(":", 1)[1])
        assert procs.owns_port(server.pid, port)
        assert httpx.get(base + "/healthz", timeout=10).status_code == 200
    finally:
        procs.kill(server)


def test_a_web_server_told_its_own_address_is_told_the_port_it_holds(
    taken_port: int, tmp_path: Path
) -> None:
    """The MCP gateway's server is told its address (HOLDPOINT_BASE_URL) before it starts:
    when the port guessed first is taken, the next start is told the next port — the one
    it then holds — not the taken one (the gateway's tests used to fail loudly then)."""
    told: list[int] = []

    def env(port: int) -> dict[str, str]:
        told.append(port)
        return procs.child_env(HOLDPOINT_BASE_URL=f"http://127.0.0.1:{port}")

    server, base = procs.start_web(env, tmp_path / "web.log")
    try:
        port = int(base.rsplit(":", 1)[1])
        assert told == [taken_port, port] and procs.owns_port(server.pid, port)
        assert httpx.get(base + "/healthz", timeout=10).status_code == 200
    finally:
        procs.kill(server)


def test_start_sandbox_never_hands_back_a_port_it_does_not_hold(
    taken_port: int, tmp_path: Path
) -> None:
    box = start_sandbox("key", tmp_path / "sandbox.sqlite3")
    try:
        assert box.url != f"http://127.0.0.1:{taken_port}"
        assert procs.owns_port(box.proc.pid, int(box.url.rsplit(":", 1)[1]))
    finally:
        procs.kill(box.proc)


def test_the_mcp_upstream_never_hands_back_a_port_it_does_not_hold(
    taken_port: int, tmp_path: Path
) -> None:
    """Seen in CI: the other suite's server answered on the upstream's port, and an import
    failed parsing that server's JSON as MCP."""
    from tests.mcp_fixture import start_upstream

    upstream = start_upstream(tmp_path)
    try:
        port = int(upstream.url.split(":")[2].split("/")[0])
        assert port != taken_port
        assert procs.owns_port(upstream.proc.pid, port)
        upstream.restart()  # on its own port again, held by the new process
        assert procs.owns_port(upstream.proc.pid, port)
    finally:
        for proc in (*upstream.retired, upstream.proc):
            procs.kill(proc)
