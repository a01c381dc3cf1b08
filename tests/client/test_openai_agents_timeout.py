"""`run_agent(approval_timeout=...)` bounds every wait of the agent for a reviewer.

In process: the real Agents SDK with a scripted fake Model (tests/client/
test_openai_agents_args.py), the API on `live_server`. The hold point here arises at the
dispatch, not when the SDK asks `needs_approval`: tenant A's policy for agent.tasks.create
asked for no approval when the call was prepared, and asks for one by the time it is sent
(a policy tightened meanwhile) — the server holds the action again at the dispatch.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from agents import Agent, FunctionTool, RunContextWrapper, set_tracing_disabled
from django.contrib.auth.models import Group
from django.db import connection

from approvals.models import ApprovalPolicy
from approvals.policies import grant
from holdpoint_client import ApprovalTimeout, AsyncHoldpoint, ToolCall
from holdpoint_client.openai_agents import holdpoint_tool, run_agent
from runtime.models import Action, Run, RunStatus, Tenant
from tests.client import TOOL, decide
from tests.client.test_openai_agents_args import Scripted
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)
THREAD = "oa-held-at-dispatch"


def tightened_after_asking(tool: FunctionTool, policy: ApprovalPolicy) -> None:
    """The seam between the SDK's `needs_approval` (answered: no approval needed) and the
    tool's invocation: the tenant's policy starts asking for approval there."""
    asked = tool.needs_approval
    assert callable(asked)

    async def needs_approval(ctx: RunContextWrapper[Any], params: Any, call_id: str) -> bool:
        needed = await asked(ctx, params, call_id)

        def tighten() -> None:
            try:
                ApprovalPolicy.objects.filter(pk=policy.pk).update(required=True)
            finally:
                connection.close()  # the thread's own, before it ends

        await asyncio.to_thread(tighten)
        return bool(needed)

    tool.needs_approval = needs_approval


def test_a_hold_point_met_at_the_dispatch_waits_only_as_long_as_run_agent_was_told(
    live_server: Any, agent_a: Persona, reviewer_a: Persona, tenant_a: Tenant
) -> None:
    """`run_agent(..., approval_timeout=0.5)` on an AsyncHoldpoint without a timeout of its
    own: the call, held again at its dispatch, was waited for with the AsyncHoldpoint's
    (none: as long as it takes) — the service that asked not to be held waited on. Now the
    wait ends after run_agent's timeout with ApprovalTimeout, everything kept; once the
    reviewer approved, running the thread again performs the call, once."""
    set_tracing_disabled(True)
    policy = ApprovalPolicy.objects.create(
        tenant=tenant_a, name="free for now", tool=TOOL, required=False
    )
    grant(policy, Group.objects.get(name="acme-reviewers"))
    performed: list[str] = []

    @holdpoint_tool(TOOL)
    def create_task(title: str, body: str, *, call: ToolCall) -> Any:
        """Open a task in the tracker."""
        performed.append(title)
        return {"id": "T-1", "title": title}

    tightened_after_asking(create_task, policy)
    model = Scripted([json.dumps({"title": "Review", "body": "GET /orders: gone"})])
    agent = Agent(name="reviewer", instructions="-", tools=[create_task], model=model)

    async def go(timeout: float | None) -> Any:
        async with AsyncHoldpoint(live_server.url, agent_a.token or "", ttl=5, backoff=0.01) as hp:
            return await run_agent(
                hp, THREAD, agent, "go", graph="api-review", approval_timeout=timeout
            )

    with pytest.raises(ApprovalTimeout):
        asyncio.run(asyncio.wait_for(go(0.5), timeout=30))

    (action,) = Action.objects.filter(run__thread_id=THREAD)
    assert action.status == "awaiting_approval" and performed == []
    decide(reviewer_a, action)

    assert asyncio.run(asyncio.wait_for(go(0.5), timeout=60)) == "finished"
    assert performed == ["Review"]
    action.refresh_from_db()
    assert (action.status, action.external_id) == ("confirmed", "T-1")
    assert Run.objects.get(thread_id=THREAD).status == RunStatus.COMPLETED
