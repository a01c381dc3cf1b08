"""A tool's `timeout_seconds` is held to one rule (`runtime.models.tooldefs.timeout_problem`)
on every way a timeout is given: `POST tools/` and `PUT tools/{name}/`, the admin's tool
form, `manage.py tools import`, and an upstream MCP server (model and admin form), whose
tools get its timeout. Before, 1e-300 s (or 0.01 s) was a valid timeout: no request can
finish in it, so every action of the tool ended `unknown` and waited for reconciliation."""

from __future__ import annotations

import json
import math
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from runtime import tooldefs
from runtime.models import McpServer, Tenant, ToolDefinition
from runtime.models.tooldefs import MAX_TIMEOUT, MIN_TIMEOUT
from tests.api import (
    fresh_throttle,  # noqa: F401
    ok,
    post,
    problem,
)
from tests.api.test_tools_api import tickets
from tests.conftest import Persona

pytestmark = pytest.mark.django_db

MCP_URL = "http://127.0.0.1:9/mcp"
# Too short for any request, negative, past the maximum, or not a number of seconds.
REFUSED = [1e-300, 0.01, 0.099, 0, -1, 60.5, 1e6, "5", True, None]
TAKEN = [MIN_TIMEOUT, 0.25, 5, MAX_TIMEOUT]


@pytest.mark.parametrize("timeout", REFUSED, ids=repr)
def test_post_tools_refuses_a_timeout_outside_the_rule(admin_a: Persona, timeout: Any) -> None:
    refused = problem(
        post(admin_a.api(), "tools/", tickets(timeout_seconds=timeout)), 422, "invalid_tool"
    )
    assert list(refused["errors"]) == ["timeout_seconds"], refused
    assert ToolDefinition.objects.count() == 0


@pytest.mark.parametrize("timeout", TAKEN, ids=repr)
def test_post_tools_takes_a_timeout_within_the_rule(admin_a: Persona, timeout: float) -> None:
    created = ok(post(admin_a.api(), "tools/", tickets(timeout_seconds=timeout)), 201)
    assert created["timeout_seconds"] == timeout


def test_put_tools_refuses_a_timeout_too_short_and_keeps_the_version(admin_a: Persona) -> None:
    client = admin_a.api()
    ok(post(client, "tools/", tickets()), 201)
    revision = {**tickets(timeout_seconds=1e-300), "expected_version": 1}
    refused = problem(
        client.put("/api/v1/tools/tickets.create/", revision, format="json"), 422, "invalid_tool"
    )
    assert "timeout_seconds" in refused["errors"], refused
    assert [row.version for row in ToolDefinition.objects.all()] == [1]


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf], ids=repr)
def test_a_timeout_that_is_no_number_of_seconds_is_refused_to_python_callers(
    tenant_a: Tenant, timeout: float
) -> None:
    """The API, the admin and files parse JSON without NaN or Infinity; an MCP import or a
    test builds the definition in Python, so the rule itself refuses them."""
    with pytest.raises(tooldefs.InvalidTool) as refused:
        tooldefs.define(tenant_a, tickets(timeout_seconds=timeout), "user:ada")
    assert "timeout_seconds" in refused.value.extra["errors"]
    assert ToolDefinition.objects.count() == 0


def test_the_admin_tool_form_shows_the_timeout_error(client: Client, admin_a: Persona) -> None:
    client.force_login(admin_a.user)
    response = client.post(
        "/admin/runtime/tooldefinition/add/",
        {"tenant": admin_a.tenant.pk, "definition": json.dumps(tickets(timeout_seconds=1e-300))},
    )
    assert response.status_code == 200  # redisplayed, not saved
    errors = response.context["adminform"].form.errors["definition"]
    assert errors == [f"timeout_seconds: between {MIN_TIMEOUT:g} and {MAX_TIMEOUT:g} seconds"]
    assert ToolDefinition.objects.count() == 0


def test_a_file_with_a_timeout_too_short_imports_nothing(tenant_a: Tenant, tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    path.write_text(json.dumps([tickets(timeout_seconds=1e-300)]))
    stderr = StringIO()
    with pytest.raises(CommandError) as refused:
        call_command("tools", "import", str(path), "--tenant", "acme", stderr=stderr)
    assert refused.value.returncode == 1
    assert "tickets.create: timeout_seconds: between 0.1 and 60 seconds" in stderr.getvalue()
    assert ToolDefinition.objects.count() == 0


@pytest.mark.parametrize("timeout", [1e-300, 0.05, 0.0, -2.0, 61.0, math.nan, math.inf], ids=repr)
def test_an_mcp_server_refuses_a_timeout_outside_the_rule(tenant_a: Tenant, timeout: float) -> None:
    with pytest.raises(ValidationError) as refused:
        McpServer.objects.create(
            tenant=tenant_a, name="helpdesk", url=MCP_URL, timeout_seconds=timeout
        )
    assert list(refused.value.message_dict) == ["timeout_seconds"]
    assert not McpServer.objects.exists()
    McpServer.objects.create(tenant=tenant_a, name="helpdesk", url=MCP_URL, timeout_seconds=0.1)


def test_the_admin_mcp_server_form_shows_the_timeout_error(
    client: Client, admin_a: Persona
) -> None:
    client.force_login(admin_a.user)
    form = {
        "tenant": admin_a.tenant.pk,
        "name": "helpdesk",
        "transport": "streamable_http",
        "url": MCP_URL,
        "command": "",
        "args": "[]",
        "credential": "",
        "timeout_seconds": "1e-300",
        "active": "on",
    }
    response = client.post("/admin/runtime/mcpserver/add/", form)
    assert response.status_code == 200  # redisplayed, not saved
    errors = response.context["adminform"].form.errors
    assert errors == {"timeout_seconds": [f"between {MIN_TIMEOUT:g} and {MAX_TIMEOUT:g} seconds"]}
    assert not McpServer.objects.exists()
    saved = client.post("/admin/runtime/mcpserver/add/", {**form, "timeout_seconds": "0.5"})
    assert saved.status_code == 302, saved.content[:2000]
    assert McpServer.objects.get().timeout_seconds == 0.5
