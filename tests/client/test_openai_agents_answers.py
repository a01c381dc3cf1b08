"""The OpenAI Agents adapter records the model's answers: a restarted thread is given the
same answers, so the same call ids, so the same ledger keys — one effect per call.

In process: the real Agents SDK with a fake Model that behaves as real ones do (a new call
id in every answer), the API on `live_server`. A process that dies right after a tool's
effect is played by an exception that nothing in the SDK or the client catches (the
action stays `sent`, as after a SIGKILL; the killed-process version of this is in
tests/client/test_openai_agents_kills.py). The tracker is a dict keyed by the
Idempotency-Key, as a deduplicating service is.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from agents import (
    Agent,
    Model,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    Usage,
    handoff,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from holdpoint_client import ActionWithdrawn, ApprovalTimeout, AsyncHoldpoint, ToolCall
from holdpoint_client.openai_agents import holdpoint_tool, run_agent
from runtime.models import Action, Run
from tests.client import decide, hold_point, the_action  # noqa: F401  (hold_point: a fixture)
from tests.client.test_openai_agents import paused_state
from tests.conftest import Persona

pytestmark = pytest.mark.django_db(transaction=True)


class Died(BaseException):
    """The process died here: nothing catches it, nothing is recorded after it."""


class Fresh(Model):
    """Asks for create_task once, with a call id of its own (as a real model does), then
    answers with what the tool said. Counts what it was asked."""

    asked = 0

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
        Fresh.asked += 1
        items = [] if isinstance(input, str) else input
        outputs = [str(i["output"]) for i in items if i.get("type") == "function_call_output"]
        if not outputs:
            call = ResponseFunctionToolCall(
                type="function_call",
                call_id=f"call_{uuid.uuid4().hex[:12]}",
                name="create_task",
                arguments=json.dumps({"title": "Review", "body": "GET /orders: gone"}),
            )
            return ModelResponse(output=[call], usage=Usage(requests=1), response_id=None)
        text = ResponseOutputText(type="output_text", text=f"Done: {outputs[-1]}", annotations=[])
        message = ResponseOutputMessage(
            type="message", id="msg_1", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError


class Tracker:
    """A deduplicating task service: one task per Idempotency-Key."""

    def __init__(self) -> None:
        self.tasks: dict[str, dict[str, Any]] = {}
        self.die_after_next = False

    def tool(self) -> Any:
        @holdpoint_tool("agent.tasks.create")
        def create_task(title: str, body: str, *, call: ToolCall) -> Any:
            """Open a task in the tracker."""
            key = call.headers()["Idempotency-Key"]
            task = self.tasks.setdefault(key, {"id": f"T-{len(self.tasks) + 1}", "title": title})
            if self.die_after_next:
                self.die_after_next = False
                raise Died  # the task exists; the answer is never recorded
            return task

        return create_task


def thread(url: str, persona: Persona, name: str, tracker: Tracker) -> Any:
    """run_agent for thread `name` with a fresh agent object (a new process would build
    one), `approval_timeout=0`."""
    set_tracing_disabled(True)
    agent = Agent(name="reviewer", instructions="-", tools=[tracker.tool()], model=Fresh())
    assert persona.token is not None

    async def go(input: Any) -> Any:
        hp = AsyncHoldpoint(url, persona.token or "", ttl=5, backoff=0.01)
        try:
            return await run_agent(hp, name, agent, input, graph="api-review", approval_timeout=0)
        finally:
            await hp.aclose()

    return go


def test_a_restart_after_the_effect_replays_the_models_answer_and_makes_one_task(
    live_server: Any, agent_a: Persona
) -> None:
    """An ungated call's task was made and the process died before recording it. The
    restart asked the model again; its new answer named a new call id, so a new key, so a
    second task (and a second paid model call). Now the model's first answer comes from the
    run's record: the same call id, the same key; the ledger settles the sent action by
    replaying it with that key, which the tracker deduplicates."""
    tracker = Tracker()
    run = thread(live_server.url, agent_a, "oa-fresh", tracker)
    Fresh.asked = 0
    tracker.die_after_next = True
    with pytest.raises(Died):
        asyncio.run(run("go"))
    assert len(tracker.tasks) == 1 and Fresh.asked == 1
    assert the_action("oa-fresh").status == "sent"

    output = asyncio.run(run("go"))

    (task,) = tracker.tasks.values()
    (action,) = Action.objects.filter(run__thread_id="oa-fresh")
    assert (action.status, action.external_id) == ("confirmed", task["id"])
    assert json.loads(output.removeprefix("Done: "))["id"] == task["id"]
    assert Fresh.asked == 2  # the first answer was never asked for again; the second once
    assert Run.objects.get(thread_id="oa-fresh").status == "completed"


@pytest.mark.usefixtures("hold_point")
def test_a_goal_revised_after_the_approved_call_was_sent_does_not_send_it_again(
    live_server: Any, agent_a: Persona, reviewer_a: Persona
) -> None:
    """The call was held, approved, sent — and the process died before recording the
    answer; then the goal was revised. Resuming the stored pause approved the SDK's call
    again, and the tool ran under a key of the new goal revision: a new action and, once
    approved, a second task the new goal never asked for. Now a pause taken under an older
    goal revision raises ActionWithdrawn and is dropped, the tool is not called, and the
    next input starts the thread under the new goal (the model is asked afresh)."""
    tracker = Tracker()
    run = thread(live_server.url, agent_a, "oa-revised-sent", tracker)
    with pytest.raises(ApprovalTimeout):
        asyncio.run(run("go"))
    decide(reviewer_a, the_action("oa-revised-sent", "awaiting_approval"))
    tracker.die_after_next = True
    with pytest.raises(Died):
        asyncio.run(run(None))
    assert len(tracker.tasks) == 1 and the_action("oa-revised-sent").status == "sent"
    assert paused_state("oa-revised-sent")  # the pause, taken under goal revision 1
    hp_run = Run.objects.get(thread_id="oa-revised-sent")
    revise(live_server.url, agent_a, hp_run.run_id, hp_run.goal_rev)

    with pytest.raises(ActionWithdrawn) as withdrawn:
        asyncio.run(run(None))

    assert "goal was revised" in str(withdrawn.value)
    # Its effect may have happened, and no call of the new goal will look at it again: the
    # new lease handed it to a person rather than leave it `sent` for ever.
    assert withdrawn.value.action is not None
    assert withdrawn.value.action.status == "manual_review"
    assert len(tracker.tasks) == 1
    (action,) = Action.objects.filter(run__thread_id="oa-revised-sent")  # none under rev 2
    assert paused_state("oa-revised-sent") is None
    Fresh.asked = 0
    with pytest.raises(ApprovalTimeout):  # a new input: the new goal's own call, held
        asyncio.run(run("the new goal"))
    assert Fresh.asked == 1
    new = Action.objects.filter(run__thread_id="oa-revised-sent").exclude(pk=action.pk).get()
    assert new.status == "awaiting_approval" and new.goal_rev == 2
    assert len(tracker.tasks) == 1


def revise(url: str, persona: Persona, run_id: Any, goal_rev: int) -> None:
    async def go() -> None:
        hp = AsyncHoldpoint(url, persona.token or "")
        try:
            await hp.client.revise(str(run_id), {"task": "other"}, expected_goal_rev=goal_rev)
        finally:
            await hp.aclose()

    asyncio.run(go())


class Handing(Model):
    """The triage agent's model: hands the conversation to the reviewer agent."""

    asked = 0

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        Handing.asked += 1
        call = ResponseFunctionToolCall(
            type="function_call",
            call_id=f"call_{uuid.uuid4().hex[:12]}",
            name="transfer_to_reviewer",
            arguments="{}",
        )
        return ModelResponse(output=[call], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError


class Reviewing(Fresh):
    """The reviewer's model: as Fresh, reading only create_task's outputs."""

    async def get_response(self, system_instructions: Any, input: Any, *a: Any, **kw: Any) -> Any:
        tasks = {i["call_id"] for i in input if i.get("name") == "create_task"}
        mine = [
            i for i in input if i.get("type") != "function_call_output" or i["call_id"] in tasks
        ]
        return await super().get_response(system_instructions, mine, *a, **kw)


@pytest.mark.usefixtures("hold_point")
def test_a_pause_after_a_handoff_resumes_with_the_target_agents_answers_recorded(
    live_server: Any, agent_a: Persona, reviewer_a: Persona
) -> None:
    """The triage agent handed off (`handoff(reviewer)`) and the reviewer's call was held.
    The stored RunState names the reviewer as its current agent; resuming it must find that
    agent among the run's (the SDK finds a `handoff()` target by a weak reference, which a
    copied Handoff loses) and keep recording its model's answers: one task, no model
    asked twice for the same turn."""
    set_tracing_disabled(True)
    tracker = Tracker()
    reviewer = Agent(name="reviewer", instructions="-", tools=[tracker.tool()], model=Reviewing())
    triage = Agent(name="triage", instructions="-", model=Handing(), handoffs=[handoff(reviewer)])

    async def go(input: Any) -> Any:
        hp = AsyncHoldpoint(live_server.url, agent_a.token or "", ttl=5, backoff=0.01)
        try:
            return await run_agent(
                hp, "oa-handoff", triage, input, graph="api-review", approval_timeout=0
            )
        finally:
            await hp.aclose()

    Fresh.asked = Handing.asked = 0
    with pytest.raises(ApprovalTimeout):
        asyncio.run(go("go"))
    decide(reviewer_a, the_action("oa-handoff", "awaiting_approval"))

    output = asyncio.run(go(None))

    (task,) = tracker.tasks.values()
    assert json.loads(output.removeprefix("Done: "))["id"] == task["id"]
    assert (Handing.asked, Fresh.asked) == (1, 2)  # triage once; the reviewer: call, answer
    assert Run.objects.get(thread_id="oa-handoff").status == "completed"
