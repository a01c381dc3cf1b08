"""Holdpoint as an MCP gateway (issue 19): a real MCP client (the SDK's ClientSession over
streamable HTTP) talks to the real web server (uvicorn, config.asgi), which sends to a real
upstream process (tests/mcp_upstream.py). The oracle for effects is the upstream's own
record of the calls that reached it; for Holdpoint's side, the stored rows.

One web server and one upstream serve the whole module (each test has its own tenant rows,
and counts the upstream's calls by a title of its own); the crash tests start their own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.db.models.functions import Now
from django.test import override_settings

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest
from audit.journal import run_stream
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime import mcpimport, toolcatalog
from runtime.agents import mcp_session
from runtime.artifacts import resolve
from runtime.auth import revoke_token
from runtime.models import Action, ActionStatus, AgentToken, Checkpoint, McpServer, Run, Tenant
from runtime.models.tenancy import Role
from runtime.sweeper import sweep_once
from tests import procs
from tests.browser import log_in
from tests.conftest import Persona, issue_token_for, make_persona
from tests.gateway.helpers import Background, Progress, session, text
from tests.mcp_fixture import Upstream, start_upstream
from tests.orphans import off_loop

pytest_plugins = ("tests.browser",)
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
S = ActionStatus
CREATE = "helpdesk.tickets_create"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    started = start_upstream(tmp_path_factory.mktemp("gateway-upstream"))
    try:
        yield started
    finally:
        procs.kill(started.proc)


def _web_env(port: int, **extra: str) -> dict[str, str]:
    return procs.child_env(
        HOLDPOINT_BASE_URL=f"http://127.0.0.1:{port}",
        HOLDPOINT_MCP_WAIT_SECONDS="60",
        HOLDPOINT_MCP_MAX_ARGUMENT_BYTES="2048",
        SESSION_COOKIE_SECURE="0",
        CSRF_COOKIE_SECURE="0",
        **extra,
    )


@pytest.fixture(scope="module")
def web(django_db_setup: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The web server, shared by the module's tests; its base URL."""
    log = tmp_path_factory.mktemp("gateway-web") / "web.log"
    server, base = procs.start_web(_web_env, log)  # told its own port, whichever it gets
    try:
        yield base
    finally:
        procs.kill(server)


def _setup(tenant: Tenant, upstream: Upstream, **server: Any) -> None:
    McpServer.objects.create(tenant=tenant, name="helpdesk", url=upstream.url, **server)
    mcpimport.import_tools(McpServer.objects.get(tenant=tenant), "user:admin")


def _title() -> str:
    return f"Printer {uuid.uuid4().hex[:8]} on fire"


def _reached(upstream: Upstream, title: str) -> list[dict[str, Any]]:
    return [c for c in upstream.calls("tickets_create") if title in c["arguments"]["title"]]


def _endpoint(base: str, tenant: Tenant) -> str:
    return f"{base}/mcp/{tenant.slug}/"


def _call(name: str, arguments: dict[str, Any], progress: Progress | None = None) -> Any:
    async def work(client: Any) -> Any:
        return await client.call_tool(name, arguments, progress_callback=progress)

    return work


def _request(action: Action) -> ApprovalRequest:
    return ApprovalRequest.objects.get(action=action)


def _wait_for_request(title: str) -> ApprovalRequest:
    def found() -> ApprovalRequest | None:
        return ApprovalRequest.objects.filter(params__contains=title).first()

    return procs.wait_for(found, timeout=60)


