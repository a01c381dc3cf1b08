"""Request-wide guards that belong to no single view.

`ClientHeaders` escapes control characters in the descriptive headers that are stored as
sent: django-axes writes the User-Agent and Accept of every failed login to its tables, the
journal records the User-Agent, and PostgreSQL refuses a NUL in text outright — a failed
login with a NUL in its User-Agent answered 500 and left no trace (issue 16 M3). No header
may carry a NUL or another control character but a tab (RFC 9110, 5.5), so nothing a
well-behaved client sends is changed. Headers with a meaning (Idempotency-Key,
Authorization, …) are left alone: their readers refuse such a value with a 4xx, which an
escaped copy would turn into a different, valid-looking value.

`NoStore` marks every response to an authenticated request `Cache-Control: no-store`
(issue 16 L6): pages and API answers hold one tenant's data, and a shared or browser cache
must not keep them for the next person at the machine.

`AdminQueryNul` answers 400 to an admin URL whose query has a NUL: PostgreSQL refuses a NUL in
a text parameter (DataError, a 500), and every changelist filter — Django's choice, boolean
and all-values filters, django-q2's, ours — hands its parameter to the query as it came. No
value a filter, a search, a page or an ordering link can mean holds a NUL, so refusing it
before any admin view runs covers every changelist, today's and tomorrow's, on both
databases alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

# What django-axes and the journal keep of a request, byte for byte.
STORED_AS_SENT = ("HTTP_USER_AGENT", "HTTP_ACCEPT")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _escaped(match: re.Match[str]) -> str:
    """As Python writes it in a string literal (`\\x00`, `\\n`): the journal's own escape."""
    return repr(match.group())[1:-1]


class ClientHeaders:
    """First in the middleware list: later middleware, views and handlers see these
    headers escaped only."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        meta = request.META
        for name in STORED_AS_SENT:
            value = meta.get(name)
            if isinstance(value, str) and _CONTROL.search(value):
                meta[name] = _CONTROL.sub(_escaped, value)
        return self.get_response(request)


class NoStore:
    """After AuthenticationMiddleware. The user is read once the view has answered: DRF
    authenticates a token inside the view and sets the user on this very request."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            if "no-store" not in response.get("Cache-Control", ""):
                response["Cache-Control"] = "no-store"
        return response


class AdminQueryNul:
    """After MessageMiddleware (the 400 page is a full page). Only the admin's URLs: the API
    refuses a NUL in its own format, and the reviewer pages' filters validate their values."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.admin = ""  # the admin's prefix, resolved once, at the first request

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not self.admin:
            self.admin = reverse("admin:index")
        if request.path.startswith(self.admin):
            named = sorted(
                {k for k, values in request.GET.lists() for v in [k, *values] if "\x00" in v}
            )
            if named:
                errors = {repr(k)[1:-1]: ["contains a NUL character"] for k in named}
                detail = "A NUL character is never part of a filter, a search or a page number."
                context = {"detail": detail, "errors": errors}
                return render(request, "400.html", context, status=400)
        return self.get_response(request)
