"""The LangGraph adapter on an asyncio graph: `ainvoke`, an `async def` tool, AsyncHoldpoint.

Real LangGraph (SqliteSaver on a file), a scripted chat model, the API on `live_server`;
reviewers decide through the REST API. Each step runs in an event loop of its own
(`asyncio.run`) with an AsyncHoldpoint and a graph built in it, as a process would: a
restart is a new loop, a new client and a new graph over the same checkpointer file.
The ORM is only used between steps (Django refuses it on a running loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command

from approvals.models import ApprovalPolicy
from holdpoint_client import AsyncHoldpoint, Holdpoint
from holdpoint_client.langgraph import KIND, HoldpointGraph, current_call
from runtime.models import Action, Run, RunStatus, Tenant
from tests.client import TOOL, decide, hold_point, the_action  # noqa: F401  (a fixture)
from tests.conftest import Persona
from tests.langgraph.test_langgraph_agent import example

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.ci_database("postgresql"),
]


# Asks for one task ("call-create-task-1"); told of it, says "The tracker answered: ...".
TaskModel = example().TaskModel


class Tracker:
    """The service, an `async def` tool: one task per Idempotency-Key; `sent` counts every
    request it received (the same key twice is a second send)."""

    def __init__(self) -> None:
        self.tasks: dict[str, dict[str, Any]] = {}
        self.sent: list[str] = []

    def tool(self, hg: HoldpointGraph) -> BaseTool:
        @hg.action(TOOL, reason="a task for the review")
        @tool
        async def create_task(title: str, body: str = "") -> dict[str, Any]:
            """Create a task in the team's tracker."""
            key = current_call().idempotency_key
            await asyncio.sleep(0)  # a real await: the tool runs on the loop
            self.sent.append(key)
            return self.tasks.setdefault(key, {"id": f"T-{len(self.tasks) + 1}", "title": title})

        return create_task


def build(
    hg: HoldpointGraph, tool: BaseTool, saver: Any, node: Any = None, model: Any = None
) -> Any:
    """An agent with async nodes: the model's, and the tool node (`node`, else hg's)."""
    model = model or TaskModel(messages=iter(()))

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", node or hg.tool_node([tool]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=saver)


Step = Callable[[HoldpointGraph, Any], Coroutine[Any, Any, Any]]


class Process:
    """Runs one step as a process would: its own loop, client, graph and saver connection."""

    def __init__(self, url: str, token: str, checkpoints: Path, tracker: Tracker) -> None:
        self.url, self.token, self.checkpoints, self.tracker = url, token, checkpoints, tracker

    def run(self, step: Step, **options: Any) -> Any:
        async def main() -> Any:
            async with (
                AsyncHoldpoint(self.url, self.token, ttl=3, backoff=0.01) as hp,
                AsyncSqliteSaver.from_conn_string(str(self.checkpoints)) as saver,
            ):
                hg = HoldpointGraph(hp, graph="api-review", **options)
                return await step(hg, build(hg, self.tracker.tool(hg), saver))

        return asyncio.run(main())


@pytest.fixture
def process(live_server: Any, agent_a: Persona, tmp_path: Path) -> Process:
    return Process(live_server.url, agent_a.token or "", tmp_path / "cp.sqlite3", Tracker())


CONFIG: Any = {"configurable": {"thread_id": "lg-async"}}
FIRST = {"messages": [("user", "GET /orders was removed")]}


def told(values: dict[str, Any]) -> ToolMessage:
    (message,) = [m for m in values["messages"] if isinstance(m, ToolMessage)]
    return message


@pytest.fixture
def free(tenant_a: Tenant) -> None:
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)


@pytest.mark.usefixtures("free")
def test_an_async_tool_is_sent_once_and_confirmed(process: Process) -> None:
    async def step(hg: HoldpointGraph, graph: Any) -> Any:
        return await graph.ainvoke(FIRST, CONFIG, durability="sync")

    values = process.run(step)

    (action,) = Action.objects.filter(run__thread_id="lg-async")
    assert (action.status, action.external_id) == ("confirmed", "T-1")
    assert process.tracker.sent == [action.idempotency_key]
    assert told(values).status == "success" and "T-1" in told(values).content
    assert "T-1" in values["messages"][-1].content  # what the model read


