"""The product's URL map plus one page and one API path that fail unexpectedly, to see the
500 answers as a person and an agent get them (tests/web/test_error_pages.py)."""

from django.http import HttpRequest, HttpResponse
from django.urls import path

from config.urls import handler403, handler404, handler500
from config.urls import urlpatterns as product

__all__ = ["handler403", "handler404", "handler500", "urlpatterns"]


def boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("an unexpected bug")


urlpatterns = [path("runs/boom/", boom), path("api/v1/boom/", boom), *product]
