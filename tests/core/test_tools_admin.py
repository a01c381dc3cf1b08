"""Tool definitions in Django admin: a tenant admin sees, defines and versions only their
own tenant's tools; a change is a new version through `tooldefs.define`, never an edit; a
refused definition shows its field errors and stores nothing; "Test this tool" shows the
request it would send, credential masked, and sends nothing (the sandbox gets no task)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from approvals.models import ApprovalPolicy
from runtime import tooldefs
from runtime.models import ToolCredential, ToolDefinition
from tests.conftest import Persona
from tests.sandbox import Sandbox

pytestmark = pytest.mark.django_db

TOOLS = "/admin/runtime/tooldefinition/"
NEEDS_APPROVAL = "needs approval by default (no policy names it)"


def ticket_tool(url: str = "http://127.0.0.1:8765", **changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "tickets.create",
        "title": "Open ticket: {title}",
        "effect": "write",
        "schema": {
            "type": "object",
            "properties": {"title": {"type": "string", "minLength": 1}},
            "required": ["title"],
            "additionalProperties": False,
        },
        "editable": ["title"],
        "executor": "http",
        "request": {"method": "POST", "url": url + "/tasks", "headers": {"X-Team": "ops"}},
        "credential": "tasks",
        "dedup": {"mode": "key", "header": "Idempotency-Key"},
        "timeout_seconds": 3,
    }
    spec.update(changes)
    return spec


def _login(client: Client, persona: Persona) -> Client:
    client.force_login(persona.user)
    return client


def _form_errors(response: Any) -> list[str]:
    assert response.status_code == 200, response.status_code  # redisplayed, not saved
    form = response.context["adminform"].form
    return [str(message) for messages in form.errors.values() for message in messages]


def test_adding_a_tool_stores_version_1_through_define(client: Client, admin_a: Persona) -> None:
    _login(client, admin_a)
    form = client.get(TOOLS + "add/")
    assert form.status_code == 200 and b"tickets.create" in form.content  # the template
    saved = client.post(
        TOOLS + "add/",
        {"tenant": admin_a.tenant.pk, "definition": json.dumps(ticket_tool())},
    )
    assert saved.status_code == 302, saved.content[:3000]
    row = ToolDefinition.objects.get()
    assert (row.tenant, row.name, row.version) == (admin_a.tenant, "tickets.create", 1)
    assert row.created_by == "user:ada" and row.spec["request"]["headers"] == {"X-Team": "ops"}


BAD = {
    "invalid schema": (ticket_tool(schema={"type": "thing"}), "schema: "),
    "unknown dedup mode": (ticket_tool(dedup={"mode": "often"}), "dedup.mode: "),
    "JSONPath that does not parse": (ticket_tool(result={"external_id": "$..["}), "result: "),
    "host not allowed": (
        ticket_tool(request={"method": "POST", "url": "https://tracker.example.org/t"}),
        "request.url: ",
    ),
    "URL template into the host": (
        ticket_tool(request={"method": "POST", "url": "http://{title}.example.org/t"}),
        "request.url: ",
    ),
}


@pytest.mark.parametrize(("spec", "where"), list(BAD.values()), ids=list(BAD))
def test_a_refused_definition_shows_its_field_errors_and_stores_nothing(
    client: Client, admin_a: Persona, spec: dict[str, Any], where: str
) -> None:
    _login(client, admin_a)
    response = client.post(
        TOOLS + "add/", {"tenant": admin_a.tenant.pk, "definition": json.dumps(spec)}
    )
    errors = _form_errors(response)
    assert any(e.startswith(where) for e in errors), errors
    assert ToolDefinition.objects.count() == 0


@pytest.mark.parametrize(
    "text",
    ["{nope", "[" * 5_000 + "]" * 5_000, '{"name": "a.b", "name": "c.d"}'],
    ids=["broken", "nested-5000", "duplicate-key"],
)
def test_text_that_is_not_json_is_a_form_error(client: Client, admin_a: Persona, text: str) -> None:
    """Parsed as the API parses (deep JSON was a 500; a repeated key kept its last value)."""
    _login(client, admin_a)
    response = client.post(TOOLS + "add/", {"tenant": admin_a.tenant.pk, "definition": text})
    assert any(e.startswith("not JSON") for e in _form_errors(response))
    assert ToolDefinition.objects.count() == 0


def test_changing_a_tool_makes_a_new_version_and_keeps_the_old(
    client: Client, admin_a: Persona
) -> None:
    first = tooldefs.define(admin_a.tenant, ticket_tool(), "user:ada").definition
    _login(client, admin_a)
    page = client.get(f"{TOOLS}{first.pk}/change/")
    assert page.status_code == 200
    shown = json.loads(page.context["adminform"].form["definition"].value())
    assert shown == first.spec  # the stored definition, prettified, to edit
    assert b"{\n  &quot;name&quot;: &quot;tickets.create&quot;," in page.content  # prettified
    changed = ticket_tool(timeout_seconds=7)
    saved = client.post(f"{TOOLS}{first.pk}/change/", {"definition": json.dumps(changed)})
    assert saved.status_code == 302, saved.content[:3000]
    rows = list(ToolDefinition.objects.order_by("version"))
    assert [r.version for r in rows] == [1, 2]
    assert rows[0].spec["timeout_seconds"] == 3 and rows[1].spec["timeout_seconds"] == 7
    # The list shows the current version only; the change page lists every version.
    listing = client.get(TOOLS)
    assert list(listing.context["cl"].result_list) == [rows[1]]
    history = client.get(f"{TOOLS}{rows[1].pk}/change/").content.decode()
    assert "version 1</a>" in history and "version 2</a>" in history
    # Renaming in the change form would define another tool: refused.
    renamed = client.post(
        f"{TOOLS}{rows[1].pk}/change/", {"definition": json.dumps(ticket_tool(name="other.x"))}
    )
    assert any("add a tool for another name" in e for e in _form_errors(renamed))
    # Saving an unchanged definition stores nothing new.
    again = client.post(f"{TOOLS}{rows[1].pk}/change/", {"definition": json.dumps(changed)})
    assert again.status_code == 302 and ToolDefinition.objects.count() == 2


def test_the_list_says_which_tools_need_approval_by_default(
    client: Client, admin_a: Persona
) -> None:
    tooldefs.define(admin_a.tenant, ticket_tool(), "user:ada")
    tooldefs.define(admin_a.tenant, ticket_tool(name="tickets.read", effect="read"), "user:ada")
    _login(client, admin_a)
    page = client.get(TOOLS).content.decode()
    assert page.count(NEEDS_APPROVAL) == 1
    ApprovalPolicy.objects.create(tenant=admin_a.tenant, name="tickets", tool="tickets.create")
    assert NEEDS_APPROVAL not in client.get(TOOLS).content.decode()


def test_another_tenants_tools_are_invisible(
    client: Client, admin_a: Persona, outsider_b: Persona
) -> None:
    foreign = tooldefs.define(outsider_b.tenant, ticket_tool(name="globex.tool"), "x").definition
    _login(client, admin_a)
    assert b"globex.tool" not in client.get(TOOLS).content
    for url in (f"{TOOLS}{foreign.pk}/change/", f"{TOOLS}{foreign.pk}/history/"):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"] == "/admin/", url
    assert client.get(f"{TOOLS}{foreign.pk}/test/").status_code == 404
    assert client.post(f"{TOOLS}{foreign.pk}/test/", {"params": "{}"}).status_code == 404
    # Changing it by forging its id: not found, nothing stored.
    client.post(f"{TOOLS}{foreign.pk}/change/", {"definition": json.dumps(ticket_tool())})
    # Adding into the other tenant by forging its id: refused by the narrowed choices.
    forged = client.post(
        TOOLS + "add/", {"tenant": outsider_b.tenant.pk, "definition": json.dumps(ticket_tool())}
    )
    assert forged.status_code == 200
    assert ToolDefinition.objects.filter(tenant=outsider_b.tenant).count() == 1
    assert ToolDefinition.objects.filter(tenant=admin_a.tenant).count() == 0
    assert b"globex" not in client.get(TOOLS + "add/").content


def test_a_dry_run_shows_the_request_and_sends_nothing(
    client: Client, admin_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    sandbox = sandbox_factory("key")
    credential = ToolCredential(tenant=admin_a.tenant, service="tasks")
    credential.set_secret("s3cret-token-value", actor="test")
    credential.save()
    row = tooldefs.define(admin_a.tenant, ticket_tool(sandbox.url), "user:ada").definition
    _login(client, admin_a)
    assert b"Test this tool" in client.get(f"{TOOLS}{row.pk}/change/").content
    page = client.get(f"{TOOLS}{row.pk}/test/")
    assert page.status_code == 200 and b"Nothing is sent" in page.content

    shown = client.post(f"{TOOLS}{row.pk}/test/", {"params": json.dumps({"title": "Fix it"})})
    assert shown.status_code == 200
    text = shown.content.decode()
    assert f"POST {sandbox.url}/tasks" in text
    assert "Idempotency-Key: dry-run" in text and "X-Team: ops" in text
    assert "Authorization: Bearer ********" in text
    assert "s3cret-token-value" not in text
    assert "{&quot;title&quot;: &quot;Fix it&quot;}" in text  # the JSON body, escaped
    assert sandbox.tasks() == []  # the service never heard of it

    refused = client.post(f"{TOOLS}{row.pk}/test/", {"params": json.dumps({"title": 5})})
    errors = [str(e) for e in refused.context["form"].errors["params"]]
    assert any(e.startswith("title: ") for e in errors), errors
    assert "dry-run-request" not in refused.content.decode()
    not_json = client.post(f"{TOOLS}{row.pk}/test/", {"params": "{"})
    assert "not JSON" in not_json.content.decode()
    assert sandbox.tasks() == []


@pytest.mark.parametrize("params", [{}, {"task": None}, {"task": {"id": 1}}, {"task": ".."}])
def test_a_dry_run_whose_url_cannot_be_built_says_why(
    client: Client, admin_a: Persona, params: dict[str, Any]
) -> None:
    """Params the schema takes but the URL cannot (a placeholder left empty, an object, a
    dot segment): the form says why, as the action's send would, and not a 500."""
    spec = ticket_tool(
        name="tickets.close",
        title="",
        editable=[],
        schema={"type": "object", "properties": {"task": {}}},
        request={"method": "POST", "url": "http://127.0.0.1:8765/tasks/{task}/close"},
    )
    row = tooldefs.define(admin_a.tenant, spec, "user:ada").definition
    _login(client, admin_a)
    shown = client.post(f"{TOOLS}{row.pk}/test/", {"params": json.dumps(params)})
    assert shown.status_code == 200
    errors = [str(e) for e in shown.context["form"].errors["params"]]
    assert any("URL" in e for e in errors), errors


def test_a_client_tool_dry_run_says_the_agent_performs_it(client: Client, admin_a: Persona) -> None:
    spec = ticket_tool(name="agent.tickets", executor="client")
    del spec["request"]
    row = tooldefs.define(admin_a.tenant, spec, "user:ada").definition
    _login(client, admin_a)
    shown = client.post(f"{TOOLS}{row.pk}/test/", {"params": json.dumps({"title": "x"})})
    assert "the agent performs it" in shown.content.decode()


def test_versions_are_never_deleted_in_admin(client: Client, admin_a: Persona) -> None:
    row = tooldefs.define(admin_a.tenant, ticket_tool(), "user:ada").definition
    _login(client, admin_a)
    assert client.get(f"{TOOLS}{row.pk}/delete/").status_code == 403
    assert ToolDefinition.objects.count() == 1
