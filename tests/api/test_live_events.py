"""G8: live events (API.md, "Live events") through the real ASGI server (`uvicorn
config.asgi`, procs.start_web) — on SQLite (polled) and PostgreSQL (LISTEN/NOTIFY).

The journal in the database is the oracle: every streamed event is compared, id and body,
with the entry `GET runs/{id}/events/` lists for that seq.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection
from httpx_sse import EventSource

from approvals.models import ApprovalRequest, ApprovalStatus
from audit.models import JournalEntry
from holdpoint_client import AsyncClient, Client
from runtime.api.serializers import JournalEntrySerializer
from runtime.models import Run, RunStatus
from tests import procs
from tests.api import (
    fresh_throttle,  # noqa: F401
    grant_policy,
    new_run,
    ok,
    post,
    prepare,
    take_lease,
)
from tests.conftest import Persona

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
STREAM = {"stream": "1"}
TERMINAL = {"completed", "failed", "cancelled"}


@pytest.fixture(scope="module")
def web(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real web server for the module (the database is emptied between tests, the server
    keeps no state of its own)."""
    log = tmp_path_factory.mktemp("web") / "web.log"
    env = procs.child_env()
    if connection.vendor == "postgresql":  # its connections are counted by this name
        env["DATABASE_URL"] += "?application_name=holdpoint-web"
    server, base = procs.start_web(env, log)
    try:
        yield base
    finally:
        procs.kill(server)


def headers(persona: Persona) -> dict[str, str]:
    return {"Authorization": f"Token {persona.token}"}


def reviewer_session(web: str, persona: Persona) -> httpx.Client:
    """A person on the API: logged in at /login/, then session + CSRF (NOTES.md)."""
    http = httpx.Client(base_url=web + "/", timeout=60)
    http.get("login/")
    name = persona.user.get_username()
    form = {"username": name, "password": f"pw-{name}"}
    form["csrfmiddlewaretoken"] = http.cookies["csrftoken"]
    assert http.post("login/", data=form).status_code == 302
    return http


def journal_json(run_id: str) -> list[dict[str, Any]]:
    """The run's journal as the list endpoint renders it (the stream's oracle)."""
    entries = JournalEntry.objects.filter(stream=f"run:{run_id}").order_by("seq")
    return json.loads(json.dumps(JournalEntrySerializer(entries, many=True).data, default=str))


