"""An inactive MCP server's tools on the hosted path (API.md, "Tools as data"): a worker's
step asks for them through `ctx.act`. The API and the MCP gateway no longer offer them
(runtime.toolcatalog.withheld), but a step still prepared a new action of one, so a
reviewer was asked to approve what is never sent. Now the step's call is refused as a call
of an unknown tool is — InvalidParams "unknown tool", the run needs attention, nothing
stored. An action prepared before the server was turned off is not sent while it is off —
refused right before `sent` (runtime.ledger.mark_sent), kept as it was — and is sent once
after the server is turned on again, by a resumed run or an external executor's dispatch.
The upstream is a real process; the oracle is its own record of the calls that reached it."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection
from django.http import HttpResponse
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus
from audit import journal
from audit.models import JournalEntry
from runtime import dispatch, mcpimport
from runtime.events import RunEvent
from runtime.executor import advance_run
from runtime.faults import FaultPoint
from runtime.lifecycle import create_run, resume_run
from runtime.models import Action, ActionStatus, McpServer, Run, RunStatus, Tenant
from tests.api import (
    fresh_throttle,  # noqa: F401  (the per-token request rate, fresh for this test)
    get,
    new_run,
    ok,
    post,
    prepare,
    problem,
    take_lease,
)
from tests.conftest import Persona
from tests.mcp_fixture import Upstream

S = ActionStatus
CREATE = "helpdesk.tickets_create"
ONE_CALL = {"tool": "tickets_create", "arguments": {"title": "Printer on fire"}}


def _run(tenant: Tenant, tool: str = CREATE) -> Run:
    return create_run(tenant, "ticketing", {"title": "Printer on fire", "tool": tool}, actor="t")


def _set_active(server: McpServer, active: bool) -> None:
    server.active = active
    server.save()  # as the admin's change form does


@pytest.fixture
def helpdesk(tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]) -> tuple[McpServer, Upstream]:
    upstream = mcp_upstream()
    server = McpServer.objects.create(tenant=tenant_a, name="helpdesk", url=upstream.url)
    mcpimport.import_tools(server, "user:admin")  # tickets_create: a write no policy names (held)
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


def test_an_action_approved_while_its_server_is_off_waits_and_is_sent_once_it_is_on(
    tenant_a: Tenant, reviewer_a: Persona, helpdesk: tuple[McpServer, Upstream]
) -> None:
    """Prepared and held while the server was active, approved after it was turned off: the
    re-check right before `sent` refuses to send it (nothing marked, nothing asked of the
    upstream), the action stays approved and the run needs attention, naming the server.
    Resumed while the server is still off, it stops there again; turned on and resumed, the
    approved action is sent once and confirmed. Before: marked sent, failed by its own call
    ("no active MCP server"), and lost for good — turning the server on could not send it."""
    server, upstream = helpdesk
    run = _run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    _set_active(server, False)
    request = ApprovalRequest.objects.get(run=run)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")

    for _ in range(2):  # and once more after a resume while the server is still off
        assert advance_run(run.run_id, "w1").outcome == "needs_attention"
        action = Action.objects.get(run=run)
        assert (action.status, action.attempts, action.sent_at) == (S.APPROVED, 0, None)
        stopped = Run.objects.get(pk=run.pk)
        assert stopped.status == RunStatus.NEEDS_ATTENTION
        assert f"{CREATE} was not sent: its MCP server 'helpdesk' is inactive" in (
            stopped.attention_reason
        )
        assert stopped.consecutive_failures == 0  # nothing failed: a person must act
        assert not _sent_marks(run)
        assert upstream.calls() == []  # the deactivated upstream was never asked
        resume_run(stopped, actor="user:admin")

    _set_active(server, True)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED and action.external_id
    assert ApprovalRequest.objects.get(run=run).pk == request.pk  # the approval given counted
    assert upstream.calls() == [ONE_CALL]
    assert len(_sent_marks(run)) == 1


def test_an_approval_that_lapses_while_the_server_is_off_is_asked_again_not_sent(
    tenant_a: Tenant, reviewer_a: Persona, helpdesk: tuple[McpServer, Upstream]
) -> None:
    """The run waits (needs attention) for the server, and meanwhile the approval's window
    passes. Turned on and resumed, the send's re-check finds the approval lapsed: nothing is
    sent on it, the request is superseded and a new one asked; approved, the action is sent
    once. Waiting for a server must not stretch an approval past its expiry."""
    server, upstream = helpdesk
    run = _run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    _set_active(server, False)
    first = ApprovalRequest.objects.get(run=run)
    decide(first.id, reviewer_a.user, "approve", first.action_hash, reason="fine")
    assert advance_run(run.run_id, "w1").outcome == "needs_attention"

    lapsed = timezone.now() - timedelta(minutes=3)  # the data moves, not the clock
    ApprovalRequest.objects.filter(pk=first.pk).update(
        decided_at=lapsed - timedelta(hours=1), expires_at=lapsed
    )
    _set_active(server, True)
    resume_run(Run.objects.get(pk=run.pk), actor="user:admin")
    assert advance_run(run.run_id, "w1").outcome == "waiting"  # asked again, not sent
    assert upstream.calls() == [] and not _sent_marks(run)
    assert ApprovalRequest.objects.get(pk=first.pk).status == ApprovalStatus.SUPERSEDED
    again = ApprovalRequest.objects.get(run=run, status=ApprovalStatus.PENDING)
    assert Action.objects.get(run=run).status == S.AWAITING_APPROVAL

    decide(again.id, reviewer_a.user, "approve", again.action_hash, reason="still fine")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert upstream.calls() == [ONE_CALL] and len(_sent_marks(run)) == 1
    assert Action.objects.get(run=run).status == S.CONFIRMED


def test_a_server_turned_off_between_the_sent_mark_and_the_call_leaves_the_action_unsent(
    tenant_a: Tenant,
    reviewer_a: Persona,
    helpdesk: tuple[McpServer, Upstream],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The re-check right before `sent` found the server active; an admin turns it off before
    the call reads it again. The call never leaves, so the action is not failed (before: a
    permanent refusal, "no active MCP server", and the approved effect lost for good) but
    left unsent: the run stops for a person, naming the server, and once the server is on
    again and the run resumed, the approved action is sent once and confirmed."""
    server, upstream = helpdesk
    run = _run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    request = ApprovalRequest.objects.get(run=run)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")

    plain_fault, turned_off = dispatch.fault, []

    def admin_turns_it_off(point: FaultPoint) -> None:
        if point == FaultPoint.AFTER_SENT_MARK and not turned_off:
            _set_active(server, False)  # between the sent mark's commit and the call
            turned_off.append(point)
        plain_fault(point)

    monkeypatch.setattr(dispatch, "fault", admin_turns_it_off)
    for _ in range(3):  # the transient refusal's retry meets the re-check before `sent`
        outcome = advance_run(run.run_id, "w1").outcome
        Run.objects.filter(pk=run.pk).update(wake_at=None)  # the retry's back-off is over
        if outcome == "needs_attention":
            break
    action = Action.objects.get(run=run)
    assert outcome == "needs_attention", (outcome, action.status, action.last_error)
    assert action.status != S.FAILED and "no active MCP server" in action.last_error
    assert upstream.calls() == []
    assert "its MCP server 'helpdesk' is inactive" in Run.objects.get(pk=run.pk).attention_reason

    _set_active(server, True)
    resume_run(Run.objects.get(pk=run.pk), actor="user:admin")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED and action.external_id
    assert upstream.calls() == [ONE_CALL]
    assert ApprovalRequest.objects.get(run=run).pk == request.pk  # the approval given counted


