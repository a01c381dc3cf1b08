"""The OpenAI Agents adapter checks a model's arguments before anything is prepared.

In process: the real Agents SDK with a scripted fake Model, the API on `live_server`. A
model that gets a tool's arguments wrong is told so, as the SDK's own `@function_tool`
tells it, and may try again; nothing reaches the ledger, a reviewer or the service.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from enum import Enum
from typing import Any

import httpx
import pytest
from agents import (
    Agent,
    Model,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    Usage,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from approvals.models import ApprovalPolicy
from holdpoint_client import AsyncHoldpoint, ToolCall
from holdpoint_client.openai_agents import holdpoint_tool, run_agent
from runtime.models import Action, Run, Tenant
from tests.client import TOOL
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)


class Scripted(Model):
    """Calls create_task with each of `attempts` in turn (one per turn); once a tool output
    follows the last, answers with every output it was given."""

    def __init__(self, attempts: list[str]) -> None:
        self.attempts = attempts
        self.outputs: list[str] = []

    async def get_response(
        self,
        system_instructions: str | None,
        input: Any,
        model_settings: ModelSettings,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: ModelTracing,
        **kwargs: Any,
    ) -> ModelResponse:
        items = [] if isinstance(input, str) else input
        self.outputs = [str(i["output"]) for i in items if i.get("type") == "function_call_output"]
        turn = len(self.outputs)
        if turn < len(self.attempts):
            call = ResponseFunctionToolCall(
                type="function_call",
                call_id=f"call_{turn}",
                name="create_task",
                arguments=self.attempts[turn],
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", text="finished", annotations=[])
        message = ResponseOutputMessage(
            type="message", id="msg_1", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError


def run_scripted(url: str, persona: Persona, thread: str, attempts: list[str]) -> list[str]:
    """Run an agent whose model calls create_task with each of `attempts`, to its end;
    what the tool told the model. The tool's function is never called, nothing is kept."""
    set_tracing_disabled(True)
    performed: list[dict[str, Any]] = []

    @holdpoint_tool("agent.tasks.create")
    def create_task(title: str, body: str, *, call: ToolCall) -> Any:
        """Open a task in the tracker."""
        performed.append({"title": title, "body": body})
        return {"id": "T-1"}

    model = Scripted(attempts)
    agent = Agent(name="reviewer", instructions="-", tools=[create_task], model=model)
    assert persona.token is not None
    hp = AsyncHoldpoint(url, persona.token, ttl=5)

    async def go() -> Any:
        try:
            return await run_agent(hp, thread, agent, "go", graph="api-review")
        finally:
            await hp.aclose()

    assert asyncio.run(go()) == "finished"
    assert performed == []
    run = Run.objects.get(thread_id=thread)
    assert not Action.objects.filter(run=run).exists()  # nothing prepared, nothing held
    assert len(model.outputs) == len(attempts)
    for told in model.outputs:
        assert told.startswith("An error occurred while running the tool. Please try again.")
    return model.outputs


def test_arguments_that_do_not_fit_the_tool_are_refused_to_the_model_not_prepared(
    live_server: Any, agent_a: Persona
) -> None:
    """A model called create_task with a title that is not a string and no body. The
    adapter prepared that as an action — held for a reviewer as a write no policy names, the
    run paused on it — and would have called the function with arguments it cannot take.
    The server's schema refused it (422), which the SDK turned into an error ending the
    whole agent run. Now the model is told what is wrong (as `@function_tool` tells it),
    and nothing is prepared. (Arguments that are not JSON at all: the next test.)"""
    (told,) = run_scripted(live_server.url, agent_a, "args-1", [json.dumps({"title": 5})])
    assert "create_task" in told and "title" in told and "body" in told


def test_arguments_that_are_not_a_json_object_are_told_to_the_model(
    live_server: Any, agent_a: Persona
) -> None:
    """Arguments that are not JSON at all (or JSON but not an object, or with NaN): the SDK
    holds such a call for approval without asking the tool's needs_approval, so nothing was
    prepared — and run_agent stopped with "not a Holdpoint tool". Now the call is let
    through to the tool, which tells the model its arguments were not valid JSON (as the
    SDK's own function tools do); nothing is prepared, held or performed."""
    attempts = ['{"title": "Review", "body": ', "[1, 2]", '{"title": NaN, "body": "b"}']
    for told in run_scripted(live_server.url, agent_a, "args-2", attempts):
        assert "Invalid JSON input for tool create_task" in told


class Team(Enum):
    ON_CALL = "on-call"
    API = "api-team"


def test_the_function_gets_the_arguments_function_tool_gives_and_the_ledger_holds_them(
    live_server: Any, agent_a: Persona, tenant_a: Tenant, sandbox_factory: Any
) -> None:
    """`@function_tool` validates the model's arguments against the function's signature
    and calls it with the result: an enum as its member, a default filled in. The adapter
    called the function with the raw JSON (`assignee` a str: the function failed after the
    action was sent — an outcome nobody could tell, replayed, then handed to a person) and
    prepared the action without the defaults (a reviewer would approve params the tracker
    did not receive). Now the function gets what `@function_tool` would give it, and the
    ledger holds those arguments."""
    set_tracing_disabled(True)
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    box = sandbox_factory("key")

    @holdpoint_tool(TOOL, strict=False)
    def create_task(
        title: str, assignee: Team, body: str = "GET /orders: removed", *, call: ToolCall
    ) -> Any:
        """Open a task in the tracker."""
        sent = {"title": title, "assignee": assignee.value, "body": body}
        return httpx.post(box.url + "/tasks", json=sent, headers=call.headers()).json()

    model = Scripted([json.dumps({"title": "Review", "assignee": "api-team"})])
    agent = Agent(name="reviewer", instructions="-", tools=[create_task], model=model)
    token = agent_a.token or ""
    hp = AsyncHoldpoint(live_server.url, token, ttl=5, backoff=0.01, resolution_timeout=1)

    async def go() -> Any:
        async with hp:
            return await run_agent(hp, "args-typed", agent, "go", graph="api-review")

    assert asyncio.run(go()) == "finished"
    action = Action.objects.get(run__thread_id="args-typed")
    (task,) = box.tasks()
    params = {"title": "Review", "assignee": "api-team", "body": "GET /orders: removed"}
    assert (action.status, json.loads(action.params)) == ("confirmed", params)
    assert task["body"] == params
    (told,) = model.outputs
    assert json.loads(told)["id"] == task["id"]
