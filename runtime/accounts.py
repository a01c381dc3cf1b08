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

import ipaddress
import logging
import time
from collections.abc import Callable
from functools import partial, wraps
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model, logout
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render, resolve_url
from django.utils import timezone
from rest_framework.throttling import SimpleRateThrottle

from audit import journal
from runtime.models import FailedLoginWindow, Membership, Role

log = logging.getLogger("holdpoint.accounts")


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


def printable(value: object, limit: int) -> str:
    """A client-sent value as the journal keeps it: control and other unprintable characters
    escaped (ASVS 16.4.1 — PostgreSQL cannot store a NUL at all, and a log reader must not
    be fooled by a newline or an escape sequence), then cut to `limit` characters."""
    text = str(value)[: limit * 2]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)[:limit]


def _tenants_of(user: Any) -> list[int]:
    return list(Membership.objects.filter(user=user).values_list("tenant_id", flat=True))


def _client(request: HttpRequest | None) -> dict[str, str]:
    if request is None:
        return {}
    return {
        # the address lockouts count by, proxies considered
        "ip": printable(client_ip(request), 100),
        "user_agent": printable(request.META.get("HTTP_USER_AGENT", ""), 200),
    }


def _recorded_or_logged(what: str, tenant_id: int, write: Callable[[], None]) -> None:
    """Run a journal write of a signal handler. Django's login and the admin's call the
    handlers inside their own request: an exception here would answer 500 for a login
    whose outcome is already decided. So a failed write never propagates — and it is never
    silent either: it is logged as an error, with the traceback, for the operator."""
    try:
        write()
    except Exception:  # noqa: BLE001 — see above: the request must still be answered
        log.exception(
            "could not journal %s in tenant %s; the request was answered", what, tenant_id
        )