def test_a_session_lists_the_gated_tools_and_a_call_waits_for_the_browser_approval(
    web: str,
    upstream: Upstream,
    tenant_a: Tenant,
    agent_a: Persona,
    reviewer_a: Persona,
    new_page: Any,
) -> None:
    _setup(tenant_a, upstream)
    key = agent_a.token
    assert key
    url = _endpoint(web, tenant_a)

    async def listing(client: Any) -> Any:
        return (await client.list_tools()).tools

    tools = {tool.name: tool for tool in session(url, key, listing)}
    assert {CREATE, "helpdesk.tickets_list"} <= set(tools)
    assert "waits for a reviewer's approval" in (tools[CREATE].description or "")
    assert tools[CREATE].input_schema["required"] == ["title"]
    assert "approval" not in (tools["helpdesk.tickets_list"].description or "")

    title = _title()
    progress = Progress()
    waiting = Background(url, key, _call(CREATE, {"title": title}, progress))
    request = _wait_for_request(title)
    assert _reached(upstream, title) == []  # held: nothing sent yet

    page = new_page()
    log_in(page, web, "alice", "pw-alice")
    page.goto(f"{web}/approvals/{request.pk}/")
    page.click("#approve-button")
    page.wait_for_url(f"{web}/inbox/")

    result = waiting.result()
    assert not result.is_error, text(result)
    assert result.structured_content["title"] == title
    assert len(_reached(upstream, title)) == 1
    assert any("approval" in message for message in progress.messages), progress.messages
    action = Action.objects.get(idempotency_key__startswith="mcp:", params__contains=title)
    assert action.status == S.CONFIRMED
    assert action.external_id == result.structured_content["id"]

    # The session is a run: on the run page, its journal telling the call's story.
    run = Run.objects.get(pk=action.run_id)
    assert run.graph == "mcp-session" and run.external and run.tenant_id == tenant_a.pk
    # The client closed its session (the SDK sends DELETE) with every answer delivered.
    assert run.status == "completed", run.status
    page.goto(f"{web}/runs/{run.run_id}/")
    assert CREATE in page.content()
    types = list(
        JournalEntry.objects.filter(stream=run_stream(run.run_id)).values_list("type", flat=True)
    )
    for expected in (
        "run_created",
        "action_prepared",
        "approval_requested",
        "approval_decided",
        "action_outcome",
        "result_delivered",
    ):
        assert expected in types, types


def test_without_a_progress_token_the_answer_is_pending_and_the_same_call_gets_the_rejection(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona, reviewer_a: Persona
) -> None:
    _setup(tenant_a, upstream)
    url, title = _endpoint(web, tenant_a), _title()
    first = session(url, str(agent_a.token), _call(CREATE, {"title": title}))
    assert not first.is_error and text(first).startswith("PENDING")
    request = ApprovalRequest.objects.get(params__contains=title)
    link = f"{web}/approvals/{request.pk}/"
    assert link in text(first) and first.meta["holdpoint/approval_url"] == link
    decide(request.id, reviewer_a.user, "reject", request.action_hash, reason="Not needed")

    again = session(url, str(agent_a.token), _call(CREATE, {"title": title}))  # a new session
    # ...is another run: the call there is a new one, held again; in the first session the
    # same call gets the decision.
    assert text(again).startswith("PENDING")
    run_id = Action.objects.get(approvals=request).run_id
    # Its client closed that session with the call still open: the run stays open, so the
    # decision lands and the session can be carried on.
    assert Run.objects.get(pk=run_id).status == "queued"

    async def retry(client: Any) -> Any:
        return await client.call_tool(CREATE, {"title": title})

    retried = _in_run(url, str(agent_a.token), str(run_id), retry)
    assert retried.is_error and "Not needed" in text(retried), text(retried)
    assert _reached(upstream, title) == []
    assert Run.objects.get(pk=run_id).status == "completed"  # now every answer is out


def _status(run_id: Any) -> str:
    return str(Run.objects.get(pk=run_id).status)


def _waits_for(run_id: Any) -> tuple[str, str | None]:
    """The session run's status, and the action its `waiting_for` names."""
    run = Run.objects.get(pk=run_id)
    return str(run.status), (run.waiting_for or {}).get("action_id")


def test_a_call_sent_while_another_waits_for_a_reviewer_leaves_the_session_waiting_for_it(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona, reviewer_a: Persona
) -> None:
    """Hosts make calls while an earlier one waits for a reviewer. Sending one (a read here)
    moved the session run from `waiting_approval` to `running` — `queued` once the call's
    lease was released — with `waiting_for` gone, though the first call still waited: the
    Runs pages and the metrics showed nothing waiting. Sending a call whose approval came
    made it `running` too while a second held call still waited."""
    _setup(tenant_a, upstream)
    url, key = _endpoint(web, tenant_a), str(agent_a.token)
    first, second = _title(), _title()

    async def held_then_read(client: Any) -> Any:
        await client.call_tool(CREATE, {"title": first})
        await client.call_tool(CREATE, {"title": second})
        return await client.call_tool("helpdesk.tickets_list", {})

    listed = session(url, key, held_then_read)
    assert not listed.is_error, text(listed)
    held = {t: Action.objects.get(tool=CREATE, params__contains=t) for t in (first, second)}
    run_id = held[first].run_id
    assert _waits_for(run_id) == ("waiting_approval", str(held[first].action_id))

    request = _request(held[first])
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    # Deciding the first wakes nothing while the second still waits for its reviewer.
    assert _waits_for(run_id) == ("waiting_approval", str(held[second].action_id))
    done = _in_run(url, key, str(run_id), _call(CREATE, {"title": first}))
    assert not done.is_error and len(_reached(upstream, first)) == 1, text(done)
    # The first is sent; the second still waits for its reviewer, and the session with it.
    assert _waits_for(run_id) == ("waiting_approval", str(held[second].action_id))
    assert _reached(upstream, second) == []


