"""The api-review agent as an external executor: its own loop, Holdpoint as the record.

    python examples/external_agent.py --api http://127.0.0.1:8000 --token T \\
        --tasks-url http://127.0.0.1:8765 [--run RUN_ID]

Without --run it creates a run of the server's "api-review" graph (the run is the durable
record; the analysis runs here), prints `run <id>` and leases it. With --run it continues
that run from its latest checkpoint, after whatever killed the previous process.

Steps (each ends in a checkpoint that names the next):
  ext:read_specs   → load both OpenAPI documents        → ext:analyse
  ext:analyse      → find client-breaking changes        → ext:propose_task (or done)
  ext:propose_task → one review task in the task tracker → done (status completed)

The steps are named apart from the hosted graph's (`read_specs`, …) on purpose: the run
belongs to the server's "api-review" graph, so a Holdpoint worker may take it over once
this process's lease has expired. With these names the worker settles the `sent` action
and then parks the run (`needs_attention`: no such step) instead of running its own
`propose_task` on this agent's state and opening a second task.

The task is created through `Executor.act` with the tool `agent.tasks.create` (the
tracker, performed by this process: executor `client`), whose idempotency key is derived
from the run and the call label: a restarted process finds the action its predecessor
prepared. A `sent` action is settled as the server says (the tracker's dedup mode,
HOLDPOINT_TASKS_DEDUP): replayed with the same Idempotency-Key (`key`), looked up by key
(`lookup`), or handed to a person on the Reconcile page while this process waits (`none`).
`AGENT_CRASH_AFTER_TOOL_CALL=1` makes the process SIGKILL itself right after the tracker
answered and before the outcome is recorded — the window where a naive agent would create
the task twice.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

import httpx

from holdpoint_client import (
    ActionRejected,
    AlreadyCompleted,
    Client,
    Executor,
    ToolCall,
    ToolRefused,
)
from holdpoint_client.executor import Lookup, Perform
from runtime.agents.api_review.diff import find_risks, load_spec

# The server-side graph's default goal (runtime/agents/api_review/graph.py), copied: that
# module registers a graph and needs Django; this one needs only the client.
DEFAULT_GOAL: dict[str, Any] = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
# The tracker as a tool this process performs itself (executor `client`): Holdpoint records
# and reconciles it; `tasks.create` is the one Holdpoint sends itself, for hosted runs.
TOOL = "agent.tasks.create"
READ_SPECS, ANALYSE, PROPOSE_TASK, DONE = "ext:read_specs", "ext:analyse", "ext:propose_task", ""
log = logging.getLogger("external_agent")


def read_specs(ex: Executor, state: dict[str, Any], goal: dict[str, Any]) -> dict[str, Any]:
    """Check both documents load; the checkpoint records which ones were read."""
    names = [str(goal["old_spec"]), str(goal["new_spec"])]
    for name in names:
        load_spec(name)
    state = {**state, "specs": names}
    ex.checkpoint(state, ANALYSE)
    return state


def analyse(ex: Executor, state: dict[str, Any], goal: dict[str, Any]) -> dict[str, Any]:
    """Evidence per scope prefix (as the hosted graph keeps it), then the report."""
    old_name, new_name = str(goal["old_spec"]), str(goal["new_spec"])
    old, new = load_spec(old_name), load_spec(new_name)
    evidence = {
        f"{old_name}..{new_name}:{prefix}": find_risks(old, new, [prefix])
        for prefix in goal["scope"]
    }
    risks = [
        risk for prefix in goal["scope"] for risk in evidence[f"{old_name}..{new_name}:{prefix}"]
    ]
    report = {
        "old_spec": old_name,
        "new_spec": new_name,
        "scope": list(goal["scope"]),
        "risks": risks,
    }
    state = {**state, "evidence": evidence, "report": report}
    if goal.get("create_review_task") and risks:
        ex.checkpoint(state, PROPOSE_TASK)
    else:
        ex.checkpoint(state, DONE, status="completed")
    return state


def propose_task(ex: Executor, state: dict[str, Any], tasks_url: str) -> dict[str, Any]:
    """One review task in the tracker, exactly once, through the ledger (and its hold
    point, if the tenant's policy puts one on tasks.create)."""
    report = state["report"]
    lines = [f"- {r['method']} {r['path']}: {r['kind']} — {r['detail']}" for r in report["risks"]]
    params = {
        "title": f"Review {len(lines)} API compatibility risk(s): "
        f"{report['old_spec']} → {report['new_spec']}",
        "body": "\n".join(lines),
    }
    try:
        action = ex.act(
            TOOL,
            params,
            call="propose_task",
            perform=post_task(tasks_url),
            lookup=find_task(tasks_url),
            reason="The new API version breaks existing clients in these places.",
            target=str(report["new_spec"]),
        )
        outcome: dict[str, Any] = {"id": action.external_id, "action": action.action_id}
    except ActionRejected as rejected:
        outcome = {"rejected": rejected.reason}
    state = {**state, "review_task": outcome}
    ex.checkpoint(state, DONE, status="completed")
    return state


def post_task(tasks_url: str) -> Perform:
    """`perform` for tasks.create: POST the ledger's params with the ledger's key."""

    def perform(call: ToolCall) -> tuple[str, Any]:
        # The ledger's params in canonical form (sorted keys, no spaces), as stored.
        body = json.dumps(call.params, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        response = httpx.post(
            tasks_url.rstrip("/") + "/tasks",
            content=body.encode(),
            headers={**call.headers(), "Content-Type": "application/json"},
            timeout=5.0,
        )
        if response.status_code in (200, 201):
            task = response.json()
            if os.environ.get("AGENT_CRASH_AFTER_TOOL_CALL") == "1":
                # The task exists at the tracker; nothing about it is recorded yet.
                print(f"crashing after the tool call (task {task['id']})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return str(task["id"]), task
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            raise ToolRefused(f"HTTP {response.status_code}: {response.text[:300]}")
        response.raise_for_status()  # 5xx: we cannot know; the executor replays with the key
        raise RuntimeError(f"unexpected HTTP {response.status_code}")

    return perform


def find_task(tasks_url: str) -> Lookup:
    """`lookup` for agent.tasks.create: the tracker's task with the ledger's key, if any."""

    def lookup(call: ToolCall) -> tuple[str, Any] | None:
        response = httpx.get(
            tasks_url.rstrip("/") + "/tasks",
            params={"key": call.idempotency_key},
            headers=call.headers(),
            timeout=5.0,
        )
        response.raise_for_status()  # cannot tell: the executor reports unknown
        found = response.json()
        return (str(found[0]["id"]), found[0]) if found else None

    return lookup


def start_run(client: Client, goal: dict[str, Any]) -> str:
    run = client.create_run("api-review", goal, external=True)
    return run.run_id


def execute(ex: Executor, tasks_url: str) -> dict[str, Any]:
    """Continue from the latest checkpoint until the run is complete."""
    state = ex.load()
    goal = dict(ex.goal)
    # Before the first checkpoint the run names the hosted graph's start step: begin ours.
    step = ex.next_step if ex.rev else READ_SPECS
    while step != DONE:
        log.info("step %s (rev %d)", step, ex.rev)
        if step == READ_SPECS:
            state = read_specs(ex, state, goal)
        elif step == ANALYSE:
            state = analyse(ex, state, goal)
        elif step == PROPOSE_TASK:
            state = propose_task(ex, state, tasks_url)
        else:
            raise SystemExit(f"unknown step {step!r} in the run's checkpoint")
        step = ex.next_step
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", required=True, help="Holdpoint base URL")
    parser.add_argument("--token", required=True, help="an agent token")
    parser.add_argument("--tasks-url", required=True, help="the task tracker's base URL")
    parser.add_argument("--run", help="continue this run instead of creating one")
    parser.add_argument("--owner", default=f"external-agent@{socket.gethostname()}")
    parser.add_argument("--ttl", type=int, default=30, help="lease seconds")
    parser.add_argument("--goal", type=json.loads, default=None, help="goal JSON (new runs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    with Client(args.api, args.token) as client:
        run_id = args.run or start_run(client, args.goal or DEFAULT_GOAL)
        print(f"run {run_id}", flush=True)
        try:
            with Executor(client, run_id, args.owner, ttl=args.ttl) as ex:
                state = execute(ex, args.tasks_url)
        except AlreadyCompleted:
            print(f"run {run_id} is already completed", flush=True)
            return 0
        print(f"completed: {json.dumps(state.get('review_task'))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
