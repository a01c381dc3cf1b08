"""A ledgered LangChain tool declared `response_format="content_and_artifact"`.

LangChain's contract for such a tool (langchain_core's BaseTool, run by LangGraph's
ToolNode): it returns `(content, artifact)`; the ToolMessage's `content` is what the model
reads, its `artifact` the raw answer kept beside it for the program, never shown to the
model. Ledgered by Holdpoint it must stay so, and the ledger keeps both — the reviewer or
auditor reads what the model was told and what the service answered, and a restarted
process rebuilds the same message from the record without calling the tool again.

Real LangGraph (SqliteSaver on a file) and a scripted chat model, the API on
`live_server`, a free policy for the tool (no approval needed).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from approvals.models import ApprovalPolicy
from holdpoint_client import Holdpoint
from holdpoint_client.langgraph import HoldpointGraph, current_call
from runtime.models import Action, Tenant
from tests.client import TOOL
from tests.conftest import Persona
from tests.langgraph.test_revisions import Model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.ci_database("postgresql"),
]


class Tracker:
    """The service: one task per Idempotency-Key; `made` is what it answered."""

    def __init__(self) -> None:
        self.made: list[dict[str, Any]] = []

    def create(self, title: str) -> dict[str, Any]:
        key = current_call().idempotency_key
        for task in self.made:
            if task["key"] == key:
                return task
        task = {"id": f"T-{len(self.made) + 1}", "title": title, "key": key}
        self.made.append(task)
        return task


def graph_with(node: Any, model: Model, saver: SqliteSaver) -> Any:
    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", node)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=saver)


@pytest.fixture
def hg(live_server: Any, agent_a: Persona, tenant_a: Tenant) -> Iterator[HoldpointGraph]:
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    hp = Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01)
    try:
        yield HoldpointGraph(hp, graph="api-review")
    finally:
        hp.close()


def tool_message(values: dict[str, Any]) -> ToolMessage:
    (message,) = [m for m in values["messages"] if isinstance(m, ToolMessage)]
    return message


def run_thread(
    hg: HoldpointGraph, made: BaseTool, where: Path, thread: str
) -> tuple[ToolMessage, Model]:
    """The thread run to its end with the tool ledgered; its ToolMessage, and the model."""
    model = Model(messages=iter(()))
    with SqliteSaver.from_conn_string(str(where)) as saver:
        graph = graph_with(hg.tool_node([made]), model, saver)
        values = hg.invoke(graph, {"messages": [("user", "go")]}, thread_config(thread))
    return tool_message(values), model


def thread_config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


def test_the_model_reads_the_content_and_the_message_carries_the_artifact(
    hg: HoldpointGraph, tmp_path: Path
) -> None:
    """The ledgered tool's message was the artifact as JSON for content, no artifact: the
    model read the raw answer the tool meant for the program, and never its content. Now
    the message is LangGraph's own ToolNode's — content for the model, the artifact beside
    it —, the ledger records both (the proof, `id`, found in the artifact), and a process
    that meets the thread again (a fresh checkpointer: the tool node runs again) rebuilds
    the same message from the record: the tool is not called a second time."""
    tracker = Tracker()

    def make(ledger: HoldpointGraph | None) -> BaseTool:
        @tool(response_format="content_and_artifact")
        def create_task(title: str) -> tuple[str, dict[str, Any]]:
            """Create a task in the team's tracker."""
            task = tracker.create(title) if ledger else {"id": "T-1", "title": title}
            return f"Created task {task['id']}", task

        return ledger.action(TOOL, reason="a task")(create_task) if ledger else create_task

    plain_model = Model(messages=iter(()))
    with SqliteSaver.from_conn_string(str(tmp_path / "plain.sqlite3")) as saver:
        plain = graph_with(ToolNode([make(None)]), plain_model, saver)
        expected = tool_message(plain.invoke({"messages": [("user", "go")]}, thread_config("p")))

    message, model = run_thread(hg, make(hg), tmp_path / "a.sqlite3", "lg-artifact")

    (task,) = tracker.made
    assert (expected.content, expected.artifact["id"]) == ("Created task T-1", "T-1")
    assert (message.content, message.artifact) == (expected.content, task)
    assert model.told == ["Created task T-1"] == plain_model.told
    action = Action.objects.get(run__thread_id="lg-artifact")
    assert (action.status, action.external_id) == ("confirmed", "T-1")
    assert action.result == {"content": "Created task T-1", "artifact": task}

    again, model = run_thread(hg, make(hg), tmp_path / "b.sqlite3", "lg-artifact")

    assert len(tracker.made) == 1  # answered from the record
    assert (again.content, again.artifact) == (message.content, task)
    assert model.told == ["Created task T-1"]


def test_an_artifact_that_is_not_json_is_recorded_not_lost(
    hg: HoldpointGraph, tmp_path: Path
) -> None:
    """An artifact holding what JSON has no word for (a datetime) broke the call after
    the service had acted: the outcome's POST could not be encoded, and the action stayed
    `sent`. Now the ledger records it as JSON (ISO time) and the call is settled."""
    tracker = Tracker()
    when = datetime(2026, 12, 7, 9, 30, tzinfo=UTC)

    @hg.action(TOOL, reason="a task")
    @tool(response_format="content_and_artifact")
    def create_task(title: str) -> tuple[str, dict[str, Any]]:
        """Create a task in the team's tracker."""
        task = tracker.create(title)
        return f"Created task {task['id']}", {**task, "created": when}

    message, model = run_thread(hg, create_task, tmp_path / "c.sqlite3", "lg-artifact-time")

    assert model.told == ["Created task T-1"] and message.content == "Created task T-1"
    action = Action.objects.get(run__thread_id="lg-artifact-time")
    assert (action.status, action.external_id) == ("confirmed", "T-1")
    recorded = action.result["artifact"]["created"]
    assert recorded.startswith("2026-12-07T09:30:00")  # ISO 8601, as the API writes time
    assert message.artifact == action.result["artifact"]