def _last_used(runs: list[Any], ago: timedelta) -> None:
    """The sessions' runs last touched `ago` before now, by the database's clock (the one
    the idle sweep reads)."""
    Run.objects.filter(pk__in=runs).update(updated_at=Now() - ago)


def test_a_session_its_host_left_open_is_closed_once_idle_unless_a_call_is_still_open(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona
) -> None:
    """Most hosts quit without the DELETE that ends a session: the sweeper closes a session
    no call has touched for HOLDPOINT_MCP_SESSION_IDLE_HOURS as that DELETE would — every
    answer delivered — and leaves one whose call still waits for a reviewer."""
    _setup(tenant_a, upstream)
    ApprovalPolicy.objects.create(
        tenant=tenant_a,
        name="an ok ticket goes",
        tool=CREATE,
        required=False,
        condition={"param": "title", "op": "matches", "value": "^ok "},
        priority=10,
    )
    ApprovalPolicy.objects.create(tenant=tenant_a, name="the rest waits", tool=CREATE)
    url, key = _endpoint(web, tenant_a), str(agent_a.token)
    titles = {"done": f"ok {_title()}", "waiting": _title(), "quiet": f"ok {_title()}"}
    for title in titles.values():  # each its own session, none closed by its host
        session(url, key, _call(CREATE, {"title": title}), close=False)
    runs = {
        name: Action.objects.get(run__graph="mcp-session", params__contains=title).run_id
        for name, title in titles.items()
    }
    before = {"done": "queued", "waiting": "waiting_approval", "quiet": "queued"}
    assert {name: _status(run) for name, run in runs.items()} == before
    assert Action.objects.get(run_id=runs["waiting"]).status == S.AWAITING_APPROVAL

    idle = timedelta(hours=settings.HOLDPOINT_MCP_SESSION_IDLE_HOURS)
    _last_used(list(runs.values()), idle + timedelta(minutes=1))
    _last_used([runs["quiet"]], idle - timedelta(minutes=59))
    with override_settings(HOLDPOINT_MCP_SESSION_IDLE_HOURS=0):  # 0: never
        sweep_once()
    assert _status(runs["done"]) == "queued"
    sweep_once()
    assert _status(runs["done"]) == "completed"
    [closing] = Checkpoint.objects.filter(run_id=runs["done"]).order_by("-rev")[:1]
    assert resolve(tenant_a.pk, closing.state) == {"calls": 1, "closed_by": "idle"}
    assert verify_stream(run_stream(runs["done"])) is None
    assert _status(runs["waiting"]) == "waiting_approval"  # its call waits for a reviewer
    assert _status(runs["quiet"]) == "queued"  # last used an hour before the limit
    # A closed session is not carried on: its client is told to open a new one.
    headers = {
        "Authorization": f"Bearer {key}",
        "Mcp-Session-Id": str(runs["done"]),
        "Accept": "application/json, text/event-stream",
    }
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    assert httpx.post(url, json=listing, headers=headers).status_code == 404


