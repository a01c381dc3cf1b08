"""Run journal event types, and rebuilding a run's status from its journal.

Every event that changes a run's status carries the new status in its payload, so the
journal alone tells where each run is (event sourcing); a test compares the rebuild with
the stored status for every run the suite creates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import models

from audit import journal
from audit.models import JournalEntry


class RunEvent(models.TextChoices):
    CREATED = "run_created"
    LEASE_TAKEN = "lease_taken"
    LEASE_RELEASED = "lease_released"
    STALE_WRITE_REFUSED = "stale_write_refused"
    STEP_COMMITTED = "step_committed"
    CALL_RECORDED = "call_recorded"
    INPUT_RECEIVED = "input_received"
    STEP_FAILED = "step_failed"
    ESCALATED = "escalated"
    RESUMED = "resumed"
    WOKEN = "woken"
    GOAL_REVISED = "goal_revised"
    REVISION_APPLIED = "revision_applied"
    LATE_RESULT_IGNORED = "late_result_ignored"
    MIGRATED = "migrated"
    INCOMPATIBLE = "incompatible_version"
    CANCELLED = "cancelled"
    ACTION_PREPARED = "action_prepared"
    ACTION_CANCELLED = "action_cancelled"
    ACTION_OUTCOME = "action_outcome"
    ACTION_RESOLVED = "action_resolved"
    ACTION_CHECKPOINT = "action_checkpoint"
    ACTION_EDITED = "action_edited"
    ACTION_TOOL_CHANGED = "action_tool_changed"
    # A standalone action's send met a tool it could not reach: still unsent (note_unsent).
    ACTION_SEND_FAILED = "action_send_failed"
    APPROVAL_REQUESTED = "approval_requested"
    APPROVAL_DECIDED = "approval_decided"
    APPROVAL_CLOSED = "approval_closed"
    PARKED = "parked"
    RECONCILE_SCHEDULED = "reconcile_scheduled"
    NEEDS_RECONCILIATION = "needs_reconciliation"
    EXECUTOR_NAMED = "executor_named"
    # An action's outcome was handed to the client that asked for it (the MCP gateway): the
    # next identical call of the session is a new call (gateway/calls.py, "the same call").
    RESULT_DELIVERED = "result_delivered"


def record(
    run: Any, type: RunEvent, actor: str, *, head: journal.Head | None = None, **payload: Any
) -> JournalEntry:
    """Append to the run's stream inside the caller's transaction.

    `head`: the stream head the caller (an executor holding the lease) already knows, which
    saves reading and locking it; a wrong one raises StreamMoved and the caller retries.
    """
    stream = journal.run_stream(run.run_id)
    return journal.append(
        stream,
        type.value,
        tenant_id=run.tenant_id,
        actor=actor,
        object_ref=stream,  # the run: "run:<id>", its stream's name
        payload=payload,
        expected_head=head,
    )


def status_from(entries: Iterable[JournalEntry]) -> str | None:
    status = None
    for entry in entries:
        status = entry.payload.get("status", status)
    return status


def rebuild_status(run_id: Any) -> str | None:
    entries = JournalEntry.objects.filter(stream=journal.run_stream(run_id)).order_by("seq")
    return status_from(entries.only("payload"))
