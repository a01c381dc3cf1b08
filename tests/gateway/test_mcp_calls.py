"""The gateway's synchronous core (gateway.calls) driven directly, against a real upstream
process (tests/mcp_upstream.py): what one `tools/call` comes to, without the web server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import mcp_types as types
import pytest
import time_machine
from django.conf import settings
from django.db import connections
from django.db.models import F
from django.db.models.functions import Now
from django.test import override_settings
from django.utils import timezone

from approvals.models import ApprovalPolicy
from gateway import calls
from runtime import mcpimport, protocol, tooldefs
from runtime.agents import mcp_session
from runtime.models import Action, ActionStatus, McpServer, Run, RunStatus, Tenant
from runtime.sweeper import flag_lost_executors
from tests import procs
from tests.conftest import Persona
from tests.mcp_fixture import Upstream
from tests.tooldefs import define_tickets

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
S = ActionStatus
CREATE = "helpdesk.tickets_create"


def _caller(agent: Persona) -> calls.Caller:
    assert agent.token
    return calls.authenticate(f"Bearer {agent.token}", agent.tenant.slug)


def _plain(tenant: Tenant, upstream: Upstream) -> None:
    McpServer.objects.create(tenant=tenant, name="helpdesk", url=upstream.url, timeout_seconds=1.5)
    mcpimport.import_tools(McpServer.objects.get(tenant=tenant), "user:admin")
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


def _call_now(caller: calls.Caller, session: str, name: str, arguments: Any) -> Any:
    """server.call_tool as the SDK calls it, for a client without a progressToken."""
    from gateway import server

    request = SimpleNamespace(scope={server.SCOPE_KEY: {"caller": caller, "session": session}})
    ctx = SimpleNamespace(request=request, request_id=1, session=None)
    params = types.CallToolRequestParams(name=name, arguments=arguments)
    return asyncio.run(server.call_tool(ctx, params))


def test_an_http_tools_answer_with_a_content_field_is_handed_over_not_a_crash(
    serve: Any, tenant_a: Tenant, agent_a: Persona
) -> None:
    """An http service's JSON answer is not an MCP result: a created note's own `content`
    field (a string) was taken for MCP content blocks, building the answer failed after its
    delivery was recorded, so the client got an internal error and its retry — the next
    identical call after a delivery — sent the note a second time."""
    from tests.httpservers import answer_with

    service = serve(answer_with(201, b'{"id": "N-1", "content": "Remember the milk"}'))
    define_tickets(tenant_a, service.url, mode="none")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="go", tool="tickets.create", required=False)
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    result = _call_now(caller, session, "tickets.create", {"title": "Milk"})
    said = " ".join(getattr(block, "text", "") for block in result.content)
    assert not result.is_error and "N-1" in said, said
    assert [r["method"] for r in service.requests] == ["POST"]


def _keyed(tenant: Tenant, upstream: Upstream, timeout: float = 1.5) -> str:
    """The README's tool with a lookup (tickets_open, found by tickets_find), a short timeout
    so its answer is lost quickly, let go by a policy. Its name."""
    from tests.core.readme import blocks

    (block,) = [b for b in blocks() if b.lang == "json" and '"executor": "mcp"' in b.text]
    declared = {**json.loads(block.text), "timeout_seconds": timeout}
    McpServer.objects.create(tenant=tenant, name="helpdesk", url=upstream.url, timeout_seconds=2)
    tooldefs.define(tenant, declared, "user:admin")
    ApprovalPolicy.objects.create(tenant=tenant, name="go", tool=declared["name"], required=False)
    return str(declared["name"])


def test_a_waiting_call_asks_a_failing_lookup_again_on_the_back_off_not_on_every_poll(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """A call whose answer was lost is settled by the tool's lookup; the gateway's wait loop
    drives it every POLL_SECONDS. It asked a failing finder on every poll: its
    HOLDPOINT_RECONCILE_ATTEMPTS were spent in seconds and the call went to a person
    (NEEDS A PERSON) although the finder was back a moment later. It now waits out the
    worker's back-off (dispatch.reconcile_delay, by the database clock) between lookups."""
    upstream = mcp_upstream(keyed=True)
    name = _keyed(tenant_a, upstream)
    upstream.faults(hang=30, find_fails=1)  # the answer is lost; the finder is down
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    call = calls.parse(caller, session, name, {"title": "Printer on fire"})
    said = []
    for _ in range(12):  # the wait loop's polls: six seconds' worth
        said.append(calls.answer(calls.drive(caller, call)).text)
    action = Action.objects.get(idempotency_key=call.key)
    assert action.status == S.UNKNOWN, (action.status, action.last_error)
    assert action.reconcile_attempts == 1  # one lookup; the next waits for the back-off
    assert all(text.startswith("PENDING:") for text in said), said

    upstream.faults(hang=30)  # the finder is back
    calls.drive(caller, call)
    assert Action.objects.get(pk=action.pk).status == S.UNKNOWN  # still within the back-off
    Action.objects.filter(pk=action.pk).update(updated_at=F("updated_at") - timedelta(seconds=2))
    settled = calls.drive(caller, call)
    assert settled.status == S.CONFIRMED and settled.external_id == "T-1", settled.last_error
    assert len(upstream.calls("tickets_open")) == 1  # found, never sent again