def test_an_idle_session_whose_client_left_before_the_decision_is_closed_all_the_same(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona, reviewer_a: Persona
) -> None:
    """A client that left while its call waited for a reviewer never collects the decision.
    DELETE's rule (every final answer handed over) would keep its session open for ever —
    and, the oldest first, take every sweep's whole batch while newer idle sessions wait.
    Idle, it is closed: a rejected call's outcome stays in the ledger; an approved one that
    only its client would have sent is withdrawn, and never reaches the upstream."""
    _setup(tenant_a, upstream)
    url, key = _endpoint(web, tenant_a), str(agent_a.token)
    titles = {"rejected": _title(), "approved": _title()}
    for title in titles.values():  # no progress token: PENDING at once; the host then quits
        first = session(url, key, _call(CREATE, {"title": title}), close=False)
        assert text(first).startswith("PENDING"), text(first)
    actions = {name: Action.objects.get(params__contains=t) for name, t in titles.items()}
    runs = {name: action.run_id for name, action in actions.items()}
    for name, verdict in (("rejected", "reject"), ("approved", "approve")):
        request = _request(actions[name])
        decide(request.id, reviewer_a.user, verdict, request.action_hash, reason="decided")
    assert {name: _status(run) for name, run in runs.items()} == {
        "rejected": "queued",
        "approved": "queued",
    }
    assert Action.objects.get(pk=actions["approved"].pk).status == S.APPROVED  # unsent
    # The session whose rejection was never handed over is the oldest.
    idle = timedelta(hours=settings.HOLDPOINT_MCP_SESSION_IDLE_HOURS)
    _last_used([runs["approved"]], idle + timedelta(minutes=1))
    _last_used([runs["rejected"]], idle + timedelta(minutes=6))
    assert mcp_session.close_idle(1) == 1  # a batch of one: the oldest is not stuck
    assert _status(runs["rejected"]) == "completed"
    assert mcp_session.close_idle(1) == 1
    assert _status(runs["approved"]) == "completed"

    rejected, approved = (Action.objects.get(pk=actions[n].pk) for n in ("rejected", "approved"))
    assert rejected.status == S.CANCELLED and "decided" in rejected.last_error  # as decided
    assert approved.status == S.CANCELLED and approved.last_error == "session closed: idle"
    assert _reached(upstream, titles["rejected"]) == _reached(upstream, titles["approved"]) == []
    states = {
        name: resolve(tenant_a.pk, Checkpoint.objects.filter(run_id=run).latest("rev").state)
        for name, run in runs.items()
    }
    assert states == {
        "rejected": {"calls": 1, "closed_by": "idle"},
        "approved": {"calls": 1, "closed_by": "idle", "withdrawn": [str(approved.pk)]},
    }
    cancelled = JournalEntry.objects.get(
        stream=run_stream(runs["approved"]), type="action_cancelled"
    )
    assert cancelled.payload["reason"] == "session closed: idle"
    for run in runs.values():
        assert verify_stream(run_stream(run)) is None


def _in_run(url: str, key: str, run_id: str, work: Any) -> Any:
    """A client that carries on an existing session: the gateway adopts the id it issued."""
    return Background(url, key, work, session_id=run_id).result()


def test_edited_params_are_what_the_upstream_receives_and_a_retry_acts_once(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona, reviewer_a: Persona
) -> None:
    _setup(tenant_a, upstream)
    spec = dict(toolcatalog.entry(tenant_a.pk, CREATE).spec)  # type: ignore[union-attr]
    toolcatalog.revise(
        tenant_a, CREATE, {**spec, "editable": ["title"], "expected_version": 1}, "user:admin"
    )
    url, key, title = _endpoint(web, tenant_a), str(agent_a.token), _title()

    async def call_then_retry(client: Any) -> Any:
        """The first answer is pending; the reviewer edits and approves; the client asks
        again — twice at once, as a client retrying on two connections might."""
        first = await client.call_tool(CREATE, {"title": title})
        await off_loop(_approve_edited, title, reviewer_a, f"{title} (edited)")
        return first, await asyncio.gather(
            client.call_tool(CREATE, {"title": title}, progress_callback=Progress()),
            client.call_tool(CREATE, {"title": title}, progress_callback=Progress()),
        )

    first, retries = session(url, key, call_then_retry)
    assert text(first).startswith("PENDING")
    answered = [r for r in retries if not r.is_error and r.structured_content]
    assert answered, [text(r) for r in retries]
    assert answered[0].structured_content["title"] == f"{title} (edited)"
    assert [c["arguments"] for c in _reached(upstream, title)] == [{"title": f"{title} (edited)"}]
    assert Action.objects.filter(status=S.CONFIRMED, params__contains=title).count() == 1


def _approve_edited(title: str, reviewer: Persona, edited: str) -> None:
    request = ApprovalRequest.objects.get(params__contains=title)
    decide(
        request.id,
        reviewer.user,
        "approve",
        request.action_hash,
        reason="ok",
        edits={"title": edited},
    )