@pytest.mark.usefixtures("free")
def test_a_blocking_holdpoint_on_an_async_graph_is_refused_before_anything_is_sent(
    live_server: Any, agent_a: Persona, tmp_path: Path
) -> None:
    """Before: `ainvoke` fell back to the blocking wrapper, which ran the `async def` tool
    through the ToolNode's sync path after marking the action `sent`: LangChain refused
    ("does not support sync invocation"), the ledger read the refusal as an outcome nobody
    knows, and the call went to a person — a call never attempted, on its way to being
    replayed. Now the blocking HoldpointGraph refuses an async graph before preparing
    anything, naming AsyncHoldpoint."""
    tracker = Tracker()

    async def main() -> Any:
        hp = Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01)
        try:
            async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "cp.sqlite3")) as saver:
                hg = HoldpointGraph(hp, graph="api-review")
                graph = build(hg, tracker.tool(hg), saver)
                return await graph.ainvoke(FIRST, CONFIG, durability="sync")
        finally:
            hp.close()

    with pytest.raises(Exception, match="AsyncHoldpoint"):
        asyncio.run(main())

    assert tracker.sent == [] and not Action.objects.filter(run__thread_id="lg-async").exists()


@pytest.mark.usefixtures("hold_point")
@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_a_held_call_interrupts_and_resumes_with_the_decision(
    process: Process, reviewer_a: Persona, decision: str
) -> None:
    async def start(hg: HoldpointGraph, graph: Any) -> Any:
        return await graph.ainvoke(FIRST, CONFIG, durability="sync")

    paused = process.run(start)

    (held,) = paused["__interrupt__"]
    action = the_action("lg-async", "awaiting_approval")
    assert held.value["type"] == KIND and held.value["action_id"] == str(action.action_id)
    assert process.tracker.sent == []
    decide(reviewer_a, action, decision, "clients still use it")

    async def resume(hg: HoldpointGraph, graph: Any) -> Any:
        command = await hg.await_decision(await graph.aget_state(CONFIG))
        return await graph.ainvoke(command, CONFIG, durability="sync")

    values = process.run(resume)

    action.refresh_from_db()
    message = told(values)
    if decision == "approve":
        assert action.status == "confirmed" and process.tracker.sent == [action.idempotency_key]
        assert message.status == "success" and "T-1" in message.content
    else:
        assert action.status == "cancelled" and process.tracker.sent == []
        assert message.status == "error" and "clients still use it" in message.content
    assert "__interrupt__" not in values


@pytest.mark.usefixtures("hold_point")
def test_a_forged_resume_approves_nothing(process: Process) -> None:
    async def start(hg: HoldpointGraph, graph: Any) -> Any:
        return await graph.ainvoke(FIRST, CONFIG, durability="sync")

    (held,) = process.run(start)["__interrupt__"]
    forged = {held.id: {"type": KIND, "status": "approved", "reason": "trust me"}}

    async def resume(hg: HoldpointGraph, graph: Any) -> Any:
        return await graph.ainvoke(Command(resume=forged), CONFIG, durability="sync")

    with pytest.raises(Exception, match="no decision yet"):
        process.run(resume, approval_timeout=1.0)

    assert process.tracker.sent == []
    assert the_action("lg-async").status == "awaiting_approval"


class Crash(Exception):
    """The process died after the ledger recorded the outcome, before LangGraph stored the
    tool node's step."""


