"""The gateway's synchronous core (gateway.calls) driven directly, against a real upstream
process (tests/mcp_upstream.py): what one `tools/call` comes to, without the web server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace

import mcp_types as types
import pytest
from django.test import override_settings

from approvals.models import ApprovalPolicy
from gateway import calls
from runtime import mcp, protocol
from runtime.models import Action, ActionStatus, McpServer, Run, RunStatus, Tenant
from tests.conftest import Persona
from tests.mcp_fixture import Upstream

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
S = ActionStatus
CREATE = "helpdesk.tickets_create"


def _caller(agent: Persona) -> calls.Caller:
    assert agent.token
    return calls.authenticate(f"Bearer {agent.token}", agent.tenant.slug)


def _plain(tenant: Tenant, upstream: Upstream) -> None:
    McpServer.objects.create(tenant=tenant, name="helpdesk", url=upstream.url, timeout_seconds=1.5)
    mcp.import_tools(McpServer.objects.get(tenant=tenant), "user:admin")
    ApprovalPolicy.objects.create(tenant=tenant, name="creates go", tool=CREATE, required=False)


def test_a_lost_answer_of_a_tool_without_lookup_is_a_persons_at_once(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """A call without a progressToken is answered after one drive: an upstream that timed
    out must get NEEDS A PERSON then, and the session must wait for the person."""
    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    upstream.faults(hang=30)  # applies, then answers long after the timeout
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    call = calls.parse(caller, session, CREATE, {"title": "Printer on fire"})
    action = calls.drive(caller, call)
    said = calls.answer(action)
    stored = Action.objects.get(pk=action.pk)
    assert stored.status == S.MANUAL_REVIEW, stored.last_error
    assert said.text.startswith("NEEDS A PERSON") and said.is_error and not said.final
    assert Run.objects.get(pk=session).status == RunStatus.NEEDS_RECONCILIATION
    assert len(upstream.calls()) == 1


def test_a_call_that_finds_its_session_busy_is_answered_pending_not_as_a_result(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """Hosts make parallel tool calls; one that comes while another call of the session is
    being sent is neither stored nor sent. Without a progressToken it is answered at once:
    that answer must say it is not a result (PENDING, as the server's instructions tell the
    host), not read as the tool's output."""
    from gateway import server

    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    run = Run.objects.get(pk=session)
    protocol.take(run, "mcp-gateway:other", 30, who=caller.who)  # the other call's lease
    request = SimpleNamespace(scope={server.SCOPE_KEY: {"caller": caller, "session": session}})
    ctx = SimpleNamespace(request=request, request_id=1, session=None)
    params = types.CallToolRequestParams(name=CREATE, arguments={"title": "Printer on fire"})
    result = asyncio.run(server.call_tool(ctx, params))
    said = " ".join(getattr(block, "text", "") for block in result.content)
    assert said.startswith("PENDING:") and not result.is_error, said
    assert "same arguments" in said
    assert not Action.objects.filter(tenant=tenant_a).exists() and upstream.calls() == []


@override_settings(HOLDPOINT_TOOL_MAX_RESPONSE_BYTES=64 * 1024)
def test_an_upstream_answer_past_the_response_cap_is_not_read_whole_nor_stored(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """An upstream that answers with megabytes is held to the cap http tools get: the
    connection is dropped past it, nothing of it is stored, and as the upstream may have
    acted, a person settles it (this tool has no lookup)."""
    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    upstream.faults(huge=4 * 1024 * 1024)
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    call = calls.parse(caller, session, CREATE, {"title": "Printer on fire"})
    action = Action.objects.get(pk=calls.drive(caller, call).pk)
    assert action.status == S.MANUAL_REVIEW, (action.status, len(json.dumps(action.result)))
    assert "larger than" in action.last_error
    assert len(json.dumps(action.result)) < 64 * 1024
    assert len(upstream.calls()) == 1
