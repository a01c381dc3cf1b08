"""G8: live events (API.md, "Live events") through the real ASGI server (`uvicorn
config.asgi`, procs.start_web) — on SQLite and PostgreSQL (both polled: runtime.live).

The journal in the database is the oracle: every streamed event is compared, id and body,
with the entry `GET runs/{id}/events/` lists for that seq.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pytest
from django.db import connection, transaction
from httpx_sse import EventSource

from approvals.models import ApprovalRequest, ApprovalStatus
from audit.models import JournalEntry
from holdpoint_client import AsyncClient, Client
from runtime import live
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
from tests.browser import log_in
from tests.conftest import Persona, issue_token_for
from tests.orphans import off_loop

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytest_plugins = ("tests.browser",)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
STREAM = {"stream": "1"}
# The clients of test_200_stream_clients_hold_on_postgresql (more for a figure: above 600 also
# raise HOLDPOINT_API_RATE, one token opens them all).
LIVE_CLIENTS = int(os.environ.get("HOLDPOINT_LIVE_CLIENTS", "200"))
TERMINAL = {"completed", "failed", "cancelled"}
T = TypeVar("T")


@contextlib.contextmanager
def web_server(
    django_db_blocker: Any, log: Path, name: str = "holdpoint-web", **extra: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real web server (`extra`: its environment's additions): its process and base URL.
    On PostgreSQL its connections carry `name`, and its teardown waits until they are gone."""
    env = procs.child_env(**extra)
    if connection.vendor == "postgresql":  # its connections are counted by this name
        env["DATABASE_URL"] += f"?application_name={name}"
    proc, base = procs.start_web(env, log)
    names = (name,)
    try:
        yield proc, base
    finally:
        procs.kill(proc)
        if connection.vendor == "postgresql":  # its backends gone before the test database
            with django_db_blocker.unblock():
                procs.wait_for(lambda: not _web_backends(names), timeout=15)
                connection.close()


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """One real web server for the module (the database is emptied between tests, the server
    keeps no state of its own): its process and base URL. One token opens all of
    test_200_stream_clients_hold_on_postgresql's streams: it may hold that many open."""
    log = tmp_path_factory.mktemp("web") / "web.log"
    streams = {"HOLDPOINT_STREAMS_PER_TOKEN": str(LIVE_CLIENTS + 10)}
    with web_server(django_db_blocker, log, **streams) as found:
        yield found


def _web_backends(names: tuple[str, ...]) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = ANY(%s)",
            [list(names)],
        )
        row = cursor.fetchone()
        return int(row[0]) if row else 0


@pytest.fixture
def web(server: tuple[subprocess.Popen[bytes], str]) -> str:
    return server[1]


def headers(persona: Persona) -> dict[str, str]:
    return {"Authorization": f"Token {persona.token}"}


def session_cookie(persona: Persona) -> dict[str, str]:
    """A person's session (as the login page makes it), sent as a header: outside DEBUG the
    cookie is Secure, and httpx keeps a Secure cookie off plain http (a browser does not for
    127.0.0.1)."""
    from django.conf import settings
    from django.test import Client as DjangoClient

    django_client = DjangoClient()
    django_client.force_login(persona.user)
    return {"Cookie": f"{settings.SESSION_COOKIE_NAME}={django_client.cookies['sessionid'].value}"}


def journal_json(run_id: str) -> list[dict[str, Any]]:
    """The run's journal as the list endpoint renders it (the stream's oracle)."""
    entries = JournalEntry.objects.filter(stream=f"run:{run_id}").order_by("seq")
    return json.loads(json.dumps(JournalEntrySerializer(entries, many=True).data, default=str))


