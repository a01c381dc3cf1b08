"""Exceptions of the Holdpoint client, built from the API's stable problem `code`.

The server answers every refusal as application/problem+json with a machine `code` (API.md,
"Conventions"). Callers branch on classes, not on strings: `except StaleFence` means "stop,
another executor owns the run", `except VersionConflict` means "re-read and decide again".
Each class names its code and HTTP status; a code this client does not know yet still gets
the class of its status family, so a newer server never turns a refusal into a crash.
"""

from __future__ import annotations

from typing import Any

import httpx


class HoldpointError(Exception):
    """Base of everything this package raises on purpose."""


# --- transport ------------------------------------------------------------------------


class TransportError(HoldpointError):
    """No usable HTTP answer arrived after the retries this call allows.

    `may_have_applied` is True when the request may have reached the server (a read timeout,
    a reset after sending): for a call that is not idempotent the caller must re-read the
    object before deciding anything, never simply repeat the call.
    """

    def __init__(self, message: str, *, may_have_applied: bool) -> None:
        super().__init__(message)
        self.may_have_applied = may_have_applied


# --- answers from the API ---------------------------------------------------------------


class HoldpointAPIError(HoldpointError):
    """A problem+json answer (RFC 9457). `errors` holds field errors, `body` everything."""

    code = "error"
    status = 400

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        errors: dict[str, list[str]] | None = None,
        *,
        title: str = "",
        body: dict[str, Any] | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.errors = errors or {}
        self.title = title
        self.body = body or {}
        self.response = response

    @property
    def said_by_holdpoint(self) -> bool:
        """Whether Holdpoint's API gave this answer (its problem+json names a `code`), not
        a gateway or server in front of it (a proxy's HTML 502, a load balancer's 504)."""
        return bool(self.body.get("code"))

    @property
    def request_id(self) -> str | None:
        """The id the server logged a 500 under: quote it when reporting the failure."""
        value = self.body.get("request_id")
        return str(value) if value is not None else None


class BadRequest(HoldpointAPIError):
    code = "invalid_request"
    status = 400


class MalformedRequest(BadRequest):
    code = "malformed_request"


class NotAuthenticated(HoldpointAPIError):
    code = "not_authenticated"
    status = 401


class NotPermitted(HoldpointAPIError):
    code = "not_permitted"
    status = 403


class NotFound(HoldpointAPIError):
    """Missing — or another tenant's: the API never tells the two apart."""

    code = "not_found"
    status = 404


class MethodNotAllowed(HoldpointAPIError):
    code = "method_not_allowed"
    status = 405


class NotAcceptable(HoldpointAPIError):
    code = "not_acceptable"
    status = 406


class PayloadTooLarge(HoldpointAPIError):
    code = "payload_too_large"
    status = 413


class UnsupportedMediaType(HoldpointAPIError):
    code = "unsupported_media_type"
    status = 415


class Conflict(HoldpointAPIError):
    """409: the server's state refuses the call. An answer, not a failure to retry."""

    code = "conflict"
    status = 409


class VersionConflict(Conflict):
    """The object moved since the caller read it (compare-and-swap lost)."""

    code = "version_conflict"


class RunFinished(Conflict):
    code = "run_finished"


class AlreadyCompleted(RunFinished):
    """Resuming (or leasing) a completed run: there is nothing left to execute."""

    code = "already_completed"


class NotWaitingInput(Conflict):
    code = "not_waiting_input"


class LeaseHeld(Conflict):
    """Another executor holds a live lease on the run."""

    code = "lease_held"


class NotExternal(Conflict):
    """The run is executed by Holdpoint's workers: the executor protocol does not apply to it
    (lease a run created with `external=True`)."""

    code = "not_external"


class StaleFence(Conflict):
    """This executor's lease was taken over: it must stop writing at once."""

    code = "stale_fence"


class ApprovalRequired(Conflict):
    """No approval binds this exact action (yet, or any more)."""

    code = "approval_required"


class ApprovalExpired(Conflict):
    code = "approval_expired"


class StaleGoalRev(Conflict):
    """The action was prepared under an older goal revision and will never be sent."""

    code = "stale_goal_rev"


class ActionCancelled(Conflict):
    code = "action_cancelled"


class InvalidTransition(Conflict):
    code = "invalid_transition"


class HashMismatch(Conflict):
    """The decision was made on an older version of the action."""

    code = "hash_mismatch"


class AlreadyDecided(Conflict):
    code = "already_decided"


class Expired(Conflict):
    """The approval request expired before the decision arrived."""

    code = "expired"


class IdempotencyKeyInFlight(Conflict):
    """The first request with this Idempotency-Key is still running: the one 409 to retry."""

    code = "idempotency_key_in_flight"


class IncompatibleVersion(Conflict):
    """The run's pinned graph version is gone and no migration leads on."""

    code = "incompatible_version"


class ActionRefusedByServer(Conflict):
    """The server reports the action failed (the hosted executor's refusal)."""

    code = "action_failed"


class ActionRejectedByReviewer(ActionRefusedByServer):
    code = "action_rejected"


class Unprocessable(HoldpointAPIError):
    """422: the request is well-formed but refers to or carries something invalid."""

    code = "unprocessable"
    status = 422


class UnknownGraph(Unprocessable):
    code = "unknown_graph"


class InvalidParams(Unprocessable):
    code = "invalid_params"


class IdempotencyKeyReused(Unprocessable):
    """The same key was sent with a different request: a bug in the caller, never retried."""

    code = "idempotency_key_reused"


class FieldNotEditable(Unprocessable):
    code = "field_not_editable"


class ToolNotAllowed(Unprocessable):
    code = "tool_not_allowed"


class InvalidTool(Unprocessable):
    """A tool definition was refused; `errors` names every field that is wrong."""

    code = "invalid_tool"


