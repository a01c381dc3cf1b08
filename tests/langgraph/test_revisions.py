"""A LangGraph tool call the model asked for before the goal was revised is not run again
under the new revision.

Real LangGraph (SqliteSaver on a file), a scripted chat model naming a call id of its own,
the ledgered tool posting to the real sandbox tracker, the API on `live_server`. A process
that dies right after the tracker answered is played by an exception nothing catches: the
action stays `sent` and the graph's tools step stays pending, as after a SIGKILL.
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
from holdpoint_client import Holdpoint
from holdpoint_client.langgraph import KIND, HoldpointGraph, current_call
from runtime.models import Action, Run, Tenant
from tests.client import TOOL, decide, hold_point, the_action  # noqa: F401  (hold_point: a fixture)
from tests.conftest import Persona
from tests.sandbox import Sandbox

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.ci_database("postgresql"),
]


class Died(BaseException):
    """The process died here: nothing catches it, nothing is recorded after it."""


class Model(GenericFakeChatModel):
    """Asks for one task, then reports what the tool said."""

    told: list[str] = []

    def bind_tools(self, tools: Any, **kwargs: Any) -> Model:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        last = messages[-1]
        if isinstance(last, ToolMessage):
            self.told.append(str(last.content))
            reply = AIMessage(f"The tool said: {last.content}")
        else:
            call = {"name": "create_task", "args": {"title": "Review"}, "id": "call-review"}
            reply = AIMessage("A task for it.", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])


@pytest.fixture
def setup(
    live_server: Any, agent_a: Persona, tenant_a: Tenant, sandbox_factory: Any, tmp_path: Path
) -> Iterator[tuple[HoldpointGraph, Any, Model, Sandbox, list[bool]]]:
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    box = sandbox_factory("key")
    hp = Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01)
    hg = HoldpointGraph(hp, graph="api-review")
    die = [True]

    @hg.action(TOOL, reason="a task")
    @tool
    def create_task(title: str) -> dict[str, Any]:
        """Create a task in the team's tracker."""
        sent = httpx.post(
            box.url + "/tasks", json={"title": title}, headers=current_call().headers()
        )
        if die[0]:
            die[0] = False
            raise Died  # the task exists; its answer is never recorded
        return dict(sent.raise_for_status().json())

    model = Model(messages=iter(()), told=[])

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", hg.tool_node([create_task]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    with SqliteSaver.from_conn_string(str(tmp_path / "rev.sqlite3")) as saver:
        try:
            yield hg, builder.compile(checkpointer=saver), model, box, die
        finally:
            hp.close()


def test_a_call_sent_before_a_goal_revision_is_not_sent_again_after_it(
    setup: tuple[HoldpointGraph, Any, Model, Sandbox, list[bool]], agent_a: Persona
) -> None:
    """The tracker made the task and the process died before recording it; then the goal
    was revised. Resuming the thread ran the pending tool call again under the new goal
    revision's key: a new action, sent at once (no hold point), and a second task. Now a
    call the model asked for under an older revision is answered to the model as not run
    again — its action stays the old goal's — and nothing is sent."""
    hg, graph, model, box, _ = setup
    config: Any = {"configurable": {"thread_id": "lg-revised"}}
    with pytest.raises(Died):
        hg.invoke(graph, {"messages": [("user", "go")]}, config)
    assert len(box.tasks()) == 1
    (first,) = Action.objects.filter(run__thread_id="lg-revised")
    assert first.status == "sent"
    run = Run.objects.get(thread_id="lg-revised")
    hg.hp.client.revise(str(run.run_id), {"task": "other"}, expected_goal_rev=run.goal_rev)

    values = hg.invoke(graph, None, config)

    assert len(box.tasks()) == 1  # no second task
    assert list(Action.objects.filter(run__thread_id="lg-revised")) == [first]
    (told,) = model.told
    # Its action, sent and never confirmed, waits for a person: a replay by its key would
    # send the old goal's call after the revision (f8cfe12).
    assert "goal was revised" in told and "not run again" in told and "(manual_review)" in told
    assert values["messages"][-1].content.startswith("The tool said:")


# --- a call held at a hold point when the goal is revised -----------------------------------