def as_json(events: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    return [json.loads(data) for _, _, data in events]


def read(
    http: httpx.Client,
    url: str,
    *,
    last: int | None = None,
    until: str | None = None,
    after: int | None = None,
) -> tuple[list[tuple[str, str, str]], bool]:
    """(id, event, data) of each event until the server closes the stream (True), or until
    an event of type `until` arrived (then this client disconnects: False)."""
    extra = {} if last is None else {"Last-Event-ID": str(last)}
    got: list[tuple[str, str, str]] = []
    params = STREAM if after is None else {**STREAM, "after": str(after)}
    with http.stream("GET", url, params=params, headers=extra) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for sse in EventSource(response).iter_sse():
            if not sse.data:  # a comment line (keep-alive): httpx-sse makes it an empty event
                continue
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
            decision = {"decision": "approve", "action_hash": approval.action_hash}
            ok(post(reviewer_a.api(), f"approvals/{approval.pk}/decision/", decision))
            # Resume where the first connection stopped, while the worker finishes the run;
            # hang up again after the decision, and resume once more to the end.
            second, closed = read(http, url, last=int(first[-1][0]), until="approval_decided")
            assert not closed
            rest, closed = read(http, url, last=int(second[-1][0]))
            assert closed  # the server closed the stream after the run's final entry
            rest = second + rest
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
        again, closed = read(http, f"runs/{run_id}/events/", after=journal[-2]["seq"])
    assert closed and as_json(again) == journal[-1:]


def test_streams_are_scoped_like_every_call(web: str, agent_a: Persona, agent_b: Persona) -> None:
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
    # Without stream=1 the same paths are the plain lists, answered by Django as before.
    listed = httpx.get(url, headers=headers(agent_a), timeout=30)
    assert listed.status_code == 200 and listed.json()["results"][0]["type"] == "run_created"
    pending = httpx.get(f"{web}/api/v1/approvals/", headers=headers(agent_a), timeout=30)
    assert pending.status_code == 200 and pending.json()["results"] == []
    bad = httpx.get(
        url, params=STREAM, headers={**headers(agent_a), "Last-Event-ID": "x"}, timeout=30
    )
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_params"
    # stream takes "1" only: anything else is refused, not read as the plain list.
    for path in (url, f"{web}/api/v1/approvals/"):
        odd = httpx.get(path, params={"stream": "yes"}, headers=headers(agent_a), timeout=30)
        assert odd.status_code == 422 and odd.json()["errors"] == {"stream": ['only "1"']}


def test_a_reviewer_page_streams_with_its_session_cookie(
    web: str, agent_a: Persona, reviewer_a: Persona, outsider_b: Persona
) -> None:
    """The pages' EventSource sends the session cookie, no token: it is authenticated and
    scoped like the session's API calls (a member of another tenant gets the 404)."""
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    _finish(agent_a, run_id, fence, 0)
    url = f"{web}/api/v1/runs/{run_id}/events/"
    with httpx.Client(headers=session_cookie(reviewer_a), timeout=30) as http:
        events, closed = read(http, url)
    assert closed and as_json(events) == journal_json(run_id)
    foreign = httpx.get(url, params=STREAM, headers=session_cookie(outsider_b), timeout=30)
    assert foreign.status_code == 404 and foreign.json()["code"] == "not_found"


def test_a_stream_not_served_on_the_event_loop_sends_what_is_there_and_ends(
    agent_a: Persona,
) -> None:
    """Through Django alone (its test client here; a WSGI server alike) a stream of a live
    run does not hold the worker: the entries so far, then the end (the client resumes)."""
    run_id = new_run(agent_a.api())["run_id"]
    take_lease(agent_a.api(), run_id)
    answer = agent_a.api().get(f"/api/v1/runs/{run_id}/events/", {"stream": "1", "after": "1"})
    assert answer.status_code == 200 and answer["Content-Type"] == "text/event-stream"
    body = b"".join(answer).decode()  # iterated as a WSGI server does
    assert [line for line in body.splitlines() if line.startswith("id:")] == ["id: 2"]
    assert "event: lease_taken" in body


def test_a_stream_not_served_on_the_event_loop_starts_no_doorbell(agent_a: Persona) -> None:
    """A stream that will not follow has nothing to wait for, so it must not start the
    process's doorbell: under Django alone each response is consumed on an event loop of
    its own that ends with it, so every such request started a doorbell task of its own
    (then a LISTEN connection on PostgreSQL), cancelled when its loop closed."""
    run_id = new_run(agent_a.api())["run_id"]
    take_lease(agent_a.api(), run_id)
    started = live.doorbell.task
    for path in (f"/api/v1/runs/{run_id}/events/", "/api/v1/approvals/"):
        answer = agent_a.api().get(path, STREAM)
        assert answer.status_code == 200 and b": stream open" in b"".join(answer)
    assert live.doorbell.task is started  # no doorbell started for these requests


# The keep-alive of the quiet-stream test's own server: the same code path as the default
# 15 s (HOLDPOINT_SSE_KEEPALIVE), without the test waiting out 15 s of quiet.
KEEPALIVE = 1


def test_a_quiet_stream_sends_a_comment_line_within_the_keepalive(
    django_db_blocker: Any, tmp_path: Path, agent_a: Persona
) -> None:
    """API.md: a comment line at least every 15 s (a proxy's idle timeout, a client's read
    timeout): the first at once, the next ones before each keep-alive interval of quiet is
    over (and some margin) — on a server of its own whose interval is KEEPALIVE seconds (the
    module's server keeps the default, so no other test is helped by an early re-read)."""
    from django.conf import settings

    assert settings.HOLDPOINT_SSE_KEEPALIVE == 15  # the default API.md promises
    url = "/api/v1/approvals/"
    lines: list[tuple[float, str]] = []
    keepalive = {"HOLDPOINT_SSE_KEEPALIVE": str(KEEPALIVE)}
    own = web_server(
        django_db_blocker, tmp_path / "web.log", "holdpoint-web-keepalive", **keepalive
    )
    with own as (_, web):
        start = time.monotonic()
        with httpx.stream(
            "GET", web + url, params=STREAM, headers=headers(agent_a), timeout=30
        ) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                lines.append((time.monotonic() - start, line))
                if len([text for _, text in lines if text.startswith(":")]) == 3:
                    break
    comments = [at for at, text in lines if text.startswith(":")]
    gaps = [later - earlier for earlier, later in zip(comments, comments[1:], strict=False)]
    assert comments[0] < 5 and max(gaps) < KEEPALIVE + 3, lines
    # No event: comment lines, and the position (`id:` alone) where the stream opened.
    assert not [text for _, text in lines if text and not text.startswith((":", "id: "))]


def test_a_web_process_told_to_stop_ends_its_streams_and_stops(
    django_db_blocker: Any, tmp_path: Path, agent_a: Persona
) -> None:
    """SIGTERM (a deploy, a supervisor's stop): uvicorn stops accepting and waits for every
    open response to end — and a stream of a live run never did. The process went on
    serving it, refusing every new connection, until a SIGKILL. Now its streams end, cleanly
    (the client resumes elsewhere with Last-Event-ID), and the process stops."""
    run_id = new_run(agent_a.api())["run_id"]
    take_lease(agent_a.api(), run_id)
    events: list[tuple[str, str, str]] = []
    caught_up = threading.Event()
    ended: list[str] = []
    with web_server(django_db_blocker, tmp_path / "web.log", "holdpoint-web-stop") as (proc, web):

        def follow() -> None:
            url = f"{web}/api/v1/runs/{run_id}/events/"
            try:
                with httpx.stream(
                    "GET", url, params=STREAM, headers=headers(agent_a), timeout=60
                ) as answer:
                    for sse in EventSource(answer).iter_sse():
                        if sse.data:
                            events.append((sse.id, sse.event, sse.data))
                        if sse.event == "lease_taken":
                            caught_up.set()
                ended.append("closed")
            except Exception as exc:  # the connection cut instead of the stream ended
                ended.append(repr(exc))

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        assert caught_up.wait(30)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("the web process with an open stream did not stop within 15 s")
        reader.join(timeout=15)
    assert ended == ["closed"]
    assert as_json(events) == journal_json(run_id)  # every entry, then the end


def test_the_poller_rings_a_stream_it_had_not_seen_before(agent_a: Persona) -> None:
    """The doorbell (both databases): the first append to a stream the poller had no head
    for rings its subscriber (it used to become the poller's baseline, and the subscriber
    waited for the next heartbeat, 15 s by default; no heartbeat runs here, so a missed ring
    fails)."""
    from audit import journal
    from runtime import live

    stream = journal.run_stream(uuid.uuid4())

    def append() -> None:
        with transaction.atomic():
            journal.append(stream, "run_created", tenant_id=agent_a.tenant.pk, actor="user:t")

    async def rung() -> bool:
        doorbell = live.Doorbell()
        try:
            async with doorbell.subscription(stream) as wake:
                await asyncio.sleep(3 * live.POLL_SECONDS)  # polled: no head for it yet
                assert not wake.is_set()
                await off_loop(append)
                await asyncio.wait_for(wake.wait(), 10 * live.POLL_SECONDS + 5)
                return True
        finally:
            await doorbell.stop()

    assert asyncio.run(rung())


def test_the_doorbell_reads_nothing_while_no_stream_is_watched(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poll is the price of live events on both databases: one read of the watched heads
    per interval while the process has a stream open, and none once it has none (a web
    process with no stream open sleeps)."""
    monkeypatch.setattr(live, "POLL_SECONDS", 0.05)
    reads: list[list[str]] = []

    def heads(keys: list[str]) -> dict[str, Any]:
        reads.append(keys)
        return {}

    monkeypatch.setattr(live, "_heads", heads)

    async def watched_then_not() -> tuple[int, int]:
        doorbell = live.Doorbell()
        try:
            async with doorbell.subscription("run:watched"):
                await asyncio.sleep(0.5)
            while doorbell.inflight:  # a read asked just before the stream ended
                await asyncio.sleep(0.01)
            watching = len(reads)
            await asyncio.sleep(0.5)
            assert doorbell.task is not None and not doorbell.task.done()  # still polling
            return watching, len(reads)
        finally:
            await doorbell.stop()

    watching, after = asyncio.run(watched_then_not())
    assert watching >= 3 and set(map(tuple, reads)) == {("run:watched",)}, reads
    assert after == watching


def test_the_doorbell_says_once_per_interval_that_it_cannot_reach_the_database(
    db: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The database away: the process's doorbell — its poll of the stream heads — tried
    again every interval and logged a traceback each time, a flood beside the streams' own
    line. Now it is one line per LOG_EVERY, as for the streams' failed reads."""
    import logging

    from django.db import OperationalError

    monkeypatch.setattr(live, "LOG_EVERY", 60.0)
    monkeypatch.setattr(live, "POLL_SECONDS", 0.1)
    tries: list[list[str]] = []

    def unreachable(keys: list[str]) -> Any:
        tries.append(keys)
        raise OperationalError("connection to server failed")

    monkeypatch.setattr(live, "_heads", unreachable)

    async def away() -> None:
        doorbell = live.Doorbell()
        try:
            async with doorbell.subscription("run:away"):
                await asyncio.sleep(1.5)  # ~15 tries
        finally:
            await doorbell.stop()

    with caplog.at_level(logging.ERROR, logger=live.log.name):
        asyncio.run(away())
    said = [r.getMessage() for r in caplog.records if r.name == live.log.name]
    assert len(said) == 1, said
    assert said[0].startswith("live events: ")
    assert len(tries) >= 5, tries  # it did keep trying


@pytest.mark.postgres
def test_stopping_the_doorbell_closes_the_connections_its_readers_kept() -> None:
    """On PostgreSQL a reader thread keeps its connection between reads; stopping the doorbell
    closes them. The test session's doorbell used to leave one open, so dropping the test
    database failed ("being accessed by other users") and left it on the server."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's readers close their connection after every read")

    def sessions() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return int(cursor.fetchone()[0])

    def settled(expected: int) -> int:
        deadline = time.monotonic() + 10  # a closed session leaves pg_stat_activity soon after
        while (found := sessions()) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def slow_read() -> int:
        time.sleep(0.3)  # held long enough for the others to need threads of their own
        return JournalEntry.objects.count()

    doorbell = live.Doorbell()

    async def read_at_once() -> None:
        await asyncio.gather(*(doorbell.read(key, slow_read) for key in range(live.READERS)))

    async def read_one_by_one() -> None:
        for key in range(2 * live.READERS):
            await doorbell.read(key, JournalEntry.objects.count)

    before = sessions()
    asyncio.run(read_one_by_one())  # threads that have done more reads than there are threads
    asyncio.run(read_at_once())
    assert settled(before + live.READERS) == before + live.READERS  # each reader kept one
    asyncio.run(doorbell.stop())
    assert settled(before) == before
    asyncio.run(read_at_once())  # a stopped doorbell reads again (new readers) ...
    doorbell.close_readers()  # ... and closes them again, outside any event loop
    assert settled(before) == before


def _finish(agent: Persona, run_id: str, fence: int, rev: int) -> None:
    body = {
        "fence": fence,
        "expected_rev": rev,
        "state": {},
        "next_step": "",
        "status": "completed",
    }
    ok(post(agent.api(), f"runs/{run_id}/checkpoints/", body), 201)


@pytest.mark.parametrize(
    ("status", "expected"), [(None, ["pending", "approved"]), ("approved", ["approved"])]
)
def test_the_approvals_stream_sees_a_created_and_a_decided_approval(
    web: str, agent_a: Persona, reviewer_a: Persona, status: str | None, expected: list[str]
) -> None:
    """And takes the list's `status` filter: only the approvals now in that status (it was
    neither checked nor applied — every approval streamed, whatever was asked)."""
    grant_policy(agent_a.tenant)
    with httpx.stream(  # a stream opened by mistake would never end: only its status is read
        "GET",
        f"{web}/api/v1/approvals/",
        params={**STREAM, "status": "pending-ish"},
        headers=headers(agent_a),
        timeout=30,
    ) as bad:
        assert bad.status_code == 422
        problem = json.loads(bad.read())
    assert problem["code"] == "invalid_params" and "status" in problem["errors"]
    run = new_run(agent_a.api())
    fence = take_lease(agent_a.api(), run["run_id"])

    async def watch() -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        async with httpx.AsyncClient(headers=headers(agent_a), timeout=60) as http:
            url = f"{web}/api/v1/approvals/"
            params = {**STREAM, **({"status": status} if status else {})}
            async with http.stream("GET", url, params=params) as response:
                assert response.status_code == 200
                opened.set()
                async for sse in EventSource(response).aiter_sse():
                    if not sse.data:  # a comment line
                        continue
                    assert sse.event == "approval"
                    seen.append(json.loads(sse.data))
                    created.set()
                    if seen[-1]["status"] != "pending":
                        return seen
        return seen

    async def act() -> None:
        await opened.wait()
        await asyncio.sleep(1)  # the stream's first read is done: what follows is new
        approval = await off_loop(_create)
        if status is None:  # seen pending (a change faster than a wake-up shows its result)
            await created.wait()
        else:  # nothing shows the pending one: give the stream a read of it
            await asyncio.sleep(2 * live.POLL_SECONDS)
        await off_loop(_decide, approval)

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
    assert [a["status"] for a in seen] == expected
    assert {a["id"] for a in seen} == {seen[0]["id"]}
    assert seen[-1]["decided_by"] == reviewer_a.user.username


def sse_lines(
    http: httpx.Client, url: str, *, last: int | None = None, after: int | None = None
) -> Iterator[tuple[str, str, str]]:
    """(id, event, data) of each block the stream sends — an `id:` alone and a comment line
    too (data empty), each with the last id seen (as EventSource keeps it) — until the caller
    closes it. Read line by line, so a caller's deadline is checked at every keep-alive."""
    extra = {} if last is None else {"Last-Event-ID": str(last)}
    params = STREAM if after is None else {**STREAM, "after": str(after)}
    with http.stream("GET", url, params=params, headers=extra) as response:
        assert response.status_code == 200, response.read()
        id, fields = "", {"event": "", "data": ""}
        for line in response.iter_lines():
            if not line:
                yield id, fields["event"], fields["data"]
                fields = {"event": "", "data": ""}
                continue
            name, _, value = line.partition(":")
            if name == "id":
                id = value.strip()
            elif name in fields:
                fields[name] = value.strip()


def until_seen(
    lines: Iterator[tuple[str, str, str]], seen: list[tuple[int, str, str]], wanted: set[Any]
) -> int:
    """Read `lines` into `seen` (id, approval id, status) until every (approval id, status)
    of `wanted` came; the last id the stream gave (what a client resumes from)."""
    deadline, got, last = time.monotonic() + 20, set(), ""
    for id, event, data in lines:
        last = id
        if data:
            assert event == "approval"
            approval = json.loads(data)
            seen.append((int(id), approval["id"], approval["status"]))
            got.add((approval["id"], approval["status"]))
        if wanted <= got:
            return int(last)
        assert time.monotonic() < deadline, f"waited for {wanted - got}; seen {seen}"
    raise AssertionError(f"the stream ended; waited for {wanted - got}")


def test_the_approvals_stream_resumes_after_the_last_id_missing_and_repeating_nothing(
    web: str, agent_a: Persona, reviewer_a: Persona
) -> None:
    """A client that reconnects with the last id it saw (Last-Event-ID, as EventSource and
    live.js do, or `after`) gets every approval created or decided while it was away, once,
    in order. The stream had no ids: a reconnect started afresh, and what happened while
    the client was away was never sent."""
    grant_policy(agent_a.tenant)
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    url = f"{web}/api/v1/approvals/"

    def create(title: str) -> str:
        action = ok(prepare(agent_a.api(), run_id, fence, params={"title": title}), 201)
        return str(action["approval"])

    def decide(approval_id: str, decision: str) -> None:
        approval = ApprovalRequest.objects.get(pk=approval_id)
        body = {"decision": decision, "action_hash": approval.action_hash, "reason": "r"}
        ok(post(reviewer_a.api(), f"approvals/{approval_id}/decision/", body))

    seen: list[tuple[int, str, str]] = []
    with httpx.Client(headers=headers(agent_a), timeout=30) as http:
        with contextlib.closing(sse_lines(http, url)) as lines:
            assert next(lines) == ("", "", "")  # ": stream open"
            opened_at, _, data = next(lines)  # then where it opened: an id, no event
            assert opened_at and not data
            first = create("one")
            last = until_seen(lines, seen, {(first, "pending")})
        # Away: decided, created, created and decided at once.
        decide(first, "approve")
        second = create("two")
        third = create("three")
        decide(third, "reject")
        with contextlib.closing(sse_lines(http, url, last=last)) as lines:
            wanted = {(first, "approved"), (second, "pending"), (third, "rejected")}
            last = until_seen(lines, seen, wanted)
        fourth = create("four")
        with contextlib.closing(sse_lines(http, url, after=last)) as lines:
            until_seen(lines, seen, {(fourth, "pending")})
    assert [(a, s) for _, a, s in seen] == [
        (first, "pending"),
        (first, "approved"),
        (second, "pending"),
        (third, "rejected"),  # its pending moved on before it was read: shown decided
        (fourth, "pending"),
    ]
    # The ids: the changes' seqs in the tenant's stream — after where it opened, in order.
    changes = JournalEntry.objects.filter(
        stream=f"tenant:{agent_a.tenant.pk}", type="approval_status"
    )
    seqs = {(e.payload["approval_id"], e.payload["status"]): e.seq for e in changes}
    ids = [id for id, _, _ in seen]
    assert ids == [seqs[(a, s)] for _, a, s in seen]
    assert int(opened_at) < ids[0] and ids == sorted(set(ids))  # each once, in order


def test_the_approvals_stream_sends_each_change_once(agent_a: Persona, reviewer_a: Persona) -> None:
    """An approval created after the stream opened and then decided is sent once per change:
    the next wake-up (here the next approval's creation; in a quiet tenant each keep-alive)
    sent it again, decided, because the stream forgot what it had last seen of it. Driven in
    this process (approvals.api.approval_events on the process's doorbell)."""
    from approvals.api import approval_events, changes_head
    from runtime.models import Role
    from runtime.tenancy import Principal

    grant_policy(agent_a.tenant)
    run = new_run(agent_a.api())
    fence = take_lease(agent_a.api(), run["run_id"])
    principal = Principal(user=agent_a.user, tenant=agent_a.tenant, role=Role.AGENT)
    seen: list[tuple[str, str]] = []

    def create(title: str) -> str:
        action = prepare(agent_a.api(), run["run_id"], fence, params={"title": title}).json()
        return str(ApprovalRequest.objects.get(action_id=action["action_id"]).pk)

    def decide(approval_id: str) -> None:
        approval = ApprovalRequest.objects.get(pk=approval_id)
        decision = {"decision": "approve", "action_hash": approval.action_hash}
        ok(post(reviewer_a.api(), f"approvals/{approval_id}/decision/", decision))

    async def until(wanted: tuple[str, str]) -> None:
        while wanted not in seen:
            await asyncio.sleep(0.05)

    start = changes_head(principal)

    async def watch() -> None:
        async for chunk in approval_events(principal, start):
            if b"event: approval" in chunk:
                data = json.loads(chunk.split(b"data: ", 1)[1])
                seen.append((data["id"], data["status"]))

    async def act() -> None:
        watcher = asyncio.create_task(watch())
        try:
            await asyncio.sleep(1)  # the stream's first read is done: what follows is new
            first = await off_loop(create, "one")
            await asyncio.wait_for(until((first, "pending")), 30)
            await off_loop(decide, first)
            await asyncio.wait_for(until((first, "approved")), 30)
            second = await off_loop(create, "two")
            await asyncio.wait_for(until((second, "pending")), 30)
            await asyncio.sleep(3 * live.POLL_SECONDS)  # anything more would show by now
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await live.doorbell.stop()
        assert seen == [(first, "pending"), (first, "approved"), (second, "pending")]

    asyncio.run(act())


def test_the_approvals_stream_sends_one_created_before_its_first_read(
    agent_a: Persona,
) -> None:
    """The stream opens (its position) before its first read: an approval created in between
    was taken for what there was at the opening, and never sent."""
    from approvals.api import approval_events, changes_head
    from runtime.models import Role
    from runtime.tenancy import Principal

    grant_policy(agent_a.tenant)
    run = new_run(agent_a.api())
    fence = take_lease(agent_a.api(), run["run_id"])
    principal = Principal(user=agent_a.user, tenant=agent_a.tenant, role=Role.AGENT)
    since = changes_head(principal)
    action = ok(prepare(agent_a.api(), run["run_id"], fence), 201)

    async def first() -> bytes:
        events = approval_events(principal, since)
        try:
            return await asyncio.wait_for(anext(events), 5)
        finally:
            await events.aclose()
            await live.doorbell.stop()

    data = json.loads(asyncio.run(first()).split(b"data: ", 1)[1])
    assert (data["id"], data["status"]) == (action["approval"], "pending")


def test_a_stream_cancelled_just_after_a_wake_up_ends(agent_a: Persona) -> None:
    """A client that goes away has its stream's task cancelled (Django's ASGI handler). On
    Python 3.11 `asyncio.wait_for` swallows a cancellation that arrives after the event it
    waits for was set and before it resumed: a stream woken in the same turn as its client
    left went on for ever (uvicorn drops what is sent to a closed connection), reading at
    every wake-up, and the handler waited on it."""
    from approvals.api import approval_events, changes_head
    from audit import journal
    from runtime.models import Role
    from runtime.tenancy import Principal

    principal = Principal(user=agent_a.user, tenant=agent_a.tenant, role=Role.AGENT)
    start = changes_head(principal)

    async def leave_on_a_ring() -> bool:
        async def watch() -> None:
            async for _ in approval_events(principal, start):
                pass

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.sleep(1)  # the first read is done: it waits for a wake-up
            live.doorbell.ring(journal.tenant_stream(agent_a.tenant.pk))
            watcher.cancel()  # the client left, in the same turn
            done, _ = await asyncio.wait([watcher], timeout=5)
            return watcher in done and watcher.cancelled()
        finally:
            while not watcher.done():  # what a swallowed cancel left running
                watcher.cancel()
                await asyncio.wait([watcher], timeout=1)
            await live.doorbell.stop()

    assert asyncio.run(leave_on_a_ring())


def test_a_stream_of_a_run_purged_while_it_is_read_ends(agent_a: Persona, settings: Any) -> None:
    """A finished run's stream reads a long journal in batches; the retention purge (here a
    thread's deletion request) deletes the run between two batches. The run's status then
    read as nothing — not finished — so the stream, having sent the last (redacted) entry,
    waited for entries that never come, for ever (API.md: closed after the run's final
    entry), sending keep-alives to a client whose run is gone."""
    from audit import journal
    from runtime.api import streams
    from runtime.lifecycle import cancel_run, create_run
    from runtime.models import Role
    from runtime.retention import purge_tenant
    from runtime.tenancy import Principal

    settings.HOLDPOINT_SSE_KEEPALIVE = 1  # a waiting stream re-reads every second
    run = create_run(agent_a.tenant, "chain", {}, actor="t", thread_id="to-delete")
    with transaction.atomic():
        for i in range(streams.BATCH + 10):  # a journal longer than one batch
            journal.append(
                journal.run_stream(run.pk),
                "note",
                tenant_id=agent_a.tenant.pk,
                actor="t",
                payload={"i": i},
            )
    cancel_run(Run.objects.get(pk=run.pk), "done", actor="t")
    total = JournalEntry.objects.filter(stream=journal.run_stream(run.pk)).count()
    principal = Principal(user=agent_a.user, tenant=agent_a.tenant, role=Role.AGENT)
    got: list[bytes] = []

    async def purged_midway() -> bool:
        events = streams.run_events(principal, run.pk, 0)
        try:
            got.append(await anext(events))  # the first batch is read
            await off_loop(lambda: purge_tenant(agent_a.tenant, thread_id="to-delete"))
            async with asyncio.timeout(5):
                async for chunk in events:
                    got.append(chunk)
            return True
        except TimeoutError:
            return False
        finally:
            await events.aclose()
            await live.doorbell.stop()

    ended = asyncio.run(purged_midway())
    assert not Run.objects.filter(pk=run.pk).exists()  # purged
    sent = [chunk for chunk in got if chunk.startswith(b"id: ")]
    assert len(sent) == total  # every entry once, the redacted ones too
    assert ended, got[-2:]


@pytest.mark.parametrize("kind", ["run", "approvals"])
def test_a_stream_far_behind_ends_soon_after_its_token_is_revoked(
    agent_a: Persona, kind: str
) -> None:
    """A stream looked at its credentials only while it waited for news: one resuming far
    behind (here five batches of backlog) read batch after batch without waiting, so a
    revoked token kept it — every entry of the backlog sent after the revocation — until it
    had caught up, and a keep-alive interval (15 s) more. It now looks between batches."""
    from approvals.api import CHANGED, approval_events
    from audit import journal
    from runtime.api import streams
    from runtime.auth import Standing, revoke_token
    from runtime.lifecycle import create_run
    from runtime.models import AgentToken, Role
    from runtime.tenancy import Principal

    tenant = agent_a.tenant
    run = create_run(tenant, "chain", {}, actor="t")  # queued: its stream follows, no end
    name = journal.run_stream(run.pk) if kind == "run" else journal.tenant_stream(tenant.pk)
    # The approvals stream reads changes of approvals gone since: it sends only where it is.
    gone = {"approval_id": str(uuid.uuid4()), "status": "pending"} if kind != "run" else {}
    with transaction.atomic():
        for i in range(streams.BATCH * 5):
            last = journal.append(
                name,
                "note" if kind == "run" else CHANGED,
                tenant_id=tenant.pk,
                actor="t",
                payload={"i": i, **gone},
            )
    token = AgentToken.objects.get(user=agent_a.user)
    principal = Principal(user=agent_a.user, tenant=tenant, role=Role.AGENT)
    standing = Standing(agent_a.user.pk, tenant.pk, Role.AGENT, token_id=token.pk)
    if kind == "run":
        events = streams.run_events(principal, run.pk, 0, standing=standing)
    else:
        events = approval_events(principal, 0, standing=standing)
    got: list[bytes] = []

    async def revoked_after_the_first_batch() -> bool:
        try:
            got.append(await anext(events))  # the first batch is read
            await off_loop(lambda: revoke_token(token, actor="test"))
            async with asyncio.timeout(5):
                async for chunk in events:
                    got.append(chunk)
            return True
        except TimeoutError:
            return False
        finally:
            await events.aclose()
            await live.doorbell.stop()

    ended = asyncio.run(revoked_after_the_first_batch())
    told = [int(line[4:]) for c in got for line in c.split(b"\n") if line.startswith(b"id: ")]
    assert ended and told, got[-2:]
    assert max(told) < last.seq - streams.BATCH * 3, (max(told), last.seq)  # one batch, no more


def test_a_stream_read_in_the_requests_thread_ends_between_batches_once_revoked(
    agent_a: Persona,
) -> None:
    """Under a WSGI server (here Django's test client) a stream sends the backlog there is
    and ends; a long one stops between two batches once its token is revoked, as a stream
    on the event loop does."""
    from audit import journal
    from runtime.api import streams
    from runtime.auth import revoke_token
    from runtime.lifecycle import create_run
    from runtime.models import AgentToken

    run = create_run(agent_a.tenant, "chain", {}, actor="t")
    with transaction.atomic():
        for _ in range(streams.BATCH * 3):
            last = journal.append(
                journal.run_stream(run.pk), "note", tenant_id=agent_a.tenant.pk, actor="t"
            )
    answer = agent_a.api().get(f"/api/v1/runs/{run.pk}/events/", {**STREAM, "after": "0"})
    assert answer.status_code == 200
    body = iter(answer.streaming_content)  # type: ignore[attr-defined]
    sent = [next(body), next(body)]  # the stream's first line, the first entry
    revoke_token(AgentToken.objects.get(user=agent_a.user), actor="test")
    sent.extend(body)
    told = [int(c.split(b"\n")[0][4:]) for c in sent if c.startswith(b"id: ")]
    assert told[0] == 1 and max(told) == streams.BATCH, (max(told), last.seq)


def test_a_stream_woken_often_with_nothing_to_send_still_sends_a_comment_line(
    agent_a: Persona, settings: Any
) -> None:
    """The approvals stream is woken by every append to its tenant's stream (logins, token
    and policy changes, decisions), most of which change no approval: the comment line went
    out only after a keep-alive interval with no wake-up at all, so while the tenant was busy
    the stream sent nothing (API.md: a comment line at least every 15 s) and a proxy closed
    it as idle."""
    from approvals.api import approval_events, changes_head
    from audit import journal
    from runtime.api.streams import KEEP_ALIVE
    from runtime.models import Role
    from runtime.tenancy import Principal

    settings.HOLDPOINT_SSE_KEEPALIVE = 1
    principal = Principal(user=agent_a.user, tenant=agent_a.tenant, role=Role.AGENT)
    start = changes_head(principal)
    got: list[bytes] = []

    async def busy() -> None:
        async def watch() -> None:
            async for chunk in approval_events(principal, start):
                got.append(chunk)

        watcher = asyncio.create_task(watch())
        try:
            for _ in range(14):  # 3.5 s of wake-ups, 4 a second
                await asyncio.sleep(0.25)
                live.doorbell.ring(journal.tenant_stream(agent_a.tenant.pk))
        finally:
            watcher.cancel()
            await asyncio.wait([watcher], timeout=5)
            await live.doorbell.stop()

    asyncio.run(busy())
    assert got.count(KEEP_ALIVE) >= 2, got


@pytest.mark.parametrize("kind", ["run", "approvals"])
def test_streams_outlive_a_database_outage_alive_and_without_a_flood_of_lines(
    agent_a: Persona,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    """The database away for a while: each open stream retried its read every second and
    sent nothing meanwhile, so a proxy closed it as idle (API.md: a comment line at least
    every 15 s) — and each retry of each stream logged a traceback (200 streams: 200 lines
    a second). Now the comment line goes on through the outage, the failure is logged once
    per interval for the whole process, and the entries come once the database is back."""
    from django.db import OperationalError

    from approvals import api as approvals_api
    from approvals.api import approval_events, changes_head
    from runtime.api import streams
    from runtime.api.streams import KEEP_ALIVE
    from runtime.models import Role
    from runtime.tenancy import Principal

    settings.HOLDPOINT_SSE_KEEPALIVE = 1
    monkeypatch.setattr(live, "LOG_EVERY", 2.0)
    principal = Principal(user=agent_a.user, tenant=agent_a.tenant, role=Role.AGENT)
    grant_policy(agent_a.tenant)
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    start = changes_head(principal)
    ok(prepare(agent_a.api(), run_id, fence), 201)  # an approval requested after `start`
    module, name = (streams, "_after") if kind == "run" else (approvals_api, "_changed")
    read = getattr(module, name)
    away = threading.Event()
    away.set()

    def through_the_outage(*args: Any) -> Any:
        if away.is_set():  # the seam between a stream and its database, as a driver fails
            raise OperationalError("server closed the connection unexpectedly")
        return read(*args)

    monkeypatch.setattr(module, name, through_the_outage)
    clients = 20
    got: list[list[bytes]] = [[] for _ in range(clients)]

    def events() -> Any:
        if kind == "run":
            return streams.run_events(principal, run_id, 0)
        return approval_events(principal, start)

    async def outage() -> None:
        async def watch(into: list[bytes]) -> None:
            async for chunk in events():
                into.append(chunk)

        watchers = [asyncio.create_task(watch(into)) for into in got]
        try:
            await asyncio.sleep(4.5)
            assert all(KEEP_ALIVE in into for into in got)  # during the outage
            away.clear()
            await asyncio.sleep(2)
        finally:
            for watcher in watchers:
                watcher.cancel()
            await asyncio.wait(watchers, timeout=5)
            await live.doorbell.stop()

    with caplog.at_level("ERROR"):
        asyncio.run(outage())
    expected = b"event: run_created" if kind == "run" else b"event: approval"
    for chunks in got:
        assert chunks.count(KEEP_ALIVE) >= 3, chunks
        assert sum(expected in chunk for chunk in chunks) == 1, chunks
    failed = [r for r in caplog.records if "live events" in r.getMessage()]
    assert 1 <= len(failed) <= 3, [r.getMessage() for r in failed]
    assert failed[0].exc_info is not None  # the operator still gets what failed


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
                    await off_loop(_finish, agent_a, second, second_fence, 0)
            return seqs

    second = new_run(agent_a.api())["run_id"]
    second_fence = take_lease(agent_a.api(), second)
    seqs = asyncio.run(asyncio.wait_for(follow_live(), 60))
    assert seqs == [e["seq"] for e in journal_json(second)]


class CuttingProxy:
    """A TCP proxy to the web server that hangs up on its first connection as soon as it has
    passed on an event of type `cut_after` — a lost connection mid-stream, as a client sees
    one — and passes every later connection whole. `requests`: what each connection sent."""

    def __init__(self, upstream: str, cut_after: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.marker = f"event: {cut_after}\n".encode()
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            index = len(self.requests)
            self.requests.append(b"")
            threading.Thread(target=self._serve, args=(down, index), daemon=True).start()

    def _serve(self, down: socket.socket, index: int) -> None:
        cut = index == 0
        up = socket.create_connection(self.upstream)

        def upward() -> None:
            with contextlib.suppress(OSError):
                while chunk := down.recv(65536):
                    self.requests[index] += chunk
                    up.sendall(chunk)

        threading.Thread(target=upward, daemon=True).start()
        seen = b""
        with contextlib.suppress(OSError), down, up:
            while chunk := up.recv(65536):
                down.sendall(chunk)
                seen += chunk
                at = seen.find(self.marker)
                if cut and at >= 0 and seen.find(b"\n\n", at) >= 0:  # that event is out
                    down.shutdown(socket.SHUT_RDWR)
                    return

    def close(self) -> None:
        self.listener.close()


def last_event_ids(proxy: CuttingProxy) -> list[str | None]:
    """The Last-Event-ID each connection through the proxy sent (None: none)."""
    found = []
    for raw in proxy.requests:
        header = [line for line in raw.split(b"\r\n") if line.lower().startswith(b"last-event-id:")]
        found.append(header[0].split(b":", 1)[1].strip().decode() if header else None)
    return found


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
                        _finish(agent_a, run_id, fence, 0)
        else:

            async def follow() -> None:
                async with AsyncClient(proxy.url, agent_a.token or "") as client:
                    async for entry in client.events(run_id, follow=True):
                        seqs.append(entry.seq)
                        if entry.type == "lease_taken":
                            await off_loop(_finish, agent_a, run_id, fence, 0)

            asyncio.run(asyncio.wait_for(follow(), 60))
    finally:
        proxy.close()
    assert seqs == [e["seq"] for e in journal_json(run_id)]  # each once, in order, to the end
    streams = [r for r in proxy.requests if b"stream=1" in r.split(b"\r\n", 1)[0]]
    assert len(streams) >= 2  # it did reconnect
    resumed = last_event_ids(proxy)
    assert resumed[0] == "0" and str(lease_seq) in resumed[1:]


def server_threads(proc: subprocess.Popen[bytes]) -> int:
    """The web server process's threads (Linux: one /proc task each)."""
    return len(os.listdir(f"/proc/{proc.pid}/task"))


@pytest.mark.postgres
def test_200_stream_clients_hold_on_postgresql(
    server: tuple[subprocess.Popen[bytes], str], agent_a: Persona
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
            await off_loop(_finish, agent_a, run_id, fence, 5)
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
                        await off_loop(_finish, agent_a, run_id, fence, 0)
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
        _finish(agent_a, run_id, fence, 0)
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
    _finish(agent_a, run_id, fence, 0)
    # Well before the next poll would be let through (live.js: one per 30 s while open).
    expect(page.locator("#run-header-title .badge")).to_have_text("completed", timeout=5000)


def test_the_inbox_refreshes_on_the_approvals_stream_and_resumes_where_it_was(
    web: str, agent_a: Persona, reviewer_a: Persona, new_page: Callable[[], Page]
) -> None:
    """In Chromium, on the real server: the inbox's stream is cut after it said where it
    opened (`id:` alone); an approval is raised meanwhile; live.js reconnects with that id as
    Last-Event-ID and the approval raised while it was away shows."""
    from playwright.sync_api import Request, Route, expect

    from approvals.api import changes_head
    from runtime.models import Role
    from runtime.tenancy import Principal

    grant_policy(agent_a.tenant)
    run_id = new_run(agent_a.api())["run_id"]
    fence = take_lease(agent_a.api(), run_id)
    opened_at = changes_head(Principal(user=agent_a.user, tenant=agent_a.tenant, role=Role.AGENT))
    page = new_page()
    streams: list[Request] = []
    page.on("request", lambda r: streams.append(r) if "stream=1" in r.url else None)
    cut: list[Route] = []

    def cut_the_first(route: Route) -> None:  # the stream's opening, then a lost connection
        if cut:
            route.continue_()
            return
        cut.append(route)
        body = f": stream open\n\nid: {opened_at}\n\n"
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/api/v1/approvals/?stream=1*", cut_the_first)
    log_in(page, web, reviewer_a.user.get_username(), f"pw-{reviewer_a.user.get_username()}")
    title = "Raised while the inbox was away"
    ok(prepare(agent_a.api(), run_id, fence, params={"title": title}), 201)
    deadline = time.monotonic() + 15
    while len(streams) < 2 and time.monotonic() < deadline:  # live.js: again after 3 s
        page.wait_for_timeout(200)  # (Playwright's events arrive while it is called)
    assert "last-event-id" not in streams[0].all_headers()
    assert streams[1].all_headers()["last-event-id"] == str(opened_at)
    expect(page.locator("#inbox-live")).to_contain_text(title, timeout=5000)


def _ended(web: str, url: str, sent: dict[str, str], lift: Callable[[], None]) -> float:
    """Open a stream with `sent`, take two comment lines, `lift` what authenticated it, and
    read on until the server ends the stream (it fails once ten keep-alive intervals passed
    without the end). Seconds from the lift to the end."""
    with httpx.stream("GET", web + url, params=STREAM, headers=sent, timeout=30) as answer:
        assert answer.status_code == 200, answer.read()
        comments, lifted = 0, None
        for line in answer.iter_lines():
            comments += line.startswith(":")
            if lifted is None and comments == 2:
                lift()
                lifted = time.monotonic()
            elif lifted is not None and time.monotonic() - lifted > KEEPALIVE * 10:
                pytest.fail(f"the stream still runs {KEEPALIVE * 10} s after its credentials")
    assert lifted is not None
    return time.monotonic() - lifted


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
            took = _ended(
                web, path, headers(agent_a), lambda t=token: revoke_token(t, actor="test")
            )
            assert took < KEEPALIVE * 2 + 5, took  # within about an interval, not 30 s
            again = httpx.get(web + path, params=STREAM, headers=headers(agent_a), timeout=30)
            assert again.status_code == 401 and again.json()["code"] == "not_authenticated"
            agent_a.token = issue_token_for(agent_a.user)  # the next path's own token

        # A session logged out (its row deleted, as logout does) ends its stream.
        cookie = session_cookie(reviewer_a)
        key = cookie["Cookie"].split("=", 1)[1]
        _ended(web, paths[1], cookie, lambda: Session.objects.filter(session_key=key).delete())
        again = httpx.get(web + paths[1], params=STREAM, headers=cookie, timeout=30)
        assert again.status_code in (401, 403), again.status_code

        # A principal whose role changed: the stream ends; the reconnect is scoped afresh.
        cookie = session_cookie(viewer_a)
        membership = Membership.objects.filter(user=viewer_a.user, tenant=viewer_a.tenant)
        _ended(web, paths[0], cookie, lambda: membership.update(role=Role.REVIEWER))
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
