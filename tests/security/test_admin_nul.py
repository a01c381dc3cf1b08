"""Every admin changelist answers a NUL in its search box or a filter parameter with a 400.

PostgreSQL refuses a NUL in a text parameter (psycopg raises DataError): the journal's type
filter answered 500 for `?type=%00` until 313314d fixed that one filter. Every registered
changelist is walked here — its search, and each of its filters' parameters — as a
superuser, who sees every changelist and every filter. Before the fix twelve filters
answered 500 on PostgreSQL (runs' and approval requests' status, memberships' role,
policies' on_expiry, webhook deliveries' event_type, django-q2's group, cluster, key and
schedule_type); on SQLite, which stores a NUL, they were empty pages.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

pytestmark = pytest.mark.django_db
NUL = "a\x00b"


def _changelists() -> list[tuple[str, Any]]:
    return sorted(
        (
            (reverse(f"admin:{m._meta.app_label}_{m._meta.model_name}_changelist"), model_admin)
            for m, model_admin in admin.site._registry.items()
        ),
        key=lambda pair: pair[0],
    )


def test_a_nul_in_any_changelists_search_or_filter_is_a_400_not_a_500() -> None:
    root = get_user_model().objects.create_superuser("root", password="pw-root")
    client = Client(raise_request_exception=False)  # a 500 is an answer to count here
    client.force_login(root)
    answers: dict[str, int] = {}
    for url, model_admin in _changelists():
        page = client.get(url)
        assert page.status_code == 200, url
        asked = [{"q": NUL}] if model_admin.search_fields else []
        for spec in page.context["cl"].filter_specs:
            asked += [{name: NUL} for name in spec.expected_parameters() or []]
        for params in asked:
            answers[f"{url}?{next(iter(params))}"] = client.get(url, params).status_code
    assert len(answers) > 20  # the walk reached the filters
    assert {where: status for where, status in answers.items() if status != 400} == {}
    refused = client.get("/admin/runtime/run/", {"status__exact": NUL})
    assert b"contains a NUL character" in refused.content and b"status__exact" in refused.content
