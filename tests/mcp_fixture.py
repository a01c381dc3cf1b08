"""The test MCP upstream (tests/mcp_upstream.py) as a real process on a free port."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import procs


@dataclass
class Upstream:
    url: str
    data: Path
    proc: procs.Child = field(repr=False)
    args: list[str] = field(default_factory=list)  # its command line but the port
    retired: list[procs.Child] = field(default_factory=list, repr=False)

    def restart(self) -> None:
        """A new process in this one's place — the same port and record, none of its
        sessions — as a deploy does: the old one is asked to stop (SIGTERM: uvicorn takes no
        new connection and finishes the requests it has; it may then linger on an open
        stream, and is killed with the others afterwards). One that died already is just
        started again."""
        port = int(self.url.split(":")[2].split("/")[0])
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.retired.append(self.proc)
        procs.wait_for(lambda: not _listening(port), timeout=30)
        self.proc = _launch(self.args, self.data, port)[0]

    def calls(self, tool: str | None = None) -> list[dict[str, Any]]:
        """What reached the upstream's tools (its own record, written before answering)."""
        path = self.data / "calls.jsonl"
        lines = path.read_text("utf-8").splitlines() if path.exists() else []
        found = [json.loads(line) for line in lines]
        return [c for c in found if tool is None or c["tool"] == tool]

    def finds(self) -> list[dict[str, Any]]:
        """Every call of a finder (tickets_find, tickets_find_text), in order."""
        path = self.data / "finds.jsonl"
        lines = path.read_text("utf-8").splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]

    def faults(self, **faults: Any) -> None:
        (self.data / "faults.json").write_text(json.dumps(faults), "utf-8")


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def mcp_upstream(tmp_path: Path) -> Iterator[Callable[..., Upstream]]:
    """Start help-desk upstreams (each with its own record); all are killed afterwards."""
    started: list[Upstream] = []

    def start(*, keyed: bool = False) -> Upstream:
        upstream = start_upstream(tmp_path / f"mcp-upstream-{len(started)}", keyed=keyed)
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        for proc in (*upstream.retired, upstream.proc):
            procs.kill(proc)


def start_upstream(data: Path, *, keyed: bool = False) -> Upstream:
    """A help-desk upstream keeping its record in `data`, once *it* holds its port (a free
    port CI's other suite took first is another's: procs.start_listening tries another)."""
    data.mkdir(exist_ok=True)
    extra = ["--data", str(data), *(["--keyed"] if keyed else [])]
    proc, base = _launch(extra, data)
    return Upstream(f"{base}/mcp", data, proc, extra)


def _launch(extra: list[str], data: Path, port: int | None = None) -> tuple[procs.Child, str]:
    return procs.start_listening(
        lambda chosen: ["--port", str(chosen), *extra],
        procs.child_env(),
        data / "upstream.log",
        program="tests.mcp_upstream",
        port=port,
    )
