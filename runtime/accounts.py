"""Human and admin acts recorded in each tenant's stream (DESIGN.md, "Journal"), and how a
reviewer's login and session end.

Logins and failed logins have no single call site we own (Django's login view, the admin),
so Django's own signals are the hook; each handler only calls `record_tenant_act`, the one
function that writes these entries. Token issue, rotation and revocation call it from
runtime/auth.py, in the transaction of the change.

Sessions: Django gives a new session key at login and deletes the session row at logout; a
password change makes every other session of the user invalid (the session keeps a hash of
the password). What Django leaves to us is here: the session ends after SESSION_COOKIE_AGE
seconds without a request the reviewer made — htmx's background polls keep a page live but
do not keep its session alive — and HOLDPOINT_SESSION_MAX_AGE seconds after login whatever
happens. django-axes counts failed logins; `locked_out` is the page it answers with and
`client_ip` the address it counts them by.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model, logout
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render, resolve_url
from rest_framework.throttling import SimpleRateThrottle

from audit import journal
from runtime.models import Membership, Role


class ReviewerLoginForm(AuthenticationForm):
    """The login form for people: an agent account is refused even with its right password.

    Agents act through the API with their token (tokens are scoped, rotated and revoked;
    a session is not): a session would let an agent use the pages' and the API's session
    door (issue 16: the old test posted an empty password, refused for anyone).
    """

    def confirm_login_allowed(self, user: Any) -> None:
        super().confirm_login_allowed(user)
        if Membership.objects.filter(user=user, role=Role.AGENT).exists():
            raise ValidationError(
                "Agent accounts cannot log in here; they use the API with their token.",
                code="agent_account",
            )


def record_tenant_act(tenant_id: int, type: str, actor: str, **payload: Any) -> None:
    with transaction.atomic():
        journal.append(
            journal.tenant_stream(tenant_id),
            type,
            tenant_id=tenant_id,
            actor=actor,
            payload=payload,
        )


def _tenants_of(user: Any) -> list[int]:
    return list(Membership.objects.filter(user=user).values_list("tenant_id", flat=True))


def _client(request: HttpRequest | None) -> dict[str, str]:
    if request is None:
        return {}
    return {
        "ip": client_ip(request),  # the address lockouts count by, proxies considered
        "user_agent": request.META.get("HTTP_USER_AGENT", "")[:200],
    }


def on_login(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    if request is not None and hasattr(request, "session"):
        request.session[LOGGED_IN_AT] = int(time.time())
    for tenant_id in _tenants_of(user):
        record_tenant_act(tenant_id, "login", f"user:{user.get_username()}", **_client(request))


def on_login_failed(
    sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **kwargs: Any
) -> None:
    username = str(credentials.get("username", ""))[:150]
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        return  # no tenant to tell; the web server's log has it
    # django-axes' handler ran first (its app is listed before ours) and flagged a lockout.
    locked = {"locked_out": True} if getattr(request, "axes_locked_out", False) else {}
    for tenant_id in _tenants_of(user):
        record_tenant_act(
            tenant_id, "login_failed", f"user:{username}", **_client(request), **locked
        )


def connect() -> None:
    user_logged_in.connect(on_login, dispatch_uid="holdpoint.login")
    user_login_failed.connect(on_login_failed, dispatch_uid="holdpoint.login_failed")


# --- sessions ---------------------------------------------------------------------------

LOGGED_IN_AT = "holdpoint_logged_in_at"


def is_background(request: HttpRequest) -> bool:
    """An htmx GET: the pages' polls (inbox list, request status, run live). The person may
    have left the tab open and gone; such a request must not count as their activity."""
    return request.method == "GET" and request.headers.get("HX-Request") == "true"


class SessionTimeoutMiddleware:
    """Inactivity and absolute session timeouts (OWASP ASVS 3.3.2).

    Placed after AuthenticationMiddleware. A session older than HOLDPOINT_SESSION_MAX_AGE is
    logged out before the view runs (the view then sees an anonymous user and sends them to
    the login page). Every request but a background poll renews the session's expiry, so
    SESSION_COOKIE_AGE is the longest a reviewer can be away. When a poll finds the session
    gone, htmx is told to reload the page (which then leads to the login page) instead of
    swapping the login form into a fragment of it.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.user.is_authenticated:
            now = int(time.time())
            started = request.session.get(LOGGED_IN_AT)
            if not isinstance(started, int):
                request.session[LOGGED_IN_AT] = now  # a session from before this check
            elif now - started >= settings.HOLDPOINT_SESSION_MAX_AGE:
                logout(request)
        response = self.get_response(request)
        if is_background(request):
            if _to_login(response):
                refresh = HttpResponse(status=200)
                refresh["HX-Refresh"] = "true"
                return refresh
        elif not request.session.is_empty():
            request.session.modified = True  # saved with a new expiry by SessionMiddleware
        return response