def _refused_call(url: str, key: str, name: str, arguments: Any) -> Any:
    """The MCP error a call gets (the SDK raises it as MCPError)."""
    from mcp.shared.exceptions import MCPError

    async def work(client: Any) -> Any:
        try:
            await client.call_tool(name, arguments)
        except MCPError as exc:
            return exc
        raise AssertionError(f"{name} was not refused")

    return session(url, key, work)


def test_bad_input_gets_mcp_errors_and_nothing_is_stored_or_sent(
    web: str,
    upstream: Upstream,
    tenant_a: Tenant,
    tenant_b: Tenant,
    agent_a: Persona,
    agent_b: Persona,
    reviewer_a: Persona,
) -> None:
    _setup(tenant_a, upstream)
    url, key, title = _endpoint(web, tenant_a), str(agent_a.token), _title()
    unknown = _refused_call(url, key, "helpdesk.tickets_burn", {"title": title})
    assert unknown.code == -32602 and "unknown tool" in unknown.message
    invalid = _refused_call(url, key, CREATE, {"title": 42})
    assert invalid.code == -32602 and "invalid arguments" in invalid.message
    oversized = _refused_call(url, key, CREATE, {"title": title + "x" * 4000})
    assert oversized.code == -32602 and "larger than 2048 bytes" in oversized.message
    deep: Any = "bottom"
    for _ in range(100):  # within the parser's limit, past the API's 64 levels
        deep = {"a": deep}
    nested = _refused_call(url, key, CREATE, {"title": title, "more": deep})
    assert nested.code == -32602 and "nested deeper than 64 levels" in nested.message

    # Authentication is refused over HTTP, before any session (or run) exists.
    runs = Run.objects.count()
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream"}

    def post(auth: str | None, endpoint: str = url) -> httpx.Response:
        headers = {**accept, **({"Authorization": auth} if auth else {})}
        return httpx.post(endpoint, json=initialize, headers=headers, timeout=30)

    assert post(None).status_code == 401
    assert post("Bearer hpt_not-a-key").status_code == 401
    assert post(f"Bearer {agent_b.token}").status_code == 403  # tenant B's token at A's door
    assert post(f"Bearer {agent_a.token}", _endpoint(web, tenant_b)).status_code == 403
    revoked = issue_token_for(agent_a.user)
    revoke_token(AgentToken.objects.get(prefix=revoked[:12]), actor="user:admin")
    assert post(f"Bearer {revoked}").status_code == 401
    assert post(f"Token {agent_a.token}").status_code == 200  # the API's spelling works too
    assert Run.objects.count() == runs + 1  # only the accepted initialize made a session

    # A session id is the account's own: another agent of the tenant, or the other tenant's
    # agent at its own endpoint, cannot carry it on (404: "initialize a new session").
    # (The raw initialize above left its session open; the SDK's sessions closed theirs.)
    session_id = str(Run.objects.get(tenant=tenant_a, graph="mcp-session", status="queued").pk)
    colleague = make_persona(tenant_a, "agent-a2", Role.AGENT)

    def carry_on(key: str, endpoint: str) -> httpx.Response:
        headers = {**accept, "Authorization": f"Bearer {key}", "Mcp-Session-Id": session_id}
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        return httpx.post(endpoint, json=listing, headers=headers, timeout=30)

    assert carry_on(str(colleague.token), url).status_code == 404
    assert carry_on(str(agent_b.token), _endpoint(web, tenant_b)).status_code == 404
    assert carry_on(str(agent_a.token), url).status_code == 200  # its own account: carried on

    assert not Action.objects.exists()
    assert not ApprovalRequest.objects.exists()
    assert _reached(upstream, title) == []


