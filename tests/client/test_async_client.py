"""`AsyncHoldpoint`/`AsyncClient`: the same flow as the blocking client, on the event loop,
against the real server (`live_server`) and the real sandbox process; and the retry policy
both clients share, against a real local HTTP server that throttles before it answers."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from django.db import connections

from approvals.models import ApprovalPolicy
from holdpoint_client import (
    ApprovalTimeout,
    AsyncClient,
    AsyncExecutor,
    AsyncHoldpoint,
    Client,
    Executor,
    Holdpoint,
    Run,
    ToolCall,
)
from runtime.models import Action, RunStatus
from runtime.models import Run as RunRow
from runtime.sweeper import flag_lost_executors
from tests.api import get, ok, post, session
from tests.client import hold_point  # noqa: F401  (a fixture)
from tests.conftest import Persona
from tests.orphans import off_loop
from tests.sandbox import Sandbox

TOOL = "agent.tasks.create"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_async_agent_waits_for_the_approval_and_acts_once(
    live_server: Any,
    agent_a: Persona,
    reviewer_a: Persona,
    hold_point: ApprovalPolicy,  # noqa: F811
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    box = sandbox_factory("key")
    assert agent_a.token is not None
    hp = AsyncHoldpoint(live_server.url, agent_a.token, ttl=3, backoff=0.01, approval_timeout=0.5)
    made: list[str] = []

    @hp.action(TOOL, reason="the API changed")
    async def create_task(title: str, *, call: ToolCall) -> Any:
        made.append(title)
        async with httpx.AsyncClient() as http:
            sent = await http.post(box.url + "/tasks", json=call.params, headers=call.headers())
        return sent.raise_for_status().json()

    async def summarise() -> str:
        made.append("model")
        return "two breaking changes"

    async def agent() -> Any:
        async with hp.run("t-async", graph="api-review", goal={"pr": 7}) as run:
            summary = await run.model("summary", summarise)
            return await create_task(title=summary)

    def approve() -> None:  # the reviewer, through the REST API (a thread: the ORM is sync)
        try:
            decide()
        finally:
            connections.close_all()  # this thread's own database session

    def decide() -> None:
        action = Action.objects.get(run__thread_id="t-async")
        assert action.status == "awaiting_approval" and made == ["model"]
        browser = session(reviewer_a.user)
        approval_id = ok(get(browser, f"actions/{action.action_id}/"))["approval"]
        approval = ok(get(browser, f"approvals/{approval_id}/"))
        decision = {"decision": "approve", "action_hash": approval["action_hash"], "reason": "ok"}
        ok(post(browser, f"approvals/{approval_id}/decision/", decision))

    async def story() -> tuple[Any, Any]:
        async with hp:
            with pytest.raises(ApprovalTimeout):
                await agent()
            await off_loop(approve)
            return await agent(), await agent()  # the second: the completed run's record

    task, again = asyncio.run(story())
    action = Action.objects.get(run__thread_id="t-async")

    assert task == again and task["title"] == "two breaking changes"
    assert made == ["model", "two breaking changes"]  # the model was not asked again
    assert [t["id"] for t in box.tasks()] == [task["id"]]
    assert (action.status, action.external_id) == ("confirmed", task["id"])
    assert RunRow.objects.get(thread_id="t-async").status == RunStatus.COMPLETED


RUN_JSON = {"run_id": "6f1c1a52-7a8e-4b59-9a55-1f5d1d1e0a01", "status": "queued"}


@pytest.fixture
def throttling_server() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """A real HTTP server: 503 with Retry-After: 1, then 429 with Retry-After: 1, then 201.
    Records (method, Idempotency-Key) of every request."""
    seen: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            seen.append((self.command, self.headers.get("Idempotency-Key", "")))
            status = {1: 503, 2: 429}.get(len(seen), 201)
            body = json.dumps(RUN_JSON if status == 201 else {"code": "throttled"}).encode()
            self.send_response(status)
            if status != 201:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = _answer  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_both_clients_honour_retry_after(
    throttling_server: tuple[str, list[tuple[str, str]]], flavour: str
) -> None:
    url, seen = throttling_server
    started = time.monotonic()
    if flavour == "async":

        async def create() -> Run:
            async with AsyncClient(url, "t", backoff=0.01) as client:
                return await client.create_run("api-review", {})

        run = asyncio.run(create())
    else:
        with Client(url, "t", backoff=0.01) as client:
            run = client.create_run("api-review", {})
    elapsed = time.monotonic() - started

    assert run.run_id == RUN_JSON["run_id"]
    assert elapsed >= 2.0  # the two Retry-After seconds, not the 0.01 s backoff
    assert len(seen) == 3 and len({key for _, key in seen}) == 1  # one logical call


def test_the_async_client_has_the_calls_of_the_client() -> None:
    """holdpoint_client/README.md: "`AsyncClient` ... has the calls of `Client`, awaited;
    `AsyncExecutor` those of `Executor`" — with the same keyword arguments."""

    def calls_of(cls: type) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(member).parameters)
            for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and callable(member) and name not in ("close", "aclose")
        }

    assert calls_of(AsyncClient) == calls_of(Client)
    public = {n for n in dir(Executor) if not n.startswith("_")}
    assert public <= {n for n in dir(AsyncExecutor) if not n.startswith("_")}


