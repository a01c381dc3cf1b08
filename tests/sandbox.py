"""The sandbox task service as a real process on a real socket, for tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import procs


@dataclass
class Sandbox:
    url: str
    mode: str
    proc: subprocess.Popen[bytes] = field(repr=False)

    def tasks(self, key: str | None = None) -> list[dict[str, Any]]:
        tasks = httpx.get(self.url + "/tasks", timeout=10).json()
        return [t for t in tasks if key is None or t["idempotency_key"] == key]

    def requests(self) -> list[dict[str, Any]]:
        """Every request the service received (method, path, key, traceparent), in order."""
        answer: list[dict[str, Any]] = httpx.get(self.url + "/requests", timeout=10).json()
        return answer

    def faults(self, **faults: float) -> None:
        httpx.post(self.url + "/_faults", json=faults, timeout=10).raise_for_status()

    def env(self) -> dict[str, str]:
        return {"HOLDPOINT_TASKS_URL": self.url, "HOLDPOINT_TASKS_DEDUP": self.mode}


def start_sandbox(mode: str, data: Path) -> Sandbox:
    """The sandbox on a free port, once *it* answers there: a port the other CI suite took
    first makes ours exit ("address in use"), and then it starts again on another."""
    for _ in range(3):
        port = procs.free_port()
        proc = procs.start(
            ["sandbox_tasks", "--port", str(port), "--mode", mode, "--data", str(data)],
            procs.child_env(),
            log=data.with_suffix(".log"),
        )
        url = f"http://127.0.0.1:{port}"

        def up(proc: subprocess.Popen[bytes] = proc, url: str = url, port: int = port) -> str:
            if proc.poll() is not None:
                return "exited"
            try:
                healthy = httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return ""
            return "ours" if healthy and procs.owns_port(proc.pid, port) else ""

        if procs.wait_for(up, timeout=30) == "ours":
            return Sandbox(url, mode, proc)
    raise RuntimeError(f"the sandbox did not start on three free ports (log: {data})")


@pytest.fixture
def sandbox_factory(tmp_path: Path, settings: Any) -> Iterator[Callable[[str], Sandbox]]:
    """Start sandboxes in a mode; the last one started is what `tasks.*` talk to."""
    started: list[Sandbox] = []

    def start(mode: str = "key") -> Sandbox:
        box = start_sandbox(mode, tmp_path / f"sandbox-{mode}-{len(started)}.sqlite3")
        started.append(box)
        settings.HOLDPOINT_TASKS_URL = box.url
        settings.HOLDPOINT_TASKS_DEDUP = mode
        return box

    yield start
    for box in started:
        procs.kill(box.proc)
