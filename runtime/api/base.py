"""What every API view shares: the principal, tenant scoping and waiting without polling."""

from __future__ import annotations

import time
from typing import Any, TypeVar, cast

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Model, QuerySet
from rest_framework.exceptions import NotAuthenticated, ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.throttling import UserRateThrottle
from rest_framework.views import APIView

from runtime.errors import InvalidParams, NotFound
from runtime.models import AgentToken
from runtime.tenancy import SESSION_KEY, Principal, get_scoped, principal_for

MAX_WAIT = 30.0


class Cursor(CursorPagination):
    page_size = 50
    ordering = "-created_at"

    def paginate_queryset(self, queryset: Any, request: Any, view: Any = None) -> Any:
        """A forged cursor (a position of the wrong type) is a 400, never a 500."""
        try:
            return super().paginate_queryset(queryset, request, view)
        except (ValueError, TypeError, DjangoValidationError):
            raise ValidationError({"cursor": ["invalid cursor"]}) from None


M = TypeVar("M", bound=Model)


class PerToken(UserRateThrottle):
    """Per token (or reviewer) request rate; 429 in the problem format with Retry-After."""

    scope = "agent"


class ApiView(APIView):
    throttle_classes = [PerToken]

    def principal(self, request: Request) -> Principal:
        cached: Principal | None = getattr(request, "_holdpoint_principal", None)
        if cached is not None:
            return cached
        if not request.user or not request.user.is_authenticated:
            raise NotAuthenticated()
        # A token acts in its own tenant (runtime.auth checked the membership); a session in
        # the tenant the person chose.
        # DRF's stubs type `auth` as authtoken's Token; ours is AgentTokenAuthentication's.
        token = cast(AgentToken | None, request.auth)
        tenant_id = request.session.get(SESSION_KEY) if token is None else token.tenant_id
        principal = principal_for(request.user, tenant_id)
        if principal is None:
            raise NotFound("no tenant for these credentials")
        request._holdpoint_principal = principal  # type: ignore[attr-defined]
        return principal

    def scoped(self, request: Request, queryset: QuerySet[M], **lookup: Any) -> M:
        return get_scoped(queryset, self.principal(request), **lookup)

    def actor(self, request: Request) -> str:
        return self.principal(request).label


def wait_seconds(request: Request) -> float:
    raw = request.query_params.get("wait")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise InvalidParams(
            "wait must be a number of seconds", errors={"wait": ["a number from 0 to 30"]}
        ) from None
    if not 0 <= value <= MAX_WAIT:
        raise InvalidParams("wait must be between 0 and 30", errors={"wait": ["0 to 30"]})
    return value


def wait_for_change(load: Any, seconds: float, version: Any) -> Any:
    """Re-read until the object's version differs or the time is up. Each read is its own
    autocommit query: no transaction is held open while waiting."""
    obj = load()
    deadline = time.monotonic() + seconds
    start = version(obj)
    while time.monotonic() < deadline and version(obj) == start:
        time.sleep(0.25)
        obj = load()
    return obj
