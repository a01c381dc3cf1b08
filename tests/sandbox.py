"""The sandbox task service as a real process on a real socket, for tests."""

from __future__ import annotations

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
    proc: procs.Child = field(repr=False)

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

    def reset(self) -> bool:
        """Empty it (tasks, fences, request log, faults) for its next test; False if it is
        gone or could not (then it must not be used again)."""
        if self.proc.poll() is not None:
            return False
        try:
            return httpx.post(self.url + "/_reset", timeout=90).status_code == 200
        except httpx.HTTPError:
            return False


def start_sandbox(mode: str, data: Path) -> Sandbox:
    """The sandbox on a free port, once *it* listens there and answers /healthz (see
    `procs.start_listening`: a port the other CI suite took first means another port)."""

    def healthy(url: str) -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    proc, url = procs.start_listening(
        lambda port: ["sandbox_tasks", "--port", str(port), "--mode", mode, "--data", str(data)],
        procs.child_env(),
        data.with_suffix(".log"),
        ready=healthy,
        timeout=30,
    )
    return Sandbox(url, mode, proc)


class SandboxPool:
    """Sandbox processes kept for the whole session, by mode, each emptied before it serves
    another test. Starting one is a Django process's boot (1.5 s idle, more under CI's load)
    and the suite asks for ~280 of them per database: reused, each test still gets a real
    process on a real socket with nothing in it. One that died (a test killed it) or will
    not empty is dropped and a new one started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.idle: dict[str, list[Sandbox]] = {}
        self.started: list[Sandbox] = []

    def take(self, mode: str) -> Sandbox:
        idle = self.idle.setdefault(mode, [])
        while idle:
            box = idle.pop()
            if box.reset():
                return box
            procs.kill(box.proc)
        box = start_sandbox(mode, self.root / f"sandbox-{mode}-{len(self.started)}.sqlite3")
        self.started.append(box)
        return box

    def give_back(self, box: Sandbox) -> None:
        if box.proc.poll() is None:
            self.idle.setdefault(box.mode, []).append(box)

    def close(self) -> None:
        for box in self.started:
            procs.kill(box.proc)


@pytest.fixture(scope="session")
def sandbox_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxPool]:
    pool = SandboxPool(tmp_path_factory.mktemp("sandboxes"))
    yield pool
    pool.close()


@pytest.fixture
def sandbox_factory(settings: Any, sandbox_pool: SandboxPool) -> Iterator[Callable[[str], Sandbox]]:
    """Sandboxes in a mode, empty, for this test alone; the last one it asked for is what
    `tasks.*` talk to. Several at once are distinct processes."""
    taken: list[Sandbox] = []

    def start(mode: str = "key") -> Sandbox:
        box = sandbox_pool.take(mode)
        taken.append(box)
        settings.HOLDPOINT_TASKS_URL = box.url
        settings.HOLDPOINT_TASKS_DEDUP = mode
        return box

    yield start
    for box in taken:
        sandbox_pool.give_back(box)
