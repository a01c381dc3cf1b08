"""A call held at its dispatch resumes as a `needs_approval` pause does: without the input.

In process: the real Agents SDK with a scripted fake Model (tests/client/
test_openai_agents_args.py) that counts what it was asked, the API on `live_server`. The
hold point arises at the dispatch, not when the SDK asks `needs_approval`: tenant A's
policy asked for no approval when the call was prepared and asks for one by the time it is
sent (tests/client/test_openai_agents_timeout.py). A service runs with `approval_timeout=0`
and, on the `approval.decided` webhook, calls `run_agent(hp, thread_id, agent)` — no input,
as the README shows.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from agents import Agent, set_tracing_disabled
from django.contrib.auth.models import Group

from approvals.models import ApprovalPolicy
from approvals.policies import grant
from holdpoint_client import ActionWithdrawn, ApprovalTimeout, AsyncHoldpoint, ToolCall
from holdpoint_client.openai_agents import holdpoint_tool, run_agent
from runtime.models import Action, Run, RunStatus, Tenant
from tests.client import TOOL, decide
from tests.client.test_openai_agents_args import Scripted
from tests.client.test_openai_agents_timeout import tightened_after_asking
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)


class Counted(Scripted):
    """Scripted, counting the answers it was asked for (a recorded one is not asked)."""

    asked = 0

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        self.asked += 1
        return await super().get_response(*args, **kwargs)


class Service:
    """An agent whose create_task is held at its dispatch, run as a service runs it."""

    def __init__(self, url: str, persona: Persona, tenant: Tenant, thread: str) -> None:
        set_tracing_disabled(True)
        policy = ApprovalPolicy.objects.create(
            tenant=tenant, name="free for now", tool=TOOL, required=False
        )
        grant(policy, Group.objects.get(name="acme-reviewers"))
        self.url, self.token, self.thread = url, persona.token or "", thread
        self.performed: list[str] = []

        @holdpoint_tool(TOOL)
        def create_task(title: str, body: str, *, call: ToolCall) -> Any:
            """Open a task in the tracker."""
            self.performed.append(title)
            return {"id": "T-1", "title": title}

        tightened_after_asking(create_task, policy)
        self.model = Counted([json.dumps({"title": "Review", "body": "GET /orders: gone"})])
        self.agent = Agent(name="reviewer", instructions="-", tools=[create_task], model=self.model)

    def run(self, *input: Any) -> Any:
        """run_agent(hp, thread, agent[, input], approval_timeout=0) in a new process's
        AsyncHoldpoint."""

        async def go() -> Any:
            async with AsyncHoldpoint(self.url, self.token, ttl=5, backoff=0.01) as hp:
                return await run_agent(
                    hp, self.thread, self.agent, *input, graph="api-review", approval_timeout=0
                )

        return asyncio.run(asyncio.wait_for(go(), timeout=60))

    def held(self) -> Action:
        """The first run: the call is held at its dispatch, and run_agent returns at once."""
        with pytest.raises(ApprovalTimeout):
            self.run("go")
        (action,) = Action.objects.filter(run__thread_id=self.thread)
        assert action.status == "awaiting_approval" and self.performed == []
        assert self.model.asked == 1
        return action


def test_the_webhooks_call_resumes_an_approved_call_held_at_its_dispatch_without_the_input(
    live_server: Any, agent_a: Persona, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    """Nothing was stored when the hold arose at the dispatch (the SDK had not paused), so
    the webhook's `run_agent(hp, thread_id, agent)` raised "pass the input". Now the thread
    resumes from what the run holds: the model's first answer from the record (not asked
    again), the approved call sent once, the run completed."""
    service = Service(live_server.url, agent_a, tenant_a, "oa-dispatch-approved")
    decide(reviewer_a, service.held())

    assert service.run() == "finished"

    assert service.performed == ["Review"]
    assert service.model.asked == 2  # the call's turn replayed; the answer's turn asked once
    (action,) = Action.objects.filter(run__thread_id="oa-dispatch-approved")
    assert (action.status, action.external_id) == ("confirmed", "T-1")
    run = Run.objects.get(thread_id="oa-dispatch-approved")
    assert run.status == RunStatus.COMPLETED
    assert service.run() == "finished"  # from the record: nothing asked, nothing sent
    assert (service.performed, service.model.asked) == (["Review"], 2)


def test_the_webhooks_call_tells_the_model_of_a_rejected_call_held_at_its_dispatch(
    live_server: Any, agent_a: Persona, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    """Rejected while held at its dispatch: the webhook's call without input raised "pass the
    input". Now the model reads the rejection as the tool's message, as of a rejected
    `needs_approval` pause, and the agent finishes; the tool never ran."""
    service = Service(live_server.url, agent_a, tenant_a, "oa-dispatch-rejected")
    decide(reviewer_a, service.held(), "reject", "clients still use it")

    assert service.run() == "finished"

    assert service.performed == []
    assert service.model.outputs == ["A reviewer rejected this call: clients still use it"]
    assert service.model.asked == 2
    (action,) = Action.objects.filter(run__thread_id="oa-dispatch-rejected")
    assert action.status == "cancelled"
    assert Run.objects.get(thread_id="oa-dispatch-rejected").status == RunStatus.COMPLETED


def test_a_call_held_at_its_dispatch_then_withdrawn_by_a_goal_revision_is_not_resumed(
    live_server: Any, agent_a: Persona, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    """As a pause taken under an older goal revision: the webhook's call raises
    ActionWithdrawn (the held call is not made under the new goal), and the next input
    starts the thread under the new goal, the model asked afresh."""
    service = Service(live_server.url, agent_a, tenant_a, "oa-dispatch-revised")
    held = service.held()

    async def revise() -> None:
        async with AsyncHoldpoint(live_server.url, service.token) as hp:
            await hp.client.revise(str(held.run_id), {"task": "other"}, expected_goal_rev=1)

    asyncio.run(revise())
    with pytest.raises(ActionWithdrawn, match="goal was revised"):
        service.run()

    with pytest.raises(ApprovalTimeout):  # the new goal's own call, held when prepared
        service.run("the new goal")
    assert service.performed == [] and service.model.asked == 2
    new = Action.objects.filter(run__thread_id="oa-dispatch-revised", goal_rev=2).get()
    assert new.status == "awaiting_approval"
    held.refresh_from_db()
    assert held.status == "cancelled"
