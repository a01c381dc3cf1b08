"""The blocking client refuses an `async def` perform, lookup or recorded function before
anything is prepared.

Found only when called, it was called after the action was marked `sent`: the TypeError was
reported as an outcome the client could not know (`unknown`), so the server had the action
replayed or handed to a person — for an effect that was never attempted. The asyncio client
(AsyncHoldpoint / AsyncExecutor) is the one that awaits such functions.

The API on `live_server`; nothing is mocked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from approvals.models import ApprovalPolicy
from holdpoint_client import Executor, Holdpoint, ToolCall
from holdpoint_client.client import Client
from runtime.models import Action, Run, Tenant
from tests.client import TOOL
from tests.conftest import Persona
from tests.sandbox import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)

TASK = {"title": "Review the API change"}


@pytest.fixture
def free(tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]) -> Sandbox:
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    return sandbox_factory("key")


async def perform_async(call: ToolCall) -> dict[str, Any]:
    return {"id": "never"}


class AsyncCallable:
    async def __call__(self, call: ToolCall) -> dict[str, Any]:
        return {"id": "never"}


@pytest.mark.parametrize("perform", [perform_async, AsyncCallable()], ids=["def", "callable"])
def test_an_async_perform_is_refused_before_the_action_is_prepared(
    live_server: Any, agent_a: Persona, free: Sandbox, perform: Any
) -> None:
    with Client(live_server.url, agent_a.token or "", backoff=0.01) as api:
        run = api.create_run("api-review", {"title": "x"}, external=True)
        with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
            with pytest.raises(TypeError, match="async"):
                ex.act(TOOL, TASK, call="propose_task", perform=perform, resolution_timeout=0)
            with pytest.raises(TypeError, match="async"):
                ex.act(
                    TOOL,
                    TASK,
                    call="propose_task",
                    perform=None,
                    lookup=perform,
                    resolution_timeout=0,
                )
    assert not Action.objects.filter(run_id=run.run_id).exists()
    assert free.tasks() == []


def test_run_act_and_record_refuse_an_async_function_up_front(
    live_server: Any, agent_a: Persona, free: Sandbox
) -> None:
    async def model() -> str:
        return "never asked"

    with Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01) as hp:
        with hp.run("t-async", graph="api-review") as run:
            with pytest.raises(TypeError, match="async"):
                run.act(TOOL, TASK, reason="r", perform=perform_async, resolution_timeout=0)
            with pytest.raises(TypeError, match="async"):
                run.model("summary", model)
    row = Run.objects.get(thread_id="t-async")
    assert not Action.objects.filter(run=row).exists()
    assert free.tasks() == []
