"""Bad input (TEST-MATRIX D2/D3): every hostile request is refused in application/problem+json
with a stable `code`, never with a 5xx, and writes nothing (row counts before = after).

Bodies are sent as raw bytes so the test controls exactly what the parser sees.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from audit.journal import run_stream
from audit.verification import verify_stream
from runtime.auth import revoke_token
from runtime.models import AgentToken, Run
from tests.api import (
    METHODS,
    PROBLEM,
    api_routes,
    fresh_throttle,  # noqa: F401
    get,
    new_run,
    ok,
    post,
    prepare,
    problem,
    row_counts,
    take_lease,
)
from tests.conftest import Persona

pytestmark = pytest.mark.django_db

ON_POSTGRES = "postgresql" in settings.DATABASES["default"]["ENGINE"]


def raw(client: APIClient, url: str, body: bytes, content_type: str = "application/json") -> Any:
    return client.generic("POST", url, body, content_type=content_type)


def refused(response: Any, status: int | tuple[int, ...], *codes: str) -> dict[str, Any]:
    """A 4xx problem with one of `codes`; never 5xx."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert response.status_code < 500, response.content[:300]
    assert response.status_code in statuses, (response.status_code, response.content[:300])
    assert response["Content-Type"].split(";")[0] == PROBLEM
    data = response.json()
    assert data["code"] in codes, data
    assert data["status"] == response.status_code
    return data


@pytest.fixture
def leased(agent_a: Persona) -> dict[str, Any]:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    return {"client": client, "run_id": run["run_id"], "fence": fence}


# --- the JSON parser --------------------------------------------------------------------------

BAD_JSON: dict[str, bytes] = {
    "truncated": b'{"graph": "chain", "goal": ',
    "not-json": b"graph=chain&goal=1",
    "trailing-garbage": b'{"graph": "chain", "goal": {}} x',
    "duplicate-keys": b'{"graph": "chain", "graph": "asker", "goal": {}}',
    "duplicate-nested-keys": b'{"graph": "chain", "goal": {"a": 1, "a": 2}}',
    "nan": b'{"graph": "chain", "goal": {"x": NaN}}',
    "infinity": b'{"graph": "chain", "goal": {"x": Infinity}}',
    "minus-infinity": b'{"graph": "chain", "goal": {"x": -Infinity}}',
    "nul-in-value": b'{"graph": "chain", "goal": {"x": "a\\u0000b"}}',
    "nul-in-key": b'{"graph": "chain", "goal": {"a\\u0000": 1}}',
    "nul-in-graph": b'{"graph": "chain\\u0000", "goal": {}}',
    "nul-in-thread-id": b'{"graph": "chain", "goal": {}, "thread_id": "t\\u0000"}',
    "int-beyond-2**53": b'{"graph": "chain", "goal": {"x": 9007199254740993}}',
    "float-overflow": b'{"graph": "chain", "goal": {"x": 1e400}}',
    "lone-surrogate": b'{"graph": "chain", "goal": {"x": "\\ud800"}}',
    "invalid-utf8": b'{"graph": "chain", "goal": {"x": "\xff\xfe"}}',
    "nested-5000": b'{"graph": "chain", "goal": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "nested-100000": b"[" * 100_000 + b"]" * 100_000,
    "nested-objects-5000": b'{"graph": "chain", "goal": '
    + b'{"a":' * 5000
    + b"1"
    + b"}" * 5000
    + b"}",
}