def test_a_body_over_the_limit_gets_413_before_any_session_and_the_server_goes_on(
    web: str, tenant_a: Tenant, agent_a: Persona
) -> None:
    """HOLDPOINT_MCP_MAX_BODY_BYTES (1 MiB, the module's server runs with the default): a
    body over it, whether its length is declared or it comes in chunks with none, is
    refused with 413 and the limit, and nothing — no session run — is stored."""
    url, limit = _endpoint(web, tenant_a), 1024 * 1024
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {agent_a.token}",
    }
    head = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":'
    head += b'"2025-11-25","capabilities":{},"clientInfo":{"version":"1","name":"'
    runs = Run.objects.count()

    declared = httpx.post(url, content=head + b"x" * limit + b'"}}}', headers=headers, timeout=30)
    assert declared.status_code == 413, declared.text
    assert f"larger than {limit} bytes" in declared.text

    def chunks() -> Iterator[bytes]:
        yield head
        for _ in range(limit // 65536 + 1):
            yield b"x" * 65536
        yield b'"}}}'

    streamed = httpx.post(url, content=chunks(), headers=headers, timeout=30)
    assert streamed.status_code == 413, streamed.text
    assert Run.objects.count() == runs

    # Just under the limit is a request like any other.
    name = b"x" * (limit - len(head) - 4)
    fits = httpx.post(url, content=head + name + b'"}}}', headers=headers, timeout=30)
    assert fits.status_code == 200, fits.text
    assert Run.objects.count() == runs + 1


def _deep(depth: int) -> bytes:
    body = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":' + b"[" * depth
    return body + b"]" * depth + b"}"


@pytest.mark.parametrize(
    "body",
    [_deep(5_000), _deep(100_000), b'{"jsonrpc": "2.0", "method": "initial', b"\xff\xfe"],
    ids=["nested-5000", "nested-100000", "cut-short", "not-utf8"],
)
@pytest.mark.parametrize("carried", [False, True], ids=["new", "in-a-session"])
def test_a_body_that_is_not_json_is_a_parse_error_not_a_crash(
    web: str, tenant_a: Tenant, agent_a: Persona, body: bytes, carried: bool
) -> None:
    """TEST-MATRIX D2 at the gateway: JSON nested 5,000 or 100,000 deep (Python's parser
    gives up with RecursionError, not ValueError: it was a 500), cut short, or not UTF-8 is
    JSON-RPC's parse error, HTTP 400, with or without a session — and nothing is stored;
    the server goes on serving."""
    url = _endpoint(web, tenant_a)
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {agent_a.token}",
    }
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    if carried:
        opened = httpx.post(url, json=initialize, headers=headers, timeout=30)
        headers["Mcp-Session-Id"] = opened.headers["mcp-session-id"]
    runs = Run.objects.count()
    answer = httpx.post(url, content=body, headers=headers, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == -32700  # JSON-RPC: parse error
    assert Run.objects.count() == runs
    headers.pop("Mcp-Session-Id", None)
    assert httpx.post(url, json=initialize, headers=headers, timeout=30).status_code == 200


def test_the_readme_example_client_waits_for_the_approval_and_prints_the_result(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona, reviewer_a: Persona
) -> None:
    """examples/mcp_gateway_client.py, the README's command (run there against make run by
    tests/core/test_run_script.py; here through an approval and a rejection)."""
    _setup(tenant_a, upstream)
    title = _title()

    def example(arguments: dict[str, Any]) -> subprocess.Popen[str]:
        command = [
            sys.executable,
            "examples/mcp_gateway_client.py",
            _endpoint(web, tenant_a),
            CREATE,
            json.dumps(arguments),
        ]
        env = {**os.environ, "HOLDPOINT_TOKEN": str(agent_a.token)}
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)

    approved = example({"title": title})
    request = _wait_for_request(title)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    out, _ = approved.communicate(timeout=120)
    assert approved.returncode == 0, out
    assert f"tool {CREATE}: " in out and "waits for a reviewer's approval" in out
    assert "progress " in out  # it waited, told by progress notifications
    action = Action.objects.get(approvals=request)
    assert f"session {action.run_id}" in out
    assert f'result {{"id": "{action.external_id}", "title": "{title}"}}' in out
    assert len(_reached(upstream, title)) == 1

    other = _title()
    rejected = example({"title": other})
    request = _wait_for_request(other)
    decide(request.id, reviewer_a.user, "reject", request.action_hash, reason="Duplicate")
    out, _ = rejected.communicate(timeout=120)
    assert rejected.returncode == 1, out
    assert "REJECTED" in out and "Duplicate" in out
    assert _reached(upstream, other) == []


@pytest.mark.parametrize(
    "body",
    [
        [{"jsonrpc": "2.0", "id": 2, "method": "tools/list"}],
        [
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
        ],
        [],
        42,
    ],
    ids=["batch-of-one", "batch-of-two", "empty-batch", "a-number"],
)
@pytest.mark.parametrize("carried", [False, True], ids=["new", "in-a-session"])
def test_a_batch_is_an_invalid_request_with_or_without_a_session(
    web: str, tenant_a: Tenant, agent_a: Persona, body: Any, carried: bool
) -> None:
    """MCP 2025-06-18 removed JSON-RPC batching. A batch (a JSON array), or any JSON that
    is not one message, is JSON-RPC's Invalid Request (-32600, id null), HTTP 400, whether
    or not it names a session: a new session's got a plain 400 without any JSON-RPC error,
    a session's the SDK's -32602 (invalid params) with pydantic's validation text. Nothing
    is stored; the session goes on."""
    url = _endpoint(web, tenant_a)
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {agent_a.token}",
    }
    if carried:
        opened = httpx.post(url, json=_initialize(), headers=headers, timeout=30)
        headers["Mcp-Session-Id"] = opened.headers["mcp-session-id"]
    runs = Run.objects.count()
    answer = httpx.post(url, content=json.dumps(body), headers=headers, timeout=30)
    assert answer.status_code == 400, answer.text
    said = answer.json()
    assert said["id"] is None and said["error"]["code"] == -32600, said
    assert "batch" in said["error"]["message"] or not isinstance(body, list), said
    assert Run.objects.count() == runs
    listing = {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
    if carried:
        assert '"result"' in httpx.post(url, json=listing, headers=headers, timeout=30).text


@pytest.mark.parametrize(
    "change",
    [
        {"Accept": "application/json"},  # 406: no event stream accepted
        {"Content-Type": "text/plain"},  # 415
        {"body": {"jsonrpc": "2.0", "method": "initialize", "params": {}}},  # no id: 202
        {"body": {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}},  # -32602
    ],
    ids=["not-acceptable", "not-json", "a-notification", "invalid-params"],
)
def test_an_initialize_the_sdk_refuses_opens_no_session(
    web: str, tenant_a: Tenant, agent_a: Persona, change: dict[str, Any]
) -> None:
    """An initialize that authenticates but that the MCP SDK then refuses — an Accept or
    Content-Type it does not serve, a notification, params it cannot read — is no session:
    it left an empty `mcp-session` run (on the Runs pages, in the metrics) until the idle
    sweep hours later, one per bad request. Only an initialize the SDK answers with a result
    opens a session (and gets its Mcp-Session-Id)."""
    url = _endpoint(web, tenant_a)
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {agent_a.token}",
    }
    body: Any = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {}},
    }
    body = change.pop("body", body)
    runs = Run.objects.count()
    refused = httpx.post(url, content=json.dumps(body), headers={**headers, **change}, timeout=30)
    assert "mcp-session-id" not in refused.headers, (refused.status_code, refused.text)
    assert Run.objects.count() == runs, (refused.status_code, refused.text)

    opened = httpx.post(url, content=json.dumps(_initialize()), headers=headers, timeout=30)
    assert opened.status_code == 200 and '"result"' in opened.text, opened.text
    assert Run.objects.filter(pk=opened.headers["mcp-session-id"], graph="mcp-session").exists()
    assert Run.objects.count() == runs + 1


