"""The request bodies accept what the OpenAPI document says and nothing else (issue 16, L7).

DRF's fields coerce: a BooleanField takes 0 and "yes", a CharField turns 0 into "0". The
document says `boolean` and `string`, so those values are refused with the body-validation
answer every other wrong type gets (400 `invalid_request`, the field named under `errors`),
and nothing is written. The JSON payload fields (goal, state, data, params) are stored in
NOT NULL columns: the document says "any JSON value but null", and null is refused the same
way — the schema and the server agree, so a schema-driven client (schemathesis) never sees a
valid-by-schema body refused.
"""

from __future__ import annotations

from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator

from runtime.models import Run, RunStatus
from tests.api import new_run, ok, post, prepare, problem, row_counts, take_lease
from tests.conftest import Persona

pytestmark = pytest.mark.django_db


def refused_400(response: Any, field: str) -> dict[str, Any]:
    data = problem(response, 400, "invalid_request")
    assert field in data["errors"], data
    return data


@pytest.mark.parametrize("external", [0, 1, "true", "yes", None], ids=repr)
def test_external_must_be_a_json_boolean(agent_a: Persona, external: Any) -> None:
    before = row_counts()
    body = {"graph": "chain", "goal": {}, "external": external}
    refused_400(post(agent_a.api(), "runs/", body), "external")
    assert row_counts() == before


@pytest.mark.parametrize("value", [0, 1.5, ["r"], {"r": 1}, True], ids=repr)
def test_a_text_field_must_be_a_json_string(agent_a: Persona, value: Any) -> None:
    client = agent_a.api()
    run = new_run(client)
    before = row_counts()
    refused_400(post(client, f"runs/{run['run_id']}/cancel/", {"reason": value}), "reason")
    refused_400(post(client, "runs/", {"graph": value, "goal": {}}), "graph")
    lease = {"owner": value, "ttl_seconds": 30}
    refused_400(post(client, f"runs/{run['run_id']}/lease/", lease), "owner")
    assert row_counts() == before
    stored = Run.objects.get(pk=run["run_id"])
    assert stored.status != RunStatus.CANCELLED and stored.fence == 0


def test_an_action_reason_must_be_a_json_string(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    before = row_counts()
    refused_400(prepare(client, run["run_id"], fence, reason=0), "reason")
    assert row_counts() == before


@pytest.mark.parametrize("call", ["create", "revision", "input", "checkpoint", "action"])
def test_null_json_payloads_are_refused_as_the_schema_says(agent_a: Persona, call: str) -> None:
    client = agent_a.api()
    run = new_run(client)
    run_id = run["run_id"]
    fence = take_lease(client, run_id) if call in ("checkpoint", "action") else 0
    url, body, name = {
        "create": ("runs/", {"graph": "chain", "goal": None}, "goal"),
        "revision": (f"runs/{run_id}/revisions/", {"goal": None, "expected_goal_rev": 1}, "goal"),
        "input": (f"runs/{run_id}/input/", {"data": None, "expected_rev": 0}, "data"),
        "checkpoint": (
            f"runs/{run_id}/checkpoints/",
            {"fence": fence, "expected_rev": 0, "state": None, "next_step": "n"},
            "state",
        ),
        "action": (
            f"runs/{run_id}/actions/",
            {"fence": fence, "tool": "tasks.create", "params": None},
            "params",
        ),
    }[call]
    before = row_counts()
    refused_400(post(client, url, body), name)
    assert row_counts() == before


def request_schema(name: str) -> dict[str, Any]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return dict(schema["components"]["schemas"][name])


@pytest.mark.parametrize(
    ("component", "field"),
    [
        ("RunCreateRequest", "goal"),
        ("RevisionInRequest", "goal"),
        ("InputInRequest", "data"),
        ("CheckpointInRequest", "state"),
        ("ActionInRequest", "params"),
    ],
)
def test_the_schema_says_a_json_payload_is_never_null(component: str, field: str) -> None:
    prop = request_schema(component)["properties"][field]
    types = {option["type"] for option in prop["anyOf"]}
    assert types == {"object", "array", "string", "number", "boolean"}
    assert not prop.get("nullable")


def test_the_schema_says_external_is_a_boolean_and_owner_a_string() -> None:
    assert request_schema("RunCreateRequest")["properties"]["external"]["type"] == "boolean"
    assert request_schema("LeaseInRequest")["properties"]["owner"]["type"] == "string"
    assert request_schema("CancelInRequest")["properties"]["reason"]["type"] == "string"


def test_valid_values_still_work(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client, goal=["a list is a JSON value too"], external=True)
    assert run["external"] is True and run["goal"] == ["a list is a JSON value too"]
    cancelled = ok(post(client, f"runs/{run['run_id']}/cancel/", {"reason": "done"}))
    assert cancelled["status"] == RunStatus.CANCELLED


def test_the_schema_says_a_non_blank_text_needs_more_than_white_space() -> None:
    """Found by schemathesis at 12,000 cases: `"owner": "\\n"` met `minLength: 1` but is
    blank once trimmed; the document now says `pattern: \\S`, so client and server agree."""
    owner = request_schema("ReleaseInRequest")["properties"]["owner"]
    assert owner["pattern"] == r"\S" and owner["minLength"] == 1
    assert "pattern" not in request_schema("CancelInRequest")["properties"]["reason"]
