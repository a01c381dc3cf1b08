"""The sandbox task service's reset (`POST /_reset`), which lets a test suite reuse one process
for many tests: everything is forgotten, and a request still being served lands before the
reset, never in the next test's empty tracker. A real process on a real socket."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import procs
from tests.sandbox import Sandbox, SandboxPool, start_sandbox


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Sandbox]:
    started = start_sandbox("key", tmp_path / "sandbox.sqlite3")
    yield started
    procs.kill(started.proc)


def _create(box: Sandbox, key: str, fence: int, run: str = "run-1") -> httpx.Response:
    headers = {"Idempotency-Key": key, "Holdpoint-Run": run, "Holdpoint-Fence": str(fence)}
    return httpx.post(box.url + "/tasks", json={"title": key}, headers=headers, timeout=30)


def test_a_reset_forgets_tasks_fences_requests_and_faults(box: Sandbox) -> None:
    assert _create(box, "k1", fence=5).status_code == 201
    box.faults(fail_before=3, delay=0.5)
    assert box.tasks() and box.requests()

    assert box.reset()

    assert box.requests() == []  # first: listing the tasks is a request it logs
    assert box.tasks() == []
    armed = httpx.get(box.url + "/_faults", timeout=10).json()
    assert armed == {"delay": 0.0, "fail_before": 0, "drop_after": 0, "error_after": 0}
    # The fence 5 seen for run-1 is forgotten: fence 1 is a first fence again, not stale.
    assert _create(box, "k1", fence=1).status_code == 201  # and k1 is a new task, not a replay
    assert [t["idempotency_key"] for t in box.tasks()] == ["k1"]


def test_a_create_in_progress_lands_before_the_reset_not_after(box: Sandbox) -> None:
    box.faults(delay=1.0)
    answers: list[int] = []
    sender = threading.Thread(target=lambda: answers.append(_create(box, "late", 1).status_code))
    sender.start()
    procs.wait_for(lambda: any(r["path"] == "/tasks" for r in box.requests()), timeout=10)

    began = time.monotonic()
    assert box.reset()
    waited = time.monotonic() - began
    sender.join(timeout=10)

    assert answers == [201]  # it was applied, and answered
    assert box.tasks() == []  # but before the reset: the next test's tracker is empty
    assert waited > 0.3  # the reset waited for it (the create sleeps 1 s before applying)


def test_the_pool_hands_each_test_an_empty_tracker(tmp_path: Path) -> None:
    """Two tests' worth, in one: what one use left behind, the next does not see."""
    pool = SandboxPool(tmp_path)
    try:
        first = pool.take("lookup")
        assert _create(first, "left-behind", 1).status_code == 201
        first.faults(drop_after=1)
        pool.give_back(first)

        second = pool.take("lookup")
        assert second.url == first.url  # the same process, reused
        assert second.requests() == [] and second.tasks() == []
        assert _create(second, "fresh", 1).status_code == 201  # drop_after is disarmed

        procs.kill(second.proc)  # a test may kill its tracker: the pool starts another
        pool.give_back(second)
        third = pool.take("lookup")
        assert third.proc.pid != second.proc.pid and third.tasks() == []
    finally:
        pool.close()
