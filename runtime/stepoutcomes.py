"""What the end of a step makes of its run: the row's status, next step and `waiting_for`.

A step returns an outcome (`Next`, `Wait`, `Complete`, `Fail`: runtime.graphs) or parks
(`Park`: an approval, a reconciliation); the executor commits what that means for the run,
and tells its worker a word for where the run was left (`AdvanceResult.outcome`). These
translations stand apart from runtime.executor because they need nothing of it — no lease,
no connection, no state of a run in progress: they are the run's state machine as a step
drives it, to be read in one place, while the executor keeps the how (fenced commits, their
overlap, the loop). (Not runtime.outcomes: that one records what came of an *action*.)
"""

from __future__ import annotations

from typing import Any

from runtime.errors import Park
from runtime.graphs import Complete, Fail, Next, Outcome
from runtime.models import RunStatus
from runtime.models.limits import NOTE_MAX


def outcome_changes(outcome: Outcome) -> tuple[str, str, dict[str, Any]]:
    """The run's status and next step after a step returned `outcome`, and the other columns
    its commit sets (`waiting_for` and `wake_at` are cleared unless the outcome waits)."""
    changes: dict[str, Any] = {"waiting_for": None, "wake_at": None}
    if isinstance(outcome, Next):
        status, next_step = RunStatus.RUNNING, outcome.step
    elif isinstance(outcome, Complete):
        status, next_step = RunStatus.COMPLETED, ""
    elif isinstance(outcome, Fail):
        status, next_step = RunStatus.FAILED, ""
        changes["last_error"] = outcome.reason[:NOTE_MAX]
    else:
        status, next_step = WAIT_STATUS[outcome.kind], outcome.then
        changes["waiting_for"] = {
            "kind": outcome.kind,
            "prompt": outcome.prompt,
            **outcome.detail,
        }
        if outcome.until is not None:
            changes["wake_at"] = outcome.until
            changes["waiting_for"]["until"] = outcome.until.isoformat()
    return status, next_step, changes


def park_changes(parked: Park) -> dict[str, Any]:
    """The columns a park sets besides its status: what the run waits for, and until when."""
    waiting: dict[str, Any] = {"kind": PARK_KIND[parked.status], "prompt": parked.reason}
    if parked.action is not None:
        waiting.update(action_id=str(parked.action.action_id), tool=parked.action.tool)
    changes: dict[str, Any] = {"waiting_for": waiting, "wake_at": parked.until}
    if parked.until is not None:
        waiting["until"] = parked.until.isoformat()
    return changes


WAIT_STATUS = {
    "input": RunStatus.WAITING_INPUT,
    "approval": RunStatus.WAITING_APPROVAL,
    "timer": RunStatus.QUEUED,
}
# The worker's word for a run left in each status (`AdvanceResult.outcome`).
ADVANCE_OUTCOME: dict[str, str] = {  # keyed by RunStatus; `run.status` is its str value
    RunStatus.COMPLETED: "completed",
    RunStatus.FAILED: "failed",
    RunStatus.WAITING_INPUT: "waiting",
    RunStatus.WAITING_APPROVAL: "waiting",
    RunStatus.QUEUED: "waiting",
    RunStatus.RETRYING: "retrying",
    RunStatus.NEEDS_ATTENTION: "needs_attention",
    RunStatus.CANCELLED: "stopped",
    RunStatus.RUNNING: "yielded",
    RunStatus.NEEDS_RECONCILIATION: "waiting",
}
PARK_KIND: dict[str, str] = {
    RunStatus.WAITING_APPROVAL: "approval",
    RunStatus.NEEDS_RECONCILIATION: "reconciliation",
    RunStatus.RETRYING: "reconciliation",
}
