"""One approval-gated, ledgered, crash-safe side effect: 10 lines of agent code.

    HOLDPOINT_URL=http://127.0.0.1:8000 HOLDPOINT_TOKEN=<agent token> \\
        python examples/approval_agent.py --tasks-url http://127.0.0.1:8765 --thread review-42

Line count: the agent is the 10 non-blank lines between the `# --- agent code` markers
(the lookup: 3, the tool: 4, the run: 3), as `ruff format` lays them out; imports,
argument parsing and the `hp` construction above them are not counted. No step state
machine and no ids kept by the agent: the run is found again by the thread name, the
action by its place in the program; the lease is taken and heartbeated, the reviewer's
decision long-polled, the tracker called with the ledger's idempotency key (the
`call.headers()`) and the run completed on exit — all by `holdpoint_client`. A rejection
raises `Rejected` with the reviewer's reason (here: the traceback says it).

Run it again after any crash (kill -9 at any point): it continues the same run, waits for
the same approval, replays or looks up the same task, and never makes a second one.
`HOLDPOINT_CLIENT_FAULTS=awaiting_approval|after_decision|after_tool_response` (see
holdpoint_client/faults.py) kills it at a named point, for the crash tests.
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx

from holdpoint_client import Holdpoint, ToolCall

parser = argparse.ArgumentParser(description="an external agent with one approval-gated task")
parser.add_argument("--tasks-url", required=True, help="the task tracker (manage.py sandbox_tasks)")
parser.add_argument("--thread", required=True, help="a stable name: rerun with it to continue")
parser.add_argument("--ttl", type=int, default=30, help="lease seconds")
args = parser.parse_args()
TASKS, THREAD = args.tasks_url.rstrip("/") + "/tasks", args.thread
hp = Holdpoint.from_env(ttl=args.ttl)


# --- agent code: 10 lines -------------------------------------------------------------
def find_task(call: ToolCall) -> Any:
    found = httpx.get(TASKS, params={"key": call.idempotency_key}).json()
    return found[0] if found else None


@hp.action("agent.tasks.create", lookup=find_task, reason="The new API breaks clients.")
def create_task(title: str, body: str, *, call: ToolCall) -> Any:
    sent = httpx.post(TASKS, json={"title": title, "body": body}, headers=call.headers())
    return sent.raise_for_status().json()


with hp.run(THREAD, graph="api-review", goal={"review": THREAD}):
    task = create_task(title=f"Review the API change of {THREAD}", body="GET /orders: removed")
    print(f"task {task['id']}: {task['title']}", flush=True)
# --- end of agent code ----------------------------------------------------------------
