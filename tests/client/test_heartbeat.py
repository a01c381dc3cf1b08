"""The executor's heartbeat, blocking (a thread) and asyncio (a task), against `live_server`.

The client's own transport forwards every request to a real one and records it; on cue it
fails a heartbeat with an error of its own (an OSError httpx does not wrap, as a custom
transport or a socket library may raise) — a network fault made in the transport, as in
test_client.py, never in the database or the clock.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from django.core.cache import caches

from holdpoint_client import AsyncClient, AsyncExecutor, Client, Executor, LeaseHeld, LeaseLost
from runtime.models import Run as RunRow
from tests.conftest import Persona
from tests.httpservers import Gateway
from tests.orphans import off_loop
from tests.runtime.helpers import expire_lease

pytestmark = pytest.mark.django_db(transaction=True)
BEAT = "/lease/heartbeat/"


@pytest.fixture(autouse=True)
def fresh_throttle() -> None:
    caches["default"].clear()


class Beats:
    """What both transports share: the heartbeats seen (fence, time) and how many to fail."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.seen: list[tuple[int, float]] = []

    def note(self, request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith(BEAT):
            fence = int(request.content.split(b'"fence":')[1].split(b",")[0].strip(b"}"))
            self.seen.append((fence, time.monotonic()))
            if self.fail:
                self.fail -= 1
                raise ConnectionResetError("the transport's own error, not httpx's")


class Transport(httpx.HTTPTransport):
    def __init__(self, beats: Beats) -> None:
        super().__init__()
        self.beats = beats

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.beats.note(request)
        return super().handle_request(request)


class AsyncTransport(httpx.AsyncHTTPTransport):
    def __init__(self, beats: Beats) -> None:
        super().__init__()
        self.beats = beats

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.beats.note(request)
        return await super().handle_async_request(request)


def renewed(run_id: str) -> Any:
    return RunRow.objects.get(pk=run_id).lease_expires_at


def test_a_heartbeat_that_meets_an_unexpected_error_goes_on(
    live_server: Any, agent_a: Persona
) -> None:
    """The heartbeat thread died on an exception that is not Holdpoint's (here an OSError
    the transport raised itself), with a traceback and nobody told: the lease lapsed under
    a working executor. Now the failure is logged and the next beat renews the lease."""
    beats = Beats(fail=2)
    with Client(live_server.url, agent_a.token or "", transport=Transport(beats)) as api:
        run = api.create_run("api-review", {}, external=True)
        with Executor(api, run.run_id, "agent-1", ttl=3) as ex:
            first = renewed(run.run_id)
            deadline = time.monotonic() + 10
            while len(beats.seen) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(beats.seen) >= 3  # the two failures, then a beat that went through
            deadline = time.monotonic() + 5
            while renewed(run.run_id) == first and time.monotonic() < deadline:
                time.sleep(0.05)
            assert renewed(run.run_id) > first and not ex.lost
            ex.checkpoint({"n": 1}, "next")


def test_an_async_heartbeat_that_meets_an_unexpected_error_goes_on(
    live_server: Any, agent_a: Persona
) -> None:
    beats = Beats(fail=2)

    async def story() -> None:
        transport = AsyncTransport(beats)
        async with AsyncClient(live_server.url, agent_a.token or "", transport=transport) as api:
            run = await api.create_run("api-review", {}, external=True)
            async with AsyncExecutor(api, run.run_id, "agent-1", ttl=3) as ex:
                deadline = time.monotonic() + 10
                while len(beats.seen) < 3 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert len(beats.seen) >= 3 and not ex.lost
                await ex.checkpoint({"n": 1}, "next")

    asyncio.run(story())


def test_an_async_executor_stops_heartbeating_once_a_write_finds_its_fence_stale(
    live_server: Any, agent_a: Persona
) -> None:
    """A checkpoint refused stale_fence makes the executor lost (LeaseLost), yet its
    heartbeat task went on beating with the stale fence until a beat of its own was
    refused. Now it stops at once, as the blocking executor's thread does."""
    beats = Beats()

    async def story() -> float:
        transport = AsyncTransport(beats)
        async with AsyncClient(live_server.url, agent_a.token or "", transport=transport) as api:
            run = await api.create_run("api-review", {}, external=True)
            async with AsyncExecutor(api, run.run_id, "agent-1", ttl=3) as ex:
                await off_loop(expire_lease, run.run_id)
                await api.lease(run.run_id, "agent-2", 30)  # the successor
                with pytest.raises(LeaseLost):
                    await ex.checkpoint({"n": 1}, "next")
                lost_at = time.monotonic()
                await asyncio.sleep(2.5)  # more than two beat intervals (ttl / 3)
            return lost_at

    lost_at = asyncio.run(story())

    assert [fence for fence, at in beats.seen if at > lost_at] == []
    assert RunRow.objects.get().lease_owner == "agent-2"


def wait_for(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


def take_over(api: Client, run_id: str, owner: str, within: float) -> float:
    """Lease the run as `owner` as soon as the holder's lease lapses; when it was taken."""
    deadline = time.monotonic() + within
    while True:
        try:
            api.lease(run_id, owner, 30)
            return time.monotonic()
        except LeaseHeld:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("flavour", ["thread", "asyncio"])
def test_a_stalled_heartbeat_gives_up_in_time_to_hear_of_a_takeover(
    live_server: Any, serve: Any, agent_a: Persona, flavour: str
) -> None:
    """Heartbeats stalled (a proxy that stops answering them) and the ttl=3 lease lapsed
    to a successor. The beat in flight was a call like any other: 10 s per attempt, four
    retries — the executor heard of the takeover only when its beat came back (~10 s or
    more after it), working on meanwhile as if it held the run. Now a heartbeat's attempts
    are bounded by the lease (ttl/4 each, one retry): once the stall ends the executor
    hears `stale_fence` and stops within about the ttl."""
    ttl = 3
    proxy = Gateway(live_server.url)
    url = serve(proxy).url
    token = agent_a.token or ""
    successor = Client(live_server.url, token)

    def stall_then_take_over(run_id: str) -> float:
        proxy.stall("POST", BEAT)
        assert wait_for(lambda: proxy.stalled >= 1, 2 * ttl)
        taken = take_over(successor, run_id, "agent-2", within=4 * ttl)
        proxy.stall("POST", None)
        return taken

    try:
        if flavour == "thread":
            with Client(url, token, backoff=0.05) as api:
                run = api.create_run("api-review", {}, external=True)
                with Executor(api, run.run_id, "agent-1", ttl=ttl) as ex:
                    taken = stall_then_take_over(run.run_id)
                    heard = wait_for(lambda: ex.lost, ttl + 1)
                    lost_after = time.monotonic() - taken
                    with pytest.raises(LeaseLost):
                        ex.checkpoint({"n": 1}, "next")
        else:

            async def story() -> tuple[bool, float]:
                async with AsyncClient(url, token, backoff=0.05) as api:
                    run = await api.create_run("api-review", {}, external=True)
                    async with AsyncExecutor(api, run.run_id, "agent-1", ttl=ttl) as ex:
                        taken = await off_loop(stall_then_take_over, run.run_id)
                        deadline = time.monotonic() + ttl + 1
                        while not ex.lost and time.monotonic() < deadline:
                            await asyncio.sleep(0.05)
                        lost_after = time.monotonic() - taken
                        heard = ex.lost
                        with pytest.raises(LeaseLost):
                            await ex.checkpoint({"n": 1}, "next")
                        return heard, lost_after

            heard, lost_after = asyncio.run(story())
    finally:
        proxy.close()
        successor.close()

    assert heard, f"the executor still thought it held the run {lost_after:.1f}s after it"
    assert RunRow.objects.get().lease_owner == "agent-2"
