"""D1: schemathesis against the live OpenAPI document, in process through WSGI.

Every operation of /api/v1/schema/ is fuzzed with positive and negative cases (bounded:
MAX_EXAMPLES per mode per operation, from HOLDPOINT_SCHEMATHESIS_CASES) under an agent
token, with all of schemathesis's default checks plus `problem_json_on_4xx` (every 4xx is
application/problem+json with a `code`). Half of the positive cases address real objects of
the agent's tenant (a leased run with a checkpoint, a prepared action, a pending approval),
so more than the 404 path is exercised. Failures are collected per operation and reported
together, worst first: server errors, then problem-format violations, then other check
failures, then schema violations — each its own exception type, so an expected schema gap
(xfail with `raises=`) can never hide a 5xx.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.cache import cache
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NotSet
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import ignored_auth, positive_data_acceptance

from approvals.models import ApprovalRequest
from audit.canonical import CanonicalError, canonical_bytes
from runtime import tooldefs
from runtime.models import Role, Run, Tenant
from tests.api import (
    fresh_throttle,  # noqa: F401
    grant_policy,
    new_run,
    ok,
    prepare,
    take_lease,
)
from tests.conftest import Persona, make_persona

pytestmark = [pytest.mark.slow]

# HOLDPOINT_SCHEMATHESIS_CASES: roughly how many cases the whole run generates (CI's default
# keeps it fast; `HOLDPOINT_SCHEMATHESIS_CASES=12000` is the large run issue 16 asks for).
# Spread evenly: half positive, half negative, per operation.
DEFAULT_CASES = 960
# Every operation the schema must carry (API.md plus the detail views).
OPERATIONS = [
    ("GET", "/api/v1/runs/"),
    ("POST", "/api/v1/runs/"),
    ("GET", "/api/v1/runs/{run_id}/"),
    ("POST", "/api/v1/runs/{run_id}/revisions/"),
    ("POST", "/api/v1/runs/{run_id}/input/"),
    ("POST", "/api/v1/runs/{run_id}/cancel/"),
    ("POST", "/api/v1/runs/{run_id}/resume/"),
    ("GET", "/api/v1/runs/{run_id}/checkpoints/"),
    ("POST", "/api/v1/runs/{run_id}/checkpoints/"),
    ("GET", "/api/v1/runs/{run_id}/checkpoints/{rev}/"),
    ("GET", "/api/v1/runs/{run_id}/events/"),
    ("GET", "/api/v1/runs/{run_id}/actions/"),
    ("POST", "/api/v1/runs/{run_id}/actions/"),
    ("POST", "/api/v1/runs/{run_id}/lease/"),
    ("POST", "/api/v1/runs/{run_id}/lease/heartbeat/"),
    ("POST", "/api/v1/runs/{run_id}/lease/release/"),
    ("GET", "/api/v1/actions/"),
    ("GET", "/api/v1/actions/{action_id}/"),
    ("POST", "/api/v1/actions/{action_id}/dispatch/"),
    ("POST", "/api/v1/actions/{action_id}/outcome/"),
    ("POST", "/api/v1/actions/{action_id}/resolve/"),
    ("GET", "/api/v1/approvals/"),
    ("GET", "/api/v1/approvals/{approval_id}/"),
    ("POST", "/api/v1/approvals/{approval_id}/decision/"),
    ("GET", "/api/v1/tools/"),
    ("POST", "/api/v1/tools/"),
    ("GET", "/api/v1/tools/{name}/"),
    ("PUT", "/api/v1/tools/{name}/"),
]

# A tenant tool for `tools/{name}/` to find (the built-ins are there too).
TOOL = {
    "name": "tickets.create",
    "effect": "write",
    "schema": {"type": "object", "properties": {"title": {"type": "string"}}},
    "request": {"method": "POST", "url": "http://127.0.0.1:8765/tickets"},
    "dedup": {"mode": "key"},
}
# Operations fuzzed a second time as the tenant's admin (a session, not a token).
ADMIN_OPERATIONS = [("POST", "/api/v1/tools/"), ("PUT", "/api/v1/tools/{name}/")]
CASES = int(os.environ.get("HOLDPOINT_SCHEMATHESIS_CASES", DEFAULT_CASES))
MAX_EXAMPLES = max(1, math.ceil(CASES / (2 * (len(OPERATIONS) + len(ADMIN_OPERATIONS)))))
TOTALS: Counter[str] = Counter()
# All default checks. Schema-valid requests may still be refused by a documented domain rule
# with 409 or 422 (API.md: unknown_graph, invalid_params for a tool's own parameter schema,
# version_conflict, stale_fence, ...), so positive_data_acceptance accepts those too.
CONFIG = schemathesis.Config.from_dict(
    {
        "checks": {
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "401", "403", "404", "409", "422", "429"]
            }
        }
    }
)


class ServerErrors(AssertionError):
    """5xx answers."""


class ProblemFormatViolations(AssertionError):
    """A 4xx that is not application/problem+json with a `code`."""


class CheckFailures(AssertionError):
    """Any other default check of schemathesis."""


class SchemaViolations(AssertionError):
    """Responses that do not match the OpenAPI document (status, content type, body)."""


SCHEMA_CHECKS = {
    "response_schema_conformance",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
}


def problem_json_on_4xx(ctx: Any, response: Any, case: Any) -> bool | None:
    """Custom check: every 4xx is application/problem+json with a stable `code`."""
    if not 400 <= response.status_code < 500:
        return None
    content_types = response.headers.get("content-type") or [""]
    media = content_types[0].split(";")[0].strip()
    if media != "application/problem+json":
        raise Failure(
            operation=case.operation.label,
            title="problem_json_on_4xx",
            message=f"{response.status_code} answered with {media!r}",
        )
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("code"), str) or not body["code"]:
        raise Failure(
            operation=case.operation.label,
            title="problem_json_on_4xx",
            message=f"{response.status_code} problem without a code: {response.text[:200]}",
        )
    return None


def refused_as_malformed(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schema-valid but outside the API-wide JSON rules (NUL characters, integers beyond
    ±2**53): refused by the strict parser (400 malformed_request), unless the call was
    refused before its body was read (403 not permitted, 404 no such object)."""
    if response.status_code in (403, 404):
        return None
    body = response.json() if response.status_code == 400 else {}
    if response.status_code != 400 or body.get("code") != "malformed_request":
        raise Failure(
            operation=case.operation.label,
            title="refused_as_malformed",
            message=f"strict-JSON violation answered {response.status_code}",
        )
    return None


