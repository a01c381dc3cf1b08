"""Nothing an authenticated caller receives may be kept by a cache (issue 16 L6).

Pages and API answers hold one tenant's data: a browser's or a proxy's cache must not keep
them for the next person at the machine. Every route the resolver knows (tests/security/
matrix.py reads them, so a route added later is checked too) is called as the tenant's
reviewer (session) and, for the API, as its agent (token); each answer says
`Cache-Control: no-store` — pages, API reads, API writes, errors alike.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.conftest import Persona
from tests.security import matrix
from tests.security.world import World

# Routes that end the session or need none: what they answer goes to nobody in particular.
UNAUTHENTICATED = {"logout", "healthz", "readyz"}


def values_of(world: World) -> dict[str, Any]:
    """The tenant's own objects, by the path parameter names the routes use."""
    return {
        "run_id": world.run_id,
        "action_id": world.held_action_id,
        "request_id": world.approval_id,
        "approval_id": world.approval_id,
        "rev": 1,
        "name": world.tool_name,
    }


def no_store(response: Any) -> bool:
    return "no-store" in response.get("Cache-Control", "")


def test_every_authenticated_page_and_api_answer_is_no_store(
    worlds: tuple[World, World],
) -> None:
    a, _ = worlds
    values = values_of(a)
    browser = Client(raise_request_exception=False)
    browser.force_login(a.reviewer.user)
    agent = APIClient(raise_request_exception=False)
    agent.credentials(HTTP_AUTHORIZATION=f"Token {a.agent.token}")
    cached, checked = [], 0
    routes = [r for r in matrix.all_routes() if r.area != "admin" and r.key not in UNAUTHENTICATED]
    for route in routes:
        url = route.url(values)
        calls = [("reviewer GET", browser.get(url))]
        if route.area == "api":
            calls.append(("agent GET", agent.get(url)))
            calls.append(("agent POST", agent.post(url, {}, format="json")))
        for who, response in calls:
            checked += 1
            if not no_store(response):
                cached.append(f"{who} {url} → {response.status_code}")
    assert cached == [] and checked > 80, cached


def test_the_login_page_is_no_store_too(client: Client) -> None:
    """The anonymous login page carries no tenant data; the rule is about authenticated
    answers. (It is marked never_cache by Django anyway.)"""
    response = client.get("/login/")
    assert response.status_code == 200 and no_store(response)


@pytest.mark.parametrize(
    "url",
    ["/admin/", "/admin/audit/journalentry/", "/admin/runtime/agenttoken/"],
)
def test_admin_pages_are_no_store(client: Client, admin_a: Persona, url: str) -> None:
    client.force_login(admin_a.user)
    response = client.get(url)
    assert response.status_code == 200 and no_store(response)
