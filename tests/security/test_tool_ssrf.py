"""Requests a tenant's tool definition makes Holdpoint send (TEST-MATRIX, outbound safety):
a tool is typed by a tenant admin and sent by a worker inside the operator's network, so a
definition must not become a probe of that network. Each case goes the whole way — the
definition stored, a real worker step, real servers on real sockets — and checks what the
servers received and what the ledger concluded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Tenant, ToolDefinition
from runtime.tooldefs import HostNotAllowed, InvalidTool, define, parse
from tests.httpservers import Behaviour, Server, answer_json, redirect_to, stream_forever
from tests.tooldefs import run_ticket as _run_ticket
from tests.tooldefs import tickets

S = ActionStatus
Serve = Callable[[Behaviour], Server]


def test_a_loopback_service_is_refused_unless_its_network_is_allowed(
    tenant_a: Tenant, serve: Serve, settings: Any
) -> None:
    server = serve(answer_json)
    settings.HOLDPOINT_TOOL_PRIVATE_NETWORKS = []  # production: no private network allowed
    for host in ("127.0.0.1", "localhost"):
        action = _run_ticket(tenant_a, f"http://{host}:{server.port}")
        assert action.status == S.FAILED and "private_address" in action.last_error
    assert server.requests == []  # nothing was sent


def test_a_metadata_address_allowed_by_name_is_still_refused_by_address(
    tenant_a: Tenant, settings: Any
) -> None:
    settings.HOLDPOINT_TOOL_HOSTS = [*settings.HOLDPOINT_TOOL_HOSTS, "169.254.169.254"]
    action = _run_ticket(tenant_a, "http://169.254.169.254")
    assert action.status == S.FAILED and "private_address" in action.last_error


def test_a_redirect_is_not_followed_and_proves_nothing(tenant_a: Tenant, serve: Serve) -> None:
    elsewhere = serve(answer_json)
    bouncer = serve(redirect_to(f"{elsewhere.url}/tasks"))
    action = _run_ticket(tenant_a, bouncer.url, mode="none")
    assert len(bouncer.requests) == 1 and elsewhere.requests == []
    # The service answered, without proof: with dedup mode none only a person can settle it.
    assert action.status == S.MANUAL_REVIEW and "redirect" in action.last_error


def test_a_huge_answer_is_cut_off_and_proves_nothing(tenant_a: Tenant, serve: Serve) -> None:
    flood = serve(stream_forever(200 * 1024 * 1024, declare=False))
    action = _run_ticket(tenant_a, flood.url, mode="none")
    assert action.status == S.MANUAL_REVIEW and "too_large" in action.last_error
    assert flood.written[0] < 50 * 1024 * 1024  # stopped reading long before the end


def test_params_cannot_leave_their_path_segment(tenant_a: Tenant, serve: Serve) -> None:
    server = serve(answer_json)
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    action = _run_ticket(
        tenant_a,
        server.url,
        mode="key",
        schema=schema,
        request={"method": "POST", "url": f"{server.url}/boards/{{title}}/tickets"},
    )
    assert action.status == S.CONFIRMED
    # "probe" is plain; a hostile title is encoded into its one segment...
    run = create_run(tenant_a, "ticketing", {"title": "x/y?z=1#w"}, actor="user:t")
    advance_run(run.run_id, "w1")
    # ...and one that climbs out once a proxy decodes the path (nginx: /boards/x/../../admin
    # is /admin) is never sent: refused before a byte went out.
    run = create_run(tenant_a, "ticketing", {"title": "x/../../admin"}, actor="user:t")
    advance_run(run.run_id, "w1")
    refused = Action.objects.get(run=run)
    assert refused.status == S.FAILED and "segment" in refused.last_error
    assert [r["path"] for r in server.requests] == [
        "/boards/probe/tickets",
        "/boards/x%2Fy%3Fz%3D1%23w/tickets",
    ]


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("http://evil.example.com/tasks", HostNotAllowed),
        ("http://{title}.example.com/tasks", InvalidTool),
        ("http://127.0.0.1:{title}/tasks", InvalidTool),
        ("http://user:{title}@127.0.0.1/tasks", InvalidTool),
        ("file:///etc/passwd", InvalidTool),
    ],
)
def test_a_definition_that_would_send_elsewhere_is_refused_and_not_stored(
    tenant_a: Tenant, url: str, code: type[Exception]
) -> None:
    create = tickets("http://127.0.0.1:9")[1]
    create["request"] = {"method": "POST", "url": url}
    with pytest.raises(code) as refused:
        define(tenant_a, create, "user:admin", known_tools=["tickets.close"])
    assert "request.url" in refused.value.extra["errors"]  # type: ignore[attr-defined]
    assert not ToolDefinition.objects.exists()


def test_a_schema_cannot_make_holdpoint_fetch_a_url(
    tenant_a: Tenant, serve: Serve, settings: Any
) -> None:
    """A `$ref` to a URL: python-jsonschema fetched it (urllib, with a DeprecationWarning)
    when a param reached it — from the API or a worker, to any host and address, past
    HOLDPOINT_TOOL_HOSTS and the private networks, its answer judging the params."""
    service, probe = serve(answer_json), serve(answer_json)
    settings.HOLDPOINT_TOOL_HOSTS = ["127.0.0.1"]  # not localhost, the probe's name
    ref = f"http://localhost:{probe.port}/schema.json"
    schema = {"type": "object", "properties": {"title": {"$ref": ref}}}
    create = {**tickets(service.url)[1], "schema": schema}
    with pytest.raises(InvalidTool) as refused:
        parse(create, known_tools=["tickets.close"])
    assert "schema" in refused.value.extra["errors"]

    # A definition stored before it was refused so: its actions fetch nothing either.
    action = _run_ticket(tenant_a, service.url, mode="key")
    assert action.status == S.CONFIRMED
    row = ToolDefinition.objects.get(tenant=tenant_a, name="tickets.create")
    ToolDefinition.objects.create(
        tenant=tenant_a,
        name=row.name,
        version=row.version + 1,
        spec={**row.spec, "schema": schema},
        digest="0" * 64,
        created_by="user:admin",
    )
    run = create_run(tenant_a, "ticketing", {"title": "probe"}, actor="user:t")
    advance_run(run.run_id, "w1")
    assert probe.requests == []
    assert len(service.requests) == 1  # the first run's; the second action was not sent
