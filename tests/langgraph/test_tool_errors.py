"""A ToolNode told to handle tool errors (`handle_tool_errors`) still stops the graph when
the ledger cannot settle a call: its outcome is never an error message for the model.

Real LangGraph (SqliteSaver on a file), a scripted chat model that asks again after an error
(as real models do), the ledgered tool posting to the real sandbox tracker in mode `none`
(no key, no lookup: an unknown outcome goes to a person), the API on `live_server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

from approvals.models import ApprovalPolicy
from holdpoint_client import Holdpoint, OutcomeUnknown
from holdpoint_client.langgraph import HoldpointGraph, current_call
from runtime.models import Action, Tenant
from tests.client import TOOL
from tests.conftest import Persona
from tests.sandbox import Sandbox

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.ci_database("postgresql"),
]


class Retrying(GenericFakeChatModel):
    """Asks for a task; told of an error, asks again under a new call id (a real model
    names a new one in every answer); told of a task, reports it."""

    asked: int = 0
    first: dict[str, Any] = {"title": "Review"}  # the arguments of the first call

    def bind_tools(self, tools: Any, **kwargs: Any) -> Retrying:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        last = messages[-1]
        if isinstance(last, ToolMessage) and last.status != "error":
            reply = AIMessage(f"The tool said: {last.content}")
        else:
            self.asked += 1
            given = self.first if self.asked == 1 else {"title": "Review"}
            call = {"name": "create_task", "args": given, "id": f"c-{self.asked}"}
            reply = AIMessage("A task for it.", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])


@pytest.fixture
def setup(
    live_server: Any, agent_a: Persona, tenant_a: Tenant, sandbox_factory: Any, tmp_path: Path
) -> Iterator[tuple[HoldpointGraph, Any, Sandbox, Retrying, list[bool]]]:
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    box = sandbox_factory("none")
    hp = Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01, resolution_timeout=0)
    hg = HoldpointGraph(hp, graph="api-review")
    lost = [True]

    @hg.action(TOOL, reason="a task")
    @tool
    def create_task(title: str) -> dict[str, Any]:
        """Create a task in the team's tracker."""
        sent = httpx.post(
            box.url + "/tasks", json={"title": title}, headers=current_call().headers()
        )
        if lost[0]:
            lost[0] = False
            raise httpx.ReadError("connection reset")  # the task exists; its answer is lost
        return dict(sent.raise_for_status().json())

    model = Retrying(messages=iter(()))

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", hg.tool_node([create_task], handle_tool_errors=True))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    with SqliteSaver.from_conn_string(str(tmp_path / "errors.sqlite3")) as saver:
        try:
            yield hg, builder.compile(checkpointer=saver), box, model, lost
        finally:
            hp.close()


def test_an_outcome_nobody_can_tell_stops_the_graph_even_when_tool_errors_are_handled(
    setup: tuple[HoldpointGraph, Any, Sandbox, Retrying, list[bool]],
) -> None:
    """The tracker made the task and its answer was lost; the tool (mode `none`) can only
    be settled by a person, and the agent waits for none (`resolution_timeout=0`). The
    ToolNode turned the OutcomeUnknown into an error message for the model, which asked
    again under a new call id — a new action, and a second task. Now the graph stops with
    OutcomeUnknown, the model is not told anything, and there is one task."""
    hg, graph, box, _, _ = setup
    config: Any = {"configurable": {"thread_id": "lg-errors"}}

    try:
        hg.invoke(graph, {"messages": [("user", "go")]}, config)
    except OutcomeUnknown:
        stopped = True
    else:
        stopped = False

    assert [t["title"] for t in box.tasks()] == ["Review"]
    assert stopped
    (action,) = Action.objects.filter(run__thread_id="lg-errors")
    assert action.status == "manual_review"
    messages = graph.get_state(config).values["messages"]
    assert not any(isinstance(m, ToolMessage) for m in messages)


def test_the_tools_own_errors_are_still_handled_as_asked(
    setup: tuple[HoldpointGraph, Any, Sandbox, Retrying, list[bool]],
) -> None:
    """What `handle_tool_errors` is for keeps working: arguments that do not fit the tool
    are told to the model, nothing is prepared for them, and its next call goes through."""
    hg, graph, box, model, lost = setup
    model.first, lost[0] = {}, False
    config: Any = {"configurable": {"thread_id": "lg-bad-args"}}

    values = hg.invoke(graph, {"messages": [("user", "go")]}, config)

    told = [m for m in values["messages"] if isinstance(m, ToolMessage)]
    assert [m.status for m in told] == ["error", "success"]
    assert "title" in str(told[0].content)
    (action,) = Action.objects.filter(run__thread_id="lg-bad-args")
    assert (action.idempotency_key.endswith(":lc:c-2"), action.status) == (True, "confirmed")
    assert [t["title"] for t in box.tasks()] == ["Review"]
