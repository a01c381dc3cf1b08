"""One error hierarchy for the domain.

Every refusal has a stable machine `code` (API.md fixes them) and the HTTP status the API
answers with; the API layer renders them once as problem+json. `transient` tells a worker
whether trying again later may succeed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any


class HoldpointError(Exception):
    code = "error"
    status = 400
    title = "Request refused"
    transient = False
    retry_after: int | None = None  # seconds: answered as a Retry-After header

    def __init__(self, detail: str = "", **extra: Any) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.extra = extra


class NotFound(HoldpointError):
    code = "not_found"
    status = 404
    title = "Not found"


class NotPermitted(HoldpointError):
    code = "not_permitted"
    status = 403
    title = "Not permitted"


class Conflict(HoldpointError):
    status = 409
    title = "Conflict"


class StaleFence(Conflict):
    """The caller's lease was taken over: it must stop executing at once."""

    code = "stale_fence"
    title = "Stale fencing token"


class LeaseHeld(Conflict):
    code = "lease_held"
    title = "Lease held by another executor"


class NotExternal(Conflict):
    """The executor protocol on a run Holdpoint's workers execute (issue 16 H1): an API
    client may not lease a hosted run, nor write to it under a fence it read."""

    code = "not_external"
    title = "The run is executed by Holdpoint, not by an external executor"


class VersionConflict(Conflict):
    code = "version_conflict"
    title = "The object moved since the caller last saw it"


class RunFinished(Conflict):
    code = "run_finished"
    title = "The run has finished"


class AlreadyCompleted(Conflict):
    code = "already_completed"
    title = "The run is already completed"


class NotWaitingInput(Conflict):
    code = "not_waiting_input"
    title = "The run is not waiting for input"


class InvalidTransition(Conflict):
    code = "invalid_transition"
    title = "Transition not allowed from the current status"


class StaleGoalRev(Conflict):
    code = "stale_goal_rev"
    title = "Prepared under an older goal revision"


class UnknownGraph(HoldpointError):
    code = "unknown_graph"
    status = 422
    title = "Unknown graph"


class InvalidParams(HoldpointError):
    code = "invalid_params"
    status = 422
    title = "Invalid parameters"


class IncompatibleVersion(HoldpointError):
    """A run's pinned graph version is gone and no migration leads to a registered one."""

    code = "incompatible_version"
    status = 409
    title = "Incompatible graph version"


class StepFailed(HoldpointError):
    """A step raised; the run retries with backoff until its failure threshold."""

    code = "step_failed"
    status = 500
    transient = True


class ActionCancelled(Conflict):
    code = "action_cancelled"
    title = "The action was cancelled"


class Unwritten(Exception):  # noqa: N818 (what happened, not an error: the commit is undone)
    """Raised inside a commit by the write it carries (`within`) when that write no longer
    holds — the tool an action was about to be prepared with was redefined: the commit rolls
    back whole, and the executor keeps what else it meant to write with it (a confirmation
    deferred from an earlier action) for its next commit. Not an API error."""


class ToolChanged(Conflict):
    """The tool was redefined after the action was prepared, and its version in force
    refuses the action's params: the action is cancelled, nothing was sent."""

    code = "tool_changed"
    title = "The tool changed and refuses the action"


class ToolUnavailable(HoldpointError):
    """Certainly not applied this time (connection refused, circuit open): retry later."""

    code = "tool_unavailable"
    status = 503
    transient = True


class ToolWithheld(ToolUnavailable):
    """Not sent, and not marked sent: the tool's MCP server is inactive now
    (runtime.toolcatalog.withheld). The action keeps its status — an approval given for it
    still binds — and is sent once the server is active again. The same code and status as
    any tool that cannot be reached now (API.md has no word for "switched off", and the
    caller's answer is the same: nothing was applied, try again later)."""

    def __init__(self, detail: str = "", *, server: str = "", **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.server = server


class ApprovalRequired(Conflict):
    code = "approval_required"
    title = "A valid approval of this exact action is required"


class ApprovalExpired(Conflict):
    code = "approval_expired"
    title = "The approval expired before the action was sent"


class HashMismatch(Conflict):
    code = "hash_mismatch"
    title = "The action changed since it was shown"


class AlreadyDecided(Conflict):
    code = "already_decided"
    title = "The request was already decided"


class Expired(Conflict):
    code = "expired"
    title = "The request expired"


class FieldNotEditable(HoldpointError):
    code = "field_not_editable"
    status = 422
    title = "This field may not be edited"


class TooManyStreams(HoldpointError):
    """The caller has as many live event streams open in this process as it may
    (HOLDPOINT_STREAMS_PER_TOKEN): a new one may open once one of them ends."""

    code = "throttled"
    status = 429
    title = "Too many requests"
    transient = True

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class Park(Exception):
    """Stop executing this run for now; the executor turns it into a run status. Not an
    error: control flow, which the traces record as why a span stopped (runtime.tracing)."""

    def __init__(
        self,
        status: str,
        reason: str,
        *,
        until: datetime | None = None,
        action: Any = None,  # the Action it waits on (typed loosely: models import this)
    ) -> None:
        super().__init__(reason)
        self.status, self.reason, self.until, self.action = status, reason, until, action