@pytest.fixture
def held(
    live_server: Any,
    agent_a: Persona,
    sandbox_factory: Any,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[tuple[HoldpointGraph, Any, Model, Sandbox]]:
    """The same agent, its create_task held for tenant A's reviewers; the tool posts to the
    tracker (and never dies)."""
    request.getfixturevalue("hold_point")
    box = sandbox_factory("key")
    hp = Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01)
    hg = HoldpointGraph(hp, graph="api-review", approval_timeout=5)  # a hang fails instead

    @hg.action(TOOL, reason="a task")
    @tool
    def create_task(title: str) -> dict[str, Any]:
        """Create a task in the team's tracker."""
        sent = httpx.post(
            box.url + "/tasks", json={"title": title}, headers=current_call().headers()
        )
        return dict(sent.raise_for_status().json())

    model = Model(messages=iter(()), told=[])

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", hg.tool_node([create_task]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    with SqliteSaver.from_conn_string(str(tmp_path / "held.sqlite3")) as saver:
        try:
            yield hg, builder.compile(checkpointer=saver), model, box
        finally:
            hp.close()


def interrupted_at_the_hold_point(hg: HoldpointGraph, graph: Any, config: Any) -> Any:
    """Run the graph until it pauses on the held call (goal revision 1); its values."""
    values = graph.invoke({"messages": [("user", "go")]}, config, durability="sync")
    (pending,) = values["__interrupt__"]
    assert pending.value["type"] == KIND and pending.value["tool"] == TOOL
    return values


def revise(hg: HoldpointGraph, thread: str) -> None:
    run = Run.objects.get(thread_id=thread)
    hg.hp.client.revise(str(run.run_id), {"task": "other"}, expected_goal_rev=run.goal_rev)


def assert_not_run_under_the_new_goal(thread: str, box: Sandbox, model: Model) -> None:
    """Nothing reached the tracker, no action of revision 2, and the model was told the call
    was not run because the goal was revised."""
    assert box.tasks() == []
    (action,) = Action.objects.filter(run__thread_id=thread)
    assert (action.goal_rev, action.status) == (1, "cancelled")
    assert Run.objects.get(thread_id=thread).goal_rev == 2
    (told,) = model.told
    assert "goal was revised" in told and "was not run:" in told and "nothing was sent" in told


@pytest.mark.parametrize("decided", ["approve", "reject"])
def test_a_decision_read_before_a_goal_revision_does_not_run_the_call_after_it(
    held: tuple[HoldpointGraph, Any, Model, Sandbox], reviewer_a: Persona, decided: str
) -> None:
    """The graph paused at the hold point under goal revision 1; the reviewer decided, and
    `wait_for_decision` read it into the resume Command; then the goal was revised, and
    the graph resumed with that Command. The old revision's decision must not let the
    call run (nor its rejection be reported as the reason) under revision 2: no task, no
    action of revision 2 (the guard against older goals holds; without it a new action is
    prepared and held). But the model was told "was not run again", as if the call had
    run once, for a call that never left; now it is told the call was not run, nothing
    sent."""
    hg, graph, model, box = held
    thread = f"lg-held-{decided}"
    config: Any = {"configurable": {"thread_id": thread}}
    values = interrupted_at_the_hold_point(hg, graph, config)
    decide(reviewer_a, the_action(thread, "awaiting_approval"), decided)

    resume = hg.wait_for_decision(values, timeout=30)
    (answer,) = resume.resume.values()
    assert answer["status"] == ("approved" if decided == "approve" else "rejected")
    revise(hg, thread)
    if decided == "approve":  # approved, not sent: withdrawn by the revision
        assert the_action(thread).status == "cancelled"

    values = graph.invoke(resume, config, durability="sync")

    assert "__interrupt__" not in values
    assert_not_run_under_the_new_goal(thread, box, model)
    assert "rejected" not in model.told[0]


def test_a_call_whose_hold_point_a_goal_revision_withdrew_is_not_run_on_resume(
    held: tuple[HoldpointGraph, Any, Model, Sandbox],
) -> None:
    """The goal was revised while the call waited for a reviewer (its approval closed with
    it); `hg.invoke` then resumed the thread: the withdrawn approval is no decision to wait
    for, and the call is not prepared again under revision 2 — the model is told it was
    not run (it was told "not run again" before)."""
    hg, graph, model, box = held
    config: Any = {"configurable": {"thread_id": "lg-held-revised"}}
    interrupted_at_the_hold_point(hg, graph, config)
    revise(hg, "lg-held-revised")

    values = hg.invoke(graph, None, config, timeout=30)

    assert values["messages"][-1].content.startswith("The tool said:")
    assert_not_run_under_the_new_goal("lg-held-revised", box, model)