def _slow_call(
    tenant: Tenant, agent: Persona, upstream: Upstream, *, timeout: float, delay: float
) -> tuple[calls.Caller, str, calls.Call]:
    """A call of the keyed tool (`timeout`) in a new session, that its upstream applies only
    `delay` seconds after it came: (caller, session, call), not sent yet."""
    name = _keyed(tenant, upstream, timeout=timeout)
    upstream.faults(delay=delay)
    caller = _caller(agent)
    session = calls.open_session(caller, {})
    return caller, session, calls.parse(caller, session, name, {"title": "Printer on fire"})


def test_a_call_whose_sender_may_still_be_in_flight_is_not_looked_up_on_every_poll(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """A call is `sent` and its request still on its way (the upstream takes 3 s before it
    applies it), its sender paused past its lease. The same call polled meanwhile — the wait
    loop drives it every POLL_SECONDS — took the lease and asked the lookup tool on every
    poll: "absent" can prove nothing while the request may still land, each lookup was a
    request to the upstream for nothing, and the lease it took refused the sender's own
    answer as stale. No lookup now until the request can no longer be in flight; the
    sender records its answer."""
    upstream = mcp_upstream(keyed=True)
    caller, session, call = _slow_call(tenant_a, agent_a, upstream, timeout=10, delay=3)
    sender = _Sender(caller, call)
    procs.wait_for(
        lambda: Action.objects.filter(idempotency_key=call.key, status=S.SENT).exists(), 10
    )
    Run.objects.filter(pk=session).update(lease_expires_at=Now() - timedelta(seconds=1))
    said = [calls.answer(calls.drive(caller, call)).text for _ in range(8)]  # the polls
    assert upstream.finds() == [], upstream.finds()
    assert all(text.startswith("PENDING:") for text in said), said
    action = sender.result()
    assert action.status == S.CONFIRMED and action.external_id == "T-1", action.last_error
    assert len(upstream.calls("tickets_open")) == 1 and upstream.finds() == []


def test_a_lost_answer_not_applied_yet_is_looked_up_once_while_it_may_still_land(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """The upstream is slow: the call's answer is lost (its 1.5 s timeout) before the
    upstream applies it (at 4 s). The wait loop drives the unknown call every POLL_SECONDS:
    its lookup said "absent", which proves nothing while the request may still land, and
    wrote nothing — so every poll asked again until the window closed. As a worker parks its
    run until then, the gateway asks once; after the window it asks again and finds it."""
    upstream = mcp_upstream(keyed=True)
    caller, _, call = _slow_call(tenant_a, agent_a, upstream, timeout=1.5, delay=4)
    assert calls.drive(caller, call).status == S.UNKNOWN  # the answer was lost
    said = [calls.answer(calls.drive(caller, call)).text for _ in range(8)]  # the polls
    assert len(upstream.finds()) == 1, upstream.finds()
    assert all(text.startswith("PENDING:") for text in said), said

    procs.wait_for(lambda: upstream.calls("tickets_open"), 10)  # applied now
    Action.objects.filter(idempotency_key=call.key).update(
        in_flight_until=Now() - timedelta(seconds=1)
    )
    settled = calls.drive(caller, call)
    assert settled.status == S.CONFIRMED and settled.external_id == "T-1", settled.last_error
    assert len(upstream.finds()) == 2 and len(upstream.calls("tickets_open")) == 1


class _Sender:
    """calls.drive on a thread of its own: the call whose request is in flight."""

    def __init__(self, caller: calls.Caller, call: calls.Call) -> None:
        self.box: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(caller, call), daemon=True)
        self.thread.start()

    def _run(self, caller: calls.Caller, call: calls.Call) -> None:
        try:
            self.box["action"] = calls.drive(caller, call)
        except Exception as exc:  # noqa: BLE001 (re-raised in the test's thread)
            self.box["error"] = exc
        finally:
            connections.close_all()

    def result(self) -> Action:
        self.thread.join(30)
        if "error" in self.box:
            raise self.box["error"]
        return Action.objects.get(pk=self.box["action"].pk)


def test_an_idle_session_whose_gateway_was_lost_is_closed_unless_a_call_may_have_gone(
    tenant_a: Tenant, agent_a: Persona
) -> None:
    """A gateway process that dies while it holds a session's lease (a deploy, a crash) leaves
    the run to the sweeper, which flags it `needs_attention` / executor_lost. The idle sweep
    closed only `queued` sessions, so such a session — its host long gone — stayed open for
    ever, on the Runs pages and in the attention count. Idle, it is closed like any other,
    its unsent call withdrawn; one whose call may have reached the service is kept for the
    person who settles it."""
    define_tickets(tenant_a, "http://127.0.0.1:9", mode="none")  # nothing is ever sent here
    ApprovalPolicy.objects.create(tenant=tenant_a, name="go", tool="tickets.create", required=False)
    caller = _caller(agent_a)
    runs: dict[str, Run] = {}
    for name in ("unsent", "nothing", "sent"):
        run = Run.objects.get(pk=calls.open_session(caller, {}))
        lease = protocol.take(run, "mcp-gateway:dead", 5, who=caller.who)  # then it dies
        if name != "nothing":
            action, _ = protocol.prepare(
                run, lease.fence, "tickets.create", {"title": name}, reason="r", who=caller.who
            )
        if name == "sent":  # marked sent, the request on its way when the process died
            Action.objects.filter(pk=action.pk).update(status=S.SENT)
        runs[name] = run
    Run.objects.filter(pk__in=[r.pk for r in runs.values()]).update(
        lease_expires_at=Now() - timedelta(minutes=5)
    )
    assert flag_lost_executors(10) == 3
    assert {Run.objects.get(pk=r.pk).status for r in runs.values()} == {RunStatus.NEEDS_ATTENTION}

    idle = timedelta(hours=settings.HOLDPOINT_MCP_SESSION_IDLE_HOURS, minutes=1)
    Run.objects.filter(pk__in=[r.pk for r in runs.values()]).update(updated_at=Now() - idle)
    assert mcp_session.close_idle(10) == 2
    status = {name: Run.objects.get(pk=run.pk).status for name, run in runs.items()}
    assert status == {
        "unsent": RunStatus.COMPLETED,
        "nothing": RunStatus.COMPLETED,
        "sent": RunStatus.NEEDS_ATTENTION,  # kept: only a person can tell whether it went
    }
    withdrawn = Action.objects.get(run=runs["unsent"])
    assert withdrawn.status == S.CANCELLED and withdrawn.last_error == "session closed: idle"
    assert Action.objects.get(run=runs["sent"]).status == S.SENT


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        ("NaN", "NaN"),
        ("-Infinity", "-Infinity"),
        ('"a\\u0000b"', "a\ufffdb"),
        ('"\\ud800 alone"', "\ufffd alone"),
        ('"\\ud83d\\ude00"', "\U0001f600"),  # a pair is a character: kept
    ],
)
def test_an_upstream_answer_holding_what_no_column_takes_is_confirmed_and_stored(
    tenant_a: Tenant,
    agent_a: Persona,
    mcp_upstream: Callable[..., Upstream],
    raw: str,
    kept: str,
) -> None:
    """The upstream applied the call and answered with its proof, plus a value no column
    takes — NaN or Infinity (JSON has none, the SDK's parser reads them), a \\u0000 escape
    (PostgreSQL's JSON refuses it), a lone surrogate (UTF-8 cannot hold it). The effect must
    be confirmed and its answer stored (as an http tool's is: the text, U+FFFD), never a
    failed write after the effect; the client gets its answer."""
    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    upstream.faults(raw=raw)
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    result = _call_now(caller, session, CREATE, {"title": "Printer on fire"})
    action = Action.objects.get(tenant=tenant_a, tool=CREATE)
    assert action.status == S.CONFIRMED and action.external_id == "T-1", action.last_error
    assert action.result["structuredContent"]["note"] == kept
    assert not result.is_error and result.structured_content["note"] == kept
    assert len(upstream.calls()) == 1


