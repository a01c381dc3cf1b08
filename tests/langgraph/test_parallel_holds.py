"""Two held calls in one AI message: both hold points reach the caller at once.

The model asks for two tasks in one message; tenant A's reviewers hold agent.tasks.create.
LangGraph's ToolNode runs a message's calls in one task (in parallel threads), and a task
surfaces one interrupt at a time: LangGraph matches resume values to a task's interrupts by
their order (langgraph.types.interrupt). So the ToolNode's held calls are asked together,
in one interrupt listing them all (as LangChain's HumanInTheLoopMiddleware asks a
message's calls); `create_agent` sends each call as a task of its own (Send), whose
interrupts LangGraph surfaces side by side — one per held call.

Real LangGraph (SqliteSaver on a file), a scripted chat model, the API on `live_server`;
reviewers decide through the REST API.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

from holdpoint_client import Holdpoint
from holdpoint_client.langgraph import KIND, HoldpointGraph, current_call
from runtime.models import Action, Run, RunStatus
from tests.client import decide, hold_point  # noqa: F401  (hold_point: a fixture)
from tests.conftest import Persona

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.ci_database("postgresql"),
    pytest.mark.usefixtures("hold_point"),
]


class Twice(GenericFakeChatModel):
    """Asks for two tasks in one message; told of them, reports what it was told."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Twice:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        told = [m for m in messages if isinstance(m, ToolMessage)]
        if told:
            reply = AIMessage(" | ".join(str(m.content) for m in told))
        else:
            calls = [
                {"name": "create_task", "args": {"title": title}, "id": f"call-{title}"}
                for title in ("orders", "users")
            ]
            reply = AIMessage("Two tasks: one per removed endpoint.", tool_calls=calls)
        return ChatResult(generations=[ChatGeneration(message=reply)])


class Tracker:
    """The service: one task per Idempotency-Key; `titles` lists every task it made."""

    def __init__(self) -> None:
        self.tasks: dict[str, dict[str, Any]] = {}

    @property
    def titles(self) -> list[str]:
        return sorted(task["title"] for task in self.tasks.values())

    def tool(self, hg: HoldpointGraph) -> BaseTool:
        @hg.action("agent.tasks.create", reason="a task per removed endpoint")
        @tool
        def create_task(title: str) -> dict[str, Any]:
            """Create a task in the team's tracker."""
            key = current_call().idempotency_key
            made = {"id": f"T-{len(self.tasks) + 1}", "title": title}
            return self.tasks.setdefault(key, made)

        return create_task


@pytest.fixture
def hg(live_server: Any, agent_a: Persona) -> Iterator[HoldpointGraph]:
    hp = Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01)
    try:
        yield HoldpointGraph(hp, graph="api-review")
    finally:
        hp.close()


@pytest.fixture
def saver(tmp_path: Path) -> Iterator[SqliteSaver]:
    with SqliteSaver.from_conn_string(str(tmp_path / "holds.sqlite3")) as checkpointer:
        yield checkpointer


def tool_node_graph(hg: HoldpointGraph, tracker: Tracker, saver: SqliteSaver) -> Any:
    model = Twice(messages=iter(()))

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", hg.tool_node([tracker.tool(hg)]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=saver)


def held(values: dict[str, Any]) -> dict[str, str]:
    """tool_call_id → approval id of every hold point in what the graph returned."""
    found: dict[str, str] = {}
    for pending in values.get("__interrupt__", ()):
        assert pending.value["type"] == KIND
        for call in pending.value.get("calls") or [pending.value]:
            found[call["tool_call_id"]] = call["approval_id"]
    return found


def approvals_of(thread: str) -> dict[str, str]:
    """tool_call_id → the approval the ledger holds for it."""
    return {
        action.idempotency_key.rsplit(":lc:", 1)[1]: str(action.approvals.get().pk)
        for action in Action.objects.filter(run__thread_id=thread)
    }


def told(values: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {
        m.tool_call_id: (m.status, str(m.content))
        for m in values["messages"]
        if isinstance(m, ToolMessage)
    }


def test_two_held_calls_of_one_message_are_asked_together(
    hg: HoldpointGraph, saver: SqliteSaver, reviewer_a: Persona
) -> None:
    """The graph paused on the first held call only: the second was prepared and waited
    in the inbox, but the caller was never told of it — and on resume the first call's
    answer could reach the second's thread (LangGraph hands a task's answers out in the
    order its interrupts are asked, which parallel calls do not keep), which then waited
    for a decision nobody was shown. Now one interrupt lists both hold points; once both
    are decided, one resume settles both: each task made once."""
    tracker = Tracker()
    graph = tool_node_graph(hg, tracker, saver)
    config: Any = {"configurable": {"thread_id": "lg-two-held"}}

    paused = graph.invoke({"messages": [("user", "GET /orders, GET /users: removed")]}, config)

    assert held(paused) == approvals_of("lg-two-held")
    assert set(held(paused)) == {"call-orders", "call-users"} and tracker.tasks == {}
    for action in Action.objects.filter(run__thread_id="lg-two-held"):
        decide(reviewer_a, action)

    values = hg.invoke(graph, None, config)

    assert tracker.titles == ["orders", "users"]
    assert {status for status, _ in told(values).values()} == {"success"}
    assert set(Action.objects.values_list("status", flat=True)) == {"confirmed"}
    assert Run.objects.get(thread_id="lg-two-held").status == RunStatus.COMPLETED
    assert hg.invoke(graph, None, config) and tracker.titles == ["orders", "users"]


def test_one_approved_one_rejected_each_as_decided(
    hg: HoldpointGraph, saver: SqliteSaver, reviewer_a: Persona
) -> None:
    tracker = Tracker()
    graph = tool_node_graph(hg, tracker, saver)
    config: Any = {"configurable": {"thread_id": "lg-two-decisions"}}
    graph.invoke({"messages": [("user", "GET /orders, GET /users: removed")]}, config)
    for action in Action.objects.filter(run__thread_id="lg-two-decisions"):
        if action.idempotency_key.endswith("call-users"):
            decide(reviewer_a, action, "reject", "users stays for now")
        else:
            decide(reviewer_a, action)

    values = hg.invoke(graph, None, config)

    assert tracker.titles == ["orders"]
    messages = told(values)
    assert messages["call-orders"][0] == "success"
    status, content = messages["call-users"]
    assert status == "error" and "users stays for now" in content


def test_create_agent_surfaces_one_interrupt_per_held_call(
    hg: HoldpointGraph, saver: SqliteSaver, reviewer_a: Persona
) -> None:
    """LangChain's `create_agent` runs each tool call as a task of its own: two held
    calls are two interrupts side by side, resumed together."""
    tracker = Tracker()
    app = create_agent(
        Twice(messages=iter(())),
        tools=[tracker.tool(hg)],
        middleware=[hg.middleware()],
        checkpointer=saver,
    )
    config: Any = {"configurable": {"thread_id": "lg-two-held-agent"}}

    paused = app.invoke({"messages": [("user", "GET /orders, GET /users: removed")]}, config)

    assert len(paused["__interrupt__"]) == 2
    assert held(paused) == approvals_of("lg-two-held-agent")
    for action in Action.objects.filter(run__thread_id="lg-two-held-agent"):
        decide(reviewer_a, action)

    hg.invoke(app, None, config)

    assert tracker.titles == ["orders", "users"]
