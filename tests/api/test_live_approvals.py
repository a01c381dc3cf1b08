"""G8: the approvals stream (API.md, "Live events") through the real ASGI server — on
SQLite and PostgreSQL: every change of a pending approval once, resumed after the last id,
and the inbox page that refreshes on it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from httpx_sse import EventSource

from approvals.models import ApprovalRequest
from audit.models import JournalEntry
from runtime import live
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
    STREAM,
    headers,
    sse_lines,
    until_seen,
)
from tests.browser import log_in
from tests.conftest import Persona
from tests.orphans import off_loop

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytest_plugins = ("tests.browser",)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


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
