"""examples/external_agent.py, killed in the worst window and restarted, over real sockets.

The agent is its own process (own session, like tests/procs.py starts workers); the API is
served by `live_server`, the task tracker is the real sandbox service in each dedup mode
(`key`, `lookup`, `none`; HOLDPOINT_TASKS_DEDUP follows it). The first process SIGKILLs
itself right after the tracker created the task and before the outcome reached Holdpoint;
its lease is left to expire and the sweeper flags the run `executor_lost`; the restarted
one must finish the run without a second task and without a false completion — in mode
`none` only after a person resolved the action (issue 15.3).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.executor import advance_run
from runtime.models import Action, Run, RunStatus
from runtime.sweeper import sweep_once
from tests import procs
from tests.api import ok, post, session
from tests.conftest import Persona
from tests.runtime.helpers import expire_lease
from tests.sandbox import Sandbox

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
EXAMPLE = procs.ROOT / "examples" / "external_agent.py"


def start_agent(args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    """The example as a separate process, in its own session so a kill stays contained."""
    child_env = {k: v for k, v in os.environ.items() if k != "AGENT_CRASH_AFTER_TOOL_CALL"}
    child_env.update(PYTHONUNBUFFERED="1", **env)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            cwd=procs.ROOT,
            env=child_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agent did not finish within {timeout}s:\n{log.read_text()}")
    finally:
        procs.kill(proc)


@pytest.fixture(params=["key", "lookup", "none"])
def agent(
    request: pytest.FixtureRequest,
    live_server: Any,
    agent_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    tmp_path: Path,
) -> tuple[list[str], Sandbox, Path]:
    """Command-line arguments for the example, the sandbox behind it (in each mode), and its
    log file."""
    box = sandbox_factory(request.param)
    assert agent_a.token is not None
    args = ["--api", live_server.url, "--token", agent_a.token, "--tasks-url", box.url]
    return [*args, "--ttl", "3", "--owner", "external-agent"], box, tmp_path / "agent.log"


def crash_after_the_tool_call(args: list[str], box: Sandbox, log: Path) -> tuple[str, Any]:
    """Run the example until it kills itself; the task exists, the action is only `sent`."""
    crashed = finish(start_agent(args, log, AGENT_CRASH_AFTER_TOOL_CALL="1"), log)
    output = log.read_text()
    assert crashed == -signal.SIGKILL, output
    found = re.search(r"^run ([0-9a-f-]{36})$", output, re.MULTILINE)
    assert found is not None, output
    run_id = found.group(1)
    action = Action.objects.get(run_id=run_id)
    assert action.status == "sent"  # the tool answered; Holdpoint never heard of it
    (task,) = box.tasks()
    assert task["idempotency_key"] == action.idempotency_key
    return run_id, task


def test_killed_after_the_tool_call_then_restarted_makes_exactly_one_task(
    agent: tuple[list[str], Sandbox, Path], reviewer_a: Persona, settings: Any
) -> None:
    settings.HOLDPOINT_EXECUTOR_GRACE = 2
    args, box, log = agent
    run_id, task = crash_after_the_tool_call(args, box, log)
    expire_lease(run_id)  # nobody renews it: TTL + grace pass (the data moves, not the clock)

    sweep_once(ring=lambda run_id: None)

    lost = Run.objects.get(pk=run_id)
    assert (lost.status, lost.attention_reason) == (RunStatus.NEEDS_ATTENTION, "executor_lost")
    restarted = start_agent([*args, "--run", run_id], log)
    if box.mode == "none":
        # Nothing can prove the task exists but a person: the new lease hands the action to
        # one, and the agent waits — it never calls the tracker again, nor completes.
        action = procs.wait_for(
            lambda: Action.objects.filter(run_id=run_id, status="manual_review").first(),
            timeout=60,
        )
        assert Run.objects.get(pk=run_id).status == RunStatus.NEEDS_RECONCILIATION
        assert restarted.poll() is None and box.tasks() == [task]
        resolution = {"outcome": "applied", "external_id": task["id"], "note": "seen it"}
        ok(post(session(reviewer_a.user), f"actions/{action.action_id}/resolve/", resolution))

    assert finish(restarted, log) == 0, log.read_text()
    assert box.tasks() == [task]  # exactly one task, in every mode
    action = Action.objects.get(run_id=run_id)
    assert (action.status, action.external_id) == ("confirmed", task["id"])
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.COMPLETED and run.lease_owner == ""
    final = run.checkpoints.get(rev=run.checkpoint_rev)
    assert final.status == RunStatus.COMPLETED

    again = finish(start_agent([*args, "--run", run_id], log), log)

    assert again == 0 and "already completed" in log.read_text()
    assert len(box.tasks()) == 1


@pytest.mark.parametrize("agent", ["key"], indirect=True)
def test_a_worker_taking_the_run_over_meanwhile_adds_no_task(
    agent: tuple[list[str], Sandbox, Path],
) -> None:
    """The agent's run is external: once the dead agent's lease expires, no Holdpoint worker
    takes it (it would run the hosted graph and could add a task); the restarted agent
    settles its own `sent` action by replaying its key and finishes the run."""
    args, box, log = agent
    run_id, task = crash_after_the_tool_call(args, box, log)
    expire_lease(run_id)

    assert advance_run(run_id, "worker-1").outcome == "skipped"
    assert Action.objects.get(run_id=run_id).status == "sent"

    assert finish(start_agent([*args, "--run", run_id], log), log) == 0, log.read_text()
    assert box.tasks() == [task]
    assert Run.objects.get(pk=run_id).status == RunStatus.COMPLETED
    assert Action.objects.get(run_id=run_id).external_id == task["id"]
