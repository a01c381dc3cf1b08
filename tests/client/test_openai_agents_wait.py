"""`wait_for_decision` waits on the run `run_agent` resumes: the thread's external run.

In process: the real Agents SDK with a scripted fake Model (tests/client/
test_openai_agents_args.py), the API on `live_server`, tenant A's reviewers holding
agent.tasks.create. A thread id names runs, not one run: a hosted run (one Holdpoint's
workers execute) may share it with the agent's external run (API.md, "External executors").
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from agents import Agent, set_tracing_disabled

from holdpoint_client import ApprovalTimeout, AsyncHoldpoint, ExecutorError, ToolCall
from holdpoint_client.models import Approval
from holdpoint_client.openai_agents import holdpoint_tool, run_agent, wait_for_decision
from runtime.models import Action, Run, RunStatus
from tests.client import decide, hold_point  # noqa: F401  (a fixture)
from tests.client.test_openai_agents_args import Scripted
from tests.conftest import Persona

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hold_point")]
THREAD = "oa-shared"


def agent(performed: list[str]) -> Agent[Any]:
    set_tracing_disabled(True)

    @holdpoint_tool("agent.tasks.create")
    def create_task(title: str, body: str, *, call: ToolCall) -> Any:
        """Open a task in the tracker."""
        performed.append(title)
        return {"id": "T-1", "title": title}

    model = Scripted([json.dumps({"title": "Review", "body": "GET /orders: gone"})])
    return Agent(name="reviewer", instructions="-", tools=[create_task], model=model)


def test_wait_for_decision_waits_on_the_agents_run_not_a_newer_hosted_one(
    live_server: Any, agent_a: Persona, reviewer_a: Persona
) -> None:
    """The agent paused on create_task in its external run; then a hosted run was started
    on the same thread id. wait_for_decision took the thread's newest run — the hosted one,
    with no approvals — and returned [] at once, "nothing pending", while the agent's call
    still waited for a reviewer. Now it waits on the external run, as run_agent finds it:
    still pending, ApprovalTimeout; decided, its approval; and run_agent then goes on."""
    performed: list[str] = []
    assert agent_a.token is not None
    token = agent_a.token

    async def resume(input: Any = None) -> Any:
        async with AsyncHoldpoint(live_server.url, token, ttl=5, backoff=0.01) as hp:
            return await run_agent(
                hp, THREAD, agent(performed), input, graph="api-review", approval_timeout=0
            )

    async def waits(timeout: float) -> list[Approval]:
        async with AsyncHoldpoint(live_server.url, token, backoff=0.01) as hp:
            return await wait_for_decision(hp, THREAD, timeout=timeout)

    async def start_hosted() -> str:
        async with AsyncHoldpoint(live_server.url, token) as hp:
            return (await hp.client.create_run("api-review", {}, thread_id=THREAD)).run_id

    with pytest.raises(ApprovalTimeout):
        asyncio.run(resume("go"))
    external = Run.objects.get(thread_id=THREAD)
    hosted = asyncio.run(start_hosted())
    assert Run.objects.get(pk=hosted).external is False  # newest on the thread, not the agent's

    with pytest.raises(ApprovalTimeout) as pending:
        asyncio.run(waits(0.5))
    assert pending.value.action is not None
    assert pending.value.action.run_id == str(external.run_id)

    (action,) = Action.objects.filter(run=external)
    decide(reviewer_a, action)
    (approval,) = asyncio.run(waits(30))
    assert (approval.status, approval.run_id) == ("approved", str(external.run_id))

    assert asyncio.run(resume()) == "finished"
    assert performed == ["Review"]
    external.refresh_from_db()
    assert external.status == RunStatus.COMPLETED
    assert Run.objects.get(pk=hosted).status == RunStatus.QUEUED  # untouched by the agent


def test_wait_for_decision_on_a_thread_with_only_hosted_runs_says_so(
    live_server: Any, agent_a: Persona
) -> None:
    """A thread whose only run is hosted has nothing of run_agent's to wait for: a clear
    ExecutorError, not the hosted run's approvals taken for the agent's."""
    assert agent_a.token is not None
    token = agent_a.token

    async def go() -> list[Approval]:
        async with AsyncHoldpoint(live_server.url, token, backoff=0.01) as hp:
            await hp.client.create_run("api-review", {}, thread_id="oa-hosted")
            return await wait_for_decision(hp, "oa-hosted", timeout=0.5)

    with pytest.raises(ExecutorError, match="external"):
        asyncio.run(go())
