"""A conversation's turns through `hg.invoke(..., turn=...)`: each input taken once.

Real LangGraph (SqliteSaver on a file) with a scripted chat model that counts what it is
asked, the ledgered tool posting to the real sandbox tracker, the API on `live_server`.
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
from holdpoint_client import ApprovalTimeout, ExecutorError, Holdpoint
from holdpoint_client.langgraph import HoldpointGraph, current_call
from runtime.models import Action, Run, RunStatus, Tenant
from tests.client import TOOL
from tests.conftest import Persona
from tests.sandbox import Sandbox

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.ci_database("postgresql"),
]


class Model(GenericFakeChatModel):
    """Asks for one task per user message (a tool call id of its own, as a real model
    names each call), then reports the tracker's answer. `asked` counts every call."""

    asked: list[str] = []

    def bind_tools(self, tools: Any, **kwargs: Any) -> Model:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        last = messages[-1]
        self.asked.append(str(last.content))
        if isinstance(last, ToolMessage):
            reply = AIMessage(f"The tracker answered: {last.content}")
        else:
            call = {
                "name": "create_task",
                "args": {"title": last.content},
                "id": f"call-{last.content}",
            }
            reply = AIMessage("A task for it.", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])


@pytest.fixture
def conversation(
    live_server: Any, agent_a: Persona, tenant_a: Tenant, sandbox_factory: Any, tmp_path: Path
) -> Iterator[tuple[HoldpointGraph, Any, Model, Sandbox]]:
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    box = sandbox_factory("key")
    hp = Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01)
    hg = HoldpointGraph(hp, graph="api-review")

    @hg.action(TOOL, reason="a task per message")
    @tool
    def create_task(title: str) -> dict[str, Any]:
        """Create a task in the team's tracker."""
        sent = httpx.post(
            box.url + "/tasks", json={"title": title}, headers=current_call().headers()
        )
        return dict(sent.raise_for_status().json())

    model = Model(messages=iter(()), asked=[])

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", hg.tool_node([create_task]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    with SqliteSaver.from_conn_string(str(tmp_path / "turns.sqlite3")) as saver:
        try:
            yield hg, builder.compile(checkpointer=saver), model, box
        finally:
            hp.close()


def test_each_turn_of_a_conversation_runs_once(
    conversation: tuple[HoldpointGraph, Any, Model, Sandbox],
) -> None:
    """README: `complete=False` "for a conversation's next turn" — but a thread that had
    ended was never run again: the next turn's input was dropped and the last turn's values
    returned. With `turn` (the same key when a crashed process runs a turn again) a new
    turn is run; a turn already taken is not — its model calls are not paid twice."""
    hg, graph, model, box = conversation
    config: Any = {"configurable": {"thread_id": "lg-turns"}}

    def say(text: str, turn: str, *, complete: bool = False) -> Any:
        return hg.invoke(
            graph, {"messages": [("user", text)]}, config, turn=turn, complete=complete
        )

    say("first", "t1")
    values = say("second", "t2")

    assert [t["title"] for t in box.tasks()] == ["first", "second"]
    assert values["messages"][-1].content.startswith("The tracker answered:")
    assert len(model.asked) == 4  # two per turn: the task, then the tracker's answer

    again = say("second", "t2")  # the same turn again, as a restarted process runs it
    say("first", "t1")

    assert len(model.asked) == 4 and len(box.tasks()) == 2
    assert again["messages"] == values["messages"]
    say("third", "t3", complete=True)

    assert [t["title"] for t in box.tasks()] == ["first", "second", "third"]
    (run,) = Run.objects.filter(thread_id="lg-turns")  # one Holdpoint run for the thread
    assert run.status == RunStatus.COMPLETED
    assert Action.objects.filter(run=run, status="confirmed").count() == 3


def test_a_new_turn_while_the_last_one_waits_is_refused(
    conversation: tuple[HoldpointGraph, Any, Model, Sandbox],
) -> None:
    """A turn paused at a hold point has not ended: a next turn's input would bury it (and
    its pending approval) under a new model call. Refused; the paused turn goes on."""
    hg, graph, model, box = conversation
    ApprovalPolicy.objects.filter(name="free").update(required=True)
    config: Any = {"configurable": {"thread_id": "lg-waits"}}
    first = {"messages": [("user", "first")]}

    with pytest.raises(ApprovalTimeout):
        hg.invoke(graph, first, config, turn="t1", complete=False, timeout=0)
    with pytest.raises(ExecutorError, match="the turn before 't2' has not ended"):
        hg.invoke(graph, {"messages": [("user", "second")]}, config, turn="t2", timeout=0)

    assert graph.get_state(config).interrupts and len(model.asked) == 1
    assert box.tasks() == []
