"""One error format for the API: application/problem+json (RFC 9457) with a stable `code`.

Every failure goes through `exception_handler` — domain refusals (HoldpointError), DRF's own
(parse errors, auth, throttling, 404, 405), Django's (an oversized body) and unexpected ones
(500 with a request id, no stack trace) — so a client handles one shape.
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Any

from django.core.exceptions import PermissionDenied, RequestDataTooBig
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from rest_framework import exceptions as drf
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler

from runtime.api.parsers import MalformedBody
from runtime.errors import HoldpointError

log = logging.getLogger("holdpoint.api")
request_log = logging.getLogger("django.request")  # where Django logs refused requests
TYPE_BASE = "https://holdpoint.dev/problems/"
CONTENT_TYPE = "application/problem+json"

# DRF exception classes → stable codes.
DRF_CODES: dict[type[Exception], str] = {
    drf.ParseError: "malformed_request",
    drf.AuthenticationFailed: "not_authenticated",
    drf.NotAuthenticated: "not_authenticated",
    drf.PermissionDenied: "not_permitted",
    drf.NotFound: "not_found",
    drf.MethodNotAllowed: "method_not_allowed",
    drf.NotAcceptable: "not_acceptable",
    drf.UnsupportedMediaType: "unsupported_media_type",
    drf.Throttled: "throttled",
    drf.ValidationError: "invalid_request",
}
# Every code the API can answer with, for the OpenAPI document.
CODES = {
    "malformed_request": 400,
    "invalid_request": 400,
    "not_authenticated": 401,
    "not_permitted": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "not_acceptable": 406,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "throttled": 429,
    "server_error": 500,
    "unknown_graph": 422,
    "invalid_params": 422,
    "idempotency_key_reused": 422,
    "field_not_editable": 422,
    "version_conflict": 409,
    "run_finished": 409,
    "already_completed": 409,
    "not_waiting_input": 409,
    "lease_held": 409,
    "not_external": 409,
    "stale_fence": 409,
    "approval_required": 409,
    "approval_expired": 409,
    "stale_goal_rev": 409,
    "action_cancelled": 409,
    "invalid_transition": 409,
    "hash_mismatch": 409,
    "already_decided": 409,
    "expired": 409,
    "idempotency_key_in_flight": 409,
    "service_unavailable": 503,
    "incompatible_version": 409,
    "action_failed": 409,
    "action_rejected": 409,
    "tool_unavailable": 503,
    "tool_not_allowed": 422,
    "tool_changed": 409,
    "invalid_tool": 422,
    "host_not_allowed": 422,
    "tool_exists": 409,
}


def problem(
    status: int,
    code: str,
    title: str,
    detail: str = "",
    errors: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": TYPE_BASE + code,
        "title": title,
        "status": status,
        "detail": detail or title,
        "code": code,
    }
    if errors:
        body["errors"] = errors
    body.update(extra)
    return body


def _field_errors(detail: Any) -> dict[str, list[str]]:
    if isinstance(detail, dict):
        return {
            str(k): [str(m) for m in (v if isinstance(v, list) else [v])] for k, v in detail.items()
        }
    return {
        "non_field_errors": [str(m) for m in (detail if isinstance(detail, list) else [detail])]
    }


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    headers: dict[str, str] = {}
    if isinstance(exc, HoldpointError):
        body = problem(exc.status, exc.code, exc.title, exc.detail, errors=exc.extra.get("errors"))
        if exc.retry_after is not None:
            headers["Retry-After"] = str(exc.retry_after)
    elif isinstance(exc, Http404):
        body = problem(404, "not_found", "Not found")
    elif isinstance(exc, PermissionDenied):
        body = problem(403, "not_permitted", "Not permitted")
    elif isinstance(exc, RequestDataTooBig):
        body = problem(413, "payload_too_large", "Request body too large")
    elif isinstance(exc, drf.APIException):
        code = next((c for cls, c in DRF_CODES.items() if isinstance(exc, cls)), "error")
        errors = _field_errors(exc.detail) if isinstance(exc, drf.ValidationError) else None
        detail = "" if errors else str(exc.detail)
        if isinstance(exc, MalformedBody):  # where in the body, as well as what
            errors = exc.errors
        body = problem(exc.status_code, code, _title(exc), detail, errors=errors)
        # DRF sets `Throttled.wait` in __init__; its stubs leave the attribute out.
        wait: float | None = getattr(exc, "wait", None)
        if isinstance(exc, drf.Throttled) and wait is not None:
            headers["Retry-After"] = str(int(wait) + 1)
        response = drf_handler(exc, context)
        if response is not None:
            headers.update(
                {k: v for k, v in response.items() if k in ("WWW-Authenticate", "Allow")}
            )
    elif isinstance(exc, DATABASE_LOST):
        body = database_lost(exc)
        headers["Retry-After"] = RETRY_AFTER
    else:
        request_id = uuid.uuid4().hex
        log.exception("unhandled API error %s", request_id)
        body = problem(
            500,
            "server_error",
            "Internal error",
            SERVER_FAULT + " Quote the request id when reporting it.",
            request_id=request_id,
        )
    request = context.get("request")
    if request is not None:
        # Problems are JSON whatever the view renders (the schema view renders YAML).
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = CONTENT_TYPE
    return Response(body, status=body["status"], headers=headers, content_type=CONTENT_TYPE)


def _title(exc: drf.APIException) -> str:
    return {
        drf.ParseError: "Malformed request body",
        drf.NotAuthenticated: "Authentication required",
        drf.AuthenticationFailed: "Authentication failed",
        drf.Throttled: "Too many requests",
        drf.ValidationError: "Invalid request",
        drf.NotFound: "Not found",
        drf.MethodNotAllowed: "Method not allowed",
    }.get(type(exc), exc.default_detail if isinstance(exc.default_detail, str) else "Error")


def problem_response(
    request: HttpRequest, status: int, code: str, title: str, detail: str = ""
) -> JsonResponse:
    """For errors raised outside DRF views (404/500 handlers under /api/)."""
    return JsonResponse(
        problem(status, code, title, detail), status=status, content_type=CONTENT_TYPE
    )


def _is_api(request: HttpRequest) -> bool:
    return request.path.startswith("/api/")


def not_found(request: HttpRequest, exception: Exception | None = None) -> Any:
    """API paths answer in the problem format; pages get templates/404.html (the site's
    layout and where to go next)."""
    if _is_api(request):
        return problem_response(request, 404, "not_found", "Not found")
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A refusal outside DRF (a viewer posting a page's form): problem+json under /api/,
    templates/403.html for pages.

    A 403 is an ordinary answer, not a fault: it is logged as one warning line with the
    reason, and Django's own log line — which carries the exception's traceback — is
    skipped (it logs a response only once, and this one is marked as logged).
    """
    response: HttpResponse
    if _is_api(request):
        response = problem_response(request, 403, "not_permitted", "Not permitted")
    else:
        from django.views.defaults import permission_denied as page_denied

        response = page_denied(request, exception)
    user = getattr(request, "user", None)
    who = user.get_username() if user is not None and user.is_authenticated else "anonymous"
    request_log.warning(
        "Forbidden: %s %s by %s: %s",
        request.method,
        request.path,
        who,
        exception or "permission denied",
        extra={"status_code": 403, "request": request},
    )
    # django.utils.log.log_response's own marker, which django-stubs do not declare.
    response._has_been_logged = True  # type: ignore[union-attr]
    return response


