"""An inactive MCP server's tools on the hosted path (API.md, "Tools as data"): a worker's
step asks for them through `ctx.act`. The API and the MCP gateway no longer offer them
(runtime.toolcatalog.withheld), but a step still prepared a new action of one, so a
reviewer was asked to approve what is never sent. Now the step's call is refused as a call
of an unknown tool is — InvalidParams "unknown tool", the run needs attention, nothing
stored — and an action prepared before the server was turned off is not sent to it either.
The upstream is a real process; the oracle is its own record of the calls that reached it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from approvals.decisions import decide
from approvals.models import ApprovalRequest
from runtime import mcp
from runtime.executor import advance_run
from runtime.lifecycle import create_run, resume_run
from runtime.models import Action, ActionStatus, McpServer, Run, RunStatus, Tenant
from tests.conftest import Persona
from tests.mcp_fixture import Upstream

S = ActionStatus
CREATE = "helpdesk.tickets_create"


def _run(tenant: Tenant, tool: str = CREATE) -> Run:
    return create_run(tenant, "ticketing", {"title": "Printer on fire", "tool": tool}, actor="t")


def _set_active(server: McpServer, active: bool) -> None:
    server.active = active
    server.save()  # as the admin's change form does


@pytest.fixture
def helpdesk(tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]) -> tuple[McpServer, Upstream]:
    upstream = mcp_upstream()
    server = McpServer.objects.create(tenant=tenant_a, name="helpdesk", url=upstream.url)
    mcp.import_tools(server, "user:admin")  # tickets_create: a write no policy names (held)
    return server, upstream


def test_a_step_calling_an_inactive_servers_tool_is_refused_as_for_an_unknown_tool(
    tenant_a: Tenant, helpdesk: tuple[McpServer, Upstream]
) -> None:
    server, upstream = helpdesk
    _set_active(server, False)
    unknown, withheld = _run(tenant_a, "helpdesk.nope"), _run(tenant_a)
    for run in (unknown, withheld):
        assert advance_run(run.run_id, "w1").outcome == "needs_attention"
    told = {run.pk: Run.objects.get(pk=run.pk) for run in (unknown, withheld)}
    assert told[unknown.pk].last_error == "InvalidParams: unknown tool 'helpdesk.nope'"
    assert told[withheld.pk].status == RunStatus.NEEDS_ATTENTION
    assert told[withheld.pk].last_error == (
        f"InvalidParams: unknown tool {CREATE!r}: its MCP server 'helpdesk' is inactive"
    )
    assert told[withheld.pk].waiting_for is None
    assert not Action.objects.filter(run=withheld).exists()
    assert not ApprovalRequest.objects.filter(run=withheld).exists()  # nobody asked in vain

    # Turned on again, the same run goes on once a person resumes it: held for a reviewer.
    _set_active(server, True)
    resume_run(withheld, actor="user:admin")
    assert advance_run(withheld.run_id, "w1").outcome == "waiting"
    assert Action.objects.get(run=withheld).status == S.AWAITING_APPROVAL
    assert ApprovalRequest.objects.filter(run=withheld).count() == 1
    assert upstream.calls() == []


def test_an_action_approved_before_its_server_was_turned_off_is_not_sent_to_it(
    tenant_a: Tenant, reviewer_a: Persona, helpdesk: tuple[McpServer, Upstream]
) -> None:
    """Prepared and held while the server was active, approved after it was turned off: the
    send refuses it (runtime.mcp: no active server) without a request to the upstream, and
    the step is told the action failed — never that it was done."""
    server, upstream = helpdesk
    run = _run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    _set_active(server, False)
    request = ApprovalRequest.objects.get(run=run)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")

    assert advance_run(run.run_id, "w1").outcome == "needs_attention"
    action = Action.objects.get(run=run)
    assert (action.status, action.external_id) == (S.FAILED, "")
    assert action.last_error == "no active MCP server 'helpdesk'"
    stopped = Run.objects.get(pk=run.pk)
    assert stopped.status == RunStatus.NEEDS_ATTENTION
    assert "no active MCP server 'helpdesk'" in stopped.attention_reason
    assert upstream.calls() == []  # the deactivated upstream was never asked
