"""Upstream MCP servers (issue 19, first part): a tenant registers one, its tools are
imported as `executor: mcp` definitions, and Holdpoint's workers send them with the `mcp`
SDK — held by default, sent once, a lost answer handed to a person. The upstream is a real
process (tests/mcp_upstream.py); the oracle is its own record of the calls that reached it."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest
from audit.models import JournalEntry
from runtime import mcpimport, tooldefs
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import (
    Action,
    ActionStatus,
    McpServer,
    Run,
    RunStatus,
    Tenant,
    ToolCredential,
    ToolDefinition,
)
from tests import procs
from tests.conftest import Persona
from tests.mcp_fixture import Upstream
from tests.runtime.helpers import make_due

S = ActionStatus
CREATE = "helpdesk.tickets_create"


def _server(tenant: Tenant, url: str, **fields: Any) -> McpServer:
    return McpServer.objects.create(tenant=tenant, name="helpdesk", url=url, **fields)


def _imported(tenant: Tenant, upstream: Upstream, **fields: Any) -> McpServer:
    server = _server(tenant, upstream.url, **fields)
    mcpimport.import_tools(server, "user:admin")
    return server


def _run(tenant: Tenant, title: Any = "Printer on fire") -> Run:
    return create_run(tenant, "ticketing", {"title": title, "tool": CREATE}, actor="user:starter")


def _exempt(tenant: Tenant, tool: str = CREATE) -> None:
    ApprovalPolicy.objects.create(tenant=tenant, name=f"{tool} goes", tool=tool, required=False)


def test_a_key_in_an_upstreams_url_is_not_written_to_the_log(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    """Some MCP servers take their key in the URL's query. httpx, the MCP client's
    transport, logged every request's whole URL at INFO: the key was in the log (JSON
    lines shipped to a collector) at every import and every call."""
    import logging

    upstream = mcp_upstream()
    server = _server(tenant_a, upstream.url + "?api_key=sekrit-in-the-url")
    with caplog.at_level(logging.INFO):  # LOG_LEVEL's default
        assert mcpimport.import_tools(server, "user:admin").tools
    assert "sekrit-in-the-url" not in caplog.text


def test_the_mcp_clients_own_lines_keep_keys_and_sessions_out_of_a_debug_log(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    """With LOG_LEVEL=DEBUG (how an operator chases a failing import) the MCP SDK's
    client wrote the endpoint's whole URL, a key in its query included, and at INFO every
    session's id (which the server takes as the session's credential) and at DEBUG every
    message a server sent (tools' answers: tenant data) into the shared log."""
    import logging

    upstream = mcp_upstream()
    server = _server(tenant_a, upstream.url + "?api_key=sekrit-in-the-url")
    with caplog.at_level(logging.DEBUG):
        assert mcpimport.import_tools(server, "user:admin").tools
    assert "sekrit-in-the-url" not in caplog.text
    assert "session ID" not in caplog.text and "SSE message" not in caplog.text
    assert not [r for r in caplog.records if r.name.startswith("mcp.client")]


def test_an_upstreams_tools_become_mcp_definitions_and_an_unchanged_import_is_no_version(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    server = _server(tenant_a, upstream.url, credential="helpdesk", timeout_seconds=4)
    first = mcpimport.import_tools(server, "user:admin").tools
    specs = {item.definition.name: item.definition.spec for item in first}
    assert sorted(specs) == [
        "helpdesk.tickets_create",
        "helpdesk.tickets_list",
        "helpdesk.tickets_purge",
    ]
    assert all(item.created and item.definition.version == 1 for item in first)
    create = specs[CREATE]
    assert create["executor"] == "mcp"
    assert create["mcp"] == {
        "server": "helpdesk",
        "tool": "tickets_create",
        # what the upstream said, for the next import
        "imported": mcpimport.said_by_upstream(create),
    }
    assert create["dedup"]["mode"] == "none" and create["credential"] == "helpdesk"
    assert create["timeout_seconds"] == 4 and create["title"] == "Open a ticket"
    assert create["schema"]["properties"]["title"]["type"] == "string"
    assert create["schema"]["required"] == ["title"]
    # effect from the annotations: readOnlyHint → read, destructiveHint → irreversible
    assert {name: spec["effect"] for name, spec in specs.items()} == {
        "helpdesk.tickets_create": "write",
        "helpdesk.tickets_list": "read",
        "helpdesk.tickets_purge": "irreversible",
    }
    again = mcpimport.import_tools(server, "user:admin")
    assert not any(item.created for item in again.tools) and again.unlisted == []
    assert ToolDefinition.objects.filter(tenant=tenant_a).count() == 3
    assert upstream.calls() == []  # listing tools calls none of them


def test_a_reimport_keeps_what_a_person_corrected_and_takes_what_the_upstream_changed(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]
) -> None:
    """An imported tool is corrected by an admin: its effect (the upstream's hints are only
    its word), a lookup with the key argument its upstream offers (taken out of the schema).
    Importing the same upstream again — to pick up a new tool — replaced the definition with
    the bare import (dedup none, the key argument a param again, effect from the hints): the
    admin's corrections were silently gone and a lost answer went to a person again. A
    re-import now changes only what the upstream (or the server's settings) changed since
    the last import."""
    from runtime import toolcatalog

    upstream = mcp_upstream(keyed=True)
    server = _imported(tenant_a, upstream, timeout_seconds=2)
    name = "helpdesk.tickets_open"
    imported = dict(toolcatalog.entry(tenant_a.pk, name).spec)  # type: ignore[union-attr]
    assert imported["effect"] == "write" and "request_id" in imported["schema"]["properties"]
    schema = {**imported["schema"], "required": ["title"]}
    schema["properties"] = {"title": schema["properties"]["title"]}
    corrected = {
        **imported,
        "effect": "irreversible",
        "schema": schema,
        "editable": ["title"],
        "mcp": {**imported["mcp"], "key_argument": "request_id"},
        "dedup": {"mode": "lookup"},
        "lookup": {
            "tool": "tickets_find",
            "arguments": {"request_id": "{idempotency_key}"},
            "found": "$.id",
        },
    }
    toolcatalog.revise(tenant_a, name, {**corrected, "expected_version": 1}, "user:admin")
    kept = toolcatalog.entry(tenant_a.pk, name).spec  # type: ignore[union-attr]

    again = {d.definition.name: d for d in mcpimport.import_tools(server, "user:admin").tools}
    assert not again[name].created and again[name].definition.version == 2
    assert toolcatalog.entry(tenant_a.pk, name).spec == kept  # type: ignore[union-attr]

    # The server's timeout changes: the next import takes it, and keeps the rest.
    McpServer.objects.filter(pk=server.pk).update(timeout_seconds=7)
    server.refresh_from_db()
    third = {d.definition.name: d for d in mcpimport.import_tools(server, "user:admin").tools}
    assert third[name].created and third[name].definition.version == 3
    spec = third[name].definition.spec
    assert spec["timeout_seconds"] == 7
    assert {k: spec[k] for k in ("effect", "dedup", "lookup", "editable", "schema")} == {
        k: kept[k] for k in ("effect", "dedup", "lookup", "editable", "schema")
    }
    assert spec["mcp"]["key_argument"] == "request_id"


def test_the_management_command_imports_and_says_what_changed(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _server(tenant_a, upstream.url)
    out = io.StringIO()
    call_command(
        "tools", "import-mcp", "--tenant", tenant_a.slug, "--server", "helpdesk", stdout=out
    )
    assert f"{CREATE}: created v1" in out.getvalue()
    out = io.StringIO()
    call_command(
        "tools", "import-mcp", "--tenant", tenant_a.slug, "--server", "helpdesk", stdout=out
    )
    assert f"{CREATE}: unchanged v1" in out.getvalue()
    with pytest.raises(CommandError):
        call_command("tools", "import-mcp", "--tenant", tenant_a.slug, "--server", "nope")


def test_a_reimport_names_the_tools_the_upstream_no_longer_lists(
    client: Client, admin_a: Persona, mcp_upstream: Callable[..., Upstream]
) -> None:
    """The upstream is redeployed without three of its tools. Importing again said only
    which listed tools changed: the three stayed defined, and offered to agents, with no
    word of it. The import now names them (its result, the command's output, the admin's
    message); they are kept as they are — versions are never removed (actions and
    approvals cite them), and nothing retires one tool."""
    tenant = admin_a.tenant
    upstream = mcp_upstream(keyed=True)
    server = _imported(tenant, upstream)
    upstream.args.remove("--keyed")
    upstream.restart()

    again = mcpimport.import_tools(server, "user:admin")
    assert sorted(d.definition.name for d in again.tools) == [
        CREATE,
        "helpdesk.tickets_list",
        "helpdesk.tickets_purge",
    ]
    gone = ["helpdesk.tickets_find", "helpdesk.tickets_find_text", "helpdesk.tickets_open"]
    assert again.unlisted == gone
    out = io.StringIO()
    call_command("tools", "import-mcp", "--tenant", tenant.slug, "--server", "helpdesk", stdout=out)
    for name in gone:
        assert f"{name}: no longer listed by helpdesk" in out.getvalue(), out.getvalue()
    assert f"{CREATE}: unchanged v1" in out.getvalue()
    client.force_login(admin_a.user)
    response = client.post(
        "/admin/runtime/mcpserver/",
        {"action": "import_tools", "_selected_action": [server.pk]},
        follow=True,
    )
    assert (
        "3 tool(s) no longer listed by the server, kept as defined and still offered to "
        f"agents (the server refuses a tool it does not have): {', '.join(gone)}."
    ) in response.content.decode()
    kept = ToolDefinition.objects.filter(tenant=tenant, name__in=gone)
    assert sorted(kept.values_list("name", "version")) == [(name, 1) for name in gone]


def test_the_imported_write_tool_is_held_approved_and_sent_once(
    tenant_a: Tenant, reviewer_a: Persona, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _imported(tenant_a, upstream)
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL
    assert upstream.calls() == []
    request = ApprovalRequest.objects.get(run=run)
    assert request.policy.any_reviewer and request.policy.tool == CREATE
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert upstream.calls() == [
        {"tool": "tickets_create", "arguments": {"title": "Printer on fire"}}
    ]
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED and action.external_id == "T-1"
    assert action.result["structuredContent"] == {"id": "T-1", "title": "Printer on fire"}
    assert action.result["isError"] is False
    advance_run(run.run_id, "w1")  # nothing left to do: still one call
    assert len(upstream.calls()) == 1


def test_an_exempting_policy_lets_it_go_without_approval(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _imported(tenant_a, upstream)
    _exempt(tenant_a)
    run = _run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert not ApprovalRequest.objects.filter(run=run).exists()
    assert len(upstream.calls()) == 1


def test_a_lost_answer_goes_to_a_person_and_is_not_sent_again(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _imported(tenant_a, upstream, timeout_seconds=1.5)
    _exempt(tenant_a)
    upstream.faults(hang=30)  # applies, then answers long after the timeout
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.MANUAL_REVIEW, action.last_error
    assert "cannot deduplicate" in action.last_error
    assert Run.objects.get(pk=run.pk).status == RunStatus.NEEDS_RECONCILIATION
    advance_run(run.run_id, "w1")
    assert len(upstream.calls()) == 1


def test_an_upstream_refusal_fails_the_action(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _imported(tenant_a, upstream)
    _exempt(tenant_a)
    run = _run(tenant_a, title="refuse me")  # the tool answers isError: true
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.FAILED and "refuses this title" in action.last_error
    assert upstream.calls() == []


def test_an_upstream_quoting_the_credential_in_its_error_never_shows_it(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream], agent_a: Persona
) -> None:
    """The upstream's error becomes the action's error (every member of the tenant reads it)
    and goes into the journal: a token it quotes back — as sent, or JSON-escaped — is masked
    there, as an http tool's is."""
    secret = "mcp-s3cret/4711"
    credential = ToolCredential(tenant=tenant_a, service="helpdesk")
    credential.set_secret(secret, actor="user:admin")
    credential.save()
    upstream = mcp_upstream()
    _imported(tenant_a, upstream, credential="helpdesk")
    _exempt(tenant_a)
    run = _run(tenant_a, title="quote my token")
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.FAILED and "not a valid token: Bearer ********" in action.last_error
    assert secret not in action.last_error and json.dumps(secret)[1:-1] not in action.last_error
    for entry in JournalEntry.objects.all():
        assert "s3cret" not in json.dumps(entry.payload), entry.type
    shown = agent_a.api().get(f"/api/v1/actions/{action.action_id}/")
    assert shown.status_code == 200 and "s3cret" not in shown.content.decode()


def test_an_upstream_echoing_the_credential_in_its_result_never_stores_it(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream], agent_a: Persona
) -> None:
    """An applied call's result is the action's `result` (`GET …/actions/`, the MCP
    gateway's answer): a token the upstream echoes in it — in the structured result and in
    its text block, JSON-escaped there — is masked as in an error; the id is still read."""
    secret = "mcp-s3cret/4711"
    credential = ToolCredential(tenant=tenant_a, service="helpdesk")
    credential.set_secret(secret, actor="user:admin")
    credential.save()
    upstream = mcp_upstream()
    _imported(tenant_a, upstream, credential="helpdesk")
    _exempt(tenant_a)
    run = _run(tenant_a, title="echo my token")
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED and action.external_id == "T-1", action.last_error
    assert action.result["structuredContent"] == {
        "id": "T-1",
        "title": "echo my token",
        "seen": "Bearer ********",
    }
    assert "Bearer ********" in action.result["content"][0]["text"]
    assert "s3cret" not in json.dumps(action.result)
    for entry in JournalEntry.objects.all():
        assert "s3cret" not in json.dumps(entry.payload), entry.type
    for url in (f"/api/v1/actions/{action.action_id}/", f"/api/v1/runs/{run.run_id}/actions/"):
        shown = agent_a.api().get(url)
        assert shown.status_code == 200 and "s3cret" not in shown.content.decode(), url


def test_an_upstream_that_cannot_be_reached_leaves_the_action_unsent(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _imported(tenant_a, upstream)
    _exempt(tenant_a)
    procs.kill(upstream.proc)
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.PREPARED and "not sent" in action.last_error  # transient


def test_invalid_arguments_are_refused_by_the_schema_before_anything_is_sent(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _imported(tenant_a, upstream)
    _exempt(tenant_a)
    run = _run(tenant_a, title=42)
    advance_run(run.run_id, "w1")
    assert not Action.objects.filter(run=run).exists()
    assert "schema" in Run.objects.get(pk=run.pk).last_error
    assert upstream.calls() == []


def test_an_unknown_upstream_tool_is_refused_by_the_upstream_and_fails(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    _server(tenant_a, upstream.url)
    tooldefs.define(
        tenant_a,
        {
            "name": CREATE,
            "effect": "write",
            "schema": {"type": "object", "properties": {"title": {"type": "string"}}},
            "executor": "mcp",
            "mcp": {"server": "helpdesk", "tool": "tickets_nope"},
            "dedup": {"mode": "none"},
        },
        "user:admin",
    )
    _exempt(tenant_a)
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.FAILED and "Unknown tool" in action.last_error
    assert upstream.calls() == []


@pytest.mark.parametrize(
    "change, field",
    [
        ({"mcp": {"server": "nowhere", "tool": "x"}}, "mcp.server"),
        ({"mcp": {"server": "helpdesk"}}, "mcp.tool"),
        ({"dedup": {"mode": "key"}}, "dedup.mode"),
        ({"request": {"method": "POST", "url": "http://127.0.0.1:9/x"}}, "request"),
    ],
)
def test_a_bad_mcp_definition_is_refused_with_its_field(
    tenant_a: Tenant, change: dict[str, Any], field: str
) -> None:
    _server(tenant_a, "http://127.0.0.1:9/mcp")
    spec = {
        "name": CREATE,
        "effect": "write",
        "executor": "mcp",
        "mcp": {"server": "helpdesk", "tool": "tickets_create"},
        "dedup": {"mode": "none"},
        **change,
    }
    with pytest.raises(tooldefs.InvalidTool) as refused:
        tooldefs.define(tenant_a, spec, "user:admin")
    assert field in refused.value.extra["errors"]
    assert not ToolDefinition.objects.exists()


def test_a_host_not_allowed_is_refused_and_nothing_is_stored(
    tenant_a: Tenant, settings: Any, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    settings.HOLDPOINT_TOOL_HOSTS = ["tools.example.com"]
    with pytest.raises(ValidationError) as refused:
        _server(tenant_a, upstream.url)
    assert "url" in refused.value.message_dict
    # A server registered while its host was allowed, imported after the operator removed it.
    settings.HOLDPOINT_TOOL_HOSTS = ["127.0.0.1"]
    server = _server(tenant_a, upstream.url)
    settings.HOLDPOINT_TOOL_HOSTS = ["tools.example.com"]
    with pytest.raises(tooldefs.HostNotAllowed):
        mcpimport.import_tools(server, "user:admin")
    assert not ToolDefinition.objects.exists()


def test_a_private_address_is_not_connected_to(
    tenant_a: Tenant, settings: Any, mcp_upstream: Callable[[], Upstream]
) -> None:
    upstream = mcp_upstream()
    server = _imported(tenant_a, upstream)
    _exempt(tenant_a)
    settings.HOLDPOINT_TOOL_PRIVATE_NETWORKS = []  # 127.0.0.1 is no longer allowed
    with pytest.raises(tooldefs.HostNotAllowed):
        mcpimport.import_tools(server, "user:admin")
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.FAILED and "private_address" in action.last_error
    assert upstream.calls() == []


def _stdio_args(data: Path) -> list[str]:
    """The test upstream as a stdio server's command line (after sys.executable)."""
    return ["-m", "tests.mcp_upstream", "--transport", "stdio", "--data", str(data)]


def test_stdio_servers_are_refused_unless_the_operator_turns_them_on(
    tenant_a: Tenant, settings: Any, tmp_path: Path
) -> None:
    args = _stdio_args(tmp_path)
    with pytest.raises(ValidationError) as refused:
        McpServer.objects.create(
            tenant=tenant_a, name="local", transport="stdio", command=sys.executable, args=args
        )
    assert "transport" in refused.value.message_dict
    settings.HOLDPOINT_MCP_STDIO = True
    server = McpServer.objects.create(
        tenant=tenant_a, name="local", transport="stdio", command=sys.executable, args=args
    )
    names = sorted(d.definition.name for d in mcpimport.import_tools(server, "user:admin").tools)
    assert names == ["local.tickets_create", "local.tickets_list", "local.tickets_purge"]


@pytest.mark.parametrize(
    ("raw", "kept"),
    [('"a\\u0000b"', "a\ufffdb"), ('"\\ud800 alone"', "\ufffd alone")],
    ids=["nul", "lone-surrogate"],
)
def test_a_stdio_upstreams_answer_holding_what_no_column_takes_is_confirmed_and_stored(
    tenant_a: Tenant, settings: Any, tmp_path: Path, raw: str, kept: str
) -> None:
    """As a streamable HTTP upstream's (tests/gateway/test_mcp_calls.py): the stdio upstream
    applied the call and answered its proof with a \\u0000 escape (PostgreSQL's JSON refuses
    it) or a lone surrogate (the SDK's parser refuses the message). The effect is confirmed
    and its answer stored with U+FFFD, never a failed write or a false failure after it."""
    settings.HOLDPOINT_MCP_STDIO = True
    server = McpServer.objects.create(
        tenant=tenant_a,
        name="helpdesk",
        transport="stdio",
        command=sys.executable,
        args=_stdio_args(tmp_path),
    )
    mcpimport.import_tools(server, "user:admin")
    _exempt(tenant_a)
    (tmp_path / "faults.json").write_text(json.dumps({"raw": raw}), "utf-8")
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED and action.external_id == "T-1", action.last_error
    assert action.result["structuredContent"]["note"] == kept
    assert len((tmp_path / "calls.jsonl").read_text("utf-8").splitlines()) == 1


def test_a_stdio_upstreams_answer_past_the_response_cap_is_not_read_whole_nor_stored(
    tenant_a: Tenant, settings: Any, tmp_path: Path
) -> None:
    """As a streamable HTTP upstream's (tests/gateway/test_mcp_calls.py): a stdio upstream
    that applies the call and answers with megabytes on one line is held to
    HOLDPOINT_TOOL_MAX_RESPONSE_BYTES. Before, the SDK's reader buffered the whole line and
    the action was confirmed with all of it stored. Now the session ends past the cap
    (without waiting for the tool's timeout), nothing of the answer is stored, and as the
    upstream may have acted, a person settles it (this tool has no lookup)."""
    settings.HOLDPOINT_MCP_STDIO = True
    settings.HOLDPOINT_TOOL_MAX_RESPONSE_BYTES = 64 * 1024
    server = McpServer.objects.create(
        tenant=tenant_a,
        name="helpdesk",
        transport="stdio",
        command=sys.executable,
        args=_stdio_args(tmp_path),
        timeout_seconds=60,
    )
    mcpimport.import_tools(server, "user:admin")
    _exempt(tenant_a)
    (tmp_path / "faults.json").write_text(json.dumps({"huge": 4 * 1024 * 1024}), "utf-8")
    run = _run(tenant_a)
    began = time.monotonic()
    advance_run(run.run_id, "w1")
    assert time.monotonic() - began < 30  # not the tool's 60 s timeout
    action = Action.objects.get(run=run)
    assert action.status == S.MANUAL_REVIEW, (action.status, len(json.dumps(action.result)))
    assert "larger than 65536 bytes" in action.last_error, action.last_error
    assert len(json.dumps(action.result)) < 64 * 1024
    assert len((tmp_path / "calls.jsonl").read_text("utf-8").splitlines()) == 1


def test_names_are_normalised_to_the_definition_rules() -> None:
    assert mcpimport.definition_name("hd", "Tickets.Create") == "hd.tickets_create"
    assert mcpimport.definition_name("hd", "9lives") == "hd.t_9lives"
    assert tooldefs.NAME.match(mcpimport.definition_name("hd", "ünïcode/tool name"))


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"name": "helpdesk\n"}, "name"), ({"credential": "helpdesk\n"}, "credential")],
)
def test_a_server_name_or_credential_ending_in_a_line_break_is_refused(
    tenant_a: Tenant, fields: dict[str, str], field: str
) -> None:
    """`$` also matches before a final line break: "helpdesk\n" passed as a server name
    (its tools then named after a server no definition rule takes) and as a credential's
    service (its requests then sent with no credential at all)."""
    server = McpServer(tenant=tenant_a, name="helpdesk", url="http://127.0.0.1:9/mcp")
    for name, value in fields.items():
        setattr(server, name, value)
    with pytest.raises(ValidationError) as refused:
        server.full_clean()
    assert field in refused.value.message_dict


def test_a_tenant_admin_sees_only_their_servers_and_imports_in_admin(
    client: Client,
    admin_a: Persona,
    tenant_b: Tenant,
    mcp_upstream: Callable[[], Upstream],
) -> None:
    upstream = mcp_upstream()
    mine = _server(admin_a.tenant, upstream.url)
    theirs = McpServer.objects.create(tenant=tenant_b, name="secret-desk", url=upstream.url)
    client.force_login(admin_a.user)
    listing = client.get("/admin/runtime/mcpserver/")
    assert listing.status_code == 200
    assert b"helpdesk" in listing.content and b"secret-desk" not in listing.content
    assert client.get(f"/admin/runtime/mcpserver/{theirs.pk}/change/").status_code in (302, 404)
    response = client.post(
        "/admin/runtime/mcpserver/",
        {"action": "import_tools", "_selected_action": [mine.pk, theirs.pk]},
        follow=True,
    )
    assert response.status_code == 200
    assert b"3 tool(s), 3 new version(s)" in response.content
    assert ToolDefinition.objects.filter(tenant=admin_a.tenant).count() == 3
    assert not ToolDefinition.objects.filter(tenant=tenant_b).exists()


def test_a_registered_server_cannot_be_moved_under_its_tools(tenant_a: Tenant) -> None:
    """The definitions (and the approvals given for them) name the server: changing where
    it is reached would send an approved call somewhere else."""
    server = McpServer.objects.create(
        tenant=tenant_a, name="ops", transport="streamable_http", url="http://127.0.0.1:9/mcp"
    )
    server.url = "http://localhost:9/mcp"
    with pytest.raises(ValidationError) as refused:
        server.save()
    assert "url" in refused.value.message_dict
    assert McpServer.objects.get(pk=server.pk).url == "http://127.0.0.1:9/mcp"
    server.url = "http://127.0.0.1:9/mcp"
    server.active = False  # anything else may change
    server.save()


@pytest.mark.parametrize("answered_id", [True, False, ""], ids=["true", "false", "empty"])
def test_an_id_that_is_not_an_id_is_no_proof_and_goes_to_a_person(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream], answered_id: Any
) -> None:
    """The upstream applies the call but answers `true`, `false` or "" where the ticket's id
    belongs. Before, that was taken as proof: the action `confirmed` with external id "True"
    / "False" (or, for "", the action's own key) — a completion nothing verifies. Only a
    number or a non-empty string is an id (tools.usable_id, as for a lookup's answer): the
    outcome is unknown, and this tool, with neither key nor lookup, goes to a person."""
    upstream = mcp_upstream()
    _imported(tenant_a, upstream)
    _exempt(tenant_a)
    upstream.faults(id=answered_id)
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert (action.status, action.external_id) == (S.MANUAL_REVIEW, ""), action.last_error
    assert Run.objects.get(pk=run.pk).status == RunStatus.NEEDS_RECONCILIATION
    assert len(upstream.calls()) == 1  # applied once, never sent again


def test_an_import_does_not_take_over_a_tool_it_did_not_import(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]
) -> None:
    """A tenant's own tool that happens to have an imported tool's name — an http tool an
    admin named helpdesk.tickets_create, or an mcp one sent to another server — was replaced
    by the import, silently: its calls went to this upstream from then on. The import is
    refused instead, naming the tool, and nothing is imported."""
    from runtime import toolcatalog
    from tests.tooldefs import define_tickets

    upstream = mcp_upstream()
    define_tickets(tenant_a, "http://127.0.0.1:9", name=CREATE)
    server = _server(tenant_a, upstream.url)
    with pytest.raises(tooldefs.InvalidTool) as refused:
        mcpimport.import_tools(server, "user:admin")
    assert CREATE in refused.value.extra["errors"], refused.value.extra
    kept = toolcatalog.entry(tenant_a.pk, CREATE)
    assert kept is not None and kept.spec["executor"] == "http"
    assert not ToolDefinition.objects.filter(tenant=tenant_a, name="helpdesk.tickets_list")


def test_an_upstream_restarted_between_initialize_and_the_call_leaves_it_unsent(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    """A 2025-protocol upstream (one with sessions) restarts, as in a deploy, after the
    session's initialize and before its tools/call: the new process does not know the
    session and answers 404, as MCP has a server answer any request of a session it no
    longer has — the request was not taken. Nothing was done: the action is left unsent (a
    transient refusal, retried in a new session), not FAILED, nor handed to a person."""
    upstream = mcp_upstream()
    _imported(tenant_a, upstream, timeout_seconds=30)
    _exempt(tenant_a)
    upstream.faults(legacy=True, hold_initialized=6)

    def deploy() -> None:
        procs.wait_for(lambda: (upstream.data / "initialized").exists(), timeout=60)
        upstream.faults(legacy=True)  # the new process holds nothing
        upstream.restart()

    restarting = threading.Thread(target=deploy, daemon=True)
    restarting.start()
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    restarting.join(timeout=60)
    action = Action.objects.get(run=run)
    assert action.status == S.PREPARED, (action.status, action.last_error)
    assert "no longer has the session" in action.last_error
    assert upstream.calls() == []
    make_due(run)  # the retry, in a new session
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert Action.objects.get(pk=action.pk).status == S.CONFIRMED
    assert len(upstream.calls()) == 1


def test_an_upstream_lost_while_the_session_is_being_initialised_leaves_the_call_unsent(
    tenant_a: Tenant, mcp_upstream: Callable[[], Upstream]
) -> None:
    """A 2025-protocol upstream (one with sessions) dies after answering the session's
    initialize, while its `notifications/initialized` is on the wire: that POST fails (the
    server disconnected), the SDK's writer stops, and the call's request never leaves — the
    SDK ends it with "Connection closed". That was taken for a lost answer (the session was
    open, so the call counted as sent): `manual_review`, a person asked about a ticket never
    sent. Only a request handed to a connection may have reached the upstream: the action is
    left unsent (a transient refusal, as a refused connection is), and the retry, once the
    upstream is back, sends it once."""
    upstream = mcp_upstream()
    _imported(tenant_a, upstream, timeout_seconds=30)
    _exempt(tenant_a)
    upstream.faults(legacy=True, hold_initialized=60)

    def crash() -> None:
        procs.wait_for(lambda: (upstream.data / "initialized").exists(), timeout=60)
        procs.kill(upstream.proc)  # SIGKILL: its connections drop, nothing is answered

    crashing = threading.Thread(target=crash, daemon=True)
    crashing.start()
    run = _run(tenant_a)
    advance_run(run.run_id, "w1")
    crashing.join(timeout=60)
    action = Action.objects.get(run=run)
    assert action.status == S.PREPARED, (action.status, action.last_error)
    assert action.last_error.startswith("not sent"), action.last_error
    assert Run.objects.get(pk=run.pk).status == RunStatus.RETRYING
    assert upstream.calls() == []
    upstream.faults()
    upstream.restart()
    make_due(run)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert Action.objects.get(pk=action.pk).status == S.CONFIRMED
    assert len(upstream.calls()) == 1