# A request is not one transaction (no ATOMIC_REQUESTS: the ledger commits `sent` before a
# tool call, for one), so a fault can come after part of it was committed: the answer must
# not promise that nothing was applied. Reading back first is what makes a retry safe.
SERVER_FAULT = (
    "Something went wrong on our side. Part of this call may have been applied before the "
    "fault: read what it changes before you retry."
)


# The database out of reach: the connection lost (a server restart, a failover, a network
# cut, the backend terminated), or SQLite's write lock not had within its busy timeout. The
# next request opens a new connection (Django closes an unusable one when a request ends), so
# the call may be tried again — after the same care as a fault's: part of it may have been
# committed before the connection went (a commit whose answer was lost is the classic case).
DATABASE_LOST = (OperationalError, InterfaceError)
RETRY_AFTER = "2"
DATABASE_FAULT = (
    "The database could not be reached; try again in a moment. Part of this call may have "
    "been applied before the connection was lost: repeat it with the same Idempotency-Key, "
    "or read what it changes before you retry."
)


def database_lost(exc: BaseException) -> dict[str, Any]:
    """503 `service_unavailable` (TEST-MATRIX A4: no 500 for a lost database connection; a
    retryable 503), logged with its request id and the driver's message for the operator."""
    request_id = uuid.uuid4().hex
    log.error("database unavailable %s: %s", request_id, exc, exc_info=exc)
    return problem(
        503, "service_unavailable", "Service unavailable", DATABASE_FAULT, request_id=request_id
    )


def server_error(request: HttpRequest) -> Any:
    """API paths answer in the problem format; pages get templates/500.html (rendered
    without the request: nothing on it may need the database). Django calls it while the
    exception is being handled (one raised outside a DRF view, in a middleware): a lost
    database is the API's 503, as inside a view."""
    if _is_api(request):
        exc = sys.exc_info()[1]
        if isinstance(exc, DATABASE_LOST):
            response = JsonResponse(database_lost(exc), status=503, content_type=CONTENT_TYPE)
            response["Retry-After"] = RETRY_AFTER
            return response
        return problem_response(request, 500, "server_error", "Internal error", SERVER_FAULT)
    from django.views.defaults import server_error as page_error

    return page_error(request)


def add_problem_responses(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """drf-spectacular hook: every operation documents the problem format and its codes."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = {
        "type": "object",
        "required": ["type", "title", "status", "detail", "code"],
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "code": {"type": "string", "enum": sorted(CODES)},
            "errors": {
                "type": "object",
                "additionalProperties": {"type": "array", "items": {"type": "string"}},
            },
            "request_id": {"type": "string"},
        },
    }
    ref = {"content": {CONTENT_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}}
    for path_item in result.get("paths", {}).values():
        for method, operation in path_item.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            # 503 for every call: `service_unavailable` (the database out of reach); a
            # dispatch Holdpoint sends itself also `tool_unavailable`, refused before
            # anything was applied (a circuit open, an MCP server turned off).
            codes = ["400", "401", "404", "405", "422", "429", "503"]
            if method in ("post", "put"):
                codes += ["403", "409", "413", "415", "422"]
            for code in codes:
                operation["responses"].setdefault(code, {"description": "Problem", **ref})
    return result