@pytest.mark.parametrize("body", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_malformed_json_on_create_run_is_400(agent_a: Persona, body: bytes) -> None:
    before = row_counts()
    refused(raw(agent_a.api(), "/api/v1/runs/", body), 400, "malformed_request")
    assert row_counts() == before


@pytest.mark.parametrize(
    "params",
    [
        b'{"title": "a", "title": "b"}',
        b'{"title": NaN}',
        b'{"title": "x\\u0000y"}',
        b'{"title": "t", "n": 18014398509481984}',
        b'{"title": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ],
    ids=["duplicate-keys", "nan", "nul", "big-int", "nested-5000"],
)
def test_malformed_params_on_prepare_are_400(leased: dict[str, Any], params: bytes) -> None:
    body = b'{"fence": %d, "tool": "tasks.create", "reason": "r", "params": %s}' % (
        leased["fence"],
        params,
    )
    before = row_counts()
    url = f"/api/v1/runs/{leased['run_id']}/actions/"
    refused(raw(leased["client"], url, body), 400, "malformed_request")
    assert row_counts() == before


def test_nul_in_checkpoint_state_is_400_and_nothing_is_written(leased: dict[str, Any]) -> None:
    body = json.dumps(
        {"fence": leased["fence"], "expected_rev": 0, "state": {"x": "\u0000"}, "next_step": "a"}
    ).encode()
    before = row_counts()
    url = f"/api/v1/runs/{leased['run_id']}/checkpoints/"
    data = refused(raw(leased["client"], url, body), 400, "malformed_request")
    assert list(data["errors"]) == ["state.x"]  # says where, not only what
    assert "NUL" in data["errors"]["state.x"][0]
    assert row_counts() == before
    assert Run.objects.get(pk=leased["run_id"]).checkpoint_rev == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"graph": "chain", "goal": {"x": "a\\u0000b"}}', "goal.x"),
        (b'{"graph": "chain", "goal": {"items": [1, NaN]}}', "$"),
        (b'{"graph": "chain", "goal": {"items": [1, 9007199254740993]}}', "goal.items[1]"),
        (b'{"graph": "chain\\u0000", "goal": {}}', "graph"),
    ],
)
def test_a_malformed_body_names_the_field(agent_a: Persona, body: bytes, field: str) -> None:
    data = refused(raw(agent_a.api(), "/api/v1/runs/", body), 400, "malformed_request")
    assert field in data["errors"], data


def test_a_body_over_the_upload_limit_is_refused(agent_a: Persona) -> None:
    size = settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 2_621_440
    body = b'{"graph": "chain", "goal": {"x": "' + b"a" * (size + 10) + b'"}}'
    before = row_counts()
    refused(raw(agent_a.api(), "/api/v1/runs/", body), (400, 413), "payload_too_large")
    assert row_counts() == before


def test_params_larger_than_the_tool_schema_allows_are_422(leased: dict[str, Any]) -> None:
    before = row_counts()
    params = {"title": "t", "body": "b" * 20_001}
    response = prepare(leased["client"], leased["run_id"], leased["fence"], params=params)
    data = refused(response, 422, "invalid_params")
    assert "body" in data["errors"]
    assert row_counts() == before


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'"a string"', b"42", b"null", b""],
    ids=["array", "string", "number", "null", "empty"],
)
def test_a_body_that_is_not_an_object_is_400(agent_a: Persona, body: bytes) -> None:
    before = row_counts()
    data = refused(raw(agent_a.api(), "/api/v1/runs/", body), 400, "invalid_request")
    assert data["errors"]
    assert row_counts() == before


@pytest.mark.tampers_journal  # on PostgreSQL the finding leaves a journal that cannot be verified
@pytest.mark.parametrize("number", [b"1e17", b"-2.7782981377118224e16", b"1e300"])
def test_a_big_integral_float_is_refused_or_kept_exactly(
    leased: dict[str, Any], number: bytes
) -> None:
    client, run_id = leased["client"], leased["run_id"]
    body = b'{"goal": {"x": %s}, "expected_goal_rev": 1}' % number
    response = raw(client, f"/api/v1/runs/{run_id}/revisions/", body)
    if response.status_code >= 400:
        refused(response, (400, 422), "malformed_request", "invalid_params")
        return
    sent = json.loads(body)["goal"]
    assert response.json()["goal"] == sent
    again = get(client, f"runs/{run_id}/")
    assert json.loads(again.content)["goal"] == sent
    assert type(json.loads(again.content)["goal"]["x"]) is float
    assert verify_stream(run_stream(run_id)) is None


# --- content types ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=xyz",
        "text/plain",
        "application/xml",
    ],
)
def test_a_wrong_content_type_is_415(agent_a: Persona, content_type: str) -> None:
    before = row_counts()
    body = b'{"graph": "chain", "goal": {}}'
    response = raw(agent_a.api(), "/api/v1/runs/", body, content_type)
    refused(response, 415, "unsupported_media_type")
    assert row_counts() == before


def test_a_codec_charset_is_not_applied_to_the_body(agent_a: Persona) -> None:
    """`charset=bz2_codec` must not make the server run a codec over the body: JSON is UTF-8
    (RFC 8259), so the body is read as UTF-8 or the request is refused — never a 5xx."""
    body = b'{"graph": "chain", "goal": {"x": "\xc3\xa9"}}'
    response = raw(agent_a.api(), "/api/v1/runs/", body, "application/json; charset=bz2_codec")
    assert response.status_code < 500
    if response.status_code == 201:
        assert response.json()["goal"] == {"x": "é"}
    else:
        assert response["Content-Type"].split(";")[0] == PROBLEM


