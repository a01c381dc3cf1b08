"""A service's 409 is a fencing refusal only when Holdpoint's database agrees (DESIGN.md,
invariant 4): the fence the request carried is no longer the run's. A 409 whose text merely
mentions a fence ("fence post already ordered") while the sender still holds the run is the
service refusing the request, like any other 409: the action fails with the HTTP detail and
the worker keeps its run — it does not stop as if it had lost its lease, leaving the action
`sent` for the next worker to meet the same 409. The real stale fence — the sandbox after a
takeover — still stops the old holder. Real servers on real sockets."""

from __future__ import annotations

import json
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest
from django.db import connection

from runtime.dispatch import reconcile_action
from runtime.executor import advance_run
from runtime.leases import take_lease
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from runtime.tooldefs import define
from tests.api import new_run, ok, post, prepare
from tests.api import take_lease as lease_over_api
from tests.conftest import Persona
from tests.httpservers import Behaviour, Gateway, Server, answer_with
from tests.runtime.helpers import expire_lease
from tests.sandbox import Sandbox
from tests.tooldefs import run_ticket, tickets

S = ActionStatus
FENCE_POST = json.dumps({"error": "fence post already ordered"}).encode()
TAKEN = json.dumps({"error": "title already taken"}).encode()


def _policy(tenant: Tenant) -> None:
    from approvals.models import ApprovalPolicy

    ApprovalPolicy.objects.get_or_create(
        tenant=tenant, name="tickets go", defaults={"tool": "tickets.create", "required": False}
    )


@pytest.mark.django_db
@pytest.mark.parametrize("body", [FENCE_POST, TAKEN], ids=["fence-post", "other"])
def test_a_409_about_something_else_fails_the_action_and_the_worker_keeps_going(
    tenant_a: Tenant, serve: Callable[[Behaviour], Server], body: bytes
) -> None:
    server = serve(answer_with(409, body))
    for item in tickets(server.url, "key"):
        define(tenant_a, item, "user:admin", known_tools=["tickets.close"])
    _policy(tenant_a)
    run = create_run(tenant_a, "ticketing", {"title": "probe"}, actor="user:t")

    result = advance_run(run.run_id, "w1")

    action = Action.objects.get(run=run)
    run.refresh_from_db()
    assert result.outcome != "stale"  # the worker did not believe it lost its lease
    assert action.status == S.FAILED
    assert action.last_error == f"HTTP 409: {body.decode()}"
    assert run.status != RunStatus.RUNNING and run.fence == 1  # nobody took it over
    assert len(server.requests) == 1  # failed, never sent again


@pytest.mark.django_db
def test_a_replay_answered_with_a_fence_post_409_fails_the_action(
    tenant_a: Tenant, serve: Callable[[Behaviour], Server], settings: Any
) -> None:
    """Reconciling a `key` tool's unknown action: the replay's 409 is the service's refusal
    under the reconciler's own current fence, not a lost lease."""
    status = [503]  # first unknown (the worker's send and its replays), then the 409

    def behaviour(handler: BaseHTTPRequestHandler, server: Server) -> None:
        answer_with(status[0], FENCE_POST)(handler, server)

    server = serve(behaviour)
    settings.HOLDPOINT_RECONCILE_ATTEMPTS = 9
    action = run_ticket(tenant_a, server.url, "key")
    assert action.status == S.UNKNOWN
    status[0] = 409
    lease = take_lease(action.run_id, "w2", ttl=30, runnable_only=False)

    verdict = reconcile_action(action, lease.fence, lease.actor)

    action.refresh_from_db()
    assert (verdict.status, action.status) == (S.FAILED, S.FAILED)
    assert "fence post already ordered" in action.last_error


@pytest.mark.django_db(transaction=True)
def test_an_external_executors_dispatch_met_by_a_fence_post_409_fails_the_action(
    agent_a: Persona, serve: Callable[[Behaviour], Server]
) -> None:
    """An http tool of an external run: Holdpoint sends it at dispatch; the 409 is the
    service's refusal, answered as the failed action, not as the executor's lost lease."""
    server = serve(answer_with(409, FENCE_POST))
    for item in tickets(server.url, "key"):
        define(agent_a.tenant, item, "user:admin", known_tools=["tickets.close"])
    _policy(agent_a.tenant)
    client = agent_a.api()
    run_id = new_run(client)["run_id"]
    fence = lease_over_api(client, run_id)
    action = ok(prepare(client, run_id, fence, tool="tickets.create", params={"title": "x"}), 201)

    answer = ok(post(client, f"actions/{action['action_id']}/dispatch/", {"fence": fence}))

    assert answer["status"] == "failed"
    assert "fence post already ordered" in answer["last_error"]
    assert Run.objects.get(pk=run_id).fence == fence  # the executor still holds its run
    assert len(server.requests) == 1


class TakeoverFirst(Gateway):
    """In front of the sandbox: before forwarding the first create, another worker takes the
    run over and its own create reaches the sandbox with the next fence — so the forwarded
    request's fence is the stale one, and the sandbox says so (409 "stale fence")."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.taken = False

    def __call__(self, handler: BaseHTTPRequestHandler, server: Server) -> None:
        request = server.requests[-1]
        if not self.taken and request["method"] == "POST":
            self.taken = True
            run_id = request["headers"]["holdpoint-run"]
            try:
                expire_lease(run_id)
                lease = take_lease(run_id, "w2", ttl=30, runnable_only=False)
            finally:
                connection.close()
            httpx.post(
                self.upstream + "/tasks",
                json={"title": "w2's own"},
                headers={"Holdpoint-Run": run_id, "Holdpoint-Fence": str(lease.fence)},
                timeout=10,
            ).raise_for_status()
        super().__call__(handler, server)


@pytest.mark.django_db(transaction=True)
def test_the_sandboxs_stale_fence_after_a_takeover_still_stops_the_old_holder(
    tenant_a: Tenant, serve: Callable[[Behaviour], Server], sandbox_factory: Any
) -> None:
    box: Sandbox = sandbox_factory("key")
    gateway = TakeoverFirst(box.url)
    try:
        server = serve(gateway)
        for item in tickets(server.url, "key"):
            define(tenant_a, item, "user:admin", known_tools=["tickets.close"])
        _policy(tenant_a)
        run = create_run(tenant_a, "ticketing", {"title": "probe"}, actor="user:t")

        result = advance_run(run.run_id, "w1")
    finally:
        gateway.close()

    action = Action.objects.get(run=run)
    run.refresh_from_db()
    assert gateway.answered[-1][2] == 409  # the sandbox refused fence 1 after fence 2
    assert result.outcome == "stale"
    assert action.status == S.SENT  # left for the new holder to reconcile by its key
    assert (run.lease_owner, run.fence) == ("w2", 2)
    assert [t["title"] for t in box.tasks()] == ["w2's own"]
