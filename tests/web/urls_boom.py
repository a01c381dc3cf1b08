"""The product's URL map plus one page and one API path that fail unexpectedly, to see the
500 answers as a person and an agent get them (tests/web/test_error_pages.py)."""

from django.http import HttpRequest, HttpResponse
from django.urls import path
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from config.urls import handler403, handler404, handler500
from config.urls import urlpatterns as product

__all__ = ["handler403", "handler404", "handler500", "urlpatterns"]


def boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("an unexpected bug")


@api_view(["POST"])
@permission_classes([AllowAny])
def commit_then_boom(request: Request) -> Response:
    """An API call that commits part of its work before a fault (no ATOMIC_REQUESTS)."""
    from runtime.models import Tenant

    Tenant.objects.create(slug="half-done", name="Committed before the fault")
    raise RuntimeError("an unexpected bug after a commit")


urlpatterns = [
    path("runs/boom/", boom),
    path("api/v1/boom/", boom),
    path("api/v1/half-done/", commit_then_boom),
    *product,
]
