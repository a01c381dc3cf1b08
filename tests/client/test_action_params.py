"""`@hp.action`: the params the ledger holds (what a reviewer approves, what the hash binds)
are the arguments the function runs with — its defaults and its `**keywords` included.

The API on `live_server`, the tracker the real sandbox process (it keeps each request's
body, so the test compares what the service received with what the ledger holds).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from approvals.models import ApprovalPolicy
from holdpoint_client import Holdpoint, ToolCall
from runtime.models import Action, Tenant
from tests.client import TOOL
from tests.conftest import Persona
from tests.sandbox import Sandbox

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def tracker(tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]) -> Sandbox:
    ApprovalPolicy.objects.create(tenant=tenant_a, name="free", tool=TOOL, required=False)
    return sandbox_factory("key")


@pytest.fixture
def hp(live_server: Any, agent_a: Persona) -> Any:
    with Holdpoint(live_server.url, agent_a.token or "", ttl=3, backoff=0.01) as hp:
        yield hp


def post(box: Sandbox, call: ToolCall, body: dict[str, Any]) -> Any:
    sent = httpx.post(box.url + "/tasks", json=body, headers=call.headers())
    return sent.raise_for_status().json()


def test_a_default_argument_is_a_param_of_the_action(hp: Holdpoint, tracker: Sandbox) -> None:
    """`assignee` was left to its default: the action was prepared without it, so the
    reviewer approved (and the hash bound) params that were not what the tracker received —
    a default changed in a new deploy would be sent under the old approval. A default of
    None is "absent" (the tool's schema refuses null for `body`): left out."""

    @hp.action(TOOL, reason="the API changed")
    def create_task(
        title: str, assignee: str = "on-call", body: str | None = None, *, call: ToolCall
    ) -> Any:
        sent = {"title": title, "assignee": assignee}
        return post(tracker, call, sent if body is None else {**sent, "body": body})

    with hp.run("t-defaults", graph="api-review"):
        create_task(title="Review")

    params = json.loads(Action.objects.get(run__thread_id="t-defaults").params)
    (task,) = tracker.tasks()
    assert params == {"title": "Review", "assignee": "on-call"}
    assert task["body"] == params


def test_keyword_arguments_are_params_of_their_own(hp: Holdpoint, tracker: Sandbox) -> None:
    """`**fields` went to the ledger as one param named `fields` (the tool's schema refused
    it: 422) and would have reached the function as `fields={"fields": {...}}`."""

    @hp.action(TOOL, reason="the API changed")
    def create_task(*, call: ToolCall, **fields: Any) -> Any:
        return post(tracker, call, fields)

    with hp.run("t-keywords", graph="api-review"):
        create_task(title="Review", body="GET /orders: removed")

    params = json.loads(Action.objects.get(run__thread_id="t-keywords").params)
    (task,) = tracker.tasks()
    assert params == {"title": "Review", "body": "GET /orders: removed"}
    assert task["body"] == params
