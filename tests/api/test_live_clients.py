"""G8: live events as clients meet them — the Python client's iterators, a connection cut
and resumed with Last-Event-ID, 200 clients at once on PostgreSQL, a lost database
connection, revoked credentials, a WSGI server's threads, and the run page that refreshes on
its stream."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from django.db import connection
from httpx_sse import EventSource

from audit.models import JournalEntry
from holdpoint_client import AsyncClient, Client
from runtime import live
from tests import procs
from tests.api import (
    fresh_throttle,  # noqa: F401
    new_run,
    take_lease,
)
from tests.api.live import (
    KEEPALIVE,
    LIVE_CLIENTS,
    STREAM,
    CuttingProxy,
    ended_after,
    finish_external,
    headers,
    journal_json,
    last_event_ids,
    server_threads,
    session_cookie,
    web_server,
)
from tests.browser import log_in
from tests.conftest import Persona, issue_token_for
from tests.orphans import off_loop

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytest_plugins = ("tests.browser",)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_client_iterators_follow_a_run_to_its_end(web: str, agent_a: Persona) -> None:
    run = new_run(agent_a.api())
    run_id = run["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    finish_external(agent_a, run_id, fence, 0)
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
                    await off_loop(finish_external, agent_a, second, second_fence, 0)
            return seqs

    second = new_run(agent_a.api())["run_id"]
    second_fence = take_lease(agent_a.api(), second)
    seqs = asyncio.run(asyncio.wait_for(follow_live(), 60))
    assert seqs == [e["seq"] for e in journal_json(second)]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_client_events_resume_after_a_lost_connection_with_last_event_id(
    web: str, agent_a: Persona, kind: str
) -> None:
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    lease_seq = journal_json(run_id)[-1]["seq"]
    proxy = CuttingProxy(web, cut_after="lease_taken")
    seqs: list[int] = []
    try:
        if kind == "sync":
            with Client(proxy.url, agent_a.token or "") as client:
                for entry in client.events(run_id, follow=True):
                    seqs.append(entry.seq)
                    if entry.type == "lease_taken":  # the connection is being cut meanwhile
                        finish_external(agent_a, run_id, fence, 0)
        else:

            async def follow() -> None:
                async with AsyncClient(proxy.url, agent_a.token or "") as client:
                    async for entry in client.events(run_id, follow=True):
                        seqs.append(entry.seq)
                        if entry.type == "lease_taken":
                            await off_loop(finish_external, agent_a, run_id, fence, 0)

            asyncio.run(asyncio.wait_for(follow(), 60))
    finally:
        proxy.close()
    assert seqs == [e["seq"] for e in journal_json(run_id)]  # each once, in order, to the end
    streams = [r for r in proxy.requests if b"stream=1" in r.split(b"\r\n", 1)[0]]
    assert len(streams) >= 2  # it did reconnect
    resumed = last_event_ids(proxy)
    assert resumed[0] == "0" and str(lease_seq) in resumed[1:]


@pytest.mark.postgres
def test_200_stream_clients_hold_on_postgresql(
    server: tuple[procs.Child, str], agent_a: Persona
) -> None:
    """200 clients of one uvicorn process: each gets every entry once, other calls answer,
    and the server's database connections and threads stay bounded — a stream holds
    neither (runtime.api.sse: at most OPENERS + READERS threads and READERS connections
    for all streams together)."""
    if connection.vendor != "postgresql":
        pytest.skip("the connection count is a PostgreSQL figure")
    proc, web = server
    clients = LIVE_CLIENTS
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    database = connection.settings_dict["NAME"]

    def server_connections() -> int:
        """Every connection to the test database but this test process's own."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND pid <> pg_backend_pid()",
                [database],
            )
            row = cursor.fetchone()
            assert row is not None
            return int(row[0])

    def figures() -> tuple[int, int]:
        return server_connections(), server_threads(proc)

    def head() -> int:
        return max(e["seq"] for e in journal_json(run_id))

    latest = [0] * clients  # each client's last seq: how far the fan-out got

    async def one(http: httpx.AsyncClient, ready: asyncio.Queue[None], index: int) -> list[int]:
        seqs: list[int] = []
        url = f"{web}/api/v1/runs/{run_id}/events/"
        async with http.stream("GET", url, params=STREAM) as response:
            assert response.status_code == 200
            async for sse in EventSource(response).aiter_sse():
                if not sse.data:  # a comment line: httpx-sse makes it an empty event
                    continue
                seqs.append(int(sse.id))
                latest[index] = seqs[-1]
                if len(seqs) == 2:  # run_created and lease_taken: connected and caught up
                    ready.put_nowait(None)
        return seqs

    async def everyone_has(seq: int) -> None:
        while min(latest) < seq:
            await asyncio.sleep(0.005)

    async def scenario() -> tuple[list[list[int]], list[tuple[int, int]], list[int]]:
        limits = httpx.Limits(max_connections=clients + 20, max_keepalive_connections=0)
        timeout = httpx.Timeout(120)
        async with httpx.AsyncClient(
            headers=headers(agent_a), limits=limits, timeout=timeout
        ) as http:
            ready: asyncio.Queue[None] = asyncio.Queue()
            streams = [asyncio.create_task(one(http, ready, i)) for i in range(clients)]
            for _ in range(clients):
                await asyncio.wait_for(ready.get(), 120)
            seen = [await off_loop(figures)]
            statuses: list[int] = []
            for rev in range(5):  # the run moves while all 200 are connected
                body = {
                    "fence": fence,
                    "expected_rev": rev,
                    "state": {"rev": rev},
                    "next_step": "x",
                }
                posted = time.monotonic()
                answer = await http.post(f"{web}/api/v1/runs/{run_id}/checkpoints/", json=body)
                statuses.append(answer.status_code)
                await asyncio.wait_for(everyone_has(await off_loop(head)), 60)
                delivered.append(time.monotonic() - posted)  # POST sent .. the last client has it
                other = await http.get(f"{web}/api/v1/runs/", timeout=30)
                statuses.append(other.status_code)
                seen.append(await off_loop(figures))
            await off_loop(finish_external, agent_a, run_id, fence, 5)
            results = await asyncio.wait_for(asyncio.gather(*streams), 180)
            seen.append(await off_loop(figures))
            return results, seen, statuses

    before = figures()
    delivered: list[float] = []
    results, seen, statuses = asyncio.run(scenario())
    expected = [e["seq"] for e in journal_json(run_id)]
    wrong = [seqs for seqs in results if seqs != expected]
    assert not wrong, (len(wrong), expected, wrong[:3])
    assert set(statuses) == {200, 201}  # other calls answered while 200 streams were open
    connections, threads = max(c for c, _ in seen), max(t for _, t in seen)
    print(
        f"\n{clients} streams on one uvicorn process: database connections {before[0]} before,"
        f" {[c for c, _ in seen]} while open (max {connections}); server threads {before[1]}"
        f" before, {[t for _, t in seen]} while open (max {threads}); a checkpoint POSTed"
        f" until all {clients} had its entry: {[round(d * 1000) for d in delivered]} ms"
    )
    # At most READERS (4) readers' ones (the doorbell's poll is one of their reads), the API
    # calls in flight.
    assert connections <= 7, seen
    # The loop, OPENERS (8) + READERS (4) pool threads, a few of Django's and asyncio's:
    # bounded and far below one per client.
    assert threads <= 32, seen


