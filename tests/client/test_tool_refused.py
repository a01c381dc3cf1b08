"""A service's refusal (`ToolRefused` from `perform`) reaches the agent's caller with its words.

The API on `live_server`, the blocking and the asyncio executor (one flow for both); the
service is a `perform` that refuses. A later `act` of the same call (a restarted agent)
finds the failed action in the ledger and says the same.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from holdpoint_client import (
    ActionFailed,
    AsyncClient,
    AsyncExecutor,
    Client,
    Executor,
    ToolCall,
    ToolRefused,
)
from runtime.models import Action as ActionRow
from tests.client import TOOL
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)
TASK = {"title": "Review the API change", "body": "GET /orders: removed"}
SAID = "HTTP 422 from the tracker: project_archived (the project was archived)"


def refuse(call: ToolCall) -> Any:
    raise ToolRefused(SAID)


def test_the_failure_says_what_the_service_refused(live_server: Any, agent_a: Persona) -> None:
    """`act` raised ActionFailed("agent.tasks.create failed: ") — the reason empty: the
    service's words were recorded in the ledger (the result) and dropped on the way to the
    caller, who could not tell an archived project from a bad title. Now the failure says
    it, in its message and its `reason`, also when a restarted agent finds it recorded."""
    with Client(live_server.url, agent_a.token or "", backoff=0.01) as client:
        run = client.create_run("api-review", {}, external=True)
        with Executor(client, run.run_id, "agent-1", ttl=10) as ex:
            with pytest.raises(ActionFailed) as failed:
                ex.act(TOOL, TASK, call="propose", perform=refuse)
        with Executor(client, run.run_id, "agent-2", ttl=10) as ex:
            with pytest.raises(ActionFailed) as found:
                ex.act(TOOL, TASK, call="propose", perform=refuse)

    for raised in (failed.value, found.value):
        assert str(raised) == f"{TOOL} failed: {SAID}"
        assert raised.reason == SAID
    assert ActionRow.objects.get(run_id=run.run_id).status == "failed"


def test_the_failure_says_what_the_service_refused_async(
    live_server: Any, agent_a: Persona
) -> None:
    async def story() -> ActionFailed:
        async with AsyncClient(live_server.url, agent_a.token or "", backoff=0.01) as client:
            run = await client.create_run("api-review", {}, external=True)
            async with AsyncExecutor(client, run.run_id, "agent-1", ttl=10) as ex:
                with pytest.raises(ActionFailed) as failed:
                    await ex.act(TOOL, TASK, call="propose", perform=refuse)
                return failed.value

    raised = asyncio.run(story())

    assert str(raised) == f"{TOOL} failed: {SAID}" and raised.reason == SAID


def test_a_refusal_without_words_is_named_by_its_kind(live_server: Any, agent_a: Persona) -> None:
    """`raise ToolRefused()` says nothing itself: the failure names the refusal's class
    rather than an empty reason."""

    class ProjectArchived(ToolRefused):
        pass

    def archived(call: ToolCall) -> Any:
        raise ProjectArchived()

    with Client(live_server.url, agent_a.token or "", backoff=0.01) as client:
        run = client.create_run("api-review", {}, external=True)
        with Executor(client, run.run_id, "agent-1", ttl=10) as ex:
            with pytest.raises(ActionFailed) as failed:
                ex.act(TOOL, TASK, call="propose", perform=archived)

    assert str(failed.value) == f"{TOOL} failed: ProjectArchived"