@pytest.mark.django_db(transaction=True)
def test_an_async_agent_runs_the_executor_protocol_by_hand(
    live_server: Any, agent_a: Persona
) -> None:
    """The raw protocol (API.md "Executor protocol") on AsyncClient: lease, checkpoint,
    prepare, dispatch, outcome, and the lists — as an agent with its own loop writes it."""
    assert agent_a.token is not None

    async def story() -> tuple[Any, ...]:
        async with AsyncClient(live_server.url, agent_a.token, backoff=0.01) as client:
            run = await client.create_run("api-review", {"pr": 9}, external=True)
            grant = await client.lease(run.run_id, "async-agent", 30)
            await client.write_checkpoint(
                run.run_id,
                fence=grant.fence,
                expected_rev=0,
                state={"step": 1},
                next_step="propose",
                idempotency_key="cp-1",
            )
            key = f"{run.run_id}:1:ext:propose"
            action = await client.prepare_action(
                run.run_id,
                fence=grant.fence,
                tool=TOOL,
                params={"title": "Review", "body": "x"},
                reason="r",
                idempotency_key=key,
            )
            sent = await client.dispatch(action.action_id, grant.fence)
            done = await client.record_outcome(
                action.action_id, fence=grant.fence, outcome="confirmed", external_id="T-1"
            )
            found = await client.find_actions(status="confirmed", tool=TOOL)
            revs = [c.rev async for c in client.checkpoints(run.run_id)]
            page = await client.runs_page(status="running")
            async with AsyncExecutor(client, run.run_id, "async-agent", ttl=10) as ex:
                goal = ex.goal
                refreshed = await ex.refresh()
            return sent.status, done, found, revs, page, goal, refreshed, run

    sent, done, found, revs, page, goal, refreshed, run = asyncio.run(story())

    assert sent == "sent" and (done.status, done.external_id) == ("confirmed", "T-1")
    assert [a.action_id for a in found] == [done.action_id]
    assert revs == [1] and [r.run_id for r in page.results] == [run.run_id]
    assert goal == {"pr": 9} and refreshed.run_id == run.run_id
    assert Action.objects.get(pk=done.action_id).status == "confirmed"


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.django_db(transaction=True)
def test_a_blocking_call_longer_than_the_lease_keeps_the_lease(
    live_server: Any, agent_a: Persona, settings: Any, flavour: str
) -> None:
    """A plain (not async) model call that takes longer than the lease: the blocking client
    heartbeats from a thread meanwhile; the asyncio one ran it on its event loop, where its
    heartbeat task could not run — the lease lapsed, the sweeper took it (`executor_lost`)
    and the answer, paid for, could not be recorded (LeaseLost). Now it runs on a thread
    there too, and both keep the lease."""
    settings.HOLDPOINT_EXECUTOR_GRACE = 0
    assert agent_a.token is not None
    thread = f"t-slow-{flavour}"
    flagged: list[int] = []

    def sweep_meanwhile() -> None:  # the sweeper's turn comes while the call runs
        time.sleep(2.5)
        try:
            flagged.append(flag_lost_executors(10))
        finally:
            connections.close_all()

    def slow_model() -> str:
        sweeper = threading.Thread(target=sweep_meanwhile)
        sweeper.start()
        time.sleep(4)  # twice the ttl
        sweeper.join()
        return "two breaking changes"

    if flavour == "sync":
        with (
            Holdpoint(live_server.url, agent_a.token, ttl=2, backoff=0.01) as hp,
            hp.run(thread, graph="api-review") as run,
        ):
            answer = run.model("summary", slow_model)
    else:

        async def agent() -> Any:
            hp = AsyncHoldpoint(live_server.url, agent_a.token or "", ttl=2, backoff=0.01)
            async with hp, hp.run(thread, graph="api-review") as run:
                return await run.model("summary", slow_model)

        answer = asyncio.run(agent())

    assert answer == "two breaking changes" and flagged == [0]
    run_row = RunRow.objects.get(thread_id=thread)
    assert run_row.status == RunStatus.COMPLETED
    assert run_row.checkpoints.get(rev=1).state["_holdpoint"] == {"model:summary": answer}
