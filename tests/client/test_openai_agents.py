"""examples/openai_agents_agent.py: the real OpenAI Agents SDK (a scripted fake Model) on
Holdpoint over real sockets.

The API is served by `live_server`, the task tracker is the real sandbox process, the agent
its own process, SIGKILLed at a named point of the client (HOLDPOINT_CLIENT_FAULTS) and
started again with the same thread. A reviewer decides through the REST API. What is
asserted is what a user sees: the tasks in the tracker, the run's status and audit trail,
the agent's output, and what the model was given (the example's --model-log).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from audit.journal import run_stream
from audit.verification import verify_stream
from holdpoint_client import ApprovalTimeout, AsyncHoldpoint
from holdpoint_client.openai_agents import STATE_KEY, wait_for_decision
from runtime import artifacts
from runtime.models import Action, Run, RunStatus
from tests import procs
from tests.client import hold_point  # noqa: F401  (a fixture)
from tests.client.test_approval_agent import Agent, decide, the_action
from tests.conftest import Persona
from tests.sandbox import Sandbox

# The adapter above the API: CI runs it on PostgreSQL only (tests/ci_pair.py).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("hold_point"),
    pytest.mark.ci_database("postgresql"),
]
EXAMPLE = procs.ROOT / "examples" / "openai_agents_agent.py"


class SdkAgent(Agent):
    """The example, with its model's inputs logged to a file the test reads."""

    def __init__(self, url: str, token: str, box: Sandbox, log: Path, model_log: Path) -> None:
        super().__init__(url, token, box, log)
        self.model_log = model_log

    def launch(self, thread: str, faults: str = "") -> subprocess.Popen[bytes]:
        extra = ["--tasks-url", self.box.url, "--ttl", "3", "--model-log", str(self.model_log)]
        return self.start(thread, faults=faults, script=EXAMPLE, extra=extra)

    def model_inputs(self) -> list[list[dict[str, Any]]]:
        lines = self.model_log.read_text().splitlines() if self.model_log.exists() else []
        return [json.loads(line) for line in lines]

    def tool_outputs_seen(self) -> list[str]:
        """The tool outputs the model was given, in the order it was given them."""
        return [
            str(item["output"])
            for items in self.model_inputs()
            for item in items
            if item.get("type") == "function_call_output"
        ]


@pytest.fixture
def sdk(
    live_server: Any,
    agent_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    tmp_path: Path,
) -> SdkAgent:
    assert agent_a.token is not None
    box = sandbox_factory("key")
    return SdkAgent(live_server.url, agent_a.token, box, tmp_path / "a.log", tmp_path / "m.log")


def crashed(sdk: SdkAgent, proc: subprocess.Popen[bytes], point: str) -> None:
    assert sdk.finish(proc) == -signal.SIGKILL, sdk.log.read_text()
    assert f"fault point {point}" in sdk.log.read_text()


def assert_done_once(sdk: SdkAgent, thread: str) -> dict[str, Any]:
    """Exactly one task, the ledger's proof of it, the run completed with an intact trail,
    and the model told what the tracker answered."""
    (task,) = sdk.box.tasks()
    (action,) = Action.objects.filter(run__thread_id=thread)
    assert (action.status, action.external_id) == ("confirmed", task["id"])
    assert task["idempotency_key"] == action.idempotency_key
    assert re.search(r":ext:oa:call_[0-9a-f]{16}$", action.idempotency_key)  # the SDK's call id
    (run,) = Run.objects.filter(thread_id=thread)
    assert run.status == RunStatus.COMPLETED and run.lease_owner == ""
    assert verify_stream(run_stream(run.run_id)) is None
    assert json.loads(sdk.tool_outputs_seen()[-1])["id"] == task["id"]
    assert task in answers(sdk)
    return task


def answers(sdk: SdkAgent) -> list[Any]:
    """The agent's printed final answers ("Done: <what the tool returned>"), parsed: the
    recorded result comes back from the database, whose JSON need not keep key order."""
    done = [line for line in sdk.log.read_text().splitlines() if line.startswith("Done: ")]
    return [json.loads(line.removeprefix("Done: ")) for line in done]


def paused_state(thread: str) -> Any:
    run = Run.objects.get(thread_id=thread)
    state = run.checkpoints.get(rev=run.checkpoint_rev).state  # large parts stored apart
    return artifacts.resolve(run.tenant_id, state).get(STATE_KEY)


# --- killed at three points, restarted ------------------------------------------------------


def test_killed_after_the_tracker_answered(sdk: SdkAgent, reviewer_a: Persona) -> None:
    first = sdk.launch("oa-answered", faults="after_tool_response")
    decide(reviewer_a, the_action("oa-answered", "awaiting_approval"))
    crashed(sdk, first, "after_tool_response")
    assert the_action("oa-answered").status == "sent" and len(sdk.box.tasks()) == 1

    assert sdk.finish(sdk.launch("oa-answered")) == 0, sdk.log.read_text()

    assert_done_once(sdk, "oa-answered")
    asked = len(sdk.model_inputs())
    assert sdk.finish(sdk.launch("oa-answered")) == 0  # completed: answers from its record
    assert len(sdk.box.tasks()) == 1 and len(sdk.model_inputs()) == asked


