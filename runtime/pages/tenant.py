"""Switching the session's current tenant (the menu every page shows).

Not a `reviewer_page`: it acts on the user's memberships, not inside one tenant, so there is
no principal to load yet — `switch_tenant` checks the membership, and a tenant the user is
not a member of is the same 404 as one that does not exist.
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from runtime.errors import NotFound
from runtime.tenancy import switch_tenant


@login_required
@require_POST
def switch_tenant_view(request: HttpRequest) -> HttpResponse:
    try:
        switch_tenant(request, int(request.POST.get("tenant", "")))
    except (ValueError, NotFound):
        raise Http404() from None
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(target, {request.get_host()}, request.is_secure()):
        target = "inbox"
    return redirect(target)