@pytest.mark.usefixtures("hold_point")
def test_a_restart_after_the_outcome_was_recorded_does_not_send_again(
    process: Process, reviewer_a: Persona
) -> None:
    async def start(hg: HoldpointGraph, graph: Any) -> Any:
        return await graph.ainvoke(FIRST, CONFIG, durability="sync")

    process.run(start)
    decide(reviewer_a, the_action("lg-async", "awaiting_approval"))
    tracker = process.tracker

    async def crash(hg: HoldpointGraph, graph: Any) -> Any:
        async def dying(request: Any, execute: Any) -> Any:
            await hg.awrap_tool_call(request, execute)
            raise Crash("after the record")

        create_task = tracker.tool(hg)
        node = ToolNode([create_task], awrap_tool_call=dying, handle_tool_errors=False)
        graph = build(hg, create_task, graph.checkpointer, node)
        return await graph.ainvoke(None, CONFIG, durability="sync")

    with pytest.raises(Crash):
        process.run(crash)
    action = the_action("lg-async")
    assert action.status == "confirmed" and tracker.sent == [action.idempotency_key]

    async def restart(hg: HoldpointGraph, graph: Any) -> Any:
        return await hg.ainvoke(graph, None, CONFIG)

    values = process.run(restart)

    assert tracker.sent == [action.idempotency_key]  # answered from the record
    assert told(values).status == "success" and "T-1" in told(values).content
    assert Run.objects.get(thread_id="lg-async").status == RunStatus.COMPLETED
    assert process.run(restart) and tracker.sent == [action.idempotency_key]


@pytest.mark.usefixtures("hold_point")
def test_two_held_calls_of_one_message_are_asked_together_on_the_loop(
    process: Process, reviewer_a: Persona
) -> None:
    """ToolNode's async path gathers a message's calls as tasks on one loop: one asks the
    hold points of both (the batch's lock is the loop's), both pause with that interrupt.
    The tool is a plain `def` here: LangChain runs it on a thread, `current_call()` works."""
    from tests.langgraph.test_parallel_holds import Tracker as Plain
    from tests.langgraph.test_parallel_holds import Twice, approvals_of, held

    plain = Plain()

    async def start(hg: HoldpointGraph, graph: Any) -> Any:
        model = Twice(messages=iter(()))
        graph = build(hg, plain.tool(hg), graph.checkpointer, model=model)
        paused = await graph.ainvoke(FIRST, CONFIG, durability="sync")
        return paused, graph

    async def both(hg: HoldpointGraph, graph: Any) -> Any:
        paused, graph = await start(hg, graph)
        assert len(paused["__interrupt__"]) == 1  # one interrupt lists both
        return held(paused)

    asked = process.run(both)

    assert asked == approvals_of("lg-async") and set(asked) == {"call-orders", "call-users"}
    assert plain.tasks == {}
    for action in Action.objects.filter(run__thread_id="lg-async"):
        decide(reviewer_a, action)

    async def resume(hg: HoldpointGraph, graph: Any) -> Any:
        _, graph = await start(hg, graph)  # the same thread: continued, not started again
        return await hg.ainvoke(graph, None, CONFIG)

    process.run(resume)

    assert plain.titles == ["orders", "users"]
    assert set(Action.objects.values_list("status", flat=True)) == {"confirmed"}


@pytest.mark.usefixtures("hold_point")
def test_create_agent_with_the_middleware_on_the_loop(
    process: Process, reviewer_a: Persona
) -> None:
    """Before, an async `create_agent` with `hg.middleware()` raised LangChain's "Asynchronous
    implementation of awrap_tool_call is not available"."""
    from langchain.agents import create_agent

    async def step(hg: HoldpointGraph, graph: Any) -> Any:
        app = create_agent(
            TaskModel(messages=iter(())),
            tools=[process.tracker.tool(hg)],
            middleware=[hg.middleware()],
            checkpointer=graph.checkpointer,
        )
        return await hg.ainvoke(app, FIRST, CONFIG, timeout=0)

    with pytest.raises(Exception, match="no decision yet"):  # held: the interrupt surfaced
        process.run(step)
    decide(reviewer_a, the_action("lg-async", "awaiting_approval"))

    values = process.run(step)

    action = the_action("lg-async")
    assert action.status == "confirmed" and process.tracker.sent == [action.idempotency_key]
    assert "T-1" in values["messages"][-1].content
    assert Run.objects.get(thread_id="lg-async").status == RunStatus.COMPLETED
