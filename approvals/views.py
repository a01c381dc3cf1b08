"""Reviewer pages."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET


@login_required
@require_GET
def inbox(request: HttpRequest) -> HttpResponse:
    """Pending hold points of the current tenant (filled by the approvals issue)."""
    return render(request, "approvals/inbox.html", {"pending": []})