def _initialize() -> dict[str, Any]:
    client = {"name": "t", "version": "1"}
    params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": client}
    return {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}


def test_an_initialize_whose_client_name_holds_a_nul_opens_its_session(
    web: str, tenant_a: Tenant, agent_a: Persona
) -> None:
    """The client's name and version are kept on the session's run (its goal). A NUL in
    them — valid JSON (`\\u0000`), which the SDK answers like any initialize — could not be
    stored: the open failed after the SDK's answer, and the client got a 500, no session."""
    url = _endpoint(web, tenant_a)
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {agent_a.token}",
    }
    body = _initialize()
    body["params"]["clientInfo"] = {"name": "host\u0000name", "version": "1"}
    opened = httpx.post(url, content=json.dumps(body), headers=headers, timeout=30)
    assert opened.status_code == 200 and '"result"' in opened.text, opened.text
    run = Run.objects.get(pk=opened.headers["mcp-session-id"], graph="mcp-session")
    assert run.goal == {"client": {"name": "host\ufffdname", "version": "1"}}


def test_mcp_tasks_are_not_offered_and_their_methods_are_method_not_found(
    web: str, tenant_a: Tenant, agent_a: Persona
) -> None:
    """README: MCP tasks are not in this version. The initialize result offers no `tasks`
    capability, and a host that calls a tasks/* method anyway gets JSON-RPC's standard
    method-not-found (-32601) naming it — not an unclear error, nor a session lost."""
    url = _endpoint(web, tenant_a)
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {agent_a.token}",
    }
    opened = httpx.post(url, json=_initialize(), headers=headers, timeout=30)
    assert '"tasks"' not in opened.text and '"result"' in opened.text, opened.text
    headers["Mcp-Session-Id"] = opened.headers["mcp-session-id"]
    for number, method in enumerate(("tasks/get", "tasks/list", "tasks/result", "tasks/cancel")):
        params = {} if method == "tasks/list" else {"taskId": "t-1"}
        request = {"jsonrpc": "2.0", "id": 10 + number, "method": method, "params": params}
        answer = httpx.post(url, json=request, headers=headers, timeout=30)
        (data,) = [line[5:] for line in answer.text.splitlines() if line.startswith("data:")]
        error = json.loads(data)["error"]
        assert (error["code"], error.get("data")) == (-32601, method), answer.text
    listing = {"jsonrpc": "2.0", "id": 20, "method": "tools/list"}
    assert '"result"' in httpx.post(url, json=listing, headers=headers, timeout=30).text