def as_json(events: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    return [json.loads(data) for _, _, data in events]


def read(
    http: httpx.Client, url: str, *, last: int | None = None, until: str | None = None
) -> tuple[list[tuple[str, str, str]], bool]:
    """(id, event, data) of each event until the server closes the stream (True), or until
    an event of type `until` arrived (then this client disconnects: False)."""
    extra = {} if last is None else {"Last-Event-ID": str(last)}
    got: list[tuple[str, str, str]] = []
    with http.stream("GET", url, params=STREAM, headers=extra) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for sse in EventSource(response).iter_sse():
            got.append((sse.id, sse.event, sse.data))
            if sse.event == until:
                return got, False
    return got, True


def test_a_worker_run_with_an_approval_streams_every_entry_once_across_a_reconnect(
    web: str, agent_a: Persona, reviewer_a: Persona, tmp_path: Path
) -> None:
    grant_policy(agent_a.tenant, "test.note")
    worker = procs.start(["qcluster"], procs.child_env(), log=tmp_path / "worker.log")
    try:
        with httpx.Client(base_url=web + "/api/v1/", headers=headers(agent_a), timeout=60) as http:
            created = http.post(
                "runs/",
                json={"graph": "proposer", "goal": {"title": "streamed"}},
                headers={"Idempotency-Key": "live-1"},
            )
            assert created.status_code == 201, created.text
            run_id = created.json()["run_id"]
            url = f"runs/{run_id}/events/"
            # Read until the run waits for its reviewer, then hang up.
            first, closed = read(http, url, until="approval_requested")
            assert not closed
            approval = ApprovalRequest.objects.get(run_id=run_id, status=ApprovalStatus.PENDING)
            with reviewer_session(web, reviewer_a) as reviewer:
                decided = reviewer.post(
                    f"api/v1/approvals/{approval.pk}/decision/",
                    json={"decision": "approve", "action_hash": approval.action_hash},
                    headers={"X-CSRFToken": reviewer.cookies["csrftoken"]},
                )
            assert decided.status_code == 200, decided.text
            # Resume where the first connection stopped, while the worker finishes the run.
            rest, closed = read(http, url, last=int(first[-1][0]))
            assert closed  # the server closed the stream after the run's final entry
    finally:
        procs.kill(worker)

    events = first + rest
    journal = journal_json(run_id)
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED
    assert [int(id) for id, _, _ in events] == [e["seq"] for e in journal]  # once, in order
    assert [event for _, event, _ in events] == [e["type"] for e in journal]
    assert as_json(events) == journal  # the same JSON as the list
    assert "approval_decided" in [e["type"] for e in journal]
    assert journal[-1]["payload"]["status"] == "completed"
    # A stream opened after the end replays from `after` and closes at once.
    with httpx.Client(base_url=web + "/api/v1/", headers=headers(agent_a), timeout=30) as http:
        again, closed = read(http, f"runs/{run_id}/events/?after={journal[-2]['seq']}")
    assert closed and as_json(again) == journal[-1:]


def test_streams_are_scoped_like_every_call(
    web: str, agent_a: Persona, agent_b: Persona
) -> None:
    run = new_run(agent_a.api())
    url = f"{web}/api/v1/runs/{run['run_id']}/events/"
    anonymous = httpx.get(url, params=STREAM, timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.headers["content-type"].startswith("application/problem+json")
    assert anonymous.json()["code"] == "not_authenticated"
    foreign = httpx.get(url, params=STREAM, headers=headers(agent_b), timeout=30)
    assert foreign.status_code == 404 and foreign.json()["code"] == "not_found"
    approvals = httpx.get(f"{web}/api/v1/approvals/", params=STREAM, timeout=30)
    assert approvals.status_code == 401
    bad = httpx.get(
        url, params=STREAM, headers={**headers(agent_a), "Last-Event-ID": "x"}, timeout=30
    )
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_params"


def _finish(agent: Persona, run_id: str, fence: int, rev: int) -> None:
    body = {"fence": fence, "expected_rev": rev, "state": {}, "next_step": "", "status": "completed"}
    ok(post(agent.api(), f"runs/{run_id}/checkpoints/", body), 201)


def test_the_approvals_stream_sees_a_created_and_a_decided_approval(
    web: str, agent_a: Persona, reviewer_a: Persona
) -> None:
    grant_policy(agent_a.tenant)
    run = new_run(agent_a.api())
    fence = take_lease(agent_a.api(), run["run_id"])

    async def watch() -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        async with httpx.AsyncClient(headers=headers(agent_a), timeout=60) as http:
            url = f"{web}/api/v1/approvals/"
            async with http.stream("GET", url, params=STREAM) as response:
                assert response.status_code == 200
                opened.set()
                async for sse in EventSource(response).aiter_sse():
                    assert sse.event == "approval"
                    seen.append(json.loads(sse.data))
                    created.set()
                    if seen[-1]["status"] != "pending":
                        return seen
        return seen

    async def act() -> None:
        await opened.wait()
        await asyncio.sleep(1)  # the stream's first read is done: what follows is new
        approval = await asyncio.to_thread(_create)
        await created.wait()  # seen pending (a change faster than a wake-up shows its result)
        await asyncio.to_thread(_decide, approval)

    def _create() -> ApprovalRequest:
        action = prepare(agent_a.api(), run["run_id"], fence).json()
        return ApprovalRequest.objects.get(action_id=action["action_id"])

    def _decide(approval: ApprovalRequest) -> None:
        decision = {"decision": "approve", "action_hash": approval.action_hash}
        ok(post(reviewer_a.api(), f"approvals/{approval.pk}/decision/", decision))

    async def both() -> list[dict[str, Any]]:
        seen, _ = await asyncio.wait_for(asyncio.gather(watch(), act()), 60)
        return seen

    opened, created = asyncio.Event(), asyncio.Event()
    seen = asyncio.run(both())
    assert [a["status"] for a in seen] == ["pending", "approved"]
    assert seen[0]["id"] == seen[1]["id"] and seen[1]["decided_by"] == reviewer_a.user.username


def test_client_iterators_follow_a_run_to_its_end(web: str, agent_a: Persona) -> None:
    run = new_run(agent_a.api())
    run_id = run["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    _finish(agent_a, run_id, fence, 0)
    journal = journal_json(run_id)
    with Client(web, agent_a.token or "") as client:
        followed = list(client.events(run_id, follow=True))
        assert [e.seq for e in followed] == [e["seq"] for e in journal]
        assert followed[-1].payload["status"] == "completed"
        tail = [e.seq for e in client.events(run_id, after=journal[1]["seq"], follow=True)]
        assert tail == [e["seq"] for e in journal[2:]]

    async def follow_live() -> list[int]:
        async with AsyncClient(web, agent_a.token or "") as client:
            seqs = []
            async for entry in client.events(second, follow=True):
                seqs.append(entry.seq)
                if entry.type == "lease_taken":  # the run is live: finish it meanwhile
                    await asyncio.to_thread(_finish, agent_a, second, second_fence, 0)
            return seqs

    second = new_run(agent_a.api())["run_id"]
    second_fence = take_lease(agent_a.api(), second)
    seqs = asyncio.run(asyncio.wait_for(follow_live(), 60))
    assert seqs == [e["seq"] for e in journal_json(second)]


@pytest.mark.postgres
def test_200_stream_clients_hold_on_postgresql(web: str, agent_a: Persona) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the connection count is a PostgreSQL figure")
    clients = 200
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    database = connection.settings_dict["NAME"]

    def server_connections() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND application_name IN ('holdpoint-web', 'holdpoint-live')",
                [database],
            )
            return int(cursor.fetchone()[0])

    async def one(http: httpx.AsyncClient, ready: asyncio.Queue[None]) -> list[int]:
        seqs: list[int] = []
        url = f"{web}/api/v1/runs/{run_id}/events/"
        async with http.stream("GET", url, params=STREAM) as response:
            assert response.status_code == 200
            async for sse in EventSource(response).aiter_sse():
                seqs.append(int(sse.id))
                if len(seqs) == 2:  # run_created and lease_taken: connected and caught up
                    ready.put_nowait(None)
        return seqs

    async def scenario() -> tuple[list[list[int]], list[int], list[int]]:
        limits = httpx.Limits(max_connections=clients + 20, max_keepalive_connections=0)
        timeout = httpx.Timeout(120)
        async with httpx.AsyncClient(headers=headers(agent_a), limits=limits, timeout=timeout) as http:
            ready: asyncio.Queue[None] = asyncio.Queue()
            streams = [asyncio.create_task(one(http, ready)) for _ in range(clients)]
            for _ in range(clients):
                await asyncio.wait_for(ready.get(), 120)
            counts = [await asyncio.to_thread(server_connections)]
            statuses = []
            for rev in range(5):  # the run moves while all 200 are connected
                body = {"fence": fence, "expected_rev": rev, "state": {"rev": rev}, "next_step": "x"}
                answer = await http.post(f"{web}/api/v1/runs/{run_id}/checkpoints/", json=body)
                statuses.append(answer.status_code)
                other = await http.get(f"{web}/api/v1/runs/", timeout=30)
                statuses.append(other.status_code)
                counts.append(await asyncio.to_thread(server_connections))
            await asyncio.to_thread(_finish, agent_a, run_id, fence, 5)
            results = await asyncio.wait_for(asyncio.gather(*streams), 180)
            counts.append(await asyncio.to_thread(server_connections))
            return results, counts, statuses

    results, counts, statuses = asyncio.run(scenario())
    expected = [e["seq"] for e in journal_json(run_id)]
    assert all(seqs == expected for seqs in results), "every client got every entry once"
    assert set(statuses) == {200, 201}  # other calls answered while 200 streams were open
    # The web server's connections (its own and its LISTEN one): one LISTEN connection, at
    # most READERS (4) reader threads' ones, and the API request in flight — bounded,
    # whatever the number of clients.
    print(f"server connections to {database} with {clients} streams open: {counts}")
    assert max(counts) <= 8, counts
