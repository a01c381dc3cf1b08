"""`reviewer_page`: the one prologue of every reviewer page (runtime.pages.access).

Probed through two small pages built with it (page_access_urls.py), so what is checked is
the decorator itself, as the approvals pages will use it too: login first, then the method,
agents refused, the principal handed over; a user of no tenant gets the friendly page on a
read, 403 on a write, and 404 where the URL names an object; another tenant's object is 404
for a viewer too (the lookup comes before the viewer's 403).
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from runtime.lifecycle import create_run
from runtime.models import Tenant
from tests.conftest import Persona

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.runtime.page_access_urls")]


def test_the_view_gets_the_principal_of_the_current_tenant(
    client: Client, reviewer_a: Persona
) -> None:
    client.force_login(reviewer_a.user)
    page = client.get(reverse("probe-listing"))
    assert page.status_code == 200 and page.content == b"user:alice in acme"


def test_login_comes_first_then_the_method(client: Client, reviewer_a: Persona) -> None:
    for method in ("get", "put"):
        answer = getattr(client, method)(reverse("probe-listing"))
        assert answer.status_code == 302 and answer["Location"].startswith(reverse("login"))
    client.force_login(reviewer_a.user)
    assert client.put(reverse("probe-listing")).status_code == 405
    assert client.get(reverse("probe-run", args=[uuid.uuid4()])).status_code == 405


def test_agents_are_refused(client: Client, agent_a: Persona) -> None:
    client.force_login(agent_a.user)
    assert client.get(reverse("probe-listing")).status_code == 403


def test_a_user_of_no_tenant(client: Client) -> None:
    nomad = get_user_model().objects.create_user(username="nomad", password="pw-nomad")
    client.force_login(nomad)
    page = client.get(reverse("probe-listing"))
    assert page.status_code == 200 and b"not a member of any active tenant" in page.content
    assert client.post(reverse("probe-listing")).status_code == 403
    assert client.post(reverse("probe-run", args=[uuid.uuid4()])).status_code == 404


def test_another_tenants_object_is_404_before_a_viewer_is_refused(
    client: Client, viewer_a: Persona, reviewer_a: Persona, tenant_b: Tenant
) -> None:
    theirs = create_run(tenant_b, "chain", {"steps": 1}, actor="t")
    mine = create_run(viewer_a.tenant, "chain", {"steps": 1}, actor="t")
    client.force_login(viewer_a.user)
    assert client.post(reverse("probe-run", args=[theirs.run_id])).status_code == 404
    assert client.post(reverse("probe-run", args=[mine.run_id])).status_code == 403
    assert client.post(reverse("probe-listing")).status_code == 403
    client.force_login(reviewer_a.user)
    acted = client.post(reverse("probe-run", args=[mine.run_id]))
    assert acted.status_code == 200 and acted.content == f"acted on {mine.run_id}".encode()