# --- path ids, numbers, fences, keys -----------------------------------------------------------


def _with(route: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        route = route.replace("{" + name + "}", value)
    return route


@pytest.mark.parametrize("bad_id", ["not-a-uuid", "123", "00000000-0000-0000-0000-00000000000g"])
def test_non_uuid_path_ids_are_404_on_every_route(agent_a: Persona, bad_id: str) -> None:
    client = agent_a.api()
    before = row_counts()
    checked = 0
    for route, names, methods in api_routes():
        if not names:
            continue
        url = _with(route, {n: ("1" if n == "rev" else bad_id) for n in names})
        for method in methods:
            response = client.generic(method, url, b"{}", content_type="application/json")
            refused(response, 404, "not_found")
            checked += 1
    assert checked >= 18
    assert row_counts() == before


@pytest.mark.parametrize(
    "ttl",
    [-5, 0, 1, 3601, 10**12, 2**53 + 1, 1.5, "30s", None, [30], {"s": 30}, True],
    ids=lambda v: repr(v)[:12],
)
def test_bad_ttl_seconds_are_refused_and_no_lease_is_taken(agent_a: Persona, ttl: Any) -> None:
    client = agent_a.api()
    run = new_run(client)
    before = row_counts()
    response = post(client, f"runs/{run['run_id']}/lease/", {"owner": "p1", "ttl_seconds": ttl})
    refused(response, 400, "invalid_request", "malformed_request")
    assert row_counts() == before
    assert Run.objects.get(pk=run["run_id"]).fence == 0


@pytest.mark.parametrize(
    "fence",
    ["abc", "", None, True, [1], {"v": 1}, 0, -1, 1.5, 2**53 + 1],
    ids=lambda v: repr(v)[:12],
)
@pytest.mark.parametrize("call", ["heartbeat", "release", "checkpoint", "prepare"])
def test_bad_fences_are_refused_and_nothing_is_written(
    leased: dict[str, Any], fence: Any, call: str
) -> None:
    client, run_id = leased["client"], leased["run_id"]
    url, body = {
        "heartbeat": (f"runs/{run_id}/lease/heartbeat/", {}),
        "release": (f"runs/{run_id}/lease/release/", {}),
        "checkpoint": (
            f"runs/{run_id}/checkpoints/",
            {"expected_rev": 0, "state": {}, "next_step": "a"},
        ),
        "prepare": (f"runs/{run_id}/actions/", {"tool": "tasks.create", "params": {"title": "t"}}),
    }[call]
    stored = Run.objects.get(pk=run_id)
    before = row_counts()
    data = refused(
        post(client, url, {**body, "fence": fence}), 400, "invalid_request", "malformed_request"
    )
    if data["code"] == "invalid_request":
        assert "fence" in data["errors"]
    assert row_counts() == before
    after = Run.objects.get(pk=run_id)
    assert (after.lease_owner, after.lease_expires_at) == (
        stored.lease_owner,
        stored.lease_expires_at,
    )


@pytest.mark.parametrize(
    "call", ["heartbeat", "checkpoint", "prepare", "lease-ttl", "revision", "input", "resume"]
)
def test_numbers_given_as_strings_are_refused(leased: dict[str, Any], call: str) -> None:
    """Fences and revisions are JSON integers: "1" must not silently become 1."""
    client, run_id, fence = leased["client"], leased["run_id"], str(leased["fence"])
    url, body, field = {
        "heartbeat": ("lease/heartbeat/", {"fence": fence}, "fence"),
        "checkpoint": (
            "checkpoints/",
            {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "a"},
            "fence",
        ),
        "prepare": (
            "actions/",
            {"fence": fence, "tool": "tasks.create", "params": {"title": "t"}},
            "fence",
        ),
        "lease-ttl": ("lease/", {"owner": "p2", "ttl_seconds": "30"}, "ttl_seconds"),
        "revision": ("revisions/", {"goal": {}, "expected_goal_rev": "1"}, "expected_goal_rev"),
        "input": ("input/", {"data": {}, "expected_rev": "0"}, "expected_rev"),
        "resume": ("resume/", {"expected_rev": "0"}, "expected_rev"),
    }[call]
    stored = Run.objects.get(pk=run_id)
    before = row_counts()
    data = refused(post(client, f"runs/{run_id}/{url}", body), 400, "invalid_request")
    assert field in data["errors"]
    assert row_counts() == before
    after = Run.objects.get(pk=run_id)
    assert (after.lease_expires_at, after.goal_rev) == (stored.lease_expires_at, stored.goal_rev)


@pytest.mark.parametrize("ttl", ["abc", "30", None, [5], {"s": 5}, 1, 3601, 2.5], ids=repr)
def test_heartbeat_with_a_bad_ttl_is_refused(leased: dict[str, Any], ttl: Any) -> None:
    client, run_id = leased["client"], leased["run_id"]
    before = Run.objects.get(pk=run_id).lease_expires_at
    body = {"fence": leased["fence"], "ttl_seconds": ttl}
    refused(post(client, f"runs/{run_id}/lease/heartbeat/", body), 400, "invalid_request")
    assert Run.objects.get(pk=run_id).lease_expires_at == before


@pytest.mark.parametrize(
    "key", ["k" * 256, "k" * 10_000, "tab\there", "line\nbreak", "nul\x00"], ids=repr
)
def test_a_bad_idempotency_key_is_refused_with_field_errors(agent_a: Persona, key: str) -> None:
    before = row_counts()
    body = {"graph": "chain", "goal": {}}
    response = post(agent_a.api(), "runs/", body, HTTP_IDEMPOTENCY_KEY=key)
    data = refused(response, (400, 422), "invalid_params", "invalid_request")
    assert "Idempotency-Key" in data["errors"]
    assert row_counts() == before


def test_a_body_idempotency_key_over_255_is_400(leased: dict[str, Any]) -> None:
    before = row_counts()
    response = prepare(
        leased["client"], leased["run_id"], leased["fence"], idempotency_key="k" * 256
    )
    data = refused(response, 400, "invalid_request")
    assert "idempotency_key" in data["errors"]
    assert row_counts() == before


# --- query parameters ---------------------------------------------------------------------------

NUL_FILTERS = [
    "runs/?thread_id=%00",
    "runs/?graph=a%00b",
    "actions/?idempotency_key=%00",
    "actions/?tool=%00",
    "actions/?status=%00",
]


@pytest.mark.parametrize("url", NUL_FILTERS)
def test_nul_in_a_list_filter_is_a_422_naming_the_filter(agent_a: Persona, url: str) -> None:
    data = problem(get(agent_a.api(), url), 422, "invalid_params")
    name = url.split("?")[1].split("=")[0]
    assert list(data["errors"]) == [name]


@pytest.mark.parametrize(
    "url",
    [
        "runs/?status=%00",
        "runs/?status=sleeping",
        "actions/?status=bogus",
        "approvals/?status=%00",
        "approvals/?status=maybe",
        "actions/?status=",
        "runs/?thread_id=" + "t" * 201,
    ],
)
def test_bad_list_parameters_are_422_with_field_errors(agent_a: Persona, url: str) -> None:
    data = problem(get(agent_a.api(), url), 422, "invalid_params")
    name = url.split("?")[1].split("=")[0]
    assert name in data["errors"] and data["errors"][name]


LISTINGS = ["runs/", "actions/", "approvals/", "runs/{run}/checkpoints/", "runs/{run}/actions/"]


def _cursor(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _forged(agent: Persona, listing: str, cursor: str) -> Any:
    run = new_run(agent.api())
    url = listing.replace("{run}", run["run_id"])
    return get(agent.api(), f"{url}?cursor={cursor}")


def _well_typed(listing: str) -> str:
    """A forged position of the ordering field's own type (rev for checkpoints)."""
    return "p=1" if "checkpoints" in listing else "p=2099-01-01T00:00:00Z"


def _wrong_type(listing: str) -> list[str]:
    return ["p=xyz", "p=2099-01-01"] if "checkpoints" in listing else ["p=xyz", "p=1"]


@pytest.mark.parametrize("cursor", ["garbage", "%00", "=" * 5000, "well-typed", "reverse"])
@pytest.mark.parametrize("listing", LISTINGS)
def test_a_forged_cursor_is_a_4xx_or_an_ordinary_page(
    agent_a: Persona, listing: str, cursor: str
) -> None:
    if cursor == "well-typed":
        cursor = _cursor(_well_typed(listing))
    elif cursor == "reverse":
        cursor = _cursor("r=1&" + _well_typed(listing))
    response = _forged(agent_a, listing, cursor)
    assert response.status_code < 500, response.content[:300]
    if response.status_code == 200:
        assert set(response.json()) >= {"next", "previous", "results"}
    else:
        refused(response, (400, 404), "not_found", "invalid_params", "invalid_request")


@pytest.mark.parametrize("which", [0, 1], ids=["p=xyz", "other-type"])
@pytest.mark.parametrize("listing", LISTINGS)
def test_a_cursor_with_a_wrong_typed_position_is_a_4xx(
    agent_a: Persona, listing: str, which: int
) -> None:
    response = _forged(agent_a, listing, _cursor(_wrong_type(listing)[which]))
    refused(response, (400, 404), "not_found", "invalid_params", "invalid_request")


def test_bad_numbers_in_query_and_path(leased: dict[str, Any]) -> None:
    client, run_id = leased["client"], leased["run_id"]
    problem(get(client, f"runs/{run_id}/events/?after=x"), 422, "invalid_params")
    assert ok(get(client, f"runs/{run_id}/events/?after=" + "9" * 40))["results"] == []
    assert ok(get(client, f"runs/{run_id}/events/?after=-3"))["results"]
    problem(get(client, f"runs/{run_id}/checkpoints/" + "9" * 40 + "/"), 404, "not_found")
    for wait in ("abc", "-1", "31", "nan", "inf", "1e400"):
        problem(get(client, f"runs/{run_id}/?wait={wait}"), 422, "invalid_params")


# --- methods and credentials ------------------------------------------------------------------


def test_wrong_methods_are_405_problems_on_every_route(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    before = row_counts()
    checked = 0
    for route, names, methods in api_routes():
        if route.endswith(("/schema/", "/docs/")):
            continue  # see test_the_schema_and_docs_answer_errors_as_json_problems
        url = _with(route, {n: ("1" if n == "rev" else run["run_id"]) for n in names})
        for method in METHODS:
            if method in methods:
                continue
            response = client.generic(method, url, b"{}", content_type="application/json")
            data = refused(response, 405, "method_not_allowed")
            assert method in data["detail"]
            assert set(response["Allow"].replace(" ", "").split(",")) >= set(methods)
            checked += 1
    assert checked >= 60
    assert row_counts() == before


@pytest.mark.parametrize("url", ["/api/v1/schema/", "/api/v1/docs/"])
def test_the_schema_and_docs_answer_errors_as_json_problems(agent_a: Persona, url: str) -> None:
    client = agent_a.api()
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        response = client.generic(method, url, b"{}", content_type="application/json")
        data = refused(response, 405, "method_not_allowed")
        assert method in data["detail"]


def _every_call(run_id: str) -> list[tuple[str, str]]:
    calls = []
    for route, names, methods in api_routes():
        if route.endswith(("/schema/", "/docs/")):
            continue  # the OpenAPI document and its viewer are public
        url = _with(route, {n: ("1" if n == "rev" else run_id) for n in names})
        calls += [(method, url) for method in methods]
    return calls


CREDENTIALS: dict[str, Callable[[Persona], dict[str, str]]] = {
    "none": lambda p: {},
    "unknown-token": lambda p: {"HTTP_AUTHORIZATION": "Token " + "0" * 40},
    "malformed-header": lambda p: {"HTTP_AUTHORIZATION": "Token"},
    "bearer-scheme": lambda p: {"HTTP_AUTHORIZATION": f"Bearer {p.token}"},
    "revoked-token": lambda p: {"HTTP_AUTHORIZATION": f"Token {p.token}"},
    "deactivated-user": lambda p: {"HTTP_AUTHORIZATION": f"Token {p.token}"},
}


@pytest.mark.parametrize("credentials", CREDENTIALS.keys())
def test_every_call_without_valid_credentials_is_401(agent_a: Persona, credentials: str) -> None:
    run = new_run(agent_a.api())
    if credentials == "revoked-token":
        revoke_token(AgentToken.objects.authenticate(agent_a.token), actor="test")
    if credentials == "deactivated-user":
        type(agent_a.user).objects.filter(pk=agent_a.user.pk).update(is_active=False)
    extra = CREDENTIALS[credentials](agent_a)
    client = APIClient()
    before = row_counts()
    calls = _every_call(run["run_id"])
    for method, url in calls:
        response = client.generic(method, url, b"{}", content_type="application/json", **extra)
        refused(response, 401, "not_authenticated")
        assert response.has_header("WWW-Authenticate")
    assert len(calls) >= 24
    assert row_counts() == before


def test_a_foreign_id_without_credentials_is_401_not_404(agent_b: Persona) -> None:
    """Authentication comes first: no existence oracle for anonymous callers either."""
    theirs = new_run(agent_b.api())
    client = APIClient()
    for url in (f"/api/v1/runs/{theirs['run_id']}/", f"/api/v1/runs/{uuid.uuid4()}/"):
        refused(client.get(url), 401, "not_authenticated")