def _to_login(response: HttpResponse) -> bool:
    if not isinstance(response, HttpResponseRedirect):
        return False
    return response.url.split("?")[0] == resolve_url(settings.LOGIN_URL)


# --- login lockout (django-axes) --------------------------------------------------------


def client_ip(request: HttpRequest) -> str:
    """The address failed logins are counted by. REMOTE_ADDR unless HOLDPOINT_PROXY_COUNT
    proxies stand in front; then the address the outermost of them saw (the entry that many
    places from the end of X-Forwarded-For) — entries before it are the client's to forge."""
    remote = str(request.META.get("REMOTE_ADDR", ""))
    hops = settings.HOLDPOINT_PROXY_COUNT
    if hops:
        forwarded = [
            part.strip()
            for part in str(request.META.get("HTTP_X_FORWARDED_FOR", "")).split(",")
            if part.strip()
        ]
        if len(forwarded) >= hops:
            return forwarded[-hops]
    return remote


def locked_out(
    request: HttpRequest,
    original_response: HttpResponse | None = None,
    credentials: dict[str, Any] | None = None,
) -> HttpResponse:
    """What a locked-out login gets, on the reviewers' login page and the admin's alike: 429,
    Retry-After, and a sentence saying what happened and when to try again. It reads the
    same whether or not the username exists (no account oracle)."""
    cooloff = settings.AXES_COOLOFF_TIME
    minutes = max(1, int(cooloff.total_seconds() // 60))
    response = render(
        request,
        "registration/locked_out.html",
        {"minutes": minutes, "failure_limit": settings.AXES_FAILURE_LIMIT},
        status=settings.AXES_HTTP_RESPONSE_CODE,
    )
    response["Retry-After"] = str(int(cooloff.total_seconds()))
    return response


# --- per-reviewer rate of decisions on the pages ------------------------------------------


class DecisionRate(SimpleRateThrottle):
    """HOLDPOINT_DECISION_RATE decisions per reviewer, counted in the shared default cache
    like the API's per-token limit (DRF's throttle, outside DRF)."""

    scope = "decide"

    def get_rate(self) -> str:
        return str(settings.HOLDPOINT_DECISION_RATE)

    def get_cache_key(self, request: Any, view: Any) -> str:
        return self.cache_format % {"scope": self.scope, "ident": request.user.pk}


def decision_rate_limited(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Refuse a reviewer's decision POSTs beyond the rate: 429 with Retry-After and a page
    that says nothing was recorded. Every POST counts, refused ones too: a script guessing
    at forms is slowed as much as one deciding. Wrap inside login_required."""

    @wraps(view)
    def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        throttle = DecisionRate()
        if not throttle.allow_request(request, None):
            wait = max(1, int(throttle.wait() or 0) + 1)
            response = render(
                request,
                "approvals/rate_limited.html",
                {"wait": wait, "rate": throttle.rate},
                status=429,
            )
            response["Retry-After"] = str(wait)
            return response
        return view(request, *args, **kwargs)

    return limited
