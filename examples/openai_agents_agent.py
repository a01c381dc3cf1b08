"""An OpenAI Agents SDK agent with one approval-gated tool, on Holdpoint.

    pip install -e ".[openai-agents]"         # in the checkout
    HOLDPOINT_URL=http://127.0.0.1:8000 HOLDPOINT_TOKEN=<agent token> \\
        python examples/openai_agents_agent.py --tasks-url http://127.0.0.1:8765 --thread review-44

The model is a small scripted `Model` (no network, no API key): it asks for one
`create_task` call (under a new call id each time it is asked, as a real model does), then
answers with what the tool said. Put `model="gpt-5"` (or any
model) in its place for a real agent; nothing else changes.

What an existing agent changes (the agent code between the markers; README.md shows the
diff): 9 lines — the imports (3), `hp = AsyncHoldpoint.from_env()` (1),
`@holdpoint_tool(...)` for `@function_tool` (1), the tool's signature takes `call` and its
POST sends `call.headers()` (2), `run_agent(hp, thread, ...)` for `Runner.run(...)` and the
output it returns (2). Whether the call waits for a reviewer is the tenant's policy on
`agent.tasks.create`; the paused RunState is kept in the Holdpoint run, so this process can
be killed at any point and started again with the same `--thread`: it resumes from the
reviewer's decision and makes one task, never two.
`HOLDPOINT_CLIENT_FAULTS=awaiting_approval|after_decision|after_tool_response` kills it at
a named point, for the crash tests; `--model-log FILE` appends what the model was given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from agents import Agent, Model, ModelResponse, ModelSettings, Usage, set_tracing_disabled
from agents.models.interface import ModelTracing
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from holdpoint_client import AsyncHoldpoint, ToolCall
from holdpoint_client.openai_agents import holdpoint_tool, run_agent

parser = argparse.ArgumentParser(description="an Agents SDK agent with one gated task")
parser.add_argument("--tasks-url", required=True, help="the task tracker (manage.py sandbox_tasks)")
parser.add_argument("--thread", required=True, help="a stable name: rerun with it to continue")
parser.add_argument("--ttl", type=int, default=30, help="lease seconds")
parser.add_argument("--model-log", default="", help="append each model input here (JSON lines)")
args = parser.parse_args()
TASKS, THREAD = args.tasks_url.rstrip("/") + "/tasks", args.thread


class ScriptedModel(Model):
    """Asks for one create_task call; once a tool output is in its input, answers with it."""

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
        items = [{"type": "message", "content": input}] if isinstance(input, str) else input
        if args.model_log:
            with open(args.model_log, "a") as log:
                log.write(json.dumps(items, default=str) + "\n")
        outputs = [i for i in items if i.get("type") == "function_call_output"]
        if not outputs:
            params = {"title": f"Review the API change of {THREAD}", "body": "GET /orders: gone"}
            call = ResponseFunctionToolCall(
                type="function_call",
                call_id=f"call_{uuid.uuid4().hex[:16]}",  # new in every answer, as a real model's
                name="create_task",
                arguments=json.dumps(params),
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(
            type="output_text", text=f"Done: {outputs[-1]['output']}", annotations=[]
        )
        message = ResponseOutputMessage(
            type="message", id="msg_1", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("this example does not stream")


set_tracing_disabled(True)  # no API key to export traces with: the model is scripted


# --- agent code -----------------------------------------------------------------------
hp = AsyncHoldpoint.from_env(ttl=args.ttl)


@holdpoint_tool("agent.tasks.create")
def create_task(title: str, body: str, *, call: ToolCall) -> Any:
    """Open a task in the tracker: the API change breaks clients."""
    sent = httpx.post(TASKS, json={"title": title, "body": body}, headers=call.headers())
    return sent.raise_for_status().json()


agent = Agent(
    name="api-reviewer",
    instructions="Open a review task for breaking API changes.",
    tools=[create_task],
    model=ScriptedModel(),
)
output = asyncio.run(run_agent(hp, THREAD, agent, "GET /orders was removed", graph="api-review"))
print(output, flush=True)
# --- end of agent code ----------------------------------------------------------------
