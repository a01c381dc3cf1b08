"""A tool credential is sent as a bearer token and nowhere else (README, "Tool credentials":
never in logs, journal payloads, exports or API responses). A value that cannot travel in an
HTTP header is refused by the HTTP layer with a message that quoted the whole header, the
secret included — and that message became the action's error, which every member of the
tenant reads over the API, and went into the journal."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.models import Action, ActionStatus, Checkpoint, Tenant, ToolCredential
from tests.conftest import Persona
from tests.httpservers import Behaviour, Server, answer_json, answer_with
from tests.runtime.helpers import make_due
from tests.tooldefs import run_ticket

pytestmark = pytest.mark.django_db

S = ActionStatus
SECRET = "s3cret-token-4711"


def _credential(tenant: Tenant, value: str) -> None:
    credential = ToolCredential(tenant=tenant, service="tasks")
    credential.set_secret(value, actor="user:admin")
    credential.save()


@pytest.mark.parametrize("value", [f"{SECRET}\n", f"{SECRET}\r\nX-Injected: 1", f"\n{SECRET}"])
def test_a_credential_no_header_can_carry_is_never_quoted_and_nothing_is_sent(
    tenant_a: Tenant, serve: Callable[[Behaviour], Server], agent_a: Persona, value: str
) -> None:
    server = serve(answer_json)
    _credential(tenant_a, value)
    action = run_ticket(tenant_a, server.url, "key", credential="tasks")
    assert server.requests == []  # refused before a byte went out
    # Nothing was sent, so nothing can have applied: not an unknown outcome for a person.
    assert action.status in (S.PREPARED, S.FAILED), action.status
    assert SECRET not in action.last_error
    assert "credential" in action.last_error or "header" in action.last_error
    for entry in JournalEntry.objects.all():
        assert SECRET not in json.dumps(entry.payload), entry.type
    listed = agent_a.api().get(f"/api/v1/actions/{action.action_id}/")
    assert listed.status_code == 200 and SECRET not in listed.content.decode()


@pytest.mark.parametrize("value", [f"{SECRET}\n", f"{SECRET}\r", "tok\x00en", "t\u20acken"])
def test_the_admin_refuses_a_secret_no_header_can_carry(
    client: Client, admin_a: Persona, value: str
) -> None:
    client.force_login(admin_a.user)
    page = client.post(
        "/admin/runtime/toolcredential/add/",
        {"tenant": admin_a.tenant.pk, "service": "tasks", "secret": value},
    )
    assert page.status_code == 200  # the form again, with its error
    assert "secret" in page.context["adminform"].form.errors
    assert not ToolCredential.objects.exists()


def test_the_admin_stores_a_secret_a_header_can_carry(client: Client, admin_a: Persona) -> None:
    client.force_login(admin_a.user)
    page = client.post(
        "/admin/runtime/toolcredential/add/",
        {"tenant": admin_a.tenant.pk, "service": "tasks", "secret": "ab c~!\t=="},
    )
    assert page.status_code == 302, page.content[:500]
    stored: Any = ToolCredential.objects.get()
    assert stored.secret().reveal() == "ab c~!\t=="


def _echo_token(status: int) -> Behaviour:
    """A service that quotes the token it was given in its error (as many do: "invalid API
    key: …")."""

    def behaviour(handler: Any, server: Server) -> None:
        sent = server.requests[-1]["headers"].get("authorization", "")
        body = json.dumps({"error": f"not a valid token: {sent}"}).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return behaviour


@pytest.mark.parametrize("status", [401, 503])
def test_a_service_quoting_the_credential_in_its_error_never_shows_it_to_the_tenant(
    tenant_a: Tenant, serve: Callable[[Behaviour], Server], agent_a: Persona, status: int
) -> None:
    """The service's answer becomes the action's error (every member reads it) and goes
    into the journal; a token it quotes back must not go with it."""
    server = serve(_echo_token(status))
    _credential(tenant_a, SECRET)
    action = run_ticket(tenant_a, server.url, "none", credential="tasks")
    assert server.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert action.last_error and "not a valid token" in action.last_error
    assert SECRET not in action.last_error
    for entry in JournalEntry.objects.all():
        assert SECRET not in json.dumps(entry.payload), entry.type
    listed = agent_a.api().get(f"/api/v1/actions/{action.action_id}/")
    assert listed.status_code == 200 and SECRET not in listed.content.decode()


def _only_token(token: str) -> Behaviour:
    """A service that takes requests carrying `token` and answers 401 to any other."""

    def behaviour(handler: Any, server: Server) -> None:
        if server.requests[-1]["headers"].get("authorization") == f"Bearer {token}":
            answer_json(handler, server)
            return
        body = b'{"error": "unauthorized"}'
        handler.send_response(401)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return behaviour


def test_another_tenants_refused_calls_do_not_stop_a_tenants_tool(
    tenant_a: Tenant, tenant_b: Tenant, serve: Callable[[Behaviour], Server]
) -> None:
    """Two tenants imported the same definition (its digest is the same); tenant A has no
    valid credential, so the service refuses each of its calls with a 401 — the service is
    up and answering. Those refusals are A's own: B's call still goes out and is confirmed,
    not refused by a circuit A's refusals opened."""
    server = serve(_only_token(SECRET))
    _credential(tenant_b, SECRET)
    for _ in range(5):  # the breaker's threshold
        refused = run_ticket(tenant_a, server.url, "key", credential="tasks")
        assert refused.status == S.FAILED and "HTTP 401" in refused.last_error
    action = run_ticket(tenant_b, server.url, "key", credential="tasks")
    assert action.status == S.CONFIRMED, (action.status, action.last_error)
    assert server.requests[-1]["headers"]["authorization"] == f"Bearer {SECRET}"


def _echo_token_applied(handler: Any, server: Server) -> None:
    """A service that applies the request and answers 201 echoing the token it was given
    (a debugging echo, an "authorized as" field): as written, JSON-escaped inside a string,
    and as the name of a member."""
    sent = server.requests[-1]["headers"].get("authorization", "")
    body = json.dumps(
        {
            "id": "T-9",
            "title": "probe",
            "seen": {"authorization": sent},
            "log": json.dumps({"authorization": sent}),
            sent: "a member named by the token",
            "count": 3,
        }
    ).encode()
    handler.send_response(201)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _nowhere_shown(action: Action, agent: Persona, reviewer: Persona) -> None:
    """The secret is in none of what the tenant's members read of the action: its row, the
    journal, the run's checkpoints, the API (an agent's token) and the run's pages (a
    reviewer's session)."""
    stored = json.dumps([action.result, action.external_id, action.last_error])
    assert SECRET not in stored and json.dumps(SECRET)[1:-1] not in stored
    for entry in JournalEntry.objects.all():
        assert SECRET not in json.dumps(entry.payload), entry.type
    for checkpoint in Checkpoint.objects.filter(run_id=action.run_id):
        assert SECRET not in json.dumps(checkpoint.state)
    browser = Client()
    browser.force_login(reviewer.user)
    api = (
        f"/api/v1/actions/{action.action_id}/",
        f"/api/v1/runs/{action.run_id}/actions/",
        f"/api/v1/runs/{action.run_id}/events/",
    )
    pages = (f"/runs/{action.run_id}/", f"/runs/{action.run_id}/trail/")
    for client, urls in ((agent.api(), api), (browser, pages)):
        for url in urls:
            shown = client.get(url)
            assert shown.status_code == 200, (url, shown.status_code)
            assert SECRET not in shown.content.decode(), url


def test_a_service_echoing_the_credential_in_a_success_never_stores_it(
    tenant_a: Tenant,
    serve: Callable[[Behaviour], Server],
    agent_a: Persona,
    reviewer_a: Persona,
) -> None:
    """A 2xx answer becomes the action's result (`GET …/actions/`, the step's `ctx.act`) and
    its id the journal's: a token it echoes is masked there as in an error, and the id is
    still read from the answer by the definition's JSONPath."""
    server = serve(_echo_token_applied)
    _credential(tenant_a, SECRET)
    action = run_ticket(tenant_a, server.url, "key", credential="tasks")
    assert server.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert action.status == S.CONFIRMED and action.external_id == "T-9", action.last_error
    assert action.result == {
        "id": "T-9",
        "title": "probe",
        "seen": {"authorization": "Bearer ********"},
        "log": json.dumps({"authorization": "Bearer ********"}),
        "Bearer ********": "a member named by the token",
        "count": 3,
    }
    _nowhere_shown(action, agent_a, reviewer_a)


def test_an_answer_without_the_credential_is_stored_as_it_came(
    tenant_a: Tenant, serve: Callable[[Behaviour], Server]
) -> None:
    """Masking changes nothing else: an answer that does not hold the secret is the result,
    equal to what the service said, and its id read by the definition's JSONPath."""
    said = {"data": {"ticket": {"ref": 42}}, "tags": ["a", "Bearer"], "ok": True, "n": 1.5}
    server = serve(answer_with(201, json.dumps(said).encode()))
    _credential(tenant_a, SECRET)
    action = run_ticket(
        tenant_a, server.url, "key", credential="tasks", result={"external_id": "$.data.ticket.ref"}
    )
    assert server.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert action.status == S.CONFIRMED and action.external_id == "42", action.last_error
    assert action.result == said


def _lost_then_found_echoing(handler: Any, server: Server) -> None:
    """The send's answer is lost (a 503 after applying); the lookup by key finds the effect
    and echoes the token it was asked with."""
    request = server.requests[-1]
    if request["method"] == "POST":
        answer_with(503, b'{"error": "busy"}')(handler, server)
        return
    sent = request["headers"].get("authorization", "")
    answer_with(200, json.dumps([{"id": "T-7", "asked_by": sent}]).encode())(handler, server)


def test_a_lookup_echoing_the_credential_never_stores_it(
    tenant_a: Tenant,
    serve: Callable[[Behaviour], Server],
    agent_a: Persona,
    reviewer_a: Persona,
) -> None:
    """A found effect's answer becomes the action's result too (reconciled by lookup)."""
    server = serve(_lost_then_found_echoing)
    _credential(tenant_a, SECRET)
    action = run_ticket(tenant_a, server.url, "lookup", credential="tasks")
    for _ in range(5):
        if action.status == S.CONFIRMED:
            break
        make_due(action.run_id)
        advance_run(action.run_id, "w1")
        action.refresh_from_db()
    assert [r["method"] for r in server.requests][:2] == ["POST", "GET"]
    assert server.requests[1]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert action.status == S.CONFIRMED and action.external_id == "T-7", action.last_error
    assert action.result == {"id": "T-7", "asked_by": "Bearer ********"}
    _nowhere_shown(action, agent_a, reviewer_a)