def _integral_beyond_2_53(value: Any) -> bool:
    """1e17 and the like: PostgreSQL's jsonb turns them into integers beyond ±2**53, which
    breaks the journal on PostgreSQL — a finding with its own test in test_errors.py
    (test_a_big_integral_float_is_refused_or_kept_exactly), kept out of the fuzzing so it
    does not mask everything else."""
    if isinstance(value, float):
        return math.isfinite(value) and value.is_integer() and abs(value) > 2**53 - 1
    if isinstance(value, dict):
        return any(_integral_beyond_2_53(v) for v in value.values())
    if isinstance(value, list):
        return any(_integral_beyond_2_53(v) for v in value)
    return False


def _fuzzable(item: tuple[str, Any]) -> bool:
    return not _integral_beyond_2_53(item[1].body)


def _canonical(body: Any) -> bool:
    if isinstance(body, NotSet):
        return True
    try:
        canonical_bytes(body)
    except CanonicalError:
        return False
    return True


def steer(case: Any, world: dict[str, Any]) -> Any:
    """Keep a generated body schema-valid but give its domain fields values the domain
    knows (a registered graph, a real tool with valid params, the current fence and rev), so
    that calls get past the refusals and reach their success paths too."""
    body = case.body
    if not isinstance(body, dict):
        return case
    run = Run.objects.get(pk=world["run_id"])
    if "graph" in body:
        body["graph"] = "chain"
        body.pop("graph_version", None)
    if "fence" in body:
        body["fence"] = run.fence
    if "tool" in body:
        body["tool"], body["params"] = "tasks.create", {"title": "fuzzed"}
    if "state" in body and not isinstance(body["state"], dict):
        body["state"] = {}
    if "expected_rev" in body:
        body["expected_rev"] = run.checkpoint_rev
    if "expected_goal_rev" in body:
        body["expected_goal_rev"] = run.goal_rev
    if "outcome" in body and body["outcome"] == "confirmed":
        body["external_id"] = "EXT-1"
    if "effect" in body and "dedup" in body:  # a tool definition: one the tenant may store
        body.update(
            executor="http",
            schema={"type": "object"},
            editable=[],
            sensitive=[],
            request={"method": "POST", "url": "http://127.0.0.1:8765/fuzzed"},
            credential="",
            dedup={"mode": "key"},
            result={"external_id": "$.id"},
            timeout_seconds=5,
            compensation="",
        )
        body.pop("lookup", None)
        if not tooldefs.NAME.match(str(body.get("name", ""))):
            body["name"] = "fuzzed.tool"
        if "expected_version" in body:
            current = tooldefs.current(run.tenant_id, world["tool_name"])
            body["name"] = world["tool_name"]
            body["expected_version"] = current.version if current else 1
    if "action_hash" in body:
        request = ApprovalRequest.objects.filter(pk=world["approval_id"]).first()
        body["action_hash"] = request.action_hash if request else body["action_hash"]
    return case


