"""The OpenAI Agents adapter when a held call's approval expires with nobody deciding.

In process: the real Agents SDK with a scripted fake Model (tests/client/
test_openai_agents_args.py), the API on `live_server`, tenant A's reviewers holding
agent.tasks.create with a policy that rejects at expiry. The expiry is the sweeper's (the
request's window moved into the past, not the clock).
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest
from agents import Agent, set_tracing_disabled
from django.utils import timezone

from approvals.expiry import sweep_approvals
from approvals.models import ApprovalPolicy, ApprovalRequest, OnExpiry
from holdpoint_client import ApprovalTimeout, AsyncHoldpoint, ToolCall
from holdpoint_client.openai_agents import holdpoint_tool, run_agent
from runtime.models import Action, Run
from tests.client import hold_point  # noqa: F401  (a fixture)
from tests.client.test_openai_agents import paused_state
from tests.client.test_openai_agents_args import Scripted
from tests.conftest import Persona

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hold_point")]


@pytest.mark.parametrize("policy", [OnExpiry.REJECT, OnExpiry.REREQUEST])
def test_a_call_whose_approval_expired_is_told_to_the_model_and_the_thread_goes_on(
    live_server: Any,
    agent_a: Persona,
    hold_point: ApprovalPolicy,  # noqa: F811
    policy: str,
) -> None:
    """The held call's approval expired and the policy rejected it. Resuming the thread
    raised ActionWithdrawn — and the stored pause stayed, so every later run_agent raised
    it again: the thread could never go on. Now the model is told the call was not run and
    why (as a hosted graph's step is told), and the agent finishes; the tool never ran."""
    ApprovalPolicy.objects.filter(pk=hold_point.pk).update(on_expiry=policy)
    set_tracing_disabled(True)
    performed: list[str] = []

    @holdpoint_tool("agent.tasks.create")
    def create_task(title: str, body: str, *, call: ToolCall) -> Any:
        """Open a task in the tracker."""
        performed.append(title)
        return {"id": "T-1"}

    model = Scripted([json.dumps({"title": "Review", "body": "GET /orders: gone"})])
    agent = Agent(name="reviewer", instructions="-", tools=[create_task], model=model)

    async def resume(input: Any = None) -> Any:
        hp = AsyncHoldpoint(live_server.url, agent_a.token or "", ttl=5, backoff=0.01)
        try:
            return await run_agent(
                hp, "oa-expired", agent, input, graph="api-review", approval_timeout=0
            )
        finally:
            await hp.aclose()

    with pytest.raises(ApprovalTimeout):
        asyncio.run(resume("go"))
    assert paused_state("oa-expired")
    for _ in range(1 if policy == OnExpiry.REJECT else 2):  # re-requested once, then rejected
        pending = ApprovalRequest.objects.filter(run__thread_id="oa-expired", status="pending")
        moved = pending.update(expires_at=timezone.now() - timedelta(seconds=1))
        assert moved == 1 and sweep_approvals() == 1

    assert asyncio.run(resume()) == "finished"

    assert performed == []
    (action,) = Action.objects.filter(run__thread_id="oa-expired")
    assert action.status == "cancelled" and "rejected at expiry" in action.last_error
    # The re-request policy's last expiry: the run needed a person; running the agent again
    # is that person's (or service's) answer, and the model reads why the call did not run.
    (told,) = model.outputs
    assert told.startswith("This call was not run:") and "rejected at expiry" in told
    assert Run.objects.get(thread_id="oa-expired").status == "completed"
    assert asyncio.run(resume()) == "finished"  # from the record: nothing asked again
