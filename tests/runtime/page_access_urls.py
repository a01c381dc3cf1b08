"""The real URL map plus two probe pages built with `reviewer_page` (test_page_access.py)."""

from __future__ import annotations

from uuid import UUID

from django.http import HttpRequest, HttpResponse
from django.urls import path

from config.urls import urlpatterns as real
from runtime.pages.access import require_may_act, reviewer_page, scoped_or_404
from runtime.tenancy import Principal, runs_for


@reviewer_page(methods=("GET", "POST"), no_tenant="runtime/runs.html")
def listing(request: HttpRequest, principal: Principal) -> HttpResponse:
    if request.method == "POST":
        require_may_act(principal, "viewers may not")
    return HttpResponse(f"{principal.label} in {principal.tenant.slug}")


@reviewer_page(methods=("POST",))
def one_run(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    run = scoped_or_404(runs_for(principal), principal, run_id=run_id)
    require_may_act(principal, "viewers may not")
    return HttpResponse(f"acted on {run.run_id}")


urlpatterns = [
    *real,
    path("_probe/", listing, name="probe-listing"),
    path("_probe/<uuid:run_id>/", one_run, name="probe-run"),
]
