"""The OpenAPI document at /api/v1/schema/ (API.md: "the complete reference and must match the
code"): OpenAPI 3.0.3, every call of API.md with its statuses, every problem code, a clean
`spectacular --validate --fail-on-warn`, and a Swagger UI served without any external URL.
"""

from __future__ import annotations

import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.test import Client

from runtime.api.problems import CODES
from tests.api import (
    PROBLEM,
    api_routes,
    fresh_throttle,  # noqa: F401
)

pytestmark = pytest.mark.django_db

# API.md's calls: (method, path) → success status and the refusal statuses it lists.
CALLS: dict[tuple[str, str], tuple[int, set[int]]] = {
    ("post", "/api/v1/runs/"): (201, {422}),
    ("get", "/api/v1/runs/"): (200, set()),
    ("get", "/api/v1/runs/{run_id}/"): (200, {404}),
    ("post", "/api/v1/runs/{run_id}/revisions/"): (200, {409}),
    ("post", "/api/v1/runs/{run_id}/input/"): (200, {409}),
    ("post", "/api/v1/runs/{run_id}/cancel/"): (200, {409}),
    ("post", "/api/v1/runs/{run_id}/resume/"): (202, {409}),
    ("get", "/api/v1/runs/{run_id}/checkpoints/"): (200, set()),
    ("get", "/api/v1/runs/{run_id}/checkpoints/{rev}/"): (200, set()),
    ("get", "/api/v1/runs/{run_id}/events/"): (200, set()),
    ("get", "/api/v1/runs/{run_id}/actions/"): (200, set()),
    ("post", "/api/v1/runs/{run_id}/lease/"): (200, {409}),
    ("post", "/api/v1/runs/{run_id}/lease/heartbeat/"): (200, {409}),
    ("post", "/api/v1/runs/{run_id}/lease/release/"): (200, {409}),
    ("post", "/api/v1/runs/{run_id}/checkpoints/"): (201, {409}),
    ("post", "/api/v1/runs/{run_id}/actions/"): (201, {409, 422}),
    ("post", "/api/v1/actions/{action_id}/dispatch/"): (200, {409}),
    ("post", "/api/v1/actions/{action_id}/outcome/"): (200, {409}),
    ("get", "/api/v1/actions/"): (200, set()),
    ("get", "/api/v1/approvals/"): (200, set()),
    ("get", "/api/v1/approvals/{approval_id}/"): (200, {404}),
    ("post", "/api/v1/approvals/{approval_id}/decision/"): (200, {403, 409, 422}),
    ("post", "/api/v1/actions/{action_id}/resolve/"): (200, {403, 409}),
    ("get", "/api/v1/tools/"): (200, set()),
    ("get", "/api/v1/tools/{name}/"): (200, {404}),
    ("post", "/api/v1/tools/"): (201, {403, 409, 422}),
    ("put", "/api/v1/tools/{name}/"): (200, {403, 404, 409, 422}),
}
# Every refusal code API.md names.
API_MD_CODES = {
    "unknown_graph",
    "version_conflict",
    "run_finished",
    "not_waiting_input",
    "already_completed",
    "lease_held",
    "stale_fence",
    "invalid_params",
    "idempotency_key_reused",
    "approval_required",
    "approval_expired",
    "stale_goal_rev",
    "action_cancelled",
    "invalid_transition",
    "not_permitted",
    "hash_mismatch",
    "already_decided",
    "expired",
    "field_not_editable",
    "not_found",
    "not_authenticated",
    "invalid_tool",
    "tool_exists",
    "host_not_allowed",
}
# The object fields API.md requires, by component.
FIELDS = {
    "Run": {
        "run_id",
        "thread_id",
        "graph",
        "graph_version",
        "status",
        "goal",
        "goal_rev",
        "checkpoint_rev",
        "next_step",
        "waiting_for",
        "lease",
        "created_at",
        "updated_at",
    },
    "Checkpoint": {"rev", "goal_rev", "next_step", "state", "digest", "created_at", "created_by"},
    "JournalEntry": {"seq", "type", "actor", "payload", "prev_hash", "hash", "created_at"},
    "Action": {
        "action_id",
        "run_id",
        "idempotency_key",
        "tool",
        "params",
        "fingerprint",
        "status",
        "goal_rev",
        "external_id",
        "result",
        "approval",
    },
    "Approval": {
        "id",
        "run_id",
        "action",
        "action_hash",
        "status",
        "expires_at",
        "decided_by",
        "decided_at",
        "decision_reason",
    },
    "Tool": {
        "name",
        "version",
        "builtin",
        "description",
        "effect",
        "schema",
        "executor",
        "request",
        "credential",
        "dedup",
        "lookup",
        "result",
        "timeout_seconds",
        "compensation",
        "approval_by_default",
    },
}
LISTS = {
    "/api/v1/runs/": {"status", "thread_id", "graph", "cursor"},
    "/api/v1/actions/": {"idempotency_key", "cursor"},
    "/api/v1/approvals/": {"status", "cursor"},
    "/api/v1/runs/{run_id}/checkpoints/": {"cursor"},
    "/api/v1/runs/{run_id}/actions/": {"cursor"},
    "/api/v1/tools/": {"cursor"},
}