class HostNotAllowed(Unprocessable):
    """A tool definition would send requests to a host the server does not allow."""

    code = "host_not_allowed"


class ToolExists(Conflict):
    """`POST tools/` for a name the tenant already defined (a change is a new version)."""

    code = "tool_exists"


class ToolChanged(Conflict):
    """The tool was redefined after the action was prepared and its version in force
    refuses the params: the action was cancelled, nothing was sent."""

    code = "tool_changed"


class Throttled(HoldpointAPIError):
    code = "throttled"
    status = 429


class ServerError(HoldpointAPIError):
    code = "server_error"
    status = 500


class ServiceUnavailable(ServerError):
    code = "service_unavailable"
    status = 503


class ToolUnavailable(ServiceUnavailable):
    code = "tool_unavailable"


# --- the executor's own outcomes --------------------------------------------------------


class ExecutorError(HoldpointError):
    """Raised by `Executor` when an action cannot go on; the ledger keeps the whole story."""

    def __init__(self, message: str, *, action: Any = None) -> None:
        super().__init__(message)
        self.action = action


class LeaseLost(ExecutorError):
    """The lease moved to another executor (stale fence): this process must stop."""


class ActionRejected(ExecutorError):
    """A reviewer rejected the action at its hold point; `reason` says why."""

    def __init__(self, message: str, *, action: Any = None, reason: str = "") -> None:
        super().__init__(message, action=action)
        self.reason = reason


class Rejected(ActionRejected):
    """What `run.act` and `@hp.action` raise on a rejection: `reason` is the reviewer's."""


class ApprovalTimeout(ExecutorError):
    """No decision within `approval_timeout`. Nothing is lost: the action stays awaiting
    approval, and running the agent again goes on waiting for the same request."""


class ActionWithdrawn(ExecutorError):
    """The action was cancelled without a rejection: goal revised, run cancelled, expired."""


class ActionFailed(ExecutorError):
    """The tool refused the action; it certainly did not apply. `reason` is the refusal as
    the ledger holds it: the server's `last_error` (a tool Holdpoint sends), else what the
    agent's `perform` reported (its ToolRefused's words)."""

    def __init__(self, message: str, *, action: Any = None, reason: str = "") -> None:
        super().__init__(message, action=action)
        self.reason = reason


class OutcomeUnknown(ExecutorError):
    """The ledger does not hold the action's outcome: do not do it again yourself.

    Either nobody can tell whether the effect happened (a person resolves it, API
    `resolve`), or the client saw what came of it and could not record it (the server
    unreachable, or answering 5xx — its own 500/503 too, which do not say whether the
    outcome landed): `unrecorded` names what it saw (`confirmed`: it happened; `failed`,
    `unknown`, `not_found`). Running the agent again settles it from the ledger — the
    action is found still `sent` and reconciled as the tool's contract says."""

    def __init__(self, message: str, *, action: Any = None, unrecorded: str | None = None) -> None:
        super().__init__(message, action=action)
        self.unrecorded = unrecorded


class ToolRefused(HoldpointError):
    """Raised by an agent's `perform` when the service refused: certainly not applied."""


_CLASSES: tuple[type[HoldpointAPIError], ...] = (
    BadRequest,
    MalformedRequest,
    NotAuthenticated,
    NotPermitted,
    NotFound,
    MethodNotAllowed,
    NotAcceptable,
    PayloadTooLarge,
    UnsupportedMediaType,
    VersionConflict,
    RunFinished,
    AlreadyCompleted,
    NotWaitingInput,
    LeaseHeld,
    NotExternal,
    StaleFence,
    ApprovalRequired,
    ApprovalExpired,
    StaleGoalRev,
    ActionCancelled,
    InvalidTransition,
    HashMismatch,
    AlreadyDecided,
    Expired,
    IdempotencyKeyInFlight,
    IncompatibleVersion,
    ActionRefusedByServer,
    ActionRejectedByReviewer,
    UnknownGraph,
    ToolNotAllowed,
    InvalidTool,
    HostNotAllowed,
    ToolExists,
    ToolChanged,
    InvalidParams,
    IdempotencyKeyReused,
    FieldNotEditable,
    Throttled,
    ServerError,
    ServiceUnavailable,
    ToolUnavailable,
)
CODE_CLASSES: dict[str, type[HoldpointAPIError]] = {cls.code: cls for cls in _CLASSES}
_FAMILIES: dict[int, type[HoldpointAPIError]] = {
    400: BadRequest,
    401: NotAuthenticated,
    403: NotPermitted,
    404: NotFound,
    405: MethodNotAllowed,
    406: NotAcceptable,
    409: Conflict,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    422: Unprocessable,
    429: Throttled,
}


def class_for(status: int, code: str) -> type[HoldpointAPIError]:
    """The class for a code; an unknown code falls back to its status family."""
    if code in CODE_CLASSES:
        return CODE_CLASSES[code]
    if status == 503:  # a proxy's 503 too: the request never reached the application
        return ServiceUnavailable
    if status >= 500:
        return ServerError
    return _FAMILIES.get(status, HoldpointAPIError)


def error_from_response(response: httpx.Response) -> HoldpointAPIError:
    """Build the exception for a non-2xx answer, problem+json or not (a proxy's HTML 502)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"detail": response.text[:500] or response.reason_phrase}
    code = str(body.get("code") or "")
    detail = str(body.get("detail") or body.get("title") or response.reason_phrase)
    errors = body.get("errors")
    cls = class_for(response.status_code, code)
    return cls(
        response.status_code,
        code or cls.code,
        detail,
        errors if isinstance(errors, dict) else None,
        title=str(body.get("title") or ""),
        body=body,
        response=response,
    )
