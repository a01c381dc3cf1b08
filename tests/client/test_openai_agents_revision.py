"""The OpenAI Agents adapter when the goal is revised while a pause waits for a reviewer.

In process: the real Agents SDK with a scripted fake Model (tests/client/
test_openai_agents_args.py), the API on `live_server`, tenant A's reviewers holding
agent.tasks.create. The revision withdraws the held call (API.md, goal revisions): the
README promises `ActionWithdrawn` for it, whichever process resumes the thread.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from agents import Agent, set_tracing_disabled
from django.db import connections

from holdpoint_client import ActionWithdrawn, ApprovalTimeout, AsyncHoldpoint, ToolCall
from holdpoint_client.openai_agents import holdpoint_tool, run_agent
from runtime.models import Action, Run
from tests.client import hold_point  # noqa: F401  (a fixture)
from tests.client.test_openai_agents import paused_state
from tests.client.test_openai_agents_args import Scripted
from tests.conftest import Persona

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hold_point")]


def paused_apart(thread: str) -> Any:
    """paused_state from a thread of its own (the test's event loop must not block on the
    database), whose connection is closed after: left open, it holds the SQLite file, and
    a later test that changes its journal mode finds it locked."""
    try:
        return paused_state(thread)
    finally:
        connections.close_all()


def test_a_pause_withdrawn_by_a_goal_revision_raises_action_withdrawn(
    live_server: Any, agent_a: Persona
) -> None:
    """The agent paused on create_task (stored, `approval_timeout=0`), then the goal was
    revised, which cancelled the held action. Resuming the thread built the call's key
    with the new goal_rev, found no action under it and raised "not a Holdpoint tool" — as
    if the paused call were someone else's. Now the call is looked up under the goal
    revision it was paused under, and its withdrawal is raised as ActionWithdrawn; the
    tool's function is never called."""
    set_tracing_disabled(True)
    performed: list[str] = []

    @holdpoint_tool("agent.tasks.create")
    def create_task(title: str, body: str, *, call: ToolCall) -> Any:
        """Open a task in the tracker."""
        performed.append(title)
        return {"id": "T-1"}

    def agent() -> Agent[Any]:
        model = Scripted([json.dumps({"title": "Review", "body": "GET /orders: gone"})])
        return Agent(name="reviewer", instructions="-", tools=[create_task], model=model)

    assert agent_a.token is not None
    hp = AsyncHoldpoint(live_server.url, agent_a.token, ttl=5, backoff=0.01)

    async def resume(input: Any = None) -> Any:
        return await run_agent(
            hp, "oa-revised", agent(), input, graph="api-review", approval_timeout=0
        )

    async def go() -> None:
        try:
            with pytest.raises(ApprovalTimeout):
                await resume("go")
            assert await asyncio.to_thread(paused_apart, "oa-revised")  # under revision 1
            (run,) = [r async for r in hp.client.list_runs(thread_id="oa-revised")]
            await hp.client.revise(run.run_id, {"task": "other"}, expected_goal_rev=run.goal_rev)
            with pytest.raises(ActionWithdrawn) as withdrawn:
                await resume()
            assert withdrawn.value.action is not None
            assert withdrawn.value.action.tool == "agent.tasks.create"
        finally:
            await hp.aclose()

    asyncio.run(go())
    assert performed == []
    (action,) = Action.objects.filter(run__thread_id="oa-revised")
    assert action.status == "cancelled" and action.idempotency_key.endswith(":1:ext:oa:call_0")
    run = Run.objects.get(thread_id="oa-revised")
    assert run.goal_rev == 2 and run.lease_owner == ""
    # The pause was the old goal's: dropped, so the next input starts the new goal's.
    assert paused_state("oa-revised") is None