@pytest.fixture
def schema(client: Client) -> dict[str, Any]:
    response = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    assert "json" in response["Content-Type"]
    return response.json()


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        node = schema["components"]["schemas"][name]
    return node


def test_the_document_is_openapi_3_0_3(schema: dict[str, Any], client: Client) -> None:
    assert schema["openapi"] == "3.0.3"
    as_yaml = yaml.safe_load(client.get("/api/v1/schema/").content)
    assert as_yaml["openapi"] == "3.0.3" and as_yaml["paths"].keys() == schema["paths"].keys()


def test_every_call_of_api_md_is_documented_with_its_statuses(schema: dict[str, Any]) -> None:
    for (method, path), (success, refusals) in CALLS.items():
        assert path in schema["paths"], path
        operation = schema["paths"][path].get(method)
        assert operation is not None, f"{method.upper()} {path}"
        statuses = {int(code) for code in operation["responses"]}
        assert success in statuses, (method, path, sorted(statuses))
        assert refusals <= statuses, (method, path, sorted(statuses))
        for status in refusals | {401}:
            content = operation["responses"][str(status)]["content"]
            assert resolve(schema, content[PROBLEM]["schema"])["required"]
        auth = {next(iter(s)) for s in operation.get("security", [])}
        assert {"tokenAuth", "cookieAuth"} <= auth, (method, path)


def test_every_routed_call_is_documented_and_nothing_else(schema: dict[str, Any]) -> None:
    routed = {
        (method.lower(), route)
        for route, _, methods in api_routes()
        if not route.endswith(("/schema/", "/docs/"))
        for method in methods
    }
    documented = {
        (method, path)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }
    assert routed == documented
    assert set(CALLS) <= documented


def test_the_problem_schema_enumerates_every_code(schema: dict[str, Any]) -> None:
    problem = schema["components"]["schemas"]["Problem"]
    assert set(problem["required"]) >= {"type", "title", "status", "detail", "code"}
    assert set(problem["properties"]["code"]["enum"]) == set(CODES)
    assert API_MD_CODES <= set(CODES), API_MD_CODES - set(CODES)
    assert problem["properties"]["errors"]["additionalProperties"]["type"] == "array"


def test_objects_document_the_fields_api_md_requires(schema: dict[str, Any]) -> None:
    found: dict[str, set[str]] = {}
    for (method, path), (success, _) in CALLS.items():
        body = schema["paths"][path][method]["responses"][str(success)].get("content", {})
        node = resolve(schema, body.get("application/json", {}).get("schema", {}))
        if "results" in node.get("properties", {}):  # a page (or the events list)
            node = node["properties"]["results"]
        if node.get("type") == "array":
            node = node["items"]
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            found[name] = set(resolve(schema, node).get("properties", {}))
    for name, fields in FIELDS.items():
        assert name in found, f"{name} is not the response of any call"
        assert fields <= found[name], (name, fields - found[name])
    statuses = schema["components"]["schemas"]
    assert "needs_reconciliation" in statuses["RunStatusEnum"]["enum"]
    assert "manual_review" in statuses["ActionStatusEnum"]["enum"]
    assert "superseded" in statuses["ApprovalStatusEnum"]["enum"]


@pytest.mark.parametrize("path", [*LISTS, "/api/v1/runs/{run_id}/events/"])
def test_list_calls_document_their_page_and_filters(schema: dict[str, Any], path: str) -> None:
    operation = schema["paths"][path]["get"]
    body = resolve(schema, operation["responses"]["200"]["content"]["application/json"]["schema"])
    assert body.get("type") == "object"
    assert "results" in body.get("properties", {})
    expected = LISTS.get(path, {"after"})
    parameters = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
    assert expected <= parameters, expected - parameters


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/runs/",
        "/api/v1/approvals/",
        "/api/v1/runs/{run_id}/events/",
        "/api/v1/runs/{run_id}/",
        "/api/v1/approvals/{approval_id}/",
        "/api/v1/tools/",
        "/api/v1/tools/{name}/",
    ],
)
def test_get_calls_that_validate_their_query_document_422(
    schema: dict[str, Any], path: str
) -> None:
    responses = schema["paths"][path]["get"]["responses"]
    assert "422" in responses
    assert PROBLEM in responses["422"]["content"]


def test_spectacular_validates_without_warnings(tmp_path: Path) -> None:
    out = StringIO()
    target = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(target), stdout=out)
    assert yaml.safe_load(target.read_text())["openapi"] == "3.0.3"


def test_swagger_ui_is_served_without_any_external_url(client: Client) -> None:
    response = client.get("/api/v1/docs/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assert "swagger-ui" in html
    for host in ("cdn", "unpkg", "jsdelivr", "cloudflare", "googleapis"):
        assert host not in html.lower(), host
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assets = re.findall(r"""(?:src|href)=["'](/static/[^"']+)["']""", html)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    for asset in assets:
        served = client.get(asset)
        assert served.status_code == 200, asset
        body = b"".join(served.streaming_content) if served.streaming else served.content
        assert body
