"""`tools/` (API.md, "Tools as data"): every member of a tenant lists and reads its tools,
built-ins included; only the tenant's admin defines one (agents and reviewers 403); a bad
definition is 422 with field errors and stores nothing; another tenant's tool is 404."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from approvals.models import ApprovalPolicy
from audit.models import JournalEntry
from runtime import tooldefs
from runtime.api import toolviews
from runtime.models import ToolDefinition
from tests.api import (
    fresh_throttle,  # noqa: F401
    get,
    ok,
    post,
    problem,
)
from tests.conftest import Persona
from tests.tooldefs import store_unchecked

pytestmark = pytest.mark.django_db

TICKETS: dict[str, Any] = {
    "name": "tickets.create",
    "description": "Open a ticket",
    "effect": "write",
    "schema": {
        "type": "object",
        "properties": {"title": {"type": "string"}},
        "required": ["title"],
    },
    "editable": ["title"],
    "sensitive": [],
    "executor": "http",
    "request": {"method": "POST", "url": "http://127.0.0.1:8765/tickets", "headers": {}},
    "credential": "tasks",
    "dedup": {"mode": "key", "header": "Idempotency-Key"},
    "lookup": {
        "method": "GET",
        "url": "http://127.0.0.1:8765/tickets?key={idempotency_key}",
        "found": "$[0].id",
    },
    "result": {"external_id": "$.id"},
    "timeout_seconds": 5,
    "compensation": "",
}


def tickets(**changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(TICKETS)
    body.update(changes)
    return body


def with_headers(headers: dict[str, str]) -> dict[str, Any]:
    """TICKETS sending these extra headers."""
    return tickets(request={**TICKETS["request"], "headers": headers})


def _defined_events() -> int:
    return JournalEntry.objects.filter(type="tool_defined").count()


def test_a_tenant_admin_defines_a_tool_and_its_agents_see_it(
    admin_a: Persona, agent_a: Persona
) -> None:
    created = ok(post(admin_a.api(), "tools/", TICKETS), 201)
    assert created["name"] == "tickets.create" and created["version"] == 1
    assert created["builtin"] is False
    assert created["effect"] == "write" and created["executor"] == "http"
    assert created["dedup"] == {"mode": "key", "header": "Idempotency-Key"}
    assert created["lookup"]["found"] == "$[0].id"
    assert created["approval_by_default"] is True  # writes, and no policy names it
    assert created["created_by"] == "user:ada" and created["digest"]
    row = ToolDefinition.objects.get()
    assert row.tenant == admin_a.tenant and row.spec["name"] == "tickets.create"

    listed = ok(get(agent_a.api(), "tools/"))
    by_name = {tool["name"]: tool for tool in listed["results"]}
    assert by_name["tickets.create"]["version"] == 1
    assert by_name["tickets.create"]["approval_by_default"] is True
    assert ok(get(agent_a.api(), "tools/tickets.create/")) == created


def test_built_in_tools_are_listed_with_the_tenants(agent_a: Persona) -> None:
    listed = ok(get(agent_a.api(), "tools/"))
    builtins = {tool["name"]: tool for tool in listed["results"] if tool["builtin"]}
    assert {"tasks.create", "tasks.close", "agent.tasks.create"} <= set(builtins)
    assert builtins["tasks.create"]["request"]["method"] == "POST"
    assert builtins["agent.tasks.create"]["executor"] == "client"
    assert builtins["agent.tasks.create"]["request"] is None
    assert all(tool["approval_by_default"] is False for tool in builtins.values())
    assert ok(get(agent_a.api(), "tools/tasks.create/"))["builtin"] is True
    problem(get(agent_a.api(), "tools/tasks.create/?version=2"), 404, "not_found")


def test_a_policy_or_a_read_effect_means_no_approval_by_default(
    admin_a: Persona, agent_a: Persona
) -> None:
    ok(post(admin_a.api(), "tools/", TICKETS), 201)
    ok(post(admin_a.api(), "tools/", tickets(name="tickets.read", effect="read")), 201)
    ApprovalPolicy.objects.create(tenant=admin_a.tenant, name="t", tool="tickets.create")
    by_name = {t["name"]: t for t in ok(get(agent_a.api(), "tools/"))["results"]}
    assert by_name["tickets.create"]["approval_by_default"] is False
    assert by_name["tickets.read"]["approval_by_default"] is False
    ApprovalPolicy.objects.update(active=False)
    assert ok(get(agent_a.api(), "tools/tickets.create/"))["approval_by_default"] is True


BAD = {
    "invalid schema": (tickets(schema={"type": 12}), "invalid_tool", "schema"),
    "unknown dedup mode": (
        tickets(dedup={"mode": "sometimes", "header": "Idempotency-Key"}),
        "invalid_tool",
        "dedup.mode",
    ),
    "JSONPath that does not parse": (
        tickets(result={"external_id": "$[?"}),
        "invalid_tool",
        "result",
    ),
    # RFC 9535 numbers are I-JSON's: the library's OverflowError was a 500 before.
    "JSONPath with a number past a double's range": (
        tickets(result={"external_id": "$[?@.a==1e400].id"}),
        "invalid_tool",
        "result",
    ),
    # Nested descendant segments: the work multiplies by the answer's size at each one.
    "JSONPath with a descendant inside a descendant": (
        tickets(result={"external_id": "$..[?@..[?@..id]].id"}),
        "invalid_tool",
        "result",
    ),
    "lookup JSONPath that does not parse": (
        tickets(lookup={"url": "http://127.0.0.1:8765/t?key={idempotency_key}", "found": "$$"}),
        "invalid_tool",
        "lookup.found",
    ),
    "host not allowed": (
        tickets(request={"method": "POST", "url": "https://tickets.example.com/t"}),
        "host_not_allowed",
        "request.url",
    ),
    "URL template into the host": (
        tickets(request={"method": "POST", "url": "http://{title}/tickets"}),
        "invalid_tool",
        "request.url",
    ),
    "URL template into the port": (
        tickets(request={"method": "POST", "url": "http://127.0.0.1:{title}/tickets"}),
        "invalid_tool",
        "request.url",
    ),
    # Sent beside the key as a second header: a service reading the first one dedups every
    # action by this constant (the sandbox does: the second action "applied" as the first).
    "the dedup header as an extra header": (
        with_headers({"idempotency-key": "same-for-all"}),
        "invalid_tool",
        "request.headers",
    ),
    # Python's `re` takes `\Z`; ECMA-262 and jsonschema-rs, which run a schema's patterns
    # (runtime.paramcheck), do not: every action would have been refused.
    "a pattern Holdpoint cannot run": (
        tickets(
            schema={
                "type": "object",
                "properties": {"title": {"type": "string", "pattern": "^x\\Z"}},
            }
        ),
        "invalid_tool",
        "schema",
    ),
    # A `$ref` that comes back to itself without reaching into the params: every check of
    # an action's params recursed until Python's stack ran out (a 500 at `POST actions/`,
    # a failed step in a worker), for every action of the tool.
    "a $ref that loops": (
        tickets(
            schema={
                "type": "object",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
                "properties": {"title": {"$ref": "#/$defs/a"}},
            }
        ),
        "invalid_tool",
        "schema",
    ),
    "a $ref to itself": (
        tickets(schema={"type": "object", "properties": {"title": {"$ref": "#/properties/title"}}}),
        "invalid_tool",
        "schema",
    ),
    # A lookup that does not carry the key asks the same question for every action: any
    # effect it finds would confirm each of them (a false completion).
    "a lookup without the key": (
        tickets(lookup={"url": "http://127.0.0.1:8765/tickets?mine=1", "found": "$[0].id"}),
        "invalid_tool",
        "lookup.url",
    ),
    # Accepted before, then refused at every send (http.client and h11 take neither).
    "a header value with a control character": (
        with_headers({"X-Team": "ops\x01"}),
        "invalid_tool",
        "request.headers",
    ),
    "a header value past Latin-1": (
        with_headers({"X-Team": "ops \u20ac"}),
        "invalid_tool",
        "request.headers",
    ),
    # `$` also matches before a final line break. Accepted before: every action of the
    # first was refused at send ("not a header name"), the second went out without the
    # credential (no credential has that name), the third stood beside tickets.create
    # looking like it (and was not 409 tool_exists).
    "a key header ending in a line break": (
        tickets(dedup={"mode": "key", "header": "Idempotency-Key\n"}),
        "invalid_tool",
        "dedup.header",
    ),
    "a credential ending in a line break": (
        tickets(credential="tasks\n"),
        "invalid_tool",
        "credential",
    ),
    "a name ending in a line break": (tickets(name="tickets.create\n"), "invalid_tool", "name"),
    "not an object": (["tickets.create"], "invalid_tool", "tool"),
    "unknown field": (tickets(surprise=1), "invalid_tool", "surprise"),
}


@pytest.mark.parametrize(("body", "code", "field"), list(BAD.values()), ids=list(BAD))
def test_a_bad_definition_is_422_with_field_errors_and_stores_nothing(
    admin_a: Persona, body: Any, code: str, field: str
) -> None:
    refused = problem(post(admin_a.api(), "tools/", body), 422, code)
    assert field in refused["errors"], refused
    assert all(isinstance(m, str) for ms in refused["errors"].values() for m in ms)
    assert ToolDefinition.objects.count() == 0
    assert _defined_events() == 0


@pytest.mark.parametrize("who", ["agent_a", "reviewer_a", "viewer_a"])
def test_only_the_tenants_admin_defines_a_tool(who: str, request: pytest.FixtureRequest) -> None:
    persona: Persona = request.getfixturevalue(who)
    refused = problem(post(persona.api(), "tools/", TICKETS), 403, "not_permitted")
    assert "admin" in refused["detail"]
    assert ToolDefinition.objects.count() == 0 and _defined_events() == 0
    assert ok(get(persona.api(), "tools/"))["results"]  # reading is for every member


def test_without_credentials_401() -> None:
    problem(get(APIClient(), "tools/"), 401, "not_authenticated")
    problem(post(APIClient(), "tools/", TICKETS), 401, "not_authenticated")


def test_a_defined_name_is_409_tool_exists(admin_a: Persona) -> None:
    ok(post(admin_a.api(), "tools/", TICKETS), 201)
    problem(post(admin_a.api(), "tools/", tickets(description="again")), 409, "tool_exists")
    assert ToolDefinition.objects.count() == 1


def test_another_tenants_tool_is_404(
    admin_a: Persona, agent_a: Persona, outsider_b: Persona, agent_b: Persona
) -> None:
    tooldefs.define(outsider_b.tenant, tickets(name="globex.only"), "user:bob")
    problem(get(agent_a.api(), "tools/globex.only/"), 404, "not_found")
    problem(get(agent_a.api(), "tools/globex.only/?version=1"), 404, "not_found")
    names = {t["name"] for t in ok(get(agent_a.api(), "tools/"))["results"]}
    assert "globex.only" not in names
    revision = {**tickets(name="globex.only"), "expected_version": 1}
    problem(
        admin_a.api().put("/api/v1/tools/globex.only/", revision, format="json"), 404, "not_found"
    )
    # The same name is free in tenant A: it is A's own, and B's is untouched.
    ok(post(admin_a.api(), "tools/", tickets(name="globex.only")), 201)
    assert ok(get(agent_b.api(), "tools/globex.only/"))["created_by"] == "user:bob"
    assert ToolDefinition.objects.filter(name="globex.only").count() == 2


def test_idempotency_key_replays_the_first_response(admin_a: Persona) -> None:
    client = admin_a.api()
    first = post(client, "tools/", TICKETS, HTTP_IDEMPOTENCY_KEY="k-1")
    again = post(client, "tools/", TICKETS, HTTP_IDEMPOTENCY_KEY="k-1")
    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true" and again.json() == first.json()
    problem(
        post(client, "tools/", tickets(name="tickets.other"), HTTP_IDEMPOTENCY_KEY="k-1"),
        422,
        "idempotency_key_reused",
    )
    assert ToolDefinition.objects.count() == 1
    # A refused request gives its key back: fixed, the same key goes through.
    problem(
        post(client, "tools/", tickets(effect="maybe"), HTTP_IDEMPOTENCY_KEY="k-2"),
        422,
        "invalid_tool",
    )
    ok(post(client, "tools/", tickets(name="tickets.two"), HTTP_IDEMPOTENCY_KEY="k-2"), 201)


def test_a_new_version_by_put_with_expected_version(admin_a: Persona, agent_a: Persona) -> None:
    client = admin_a.api()
    ok(post(client, "tools/", TICKETS), 201)
    url = "/api/v1/tools/tickets.create/"
    changed = {**tickets(description="Open a ticket, v2"), "expected_version": 1}
    revised = ok(client.put(url, changed, format="json"))
    assert revised["version"] == 2 and revised["description"] == "Open a ticket, v2"
    # The caller saw version 1: version 2 is current now, so a second edit from v1 is refused.
    stale = {**tickets(description="lost update"), "expected_version": 1}
    problem(client.put(url, stale, format="json"), 409, "version_conflict")
    # Unchanged: no new version.
    same = {**tickets(description="Open a ticket, v2"), "expected_version": 2}
    assert ok(client.put(url, same, format="json"))["version"] == 2
    # The name comes from the URL; another name in the body is refused.
    renamed = {**tickets(name="tickets.renamed"), "expected_version": 2}
    problem(client.put(url, renamed, format="json"), 422, "invalid_tool")
    problem(client.put(url, tickets(), format="json"), 422, "invalid_tool")  # no expected_version
    problem(
        agent_a.api().put(url, {**TICKETS, "expected_version": 2}, format="json"),
        403,
        "not_permitted",
    )
    assert ToolDefinition.objects.count() == 2
    old = ok(get(agent_a.api(), "tools/tickets.create/?version=1"))
    assert old["version"] == 1 and old["description"] == "Open a ticket"
    assert ok(get(agent_a.api(), "tools/tickets.create/"))["version"] == 2
    problem(get(agent_a.api(), "tools/tickets.create/?version=x"), 422, "invalid_params")
    problem(get(agent_a.api(), "tools/tickets.create/?version=9"), 404, "not_found")


def test_the_list_pages_by_cursor(
    admin_a: Persona, agent_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a.one", "b.two", "c.three"):
        ok(post(admin_a.api(), "tools/", tickets(name=name)), 201)
    monkeypatch.setattr(toolviews, "PAGE_SIZE", 2)
    client = agent_a.api()
    seen: list[str] = []
    page = ok(get(client, "tools/"))
    assert page["previous"] is None
    pages = [page]
    while page["next"]:
        page = ok(client.get(page["next"]))
        pages.append(page)
    seen = [tool["name"] for p in pages for tool in p["results"]]
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    assert {"a.one", "b.two", "c.three", "tasks.create"} <= set(seen)
    back = ok(client.get(pages[-1]["previous"]))
    assert [t["name"] for t in back["results"]] == [t["name"] for t in pages[-2]["results"]]
    problem(get(client, "tools/?cursor=bm9wZQ"), 422, "invalid_params")


def test_a_schema_that_recurses_into_its_params_is_a_definition(admin_a: Persona) -> None:
    """A `$ref` back to the root through a property reaches one level deeper into the
    params each time: a tree of any depth, not a loop."""
    tree = {
        "type": "object",
        "properties": {"title": {"type": "string"}, "child": {"$ref": "#"}},
    }
    ok(post(admin_a.api(), "tools/", tickets(schema=tree)), 201)


def test_a_stored_schema_that_loops_refuses_the_params_not_the_server(
    admin_a: Persona, agent_a: Persona
) -> None:
    """A definition stored before such schemas were refused: its actions are 422
    invalid_params with the reason, not a 500, and nothing is prepared."""
    from runtime import protocol
    from runtime.lifecycle import create_run
    from runtime.models import Action

    ok(post(admin_a.api(), "tools/", TICKETS), 201)
    row = ToolDefinition.objects.get()
    looping = {"type": "object", "properties": {"title": {"$ref": "#/properties/title"}}}
    store_unchecked(row, {**row.spec, "schema": looping})
    run = create_run(
        admin_a.tenant,
        "ticketing",
        {"title": "x"},
        actor="agent:a",
        external=True,
        executor_account=agent_a.user,
    )
    fence = protocol.take(run, "agent-1", 30, who="agent:a").fence
    body = {"fence": fence, "tool": "tickets.create", "params": {"title": "x"}, "reason": "r"}
    refused = problem(
        post(agent_a.api(), f"runs/{run.run_id}/actions/", body), 422, "invalid_params"
    )
    assert "schema" in json.dumps(refused)
    assert not Action.objects.exists()
