"""An inactive MCP server's tools over the REST API (API.md, "Tools as data"): its tools are
not sent, so the API no longer offers them — the rule the MCP gateway follows
(runtime.toolcatalog.withheld). They were listed by `GET tools/` and `GET tools/{name}/`,
and `POST runs/{id}/actions/` prepared an action of one, asking a reviewer to approve it,
which a worker then failed with "no active MCP server". Now they are not listed, not found
(404 as an unknown name), and a new action is refused as an unknown tool is (422
`invalid_params`); the same request made before finds its action, and past actions stay
readable. Reactivating the server offers them again."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import ApprovalRequest
from runtime import tooldefs
from runtime.models import Action, ActionStatus, McpServer, Tenant
from tests.api import fresh_throttle, get, new_run, ok, prepare, problem, take_lease  # noqa: F401
from tests.conftest import Persona

pytestmark = pytest.mark.django_db

MCP_TOOL = "helpdesk.tickets_create"
HTTP_TOOL = "tickets.create"
PARAMS = {"title": "Printer on fire"}
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}


def _define(tenant: Tenant) -> McpServer:
    """The helpdesk server (never reached: nothing here is sent) with one write tool, and
    an http tool that no server's state touches."""
    server = McpServer.objects.create(tenant=tenant, name="helpdesk", url="http://127.0.0.1:9/mcp")
    mcp_spec = {
        "name": MCP_TOOL,
        "effect": "write",
        "schema": SCHEMA,
        "executor": "mcp",
        "mcp": {"server": "helpdesk", "tool": "tickets_create"},
        "dedup": {"mode": "none"},
    }
    http_spec = {
        "name": HTTP_TOOL,
        "effect": "write",
        "schema": SCHEMA,
        "executor": "http",
        "request": {"method": "POST", "url": "http://127.0.0.1:9/tickets"},
        "dedup": {"mode": "key"},
    }
    tooldefs.define_many(tenant, [mcp_spec, http_spec], "user:admin")
    return server


def _set_active(server: McpServer, active: bool) -> None:
    server.active = active
    server.save()  # as the admin's change form does


def _listed(persona: Persona) -> set[str]:
    return {tool["name"] for tool in ok(get(persona.api(), "tools/"))["results"]}


def _leased(persona: Persona) -> tuple[str, int]:
    run = new_run(persona.api())
    return run["run_id"], take_lease(persona.api(), run["run_id"])


def test_an_inactive_servers_tools_are_neither_listed_nor_found_until_it_is_active_again(
    tenant_a: Tenant, agent_a: Persona, admin_a: Persona
) -> None:
    server = _define(tenant_a)
    assert {MCP_TOOL, HTTP_TOOL} <= _listed(agent_a)
    assert ok(get(agent_a.api(), f"tools/{MCP_TOOL}/"))["executor"] == "mcp"

    _set_active(server, False)
    for persona in (agent_a, admin_a):
        listed = _listed(persona)
        assert HTTP_TOOL in listed and MCP_TOOL not in listed, listed
        problem(get(persona.api(), f"tools/{MCP_TOOL}/"), 404, "not_found")
        problem(get(persona.api(), f"tools/{MCP_TOOL}/?version=1"), 404, "not_found")
    assert ok(get(agent_a.api(), f"tools/{HTTP_TOOL}/"))["name"] == HTTP_TOOL

    _set_active(server, True)
    assert {MCP_TOOL, HTTP_TOOL} <= _listed(agent_a)
    assert ok(get(agent_a.api(), f"tools/{MCP_TOOL}/"))["version"] == 1


def test_a_removed_servers_tools_are_not_listed(tenant_a: Tenant, agent_a: Persona) -> None:
    _define(tenant_a).delete()  # its definitions stay: actions and approvals cite them
    assert MCP_TOOL not in _listed(agent_a)
    problem(get(agent_a.api(), f"tools/{MCP_TOOL}/"), 404, "not_found")


def test_a_new_action_of_an_inactive_servers_tool_is_refused_as_an_unknown_tool(
    tenant_a: Tenant, agent_a: Persona
) -> None:
    server = _define(tenant_a)
    run_id, fence = _leased(agent_a)
    client = agent_a.api()
    before: dict[str, Any] = ok(prepare(client, run_id, fence, MCP_TOOL, PARAMS), 201)
    assert before["status"] == ActionStatus.AWAITING_APPROVAL  # a write no policy names
    approvals = ApprovalRequest.objects.count()

    _set_active(server, False)
    unknown = problem(
        prepare(client, run_id, fence, "helpdesk.nope", PARAMS), 422, "invalid_params"
    )
    refused = problem(
        prepare(client, run_id, fence, MCP_TOOL, {"title": "Another one"}), 422, "invalid_params"
    )
    assert refused["errors"] == unknown["errors"] == {"tool": ["unknown tool"]}
    assert "'helpdesk' is inactive" in refused["detail"]
    assert Action.objects.filter(run_id=run_id).count() == 1
    assert ApprovalRequest.objects.count() == approvals  # no reviewer asked in vain
    # The same request as before finds its action; the action stays readable.
    again = ok(prepare(client, run_id, fence, MCP_TOOL, PARAMS), 200)
    assert again["action_id"] == before["action_id"]
    shown = ok(get(client, f"actions/{before['action_id']}/"))
    assert shown["tool"] == MCP_TOOL and shown["status"] == ActionStatus.AWAITING_APPROVAL
    # Another tool is prepared as ever.
    ok(prepare(client, run_id, fence, HTTP_TOOL, {"title": "Another one"}), 201)

    _set_active(server, True)
    made = ok(prepare(client, run_id, fence, MCP_TOOL, {"title": "Another one"}), 201)
    assert Action.objects.get(pk=made["action_id"]).tool == MCP_TOOL