def on_login(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    if request is not None and hasattr(request, "session"):
        request.session[LOGGED_IN_AT] = int(time.time())
    actor = f"user:{user.get_username()}"
    client = _client(request)

    def write(tenant_id: int) -> None:
        with transaction.atomic():
            close_failed_logins(user, tenant_id)
            record_tenant_act(tenant_id, "login", actor, **client)

    for tenant_id in _tenants_of(user):
        _recorded_or_logged("login", tenant_id, partial(write, tenant_id))


def on_login_failed(
    sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **kwargs: Any
) -> None:
    username = str(credentials.get("username", ""))
    if not username or len(username) > 150 or not username.isprintable():
        return  # no account can have that name (and PostgreSQL could not even look for it)
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        return  # no tenant to tell; the web server's log has it
    # django-axes' handler ran first (its app is listed before ours) and flagged a lockout.
    locked = bool(getattr(request, "axes_locked_out", False))
    client = _client(request)
    for tenant_id in _tenants_of(user):
        _recorded_or_logged(
            "login_failed",
            tenant_id,
            partial(record_failed_login, user, tenant_id, client, locked_out=locked),
        )


# --- failed logins: one window, one count (runtime/models/logins.py) ----------------------


def record_failed_login(
    user: Any, tenant_id: int, client: dict[str, str], *, locked_out: bool = False
) -> None:
    """The first failure of a window is journalled now, with the client's address and
    agent; later ones in the window are only counted, until the window is closed."""
    now = timezone.now()
    with transaction.atomic():
        row, created = FailedLoginWindow.objects.select_for_update().get_or_create(
            user=user, tenant_id=tenant_id, defaults={"started_at": now, "last_at": now}
        )
        if not created and now - row.started_at < settings.HOLDPOINT_LOGIN_FAILURE_WINDOW:
            _count(row, now, client, locked_out)
            return
        if not created:
            _close(row, user)
            FailedLoginWindow.objects.create(
                user=user, tenant_id=tenant_id, started_at=now, last_at=now
            )
        locked = {"locked_out": True} if locked_out else {}
        record_tenant_act(
            tenant_id, "login_failed", f"user:{user.get_username()}", count=1, **client, **locked
        )


def _count(row: FailedLoginWindow, now: Any, client: dict[str, str], locked_out: bool) -> None:
    row.unrecorded += 1
    row.last_at = now
    row.locked_out = row.locked_out or locked_out
    ip = client.get("ip", "")
    if ip and ip not in row.ips and len(row.ips) < FailedLoginWindow.MAX_ADDRESSES:
        row.ips = [*row.ips, ip]
    row.user_agent = client.get("user_agent", "")
    row.save(update_fields=["unrecorded", "last_at", "locked_out", "ips", "user_agent"])


def _close(row: FailedLoginWindow, user: Any) -> None:
    """Journal what the window counted but did not record yet, and forget the window."""
    if row.unrecorded:
        locked = {"locked_out": True} if row.locked_out else {}
        record_tenant_act(
            row.tenant_id,
            "login_failed",
            f"user:{user.get_username()}",
            count=row.unrecorded,
            since=row.started_at.isoformat(),
            until=row.last_at.isoformat(),
            ips=row.ips,
            user_agent=row.user_agent,
            **locked,
        )
    row.delete()


def close_failed_logins(user: Any, tenant_id: int) -> None:
    """At a login: the failures before it are journalled before the login itself."""
    with transaction.atomic():
        row = (
            FailedLoginWindow.objects.select_for_update()
            .filter(user=user, tenant_id=tenant_id)
            .first()
        )
        if row is not None:
            _close(row, user)


def close_ended_failed_login_windows() -> int:
    """The periodic flush: every window past its length gets its count journalled, so a
    count never waits for the person's next attempt. Returns how many were closed."""
    ended = timezone.now() - settings.HOLDPOINT_LOGIN_FAILURE_WINDOW
    closed = 0
    for pk in FailedLoginWindow.objects.filter(started_at__lte=ended).values_list("pk", flat=True):
        with transaction.atomic():
            row = (
                FailedLoginWindow.objects.select_for_update()
                .select_related("user")
                .filter(pk=pk, started_at__lte=ended)
                .first()
            )
            if row is not None:
                _close(row, row.user)
                closed += 1
    return closed


def connect() -> None:
    user_logged_in.connect(on_login, dispatch_uid="holdpoint.login")
    user_login_failed.connect(on_login_failed, dispatch_uid="holdpoint.login_failed")


# --- sessions ---------------------------------------------------------------------------

LOGGED_IN_AT = "holdpoint_logged_in_at"


def outlived(session: Any, now: float) -> bool:
    """Whether the session was logged in HOLDPOINT_SESSION_MAX_AGE seconds ago or more (a
    session from before the login time was recorded has none: not outlived)."""
    started = session.get(LOGGED_IN_AT)
    return isinstance(started, int) and now - started >= settings.HOLDPOINT_SESSION_MAX_AGE


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
            if not isinstance(request.session.get(LOGGED_IN_AT), int):
                request.session[LOGGED_IN_AT] = now  # a session from before this check
            elif outlived(request.session, now):
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
    places from the end of X-Forwarded-For) — entries before it are the client's to forge.
    An entry that is no IP address (more proxies configured than there are, so the client
    wrote it) counts as REMOTE_ADDR: django-axes stores the address in an address column,
    and PostgreSQL refused the junk with a 500."""
    remote = str(request.META.get("REMOTE_ADDR", ""))
    hops = settings.HOLDPOINT_PROXY_COUNT
    if hops:
        forwarded = [
            part.strip()
            for part in str(request.META.get("HTTP_X_FORWARDED_FOR", "")).split(",")
            if part.strip()
        ]
        if len(forwarded) >= hops and _is_address(forwarded[-hops]):
            return forwarded[-hops]
    return remote


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


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
        # A page's HttpRequest and no DRF view: DecisionRate reads only `request.user`.
        if not throttle.allow_request(request, None):  # type: ignore[arg-type]
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