def test_killed_while_waiting_for_the_approval(sdk: SdkAgent, reviewer_a: Persona) -> None:
    crashed(sdk, sdk.launch("oa-waiting", faults="awaiting_approval"), "awaiting_approval")
    assert the_action("oa-waiting").status == "awaiting_approval" and sdk.box.tasks() == []
    assert paused_state("oa-waiting")  # the RunState is in the Holdpoint run
    assert len(sdk.model_inputs()) == 1

    restarted = sdk.launch("oa-waiting")
    decide(reviewer_a, the_action("oa-waiting", "awaiting_approval"))
    assert sdk.finish(restarted) == 0, sdk.log.read_text()

    assert_done_once(sdk, "oa-waiting")
    assert len(sdk.model_inputs()) == 2  # resumed from the stored state: no first turn again


def test_killed_after_the_decision_before_the_call(sdk: SdkAgent, reviewer_a: Persona) -> None:
    first = sdk.launch("oa-decided", faults="after_decision")
    decide(reviewer_a, the_action("oa-decided", "awaiting_approval"))
    crashed(sdk, first, "after_decision")
    assert the_action("oa-decided").status == "approved" and sdk.box.tasks() == []

    assert sdk.finish(sdk.launch("oa-decided")) == 0, sdk.log.read_text()

    assert_done_once(sdk, "oa-decided")


# --- the reviewer's edits and rejection -----------------------------------------------------


def test_the_reviewers_edits_are_what_the_tool_sends(sdk: SdkAgent, reviewer_a: Persona) -> None:
    proc = sdk.launch("oa-edit")
    decide(reviewer_a, the_action("oa-edit", "awaiting_approval"), edits={"title": "Edited"})
    assert sdk.finish(proc) == 0, sdk.log.read_text()

    task = assert_done_once(sdk, "oa-edit")
    assert task["title"] == "Edited"  # the tracker got the edited params, the rest as asked
    assert task["body"] == {"title": "Edited", "body": "GET /orders: gone"}
    assert json.loads(sdk.tool_outputs_seen()[-1])["title"] == "Edited"


def test_a_rejection_reaches_the_model_with_the_reason(sdk: SdkAgent, reviewer_a: Persona) -> None:
    proc = sdk.launch("oa-reject")
    action = the_action("oa-reject", "awaiting_approval")
    decide(reviewer_a, action, "reject", "clients still use it")
    assert sdk.finish(proc) == 0, sdk.log.read_text()

    assert sdk.box.tasks() == [] and the_action("oa-reject").status == "cancelled"
    (seen,) = sdk.tool_outputs_seen()
    assert "rejected" in seen and "clients still use it" in seen
    assert "clients still use it" in sdk.log.read_text()  # the model's answer said it
    (run,) = Run.objects.filter(thread_id="oa-reject")
    assert run.status == RunStatus.COMPLETED
    assert verify_stream(run_stream(run.run_id)) is None


# --- two resumers, and the script's resumer -------------------------------------------------


def test_two_processes_resuming_one_thread_make_one_task(
    sdk: SdkAgent, reviewer_a: Persona
) -> None:
    crashed(sdk, sdk.launch("oa-race", faults="awaiting_approval"), "awaiting_approval")

    both = [sdk.launch("oa-race"), sdk.launch("oa-race")]
    decide(reviewer_a, the_action("oa-race", "awaiting_approval"))
    assert [sdk.finish(proc) for proc in both] == [0, 0], sdk.log.read_text()

    task = assert_done_once(sdk, "oa-race")
    assert answers(sdk) == [task, task]  # both processes give the one recorded answer
    assert Run.objects.filter(thread_id="oa-race").count() == 1


def test_wait_for_decision_long_polls_a_paused_thread(sdk: SdkAgent, reviewer_a: Persona) -> None:
    crashed(sdk, sdk.launch("oa-wait", faults="awaiting_approval"), "awaiting_approval")

    async def waits(timeout: float | None) -> list[str]:
        async with AsyncHoldpoint(sdk.url, sdk.token, backoff=0.01) as hp:
            return [a.status for a in await wait_for_decision(hp, "oa-wait", timeout=timeout)]

    with pytest.raises(ApprovalTimeout):
        asyncio.run(waits(0.5))
    decide(reviewer_a, the_action("oa-wait", "awaiting_approval"))
    assert asyncio.run(waits(30)) == ["approved"]

    assert sdk.finish(sdk.launch("oa-wait")) == 0, sdk.log.read_text()
    assert_done_once(sdk, "oa-wait")