def _sent_marks(run: Run) -> list[JournalEntry]:
    """The run's journal entries that marked one of its actions `sent`."""
    entries = JournalEntry.objects.filter(
        stream=journal.run_stream(run.run_id), type=RunEvent.ACTION_OUTCOME.value
    )
    return [e for e in entries if e.payload.get("action_status") == S.SENT]


def test_an_external_executors_dispatch_while_the_server_is_off_is_refused_then_sent_once(
    tenant_a: Tenant, agent_a: Persona, reviewer_a: Persona, helpdesk: tuple[McpServer, Upstream]
) -> None:
    """The executor protocol meets the same re-check: `POST actions/{id}/dispatch/` of an
    approved action of the inactive server's tool answers 503 `tool_unavailable` (what the
    endpoint answers for any tool that cannot be reached now: nothing was applied, dispatch
    again later), with nothing marked; once the server is on, the same dispatch sends it
    once. Before: 200 with the action `failed` ("no active MCP server"), for good."""
    server, upstream = helpdesk
    agent = agent_a.api()
    run = new_run(agent)
    fence = take_lease(agent, run["run_id"])
    held = ok(prepare(agent, run["run_id"], fence, CREATE, {"title": "Printer on fire"}), 201)
    assert held["status"] == "awaiting_approval"
    _set_active(server, False)
    request = ApprovalRequest.objects.get(pk=held["approval"])
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")

    dispatch = f"actions/{held['action_id']}/dispatch/"
    refused = problem(post(agent, dispatch, {"fence": fence}), 503, "tool_unavailable")
    assert "its MCP server 'helpdesk' is inactive" in refused["detail"]
    assert ok(get(agent, f"actions/{held['action_id']}/"))["status"] == "approved"
    assert upstream.calls() == []

    _set_active(server, True)
    sent = ok(post(agent, dispatch, {"fence": fence}))
    assert sent["status"] == "confirmed" and sent["external_id"]
    assert ok(post(agent, dispatch, {"fence": fence}))["status"] == "confirmed"  # a retry
    assert upstream.calls() == [ONE_CALL]


