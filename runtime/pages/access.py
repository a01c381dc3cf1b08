"""Who is looking at a reviewer page: the one prologue every page view shares.

Before a page does its own work it needs the same things, in the same order: a logged-in
user (else the login page), a method the page answers (else 405), not an agent account
(agents act through the API with their token: 403), and the principal of the session's
current tenant (`runtime.tenancy.CurrentTenantMiddleware` attaches it). A user who belongs to
no active tenant gets either the page's friendly "not a member" rendering or, where the page
names an object, the same 404 as an object that does not exist. `reviewer_page` does all of
that once and hands the view its `Principal`, so no view can skip a step or reorder them.

Two rules stay with the view, because their order relative to the view's own lookup
matters: another tenant's object is looked up first (`scoped_or_404`) and only then is a
viewer refused (`require_may_act`), so a viewer probing ids learns nothing from a 403
(DESIGN.md, invariant 9).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Model, QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import render
from django.views.decorators.http import require_http_methods
from django_htmx.middleware import HtmxDetails
from rest_framework.serializers import Serializer

from runtime.errors import InvalidParams, NotFound
from runtime.tenancy import Principal, get_scoped

P = ParamSpec("P")
R = TypeVar("R", bound=HttpRequest)
M = TypeVar("M", bound=Model)
# The friendly no-tenant rendering answers reads only: there is nothing to change.
_READS = ("GET", "HEAD")


class HtmxHttpRequest(HttpRequest):
    """What the middlewares add to a request (for type checkers only)."""

    htmx: HtmxDetails
    principal: Principal | None


def principal_of(request: HttpRequest) -> Principal | None:
    """The session's principal; None when the user belongs to no active tenant.

    An agent account is refused outright: it acts through the API with its token, never
    through pages, whatever tenant it belongs to.
    """
    principal: Principal | None = getattr(request, "principal", None)
    if principal is not None and principal.is_agent:
        raise PermissionDenied("Agents use the API.")
    return principal


def reviewer_page(
    *, methods: Sequence[str] = ("GET",), no_tenant: str | None = None
) -> Callable[
    [Callable[Concatenate[R, Principal, P], HttpResponseBase]],
    Callable[Concatenate[R, P], HttpResponseBase],
]:
    """Make `view(request, principal, *args)` a page view: login, methods, principal.

    `no_tenant` is the template rendered (empty context, 200) for a GET by a user who
    belongs to no active tenant; such a user's other methods are refused with 403. Without
    it, that user gets 404, as for an object they cannot see — right for every page whose
    URL names an object.
    """

    def decorate(
        view: Callable[Concatenate[R, Principal, P], HttpResponseBase],
    ) -> Callable[Concatenate[R, P], HttpResponseBase]:
        @wraps(view)
        def page(request: R, /, *args: P.args, **kwargs: P.kwargs) -> HttpResponseBase:
            principal = principal_of(request)
            if principal is None:
                if no_tenant is None:
                    raise Http404()
                if request.method not in _READS:
                    raise PermissionDenied("You are not a member of any active tenant.")
                return render(request, no_tenant, {})
            try:
                return view(request, principal, *args, **kwargs)
            except InvalidParams as exc:
                return bad_input(request, exc)

        guarded = login_required(require_http_methods(list(methods))(page))
        return cast(Callable[Concatenate[R, P], HttpResponseBase], guarded)

    return decorate


def bad_input(request: HttpRequest, exc: InvalidParams) -> HttpResponse:
    """The 400 page for a query or form value a page cannot use, with the reason.

    Raised before anything was read with the value, or inside the write's transaction (which
    rolled back), so the page can truthfully say nothing was changed.
    """
    context = {"detail": exc.detail, "errors": exc.extra.get("errors") or {}}
    return render(request, "400.html", context, status=400)


def page_input(
    serializer: type[Serializer[Any]], data: dict[str, Any], *, partial: bool = False
) -> dict[str, Any]:
    """A page form's values checked by the API's own request serializer, or InvalidParams.

    One validation path for both doors (issue 16, L1): a NUL character, an over-long text
    or a word outside the choices is refused on the page exactly as the API refuses it,
    before any write — PostgreSQL cannot store a NUL, and a late driver error is a 500.
    `partial` checks only the fields given: a word the domain function validates itself
    (and answers with a message on the page) is left to it.
    """
    bound = serializer(data=data, partial=partial)
    if not bound.is_valid():
        errors = {name: [str(m) for m in msgs] for name, msgs in bound.errors.items()}
        said = "; ".join(f"{name}: {' '.join(msgs)}" for name, msgs in sorted(errors.items()))
        raise InvalidParams(said, errors=errors)
    return dict(bound.validated_data)


def scoped_or_404(queryset: QuerySet[M], principal: Principal, **lookup: Any) -> M:
    """One object of the principal's tenant; any other case is the same plain 404."""
    try:
        return get_scoped(queryset, principal, **lookup)
    except NotFound:
        raise Http404() from None


def require_may_act(principal: Principal, why: str) -> None:
    """Refuse a viewer (403) — after the object was found, never before (see above)."""
    if not principal.may_act:
        raise PermissionDenied(why)