def test_a_session_id_spelled_otherwise_is_the_same_session_and_a_new_call_acts_again(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona
) -> None:
    """A session id is a UUID, and the gateway adopts it however it is spelled (upper case,
    braces, no hyphens) — but it keyed the session's calls and counted their delivered
    answers under the spelling the client sent. Under an upper-case id the delivered answer
    was never found again: the next identical call, which the README makes a new call, was
    answered with the first call's result, and the upstream never got it (a false
    completion)."""
    _setup(tenant_a, upstream)
    ApprovalPolicy.objects.create(tenant=tenant_a, name="creates go", tool=CREATE, required=False)
    url, key, title = _endpoint(web, tenant_a), str(agent_a.token), _title()
    headers = {
        "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {key}",
    }
    opened = httpx.post(url, json=_initialize(), headers=headers, timeout=30)
    session_id = opened.headers["mcp-session-id"]
    headers["Mcp-Session-Id"] = session_id.upper()  # kept as the client spells it

    def call(number: int) -> dict[str, Any]:
        params = {"name": CREATE, "arguments": {"title": title}}
        request = {"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": params}
        answer = httpx.post(url, json=request, headers=headers, timeout=60)
        (data,) = [line[5:] for line in answer.text.splitlines() if line.startswith("data:")]
        result: dict[str, Any] = json.loads(data)["result"]
        return result

    first, second = call(2), call(3)
    assert not first["isError"] and not second["isError"], (first, second)
    assert len(_reached(upstream, title)) == 2  # two calls, each delivered: two tickets
    assert first["structuredContent"]["id"] != second["structuredContent"]["id"]
    assert first["_meta"]["holdpoint/session"] == session_id
    actions = Action.objects.filter(params__contains=title)
    assert {str(a.run_id) for a in actions} == {session_id}
    assert sorted(a.idempotency_key.rsplit(":", 1)[1] for a in actions) == ["1", "2"]
    assert all(a.idempotency_key.startswith(f"mcp:{session_id}:") for a in actions)


def test_arguments_with_a_duplicate_key_are_refused_and_nothing_is_stored_or_sent(
    web: str, upstream: Upstream, tenant_a: Tenant, agent_a: Persona
) -> None:
    """DESIGN.md: params are parsed strictly, no duplicate keys — the API answers them 400.
    The gateway's parser kept the last of two `title`s silently: an action was prepared
    and sent with a value other parsers (a host's log, a proxy) read differently."""
    _setup(tenant_a, upstream)
    ApprovalPolicy.objects.create(tenant=tenant_a, name="creates go", tool=CREATE, required=False)
    url, title = _endpoint(web, tenant_a), _title()
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {agent_a.token}",
    }
    opened = httpx.post(url, json=_initialize(), headers=headers, timeout=30)
    headers["Mcp-Session-Id"] = opened.headers["mcp-session-id"]
    arguments = f'{{"title": "{title}", "title": "{title} (other)"}}'
    call = f'{{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {{"name": "{CREATE}", '
    call += f'"arguments": {arguments}}}}}'
    answer = httpx.post(url, content=call, headers=headers, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == -32700 and "duplicate key" in error["message"], error
    assert not Action.objects.filter(params__contains=title).exists()
    assert _reached(upstream, title) == []
    listing = {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}  # the session goes on
    assert '"result"' in httpx.post(url, json=listing, headers=headers, timeout=30).text