NOTICE = (
    "The tool's MCP server 'helpdesk' is inactive; approving will not send it until the "
    "server is active again."
)


def _text(response: HttpResponse) -> str:
    """The page as a reader sees it: tags dropped, entities decoded, spaces collapsed."""
    assert response.status_code == 200
    words = html.unescape(re.sub(r"<[^>]+>", " ", response.content.decode()))
    return " ".join(words.split())


def test_a_pending_request_for_an_inactive_servers_tool_says_approving_will_not_send_it(
    tenant_a: Tenant, reviewer_a: Persona, helpdesk: tuple[McpServer, Upstream]
) -> None:
    """A request raised while the server was active waits in the inbox after it is turned
    off: its page and its inbox card tell the reviewer that approving sends nothing until
    the server is on again — and say nothing of it while the server is on. The inbox finds
    out for all its cards at once (the same statements for one card as for three)."""
    server, _ = helpdesk
    runs = [_run(tenant_a) for _ in range(3)]
    for run in runs:
        assert advance_run(run.run_id, "w1").outcome == "waiting"
    page = reverse("approval-page", args=[ApprovalRequest.objects.get(run=runs[0]).pk])
    client = Client()
    client.force_login(reviewer_a.user)
    assert NOTICE not in _text(client.get(page))
    assert NOTICE not in _text(client.get(reverse("inbox")))

    _set_active(server, False)
    assert NOTICE in _text(client.get(page))
    inbox = _text(client.get(reverse("inbox")))
    assert inbox.count(NOTICE) == 3  # one per card

    def statements() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get(reverse("inbox")).status_code == 200
        return len(captured)

    three = statements()
    ApprovalRequest.objects.filter(run__in=runs[1:]).update(status=ApprovalStatus.CANCELLED)
    assert _text(client.get(reverse("inbox"))).count(NOTICE) == 1
    assert statements() == three

    _set_active(server, True)
    assert NOTICE not in _text(client.get(page))
    assert NOTICE not in _text(client.get(reverse("inbox")))