def test_an_upstream_answer_the_sdk_cannot_parse_is_an_unknown_outcome_not_a_refusal(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """The upstream applied the call and answered with a message that is not JSON. The SDK's
    client then answers the call itself with JSON-RPC's parse error (-32700) — the code an
    upstream gives a request it could not read, which was taken as "not taken": the action
    was FAILED and the client told so, though the ticket had been opened, and its next
    identical call would open a second one. Nobody can tell from such an answer: it is
    unknown (this tool has no lookup: a person settles it)."""
    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    upstream.faults(raw="{")  # the answer's JSON is cut off inside
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    call = calls.parse(caller, session, CREATE, {"title": "Printer on fire"})
    said = calls.answer(calls.drive(caller, call))
    action = Action.objects.get(idempotency_key=call.key)
    assert action.status == S.MANUAL_REVIEW, (action.status, action.last_error)
    assert said.text.startswith("NEEDS A PERSON") and not said.final, said.text
    assert len(upstream.calls()) == 1


def test_an_inactive_servers_tools_are_not_listed_and_a_new_call_of_one_is_an_mcp_error(
    tenant_a: Tenant, agent_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """An admin turned an MCP server off: its tools are not sent (runtime.mcp). They were
    still listed, and a call of one was stored, held for a reviewer when the tool is held,
    and then FAILED with "no active MCP server". They are no longer listed, a new call is
    an MCP error with nothing stored; a call made before still gets its answer."""
    upstream = mcp_upstream()
    _plain(tenant_a, upstream)
    define_tickets(tenant_a, "http://127.0.0.1:9/tickets", mode="none")  # an http tool
    purge = "helpdesk.tickets_purge"  # irreversible: every call waits for a reviewer
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    held = calls.parse(caller, session, purge, {"older_than_days": 30})
    assert calls.drive(caller, held).status == S.AWAITING_APPROVAL

    server = McpServer.objects.get(tenant=tenant_a)
    server.active = False
    server.save()
    listed = {tool.name for tool in calls.listing(caller)}
    assert "tickets.create" in listed and not {n for n in listed if n.startswith("helpdesk.")}
    with pytest.raises(calls.CallError) as refused:
        calls.parse(caller, session, CREATE, {"title": "Printer on fire"})
    assert refused.value.code == calls.INVALID_PARAMS
    assert "'helpdesk' is inactive" in refused.value.message
    assert not Action.objects.filter(tenant=tenant_a, tool=CREATE).exists()
    again = calls.parse(caller, session, purge, {"older_than_days": 30})
    assert calls.answer(calls.drive(caller, again)).text.startswith("PENDING:")
    assert upstream.calls() == []


def test_the_idle_cutoff_is_the_databases_clock_not_the_process_clock(
    tenant_a: Tenant, agent_a: Persona
) -> None:
    """A session is idle when its run was last touched HOLDPOINT_MCP_SESSION_IDLE_HOURS ago
    by the database's clock, which writes that time (and every lease). The cutoff was the
    process's clock: a sweeper whose clock ran a day ahead closed every open session, and
    one behind closed none."""
    caller = _caller(agent_a)
    fresh, aged = (calls.open_session(caller, {}) for _ in range(2))
    idle = timedelta(hours=settings.HOLDPOINT_MCP_SESSION_IDLE_HOURS)
    Run.objects.filter(pk__in=[fresh, aged]).update(updated_at=Now())
    Run.objects.filter(pk=aged).update(updated_at=Now() - idle - timedelta(minutes=1))
    with time_machine.travel(timezone.now() - 2 * idle, tick=False):  # the process is behind
        assert mcp_session.close_idle(10) == 1
    with time_machine.travel(timezone.now() + 2 * idle, tick=False):  # and now ahead
        assert mcp_session.close_idle(10) == 0
    status = {
        name: Run.objects.get(pk=run).status for name, run in (("fresh", fresh), ("aged", aged))
    }
    assert status == {"fresh": RunStatus.QUEUED, "aged": RunStatus.COMPLETED}


def test_a_session_opened_by_a_gateway_whose_clock_runs_behind_is_not_idle_at_once(
    tenant_a: Tenant, agent_a: Persona
) -> None:
    """The idle sweep compares a session's updated_at with the database's now; the insert
    stamped updated_at with the opening process's clock (auto_now). A session opened by a
    gateway whose clock ran behind by more than HOLDPOINT_MCP_SESSION_IDLE_HOURS was closed
    as idle by the next sweep, before its client's first call."""
    caller = _caller(agent_a)
    idle = timedelta(hours=settings.HOLDPOINT_MCP_SESSION_IDLE_HOURS)
    with time_machine.travel(timezone.now() - 2 * idle, tick=True):
        session = calls.open_session(caller, {})
    assert mcp_session.close_idle(10) == 0
    assert Run.objects.get(pk=session).status == RunStatus.QUEUED


@pytest.mark.parametrize("end", ["cancelled", "closed"])
def test_a_call_whose_session_ended_after_it_was_let_in_is_told_to_open_a_new_one(
    serve: Any, tenant_a: Tenant, agent_a: Persona, end: str
) -> None:
    """The endpoint lets a request in if its session is open; the session can end before
    its call takes the run's lease — cancelled on the Runs page, closed by the client's
    DELETE on another connection or by the idle sweep. The call then raised the lease's
    RunFinished out of the tool handler: the SDK answered JSON-RPC error code 0 with the
    exception's text and logged a traceback. It is the answer a finished session gets at
    the door (404: initialize a new one) as an MCP error, and nothing is stored or sent."""
    from mcp.shared.exceptions import MCPError

    from runtime.lifecycle import cancel_run
    from tests.httpservers import answer_with

    service = serve(answer_with(201, b'{"id": "N-1"}'))
    define_tickets(tenant_a, service.url, mode="none")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="go", tool="tickets.create", required=False)
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    assert calls.adopt(caller, session)  # let in...
    if end == "cancelled":
        cancel_run(Run.objects.get(pk=session), "not needed", actor="user:alice")
    else:
        assert calls.close_session(caller, session)
    with pytest.raises(MCPError) as refused:  # ...and ended before its call
        _call_now(caller, session, "tickets.create", {"title": "Milk"})
    assert refused.value.error.code == -32600, refused.value.error
    assert "initialize a new session" in refused.value.error.message
    assert not Action.objects.filter(tenant=tenant_a).exists()
    assert service.requests == []


@pytest.mark.postgres
def test_two_deliveries_of_one_outcome_at_once_are_journalled_once(
    serve: Any, tenant_a: Tenant, agent_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two identical calls of a session answered at once hand out the same final outcome;
    each records its delivery (settle_delivery). Both looked for a `result_delivered` entry
    before either wrote one, so both wrote: the journal told of two deliveries. Here each
    caller is held between its look and its write until the other arrives too (or 2 s
    passed: with the look guarded, the second caller waits at the lock, not at this seam)."""
    from runtime.events import record
    from tests.httpservers import answer_with

    if connections["default"].vendor != "postgresql":
        pytest.skip("two connections racing: PostgreSQL")
    service = serve(answer_with(201, b'{"id": "N-1"}'))
    define_tickets(tenant_a, service.url, mode="none")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="go", tool="tickets.create", required=False)
    caller = _caller(agent_a)
    session = calls.open_session(caller, {})
    call = calls.parse(caller, session, "tickets.create", {"title": "Milk"})
    action = calls.drive(caller, call)
    assert action.status == S.CONFIRMED, action.last_error

    seam = threading.Barrier(2, timeout=2)

    def held_then_record(*args: Any, **kwargs: Any) -> Any:
        try:
            seam.wait()
        except threading.BrokenBarrierError:
            pass  # the other caller never came this far
        return record(*args, **kwargs)

    monkeypatch.setattr(calls, "record", held_then_record)
    start = threading.Barrier(2, timeout=10)
    failures: list[BaseException] = []

    def deliver() -> None:
        try:
            start.wait()
            calls.settle_delivery(caller, call, action)
        except BaseException as exc:  # noqa: BLE001 (reported in the test's thread)
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    delivered = calls._delivered(session, tenant_a.pk, call.call_hash)
    assert delivered.count() == 1
    # The next identical call is a new one, keyed after exactly one delivery.
    assert calls.parse(caller, session, "tickets.create", {"title": "Milk"}).key.endswith(":2")
