"""examples/approval_agent.py (10 lines of agent code) and `Holdpoint` over real sockets.

The API is served by `live_server`, the task tracker is the real sandbox process, the agent
is its own process (own session) killed by SIGKILL at a named point of the client
(HOLDPOINT_CLIENT_FAULTS) and started again with the same thread name. A reviewer decides
through the REST API. Each crash must end with exactly one task and the run completed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from holdpoint_client import ApprovalTimeout, Holdpoint, Rejected, ToolCall
from runtime.models import Action, Run, RunStatus
from tests import procs
from tests.client import decide, hold_point, the_action  # noqa: F401  (hold_point: a fixture)
from tests.conftest import Persona
from tests.sandbox import Sandbox

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
EXAMPLE = procs.ROOT / "examples" / "approval_agent.py"
RECORDER = Path(__file__).with_name("record_agent.py")
TOOL = "agent.tasks.create"


class Agent:
    """Starts the example (or another agent script) as its own process, logging to a file."""

    def __init__(self, url: str, token: str, box: Sandbox, log: Path) -> None:
        self.url, self.token, self.box, self.log = url, token, box, log

    def start(
        self,
        thread: str,
        *,
        faults: str = "",
        script: Path = EXAMPLE,
        extra: list[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDPOINT_")}
        env.update(
            PYTHONUNBUFFERED="1",
            HOLDPOINT_URL=self.url,
            HOLDPOINT_TOKEN=self.token,
            HOLDPOINT_CLIENT_FAULTS=faults,
        )
        args = extra if extra is not None else ["--tasks-url", self.box.url, "--ttl", "3"]
        with open(self.log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, str(script), "--thread", thread, *args],
                cwd=procs.ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def finish(self, proc: subprocess.Popen[bytes], timeout: float = 90) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent did not finish within {timeout}s:\n{self.log.read_text()}")
        finally:
            procs.kill(proc)


@pytest.fixture
def agent(
    live_server: Any,
    agent_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Agent:
    mode = getattr(request, "param", "key")
    assert agent_a.token is not None
    return Agent(live_server.url, agent_a.token, sandbox_factory(mode), tmp_path / "agent.log")


@pytest.fixture
def holdpoint(agent: Agent) -> Iterator[Callable[..., Holdpoint]]:
    """Holdpoint entry points in this process, closed at the end: an idle keep-alive
    connection would keep a live-server thread, and its database session, alive."""
    made: list[Holdpoint] = []

    def make(**options: Any) -> Holdpoint:
        made.append(Holdpoint(agent.url, agent.token, ttl=3, backoff=0.01, **options))
        return made[-1]

    yield make
    for hp in made:
        hp.close()


def assert_done_once(agent: Agent, thread: str) -> None:
    (task,) = agent.box.tasks()  # exactly one task
    (action,) = Action.objects.filter(run__thread_id=thread)
    assert (action.status, action.external_id) == ("confirmed", task["id"])
    assert task["idempotency_key"] == action.idempotency_key
    (run,) = Run.objects.filter(thread_id=thread)
    assert run.status == RunStatus.COMPLETED and run.lease_owner == ""
    assert f"task {task['id']}" in agent.log.read_text()


def crashed(agent: Agent, proc: subprocess.Popen[bytes], point: str) -> None:
    assert agent.finish(proc) == -signal.SIGKILL, agent.log.read_text()
    assert f"fault point {point}" in agent.log.read_text()


# --- the example, killed at three points ----------------------------------------------------


@pytest.mark.parametrize("agent", ["key", "lookup"], indirect=True)
@pytest.mark.usefixtures("hold_point")
def test_killed_after_the_tracker_answered(
    agent: Agent,
    reviewer_a: Persona,
) -> None:
    first = agent.start("t-answered", faults="after_tool_response")
    decide(reviewer_a, the_action("t-answered", "awaiting_approval"))
    crashed(agent, first, "after_tool_response")
    assert the_action("t-answered").status == "sent" and len(agent.box.tasks()) == 1

    assert agent.finish(agent.start("t-answered")) == 0, agent.log.read_text()

    assert_done_once(agent, "t-answered")
    again = agent.finish(agent.start("t-answered"))  # a completed run answers from its record
    assert again == 0 and len(agent.box.tasks()) == 1


@pytest.mark.usefixtures("hold_point")
def test_killed_while_waiting_for_the_approval(
    agent: Agent,
    reviewer_a: Persona,
) -> None:
    crashed(agent, agent.start("t-waiting", faults="awaiting_approval"), "awaiting_approval")
    assert the_action("t-waiting").status == "awaiting_approval" and agent.box.tasks() == []

    restarted = agent.start("t-waiting")
    decide(reviewer_a, the_action("t-waiting", "awaiting_approval"))
    assert agent.finish(restarted) == 0, agent.log.read_text()

    assert_done_once(agent, "t-waiting")


@pytest.mark.usefixtures("hold_point")
def test_killed_after_the_decision_before_the_call(
    agent: Agent,
    reviewer_a: Persona,
) -> None:
    first = agent.start("t-decided", faults="after_decision")
    decide(reviewer_a, the_action("t-decided", "awaiting_approval"))
    crashed(agent, first, "after_decision")
    assert the_action("t-decided").status == "approved" and agent.box.tasks() == []

    assert agent.finish(agent.start("t-decided")) == 0, agent.log.read_text()

    assert_done_once(agent, "t-decided")


@pytest.mark.usefixtures("hold_point")
def test_the_example_stops_on_a_rejection_with_the_reason(
    agent: Agent,
    reviewer_a: Persona,
) -> None:
    proc = agent.start("t-rejected")
    decide(reviewer_a, the_action("t-rejected", "awaiting_approval"), "reject", "not now")

    assert agent.finish(proc) == 1
    output = agent.log.read_text()
    assert "Rejected" in output and "not now" in output
    assert agent.box.tasks() == [] and the_action("t-rejected").status == "cancelled"


# --- record and model, killed after storing -------------------------------------------------


def test_recorded_calls_are_not_made_again_after_a_crash(agent: Agent, tmp_path: Path) -> None:
    counts = tmp_path / "calls.txt"
    args = ["--count", str(counts)]
    first = agent.start("t-record", faults="after_record", script=RECORDER, extra=args)
    crashed(agent, first, "after_record")
    assert counts.read_text().split() == ["record"]

    assert agent.finish(agent.start("t-record", script=RECORDER, extra=args)) == 0
    assert agent.finish(agent.start("t-record", script=RECORDER, extra=args)) == 0

    assert counts.read_text().split() == ["record", "model"]  # each paid for once
    output = agent.log.read_text()
    assert output.count("answers record=42 model=43") == 2, output
    (run,) = Run.objects.filter(thread_id="t-record")
    assert run.status == RunStatus.COMPLETED
    state = run.checkpoints.get(rev=run.checkpoint_rev).state
    assert state["_holdpoint"] == {"record:evidence": 42, "model:summary": 43}


# --- Holdpoint in this process: edits, rejection, timeout ---------------------------------


def post_task(box: Sandbox, seen: list[dict[str, Any]]) -> Callable[..., Any]:
    def create_task(title: str, body: str = "", *, call: ToolCall) -> Any:
        seen.append({"title": title, "body": body})
        sent = httpx.post(box.url + "/tasks", json=call.params, headers=call.headers())
        return sent.raise_for_status().json()

    return create_task


@pytest.mark.usefixtures("hold_point")
def test_the_reviewers_edits_are_what_perform_receives(
    agent: Agent, reviewer_a: Persona, holdpoint: Callable[..., Holdpoint]
) -> None:
    hp = holdpoint(approval_timeout=0.5)
    seen: list[dict[str, Any]] = []
    create_task = hp.action(TOOL, reason="needs a look")(post_task(agent.box, seen))
    with pytest.raises(ApprovalTimeout), hp.run("t-edit", graph="api-review"):
        create_task(title="Draft title", body="b")
    assert the_action("t-edit").status == "awaiting_approval"  # durable, not cancelled
    decide(reviewer_a, the_action("t-edit"), edits={"title": "Reviewed title"})

    with hp.run("t-edit", graph="api-review") as run:
        task = create_task(title="Draft title", body="b")

    assert seen == [{"title": "Reviewed title", "body": "b"}]
    assert task["title"] == "Reviewed title" and run.last_action is not None
    assert [t["title"] for t in agent.box.tasks()] == ["Reviewed title"]
    assert Run.objects.get(thread_id="t-edit").status == RunStatus.COMPLETED


@pytest.mark.usefixtures("hold_point")
def test_a_rejection_raises_rejected_with_the_reviewers_reason(
    agent: Agent, reviewer_a: Persona, holdpoint: Callable[..., Holdpoint]
) -> None:
    hp = holdpoint(approval_timeout=0.5)
    seen: list[dict[str, Any]] = []
    create_task = hp.action(TOOL)(post_task(agent.box, seen))
    with pytest.raises(ApprovalTimeout), hp.run("t-reject", graph="api-review"):
        create_task(title="Close the old API")
    decide(reviewer_a, the_action("t-reject"), "reject", "clients still use it")

    with pytest.raises(Rejected) as rejected, hp.run("t-reject", graph="api-review"):
        create_task(title="Close the old API")

    assert rejected.value.reason == "clients still use it"
    assert seen == [] and agent.box.tasks() == []


def test_one_run_per_thread_and_actions_keep_their_place(
    agent: Agent, holdpoint: Callable[..., Holdpoint]
) -> None:
    """Without a hold point: two acts in program order, the second run of the program meets
    both confirmed and calls nothing."""
    hp = holdpoint()
    seen: list[dict[str, Any]] = []
    perform = post_task(agent.box, seen)

    def program() -> list[Any]:
        with hp.run("t-two", graph="api-review", complete=False) as run:
            return [
                run.act(
                    TOOL,
                    {"title": "one"},
                    reason="r",
                    perform=lambda c: perform(**c.params, call=c),
                ),
                run.act(
                    TOOL,
                    {"title": "two"},
                    reason="r",
                    perform=lambda c: perform(**c.params, call=c),
                ),
            ]

    first, second = program(), program()

    assert first == second and [t["title"] for t in first] == ["one", "two"]
    assert len(seen) == 2 and len(agent.box.tasks()) == 2
    assert Run.objects.filter(thread_id="t-two").count() == 1
    keys = sorted(
        Action.objects.filter(run__thread_id="t-two").values_list("idempotency_key", flat=True)
    )
    assert [k.rsplit(":", 1)[1] for k in keys] == ["act-1", "act-2"]


def test_two_agents_starting_one_thread_at_once_get_one_run(
    agent: Agent, holdpoint: Callable[..., Holdpoint]
) -> None:
    """Both look the thread up before either created it: the creation's key, derived from
    the thread, makes the second creation return the first run."""
    results: list[str] = []
    barrier = threading.Barrier(2)

    def start() -> None:
        hp = holdpoint()
        barrier.wait()
        with hp.run("t-race", graph="api-review", complete=False) as run:
            results.append(run.run_id)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert len(results) == 2 and results[0] == results[1]
    assert Run.objects.filter(thread_id="t-race").count() == 1
