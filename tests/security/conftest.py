"""Fixtures of the security tests (the isolation summary is printed by tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.conftest import Persona
from tests.security.world import World, build_world


@pytest.fixture
def worlds(
    settings: Any,
    agent_a: Persona,
    agent_b: Persona,
    reviewer_a: Persona,
    outsider_b: Persona,
) -> tuple[World, World]:
    """Tenant A's and tenant B's objects (A = acme, B = globex)."""
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    return build_world(agent_a, reviewer_a), build_world(agent_b, outsider_b)


def csrf_client(user: Any, *, api: bool = False) -> tuple[Client, str]:
    """A logged-in browser session that enforces CSRF like a real browser's would, and the
    token its pages carry (read from the cookie the login page sets)."""
    kind = APIClient if api else Client
    client: Client = kind(enforce_csrf_checks=True, raise_request_exception=False)
    client.force_login(user)
    client.get("/login/")
    return client, client.cookies["csrftoken"].value


def token_client(persona: Persona) -> Client:
    """The agent's API client; a server error is an answer to assert on, not an exception."""
    client = persona.api()
    client.raise_request_exception = False
    return client
