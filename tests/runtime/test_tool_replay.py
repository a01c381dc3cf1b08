"""Reconciling a `key` tool's unknown action replays it with the same key (DESIGN.md,
invariant 3). A replay Holdpoint itself refuses to send — the host no longer allowed, its
name now resolving to a private address — proves nothing about the first request, which
may have applied: the action is not `failed`, it is reconciled again and then goes to a
person. Real server, real socket; the server's own request log is the oracle."""

from __future__ import annotations

from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from runtime.dispatch import reconcile_action
from runtime.leases import take_lease
from runtime.models import ActionStatus, Tenant
from tests.httpservers import Behaviour, Server
from tests.tooldefs import run_ticket

pytestmark = pytest.mark.django_db

S = ActionStatus


def _failing(handler: BaseHTTPRequestHandler, server: Server) -> None:
    """A 503: the request may or may not have applied (an unknown outcome)."""
    handler.send_response(503)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


@pytest.mark.parametrize("refusal", ["host_not_allowed", "private_address"])
def test_a_replay_holdpoint_refuses_to_send_never_fails_the_action(
    tenant_a: Tenant, serve: Callable[[Behaviour], Server], settings: Any, refusal: str
) -> None:
    server = serve(_failing)
    action = run_ticket(tenant_a, server.url, "key")
    assert action.status == S.UNKNOWN
    settings.HOLDPOINT_RECONCILE_ATTEMPTS = action.reconcile_attempts + 2  # two more
    sent = len(server.requests)  # the first request, and the replays the worker made
    if refusal == "host_not_allowed":
        settings.HOLDPOINT_TOOL_HOSTS = ["tickets.example.com"]
    else:
        settings.HOLDPOINT_TOOL_PRIVATE_NETWORKS = []
    lease = take_lease(action.run_id, "w2", ttl=30, runnable_only=False)
    assert lease is not None
    verdicts = [reconcile_action(action, lease.fence, lease.actor).status for _ in range(2)]
    action.refresh_from_db()
    assert verdicts == ["wait", S.MANUAL_REVIEW], action.last_error
    assert action.status == S.MANUAL_REVIEW and refusal in action.last_error
    assert len(server.requests) == sent  # these replays never left
