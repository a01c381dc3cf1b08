"""A lookup's "not found" that the server refuses as too early costs the agent no attempt.

The tracker is reconciled by lookup (HOLDPOINT_TASKS_DEDUP=lookup). The first call's
outcome cannot be told (the request failed on the way), so the executor asks the tracker
by key; nothing is there, and `not_found` is accepted only once the first request can no
longer be in flight (API.md, "External executors": the lease plus the tool's timeout,
`reconcile.not_found_after`). The API on `live_server`, the blocking and asyncio executor.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from holdpoint_client import AsyncClient, AsyncExecutor, Client, Executor, ToolCall
from runtime.models import Action as ActionRow
from tests.client import TOOL
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)
TASK = {"title": "Review the API change", "body": "GET /orders: removed"}


class Tracker:
    """A service reconciled by lookup: the first request never arrives (the agent cannot
    tell: the connection broke), later ones make one task per key."""

    def __init__(self) -> None:
        self.tasks: dict[str, str] = {}
        self.sent = 0
        self.looked = 0

    def perform(self, call: ToolCall) -> Any:
        self.sent += 1
        if self.sent == 1:
            raise ConnectionResetError("the connection broke: did the tracker get it?")
        task = self.tasks.setdefault(call.idempotency_key, f"T-{len(self.tasks) + 1}")
        return task, {"id": task}

    def lookup(self, call: ToolCall) -> Any:
        self.looked += 1
        task = self.tasks.get(call.idempotency_key)
        return None if task is None else (task, {"id": task})


def test_a_too_early_not_found_waits_for_the_servers_moment(
    live_server: Any, agent_a: Persona, settings: Any
) -> None:
    """With replay_attempts=2 the agent looked up once, was told "too early" (the first
    request could be in flight for ttl + the tool's timeout, 5 s), paused at most a ttl,
    and counted that as its second attempt: OutcomeUnknown ("the server reconciles it"),
    a person's work, before the lookup could ever be answered. Now a too-early refusal
    waits for `not_found_after` and looks again, costing no attempt: the lookup is
    accepted, the call sent again with its key, one task."""
    settings.HOLDPOINT_TASKS_DEDUP = "lookup"
    tracker = Tracker()
    with Client(live_server.url, agent_a.token or "", backoff=0.01) as client:
        run = client.create_run("api-review", {}, external=True)
        with Executor(
            client, run.run_id, "agent-1", ttl=2, replay_attempts=2, retry_pause=0.01
        ) as ex:
            done = ex.act(
                TOOL, TASK, call="propose", perform=tracker.perform, lookup=tracker.lookup
            )

    assert (done.status, done.external_id) == ("confirmed", "T-1")
    assert tracker.tasks == {done.idempotency_key: "T-1"} and tracker.sent == 2
    assert tracker.looked >= 2  # looked again after the server's moment
    assert ActionRow.objects.get(pk=done.action_id).status == "confirmed"


def test_a_too_early_not_found_waits_for_the_servers_moment_async(
    live_server: Any, agent_a: Persona, settings: Any
) -> None:
    settings.HOLDPOINT_TASKS_DEDUP = "lookup"
    tracker = Tracker()

    async def story() -> Any:
        async with AsyncClient(live_server.url, agent_a.token or "", backoff=0.01) as client:
            run = await client.create_run("api-review", {}, external=True)
            async with AsyncExecutor(
                client, run.run_id, "agent-1", ttl=2, replay_attempts=2, retry_pause=0.01
            ) as ex:
                return await ex.act(
                    TOOL, TASK, call="propose", perform=tracker.perform, lookup=tracker.lookup
                )

    done = asyncio.run(story())

    assert (done.status, done.external_id) == ("confirmed", "T-1") and tracker.sent == 2