@pytest.fixture
def wsgi_app() -> Iterator[WSGIHandler]:
    """Django's WSGI handler, without closing the test's connection after each request
    (as Django's own test client does), so the cases run inside the test transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield WSGIHandler()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def world(db: None, tenant_a: Tenant, reviewer_a: Persona) -> dict[str, Any]:
    """Real objects of tenant A for the cases to address."""
    agent = make_persona(tenant_a, "fuzz-agent", Role.AGENT)
    client = agent.api()
    grant_policy(tenant_a, tool="tasks.close")
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    ok(
        client.post(
            f"/api/v1/runs/{run['run_id']}/checkpoints/",
            {"fence": fence, "expected_rev": 0, "state": {"seen": 1}, "next_step": "tick"},
            format="json",
        ),
        201,
    )
    action = ok(prepare(client, run["run_id"], fence), 201)
    held = ok(prepare(client, run["run_id"], fence, "tasks.close", {"task_id": "T-1"}), 201)
    assert held["status"] == "awaiting_approval" and held["approval"]
    tool = tooldefs.define(tenant_a, TOOL, "test:schemathesis").definition
    return {
        "tool_name": tool.name,
        "token": agent.token,
        "run_id": run["run_id"],
        "action_id": action["action_id"],
        "approval_id": held["approval"],
        "rev": 1,
    }


@pytest.fixture(scope="module")
def report() -> Iterator[Counter[str]]:
    yield TOTALS
    if TOTALS:
        print(
            f"\nschemathesis: {TOTALS['cases']} generated cases over {TOTALS['operations']} "
            f"operations ({TOTALS['positive']} positive, {TOTALS['negative']} negative; "
            f"{TOTALS['2xx']} 2xx, {TOTALS['4xx']} 4xx); 5xx {TOTALS['5xx']}, responses "
            f"violating the schema {TOTALS['schema_violations']}"
        )


def _known(method: str, path: str) -> list[Any]:
    reason = KNOWN_SCHEMA_GAPS.get((method, path))
    if reason is None:
        return []
    return [pytest.mark.xfail(strict=True, raises=SchemaViolations, reason=reason)]


# Known gaps between the document and the code, each a finding.
GET_422 = (
    "finding: an unknown `status` filter answers 422 invalid_params, but the document lists "
    "422 for POST operations only (see test_schema.py)"
)
# (The GET 422 gap is closed: every operation now documents 422.)
KNOWN_SCHEMA_GAPS: dict[tuple[str, str], str] = {}


def _session(user: Any) -> tuple[dict[str, str], dict[str, str]]:
    """A signed-in browser's headers and cookies: the session, and the CSRF token as cookie
    and header (double submit), as the admin's own pages would send them."""
    from django.test import Client

    client = Client()
    client.force_login(user)
    csrf = "A" * 32
    return {"X-CSRFToken": csrf}, {
        "sessionid": client.cookies["sessionid"].value,
        "csrftoken": csrf,
    }


