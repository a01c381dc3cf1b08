"""What `act` raises for a holdpoint_tool's call reaches the caller of `run_agent` as the
class holdpoint_client/README.md names ("Errors"), not wrapped in the SDK's UserError.

In process: the real Agents SDK with a scripted fake Model, the API on `live_server`, the
tracker the real sandbox process in mode `none` (an unknown outcome goes to a person).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from agents import Agent, set_tracing_disabled

from approvals.models import ApprovalPolicy
from holdpoint_client import (
    ActionFailed,
    AsyncHoldpoint,
    HoldpointError,
    OutcomeUnknown,
    ToolCall,
    ToolRefused,
)
from holdpoint_client.openai_agents import holdpoint_tool, run_agent
from runtime.models import Action, Tenant
from tests.client import TOOL
from tests.client.test_openai_agents_args import Scripted
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("answer", "raised", "status"),
    [("lost", OutcomeUnknown, "manual_review"), ("refused", ActionFailed, "failed")],
)
def test_what_act_raises_is_what_run_agent_raises(
    live_server: Any,
    agent_a: Persona,
    tenant_a: Tenant,
    sandbox_factory: Any,
    answer: str,
    raised: type[HoldpointError],
    status: str,
) -> None:
    """The tracker's answer was lost after it made the task (nobody can tell: a person
    resolves it, and this service waits for none), or it refused the call. The SDK wrapped
    either in `UserError("Error running tool …")`, so `except OutcomeUnknown` ("do not do it
    again yourself") or `except ActionFailed` never matched. Now run_agent raises them."""
    set_tracing_disabled(True)
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    box = sandbox_factory("none")

    @holdpoint_tool(TOOL)
    def create_task(title: str, body: str, *, call: ToolCall) -> Any:
        """Open a task in the tracker."""
        if answer == "refused":
            raise ToolRefused("the tracker said 400: no such project")
        httpx.post(box.url + "/tasks", json={"title": title, "body": body}, headers=call.headers())
        raise httpx.ReadError("connection reset")  # the task exists; its answer is lost

    model = Scripted([json.dumps({"title": "Review", "body": "GET /orders: removed"})])
    agent = Agent(name="reviewer", instructions="-", tools=[create_task], model=model)
    token = agent_a.token or ""
    hp = AsyncHoldpoint(live_server.url, token, ttl=5, backoff=0.01, resolution_timeout=0)

    async def go() -> Any:
        async with hp:
            return await run_agent(hp, f"errors-{answer}", agent, "go", graph="api-review")

    with pytest.raises(raised) as stopped:
        asyncio.run(go())

    assert stopped.value.action is not None
    action = Action.objects.get(run__thread_id=f"errors-{answer}")
    assert (action.status, str(action.action_id)) == (status, stopped.value.action.action_id)
    assert len(box.tasks()) == (1 if answer == "lost" else 0)
    assert model.outputs == []  # the model was told nothing