@pytest.mark.postgres
def test_a_lost_database_connection_loses_no_entry(web: str, agent_a: Persona) -> None:
    """The server's database connections killed (a database restart, a proxy's idle cut)
    while a stream waits: the doorbell's next poll fails, the one after reconnects and
    rings, so the entries written meanwhile arrive, once each, well before the 15 s
    heartbeat's re-read would bring them."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's readers keep no connection between reads")
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)

    def kill_the_servers() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'holdpoint-web' AND datname = current_database()"
            )  # the module server's: no other's
            row = cursor.fetchone()
            assert row is not None
            return int(row[0])

    async def scenario() -> list[int]:
        seqs: list[int] = []
        async with httpx.AsyncClient(headers=headers(agent_a), timeout=60) as http:
            url = f"{web}/api/v1/runs/{run_id}/events/"
            async with http.stream("GET", url, params=STREAM) as response:
                async for sse in EventSource(response).aiter_sse():
                    if not sse.data:  # a comment line
                        continue
                    seqs.append(int(sse.id))
                    if sse.event == "lease_taken":  # caught up: cut its readers, then write
                        await asyncio.sleep(2 * live.POLL_SECONDS)  # the poller has read
                        assert await off_loop(kill_the_servers) >= 1
                        await off_loop(finish_external, agent_a, run_id, fence, 0)
        return seqs

    seqs = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert seqs == [e["seq"] for e in journal_json(run_id)]


@pytest.mark.postgres
def test_a_journal_append_sends_no_notification(agent_a: Persona) -> None:
    """Audit migration 0009 dropped 0006's NOTIFY trigger on the stream head: a transaction
    that notifies takes a cluster-wide lock at commit, held until its commit is flushed, so
    every step commit of every worker was serialized. A listener on its old channel hears
    nothing from appends made through the app — and does hear a NOTIFY sent by hand
    afterwards (it was listening)."""
    if connection.vendor != "postgresql":
        pytest.skip("NOTIFY is PostgreSQL's")
    import psycopg

    with psycopg.connect(procs.test_database_url(), autocommit=True) as listener:
        listener.execute("LISTEN holdpoint_journal")
        run_id = new_run(agent_a.api())["run_id"]  # creates the run's stream head
        fence = take_lease(agent_a.api(), run_id)  # moves it (the trigger's UPDATE OF seq)
        finish_external(agent_a, run_id, fence, 0)
        assert JournalEntry.objects.filter(stream=f"run:{run_id}").count() >= 3
        with psycopg.connect(procs.test_database_url(), autocommit=True) as other:
            other.execute("NOTIFY holdpoint_journal, 'by hand'")
        heard = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert heard == ["by hand"]


def test_the_run_page_refreshes_on_the_stream_instead_of_polling(
    web: str, agent_a: Persona, reviewer_a: Persona, new_page: Callable[[], Page]
) -> None:
    """In Chromium, on the real server: once the run's stream is open the page stops its 2 s
    polls, and an entry the agent writes shows at once (the fragment re-fetched on it)."""
    from playwright.sync_api import expect

    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    page = new_page()
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url))
    log_in(page, web, reviewer_a.user.get_username(), f"pw-{reviewer_a.user.get_username()}")
    page.goto(f"{web}/runs/{run_id}/")
    expect(page.locator("#run-header-title .badge")).to_have_text("running")
    procs.wait_for(lambda: any("stream=1" in url for url in fetched), timeout=15)
    time.sleep(1.5)  # the stream's backlog may ring once: that re-fetch is done
    polls = [url for url in fetched if f"/runs/{run_id}/live/" in url]
    time.sleep(6.5)  # three polling intervals
    assert [url for url in fetched if f"/runs/{run_id}/live/" in url] == polls
    finish_external(agent_a, run_id, fence, 0)
    # Well before the next poll would be let through (live.js: one per 30 s while open).
    expect(page.locator("#run-header-title .badge")).to_have_text("completed", timeout=5000)


def test_an_open_stream_ends_once_its_credentials_no_longer_stand(
    django_db_blocker: Any,
    tmp_path: Path,
    agent_a: Persona,
    reviewer_a: Persona,
    viewer_a: Persona,
) -> None:
    """Every API call authenticates afresh; a stream is one call that lasts for hours. It
    ends within a keep-alive interval once its token is revoked, its session logged out or
    its principal's role changed — and the reconnect is refused like any call — while a
    stream whose credentials still stand goes on (on a server of its own with a KEEPALIVE-
    second interval, as the quiet-stream test)."""
    from django.contrib.sessions.models import Session

    from runtime.auth import revoke_token
    from runtime.models import AgentToken, Membership, Role

    run_id = new_run(agent_a.api())["run_id"]  # queued: its stream stays open, quiet
    paths = [f"/api/v1/runs/{run_id}/events/", "/api/v1/approvals/"]
    keepalive = {"HOLDPOINT_SSE_KEEPALIVE": str(KEEPALIVE)}
    own = web_server(django_db_blocker, tmp_path / "web.log", "holdpoint-web-standing", **keepalive)
    with own as (_, web):
        # A token revoked: both streams end, and the token is refused from then on.
        for path in paths:
            token = AgentToken.objects.filter(user=agent_a.user, revoked_at__isnull=True).get()
            took = ended_after(
                web, path, headers(agent_a), lambda t=token: revoke_token(t, actor="test")
            )
            assert took < KEEPALIVE * 2 + 5, took  # within about an interval, not 30 s
            again = httpx.get(web + path, params=STREAM, headers=headers(agent_a), timeout=30)
            assert again.status_code == 401 and again.json()["code"] == "not_authenticated"
            agent_a.token = issue_token_for(agent_a.user)  # the next path's own token

        # A session logged out (its row deleted, as logout does) ends its stream.
        cookie = session_cookie(reviewer_a)
        key = cookie["Cookie"].split("=", 1)[1]
        ended_after(web, paths[1], cookie, lambda: Session.objects.filter(session_key=key).delete())
        again = httpx.get(web + paths[1], params=STREAM, headers=cookie, timeout=30)
        assert again.status_code in (401, 403), again.status_code

        # A principal whose role changed: the stream ends; the reconnect is scoped afresh.
        cookie = session_cookie(viewer_a)
        membership = Membership.objects.filter(user=viewer_a.user, tenant=viewer_a.tenant)
        ended_after(web, paths[0], cookie, lambda: membership.update(role=Role.REVIEWER))
        with httpx.stream("GET", web + paths[0], params=STREAM, headers=cookie) as again:
            assert again.status_code == 200

        # Credentials that still stand: the stream goes on past several checks.
        with httpx.stream(
            "GET", web + paths[1], params=STREAM, headers=headers(agent_a), timeout=30
        ) as answer:
            assert answer.status_code == 200
            comments = 0
            for line in answer.iter_lines():
                comments += line.startswith(":")
                if comments == 5:  # KEEPALIVE-second checks, every one passed
                    break
            assert comments == 5


@pytest.mark.django_db(transaction=True)  # the threads below read with connections of their own
def test_streams_served_by_threads_of_a_wsgi_server_at_once_all_answer(agent_a: Persona) -> None:
    """Under a threaded WSGI server (config.wsgi) several clients' streams are served at once,
    each by a thread of its own. They all answer: an async body would be driven on an event
    loop per thread by Django, and two loops sharing the doorbell's reads (same tenant, same
    position) failed with "attached to a different loop". Nor does Django warn that it must
    buffer an async body: a WSGI server is handed a body it can iterate."""
    run_id = new_run(agent_a.api())["run_id"]
    take_lease(agent_a.api(), run_id)
    paths = [f"/api/v1/runs/{run_id}/events/", "/api/v1/approvals/"]
    failures: list[str] = []
    start = threading.Barrier(4)

    def client(path: str) -> None:
        start.wait()
        try:
            for _ in range(15):
                answer = agent_a.api().get(path, {**STREAM, "after": "0"})
                body = b"".join(answer)
                assert answer.status_code == 200 and body.startswith(b": stream open"), body
        except BaseException as error:  # noqa: BLE001 (reported below, with the thread's path)
            failures.append(f"{path}: {error!r}")
        finally:
            connection.close()

    with warnings.catch_warnings():
        warnings.filterwarnings("error", "StreamingHttpResponse must consume")
        threads = [threading.Thread(target=client, args=(p,)) for p in paths * 2]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