@pytest.mark.parametrize(
    ("method", "path", "who"),
    [pytest.param(m, p, "agent", id=f"{m} {p}", marks=_known(m, p)) for m, p in OPERATIONS]
    # Defining tools is for the tenant's admin: under the agent token it is always 403, so
    # these are fuzzed once more as the admin's session, where the definition is parsed.
    + [pytest.param(m, p, "admin", id=f"{m} {p} as admin") for m, p in ADMIN_OPERATIONS],
)
def test_operation_conforms(
    method: str,
    path: str,
    who: str,
    world: dict[str, Any],
    wsgi_app: WSGIHandler,
    report: Counter[str],
    admin_a: Persona,
) -> None:
    schema = schemathesis.openapi.from_wsgi("/api/v1/schema/", wsgi_app, config=CONFIG)
    operation = schema[path][method]
    headers, cookies = (
        ({"Authorization": f"Token {world['token']}"}, {})
        if who == "agent"
        else _session(admin_a.user)
    )
    real = {
        name: str(world[key])
        for name, key in (
            ("run_id", "run_id"),
            ("action_id", "action_id"),
            ("approval_id", "approval_id"),
            ("rev", "rev"),
            ("name", "tool_name"),
        )
        if "{" + name + "}" in path
    }
    strategies = [operation.as_strategy(GenerationMode.POSITIVE).map(lambda c: ("positive", c))]
    if real:
        strategies.append(
            operation.as_strategy(GenerationMode.POSITIVE, path_parameters=real).map(
                lambda c: ("positive", steer(c, world))
            )
        )
    elif method == "POST":
        strategies.append(
            operation.as_strategy(GenerationMode.POSITIVE).map(
                lambda c: ("positive", steer(c, world))
            )
        )
    negative = operation.as_strategy(GenerationMode.NEGATIVE).map(lambda c: ("negative", c))
    failures: dict[str, list[str]] = {}
    seen: Counter[str] = Counter()

    def run_case(mode: str, case: Any) -> None:
        cache.clear()  # the per-token rate limit is not what is being fuzzed
        seen["cases"] += 1
        seen[mode] += 1
        strict = mode == "positive" and not _canonical(case.body)
        if strict:
            seen["strict_json"] += 1
        if cookies:  # schemathesis sends a case's own cookies, replacing a Cookie header
            case.cookies = {**(case.cookies or {}), **cookies}
        response = case.call(headers=headers)
        seen[f"{response.status_code // 100}xx"] += 1
        try:
            case.validate_response(
                response,
                headers=headers,
                additional_checks=[problem_json_on_4xx]
                + ([refused_as_malformed] if strict else []),
                excluded_checks=([positive_data_acceptance] if strict else [])
                # Its replay without credentials keeps the case's session cookie (schemathesis
                # strips headers, not cookies); no credentials at all are tested as the agent.
                + ([ignored_auth] if cookies else []),
                transport_kwargs={"headers": dict(headers)},
            )
        except (Failure, FailureGroup) as exc:
            group = exc.exceptions if isinstance(exc, FailureGroup) else (exc,)
            if any(_check_name(f) in SCHEMA_CHECKS for f in group):
                seen["schema_violations"] += 1
            for failure in group:
                name = _check_name(failure)
                text = (
                    f"{case.method} {case.formatted_path} query={case.query} "
                    f"body={_short(case.body)} -> "
                    f"{response.status_code} {response.text[:160]} :: {failure.title}: "
                    f"{failure.message.splitlines()[0] if failure.message else ''}"
                )
                failures.setdefault(name, [])
                if text not in failures[name] and len(failures[name]) < 5:
                    failures[name].append(text)

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(*strategies).filter(_fuzzable))
    def positive(item: tuple[str, Any]) -> None:
        run_case(*item)

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(negative.filter(_fuzzable))
    def negative_cases(item: tuple[str, Any]) -> None:
        run_case(*item)

    positive()
    try:
        negative_cases()
    except Unsatisfiable:  # no negative space: no parameters and no body to break
        pass
    report.update(seen)
    report["operations"] += 1
    print(
        f"\n{method} {path}: {seen['cases']} cases ({seen['2xx']} 2xx, {seen['4xx']} 4xx, "
        f"{seen['5xx']} 5xx); failing checks {sorted(failures) or 'none'}"
    )
    _raise_worst_first(failures)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def test_every_documented_operation_is_fuzzed(wsgi_app: WSGIHandler, db: None) -> None:
    schema = schemathesis.openapi.from_wsgi("/api/v1/schema/", wsgi_app, config=CONFIG)
    documented = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert documented == set(OPERATIONS)


def _check_name(failure: Failure) -> str:
    if failure.title == "problem_json_on_4xx":
        return "problem_json_on_4xx"
    checks = type(failure).checks
    return checks[0] if checks else type(failure).__name__


def _raise_worst_first(failures: dict[str, list[str]]) -> None:
    def text(names: set[str]) -> str:
        return "\n".join(f"[{n}] {m}" for n in sorted(names) for m in failures[n])

    names = set(failures)
    if "not_a_server_error" in names:
        raise ServerErrors(text(names))
    if "problem_json_on_4xx" in names:
        raise ProblemFormatViolations(text(names))
    if names - SCHEMA_CHECKS:
        raise CheckFailures(text(names))
    if names:
        raise SchemaViolations(text(names))
