"""The gateway's synchronous core (gateway.calls) driven directly, against a real upstream
process (tests/mcp_upstream.py): what one `tools/call` comes to, without the web server."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from approvals.models import ApprovalPolicy
from gateway import calls
from runtime import mcp
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
