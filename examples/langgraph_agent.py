"""A LangGraph agent with one approval-gated tool, made exactly-once by Holdpoint.

    HOLDPOINT_URL=http://127.0.0.1:8000 HOLDPOINT_TOKEN=<agent token> \\
        python examples/langgraph_agent.py --tasks-url http://127.0.0.1:8765 --thread review-43 \\
            --checkpoints var/langgraph.sqlite3      # or postgres://…/db (PostgresSaver)

An ordinary LangGraph agent — a model node, a `ToolNode`, a checkpointer — whose
`create_task` tool POSTs to the sandbox task tracker (`python manage.py sandbox_tasks`).
The lines marked `# +hp` are all that Holdpoint changes in it — 9: two imports, the
`HoldpointGraph`, `build` taking it (and its call), the `@hg.action` line, the headers
of the POST, the tool node and the invoke (an agent without a `build` function changes 7:
README.md, "LangGraph"). Nothing else of the agent knows about Holdpoint. The model is a
fake from `langchain_core` (no network, no API key) that asks for one task and then reports
the tool's answer; put any chat model in its place.

If the tenant's policy holds `agent.tasks.create`, the graph pauses with LangGraph's
`interrupt()` carrying the approval (id, hash, expiry, link); `hg.invoke` long-polls it and
resumes with the reviewer's decision: the approved params (edits included) are what the
tracker receives, a rejection reaches the model as the tool's message with the reason.
Kill it at any point (`kill -9`) and run it again with the same thread: it continues the
same graph thread and the same Holdpoint run, and never makes a second task.
`HOLDPOINT_CLIENT_FAULTS=awaiting_approval|after_decision|after_tool_response` kills it at
a named point, for the crash tests (tests/langgraph/).
"""

from __future__ import annotations

import argparse
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

from holdpoint_client import Holdpoint  # +hp
from holdpoint_client.langgraph import HoldpointGraph, current_call  # +hp

Saver = BaseCheckpointSaver[Any]


class TaskModel(GenericFakeChatModel):
    """Stands in for a chat model: asks for one task, then reports the tool's answer."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> TaskModel:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        last = messages[-1]
        if isinstance(last, ToolMessage):
            reply = AIMessage(f"The tracker answered: {last.content}")
        else:
            title = f"Review the API change of {last.content}"
            reply = AIMessage(
                "GET /orders was removed: clients break, so the review needs a task.",
                tool_calls=[
                    {
                        "name": "create_task",
                        "args": {"title": title, "body": "GET /orders: removed"},
                        "id": "call-create-task-1",
                    }
                ],
            )
        return ChatResult(generations=[ChatGeneration(message=reply)])


def build(hg: HoldpointGraph, tasks_url: str, checkpointer: Saver) -> Any:  # +hp
    """The agent, compiled with its checkpointer."""
    tasks = tasks_url.rstrip("/") + "/tasks"

    @hg.action("agent.tasks.create")  # +hp
    @tool
    def create_task(title: str, body: str) -> dict[str, Any]:
        """Create a task in the team's tracker."""
        task = {"title": title, "body": body}
        sent = httpx.post(tasks, json=task, headers=current_call().headers())  # +hp
        return dict(sent.raise_for_status().json())

    model = TaskModel(messages=iter(())).bind_tools([create_task])

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", hg.tool_node([create_task]))  # +hp  (was ToolNode([...]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


@contextmanager
def saver(where: str) -> Iterator[BaseCheckpointSaver[Any]]:
    """SqliteSaver on a file, or PostgresSaver on a postgres:// URL."""
    if where.startswith(("postgres://", "postgresql://")):
        from langgraph.checkpoint.postgres import PostgresSaver

        with PostgresSaver.from_conn_string(where) as checkpointer:
            checkpointer.setup()
            yield checkpointer
        return
    from langgraph.checkpoint.sqlite import SqliteSaver

    connection = sqlite3.connect(where, check_same_thread=False, timeout=30)
    try:
        yield SqliteSaver(connection)
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="a LangGraph agent with one gated tool")
    parser.add_argument("--tasks-url", required=True, help="the task tracker (sandbox_tasks)")
    parser.add_argument("--thread", required=True, help="the graph thread: rerun to continue")
    parser.add_argument("--checkpoints", required=True, help="a SQLite file or a postgres:// URL")
    parser.add_argument("--ttl", type=int, default=30, help="Holdpoint lease seconds")
    args = parser.parse_args()
    hg = HoldpointGraph(Holdpoint.from_env(ttl=args.ttl), graph="api-review")  # +hp
    with saver(args.checkpoints) as checkpointer:
        graph = build(hg, args.tasks_url, checkpointer)  # +hp
        config: Any = {"configurable": {"thread_id": args.thread}}
        start = {"messages": [HumanMessage(args.thread)]}
        values = hg.invoke(graph, start, config)  # +hp  (was graph.invoke(start, config))
        print(values["messages"][-1].content, flush=True)


if __name__ == "__main__":
    main()
