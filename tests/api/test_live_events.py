"""G8: live events (API.md, "Live events") through the real ASGI server (`uvicorn
config.asgi`, procs.start_web) — on SQLite and PostgreSQL (both polled: runtime.live).

The journal in the database is the oracle: every streamed event is compared, id and body,
with the entry `GET runs/{id}/events/` lists for that seq.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection, transaction
from httpx_sse import EventSource

from approvals.models import ApprovalRequest, ApprovalStatus
from audit.models import JournalEntry
from runtime import live
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
from tests.api.live import (
    KEEPALIVE,
    STREAM,
    as_json,
    finish_external,
    headers,
    journal_json,
    read,
    session_cookie,
    web_server,
)
from tests.conftest import Persona
from tests.orphans import off_loop

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


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
    finish_external(agent_a, run_id, fence, 0)
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
