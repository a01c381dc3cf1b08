"""Shared helpers of the API tests (API.md): problem assertions, lease/prepare shortcuts.

Fixtures defined here are imported by the test modules that use them (there is no
tests/api/conftest.py): `fresh_throttle` keeps the per-token request rate from leaking
between tests that reuse a user id on SQLite.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Group
from rest_framework.test import APIClient

PROBLEM = "application/problem+json"
API = "/api/v1/"


@pytest.fixture(autouse=True)
def fresh_throttle() -> Iterator[None]:
    """The throttle counts requests per user id in the local-memory cache; a test must not
    inherit another test's count (SQLite reuses ids after a rollback)."""
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()


def problem(response: Any, status: int, code: str) -> dict[str, Any]:
    """Assert an RFC 9457 problem with the stable `code`; returns the body."""
    content_type = response.get("Content-Type", "")
    body = response.content.decode("utf-8", "replace")
    assert response.status_code == status, f"{response.status_code} {body[:500]}"
    assert content_type.split(";")[0].strip() == PROBLEM, content_type
    data = response.json()
    assert data["code"] == code, data
    assert data["status"] == status
    assert {"type", "title", "status", "detail", "code"} <= set(data), data
    return data


def ok(response: Any, status: int = 200) -> Any:
    body = response.content.decode("utf-8", "replace")
    assert response.status_code == status, f"{response.status_code} {body[:500]}"
    assert response.get("Content-Type", "").startswith("application/json")
    return response.json()


def post(client: APIClient, url: str, body: Any = None, **extra: Any) -> Any:
    return client.post(
        url if url.startswith("/") else API + url, body or {}, format="json", **extra
    )


def get(client: APIClient, url: str, **extra: Any) -> Any:
    return client.get(url if url.startswith("/") else API + url, **extra)


def new_run(
    client: APIClient,
    graph: str = "chain",
    goal: Any = None,
    *,
    external: bool = True,
    **fields: Any,
) -> dict[str, Any]:
    """A run through the API; `external` (the default here): the test is its executor, so
    Holdpoint's workers never pick it up."""
    body = {
        "graph": graph,
        "goal": goal if goal is not None else {"steps": 3},
        "external": external,
        **fields,
    }
    return ok(post(client, "runs/", body), 201)


def take_lease(client: APIClient, run_id: str, owner: str = "agent-1", ttl: int = 60) -> int:
    data = ok(post(client, f"runs/{run_id}/lease/", {"owner": owner, "ttl_seconds": ttl}))
    return int(data["fence"])


# What an external executor acts with by default in these tests: the tracker performed by the
# agent itself (executor `client`) — the kind of tool whose outcome an API client reports.
CLIENT_TOOL = "agent.tasks.create"


def prepare(
    client: APIClient,
    run_id: str,
    fence: int,
    tool: str = CLIENT_TOOL,
    params: dict[str, Any] | None = None,
    **fields: Any,
) -> Any:
    body = {
        "fence": fence,
        "tool": tool,
        "params": params if params is not None else {"title": "Review the diff"},
        "reason": "the goal asks for it",
        **fields,
    }
    return post(client, f"runs/{run_id}/actions/", body)


def grant_policy(tenant: Any, tool: str = CLIENT_TOOL, **fields: Any) -> Any:
    """A hold point on `tool` in `tenant`, decided by the tenant's reviewer group."""
    from approvals.models import ApprovalPolicy
    from approvals.policies import grant

    policy = ApprovalPolicy.objects.create(
        tenant=tenant, name=f"{tool} needs review", tool=tool, **fields
    )
    group, _ = Group.objects.get_or_create(name=f"{tenant.slug}-reviewers")
    grant(policy, group)
    return policy


def session(user: Any) -> APIClient:
    """A reviewer's browser session (CSRF is not enforced by APIClient)."""
    client = APIClient()
    client.force_login(user)
    return client


def row_counts() -> dict[str, int]:
    """Rows of every table an API call could write."""
    from approvals.models import ApprovalRequest, ApprovalVote
    from audit.models import JournalEntry
    from runtime.models import Action, Checkpoint, IdempotencyRecord, Run

    return {
        model.__name__: model.objects.count()
        for model in (
            Run,
            Checkpoint,
            Action,
            IdempotencyRecord,
            ApprovalRequest,
            ApprovalVote,
            JournalEntry,
        )
    }


METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def api_routes() -> list[tuple[str, list[str], list[str]]]:
    """Every URL pattern under /api/v1/ from the resolver: (route with `{name}` placeholders,
    the path converters' names in order, the methods its view implements)."""
    from django.urls import URLPattern, URLResolver, get_resolver

    found: list[tuple[str, list[str], list[str]]] = []

    def walk(patterns: list[Any], prefix: str) -> None:
        for entry in patterns:
            route = prefix + str(entry.pattern)
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, route)
            elif isinstance(entry, URLPattern) and route.startswith("api/v1/"):
                view = getattr(entry.callback, "view_class", None)
                methods = [m for m in METHODS if view is not None and hasattr(view, m.lower())]
                names = list(entry.pattern.converters)
                for name in names:
                    route = route.replace(f"<{type_of(entry, name)}:{name}>", "{" + name + "}")
                found.append(("/" + route, names, methods))

    walk(get_resolver().url_patterns, "")
    return found


def type_of(entry: Any, name: str) -> str:
    from django.urls.converters import IntConverter, UUIDConverter

    converter = entry.pattern.converters[name]
    return {UUIDConverter: "uuid", IntConverter: "int"}.get(type(converter), "str")
