"""An MCP tool whose definition declares a lookup (issue 19): MCP itself has no idempotency
contract, but an upstream that stores a client's request id with the effect and can find it
by that id gives one. Holdpoint then passes the action's key in `mcp.key_argument` on every
call, and a lost answer is settled by asking the upstream's lookup tool — not by a person,
and never by sending again while the effect may exist. The upstream is a real process
(tests/mcp_upstream.py --keyed); the oracle is its own record of calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import ApprovalPolicy
from runtime import tooldefs
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
from tests.core.readme import blocks
from tests.mcp_fixture import Upstream

S = ActionStatus
OPEN = "helpdesk.tickets_open"


def _definition(**change: Any) -> dict[str, Any]:
    """The README's declaration, exactly as written there (so the README's example is the one
    these tests run), with a short timeout for the lost answers."""
    (block,) = [b for b in blocks() if b.lang == "json" and '"executor": "mcp"' in b.text]
    declared: dict[str, Any] = json.loads(block.text)
    assert declared["name"] == OPEN
    return {**declared, "timeout_seconds": 1.5, **change}


def _keyed(tenant: Tenant, upstream: Upstream) -> None:
    McpServer.objects.create(tenant=tenant, name="helpdesk", url=upstream.url, timeout_seconds=2)
    tooldefs.define(tenant, _definition(), "user:admin")
    ApprovalPolicy.objects.create(tenant=tenant, name="opens go", tool=OPEN, required=False)


def _run(tenant: Tenant) -> Run:
    return create_run(
        tenant, "ticketing", {"title": "Printer on fire", "tool": OPEN}, actor="user:starter"
    )


def test_every_call_carries_the_actions_key_in_the_key_argument(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]
) -> None:
    upstream = mcp_upstream(keyed=True)
    _keyed(tenant_a, upstream)
    run = _run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED and action.external_id == "T-1"
    assert upstream.calls() == [
        {
            "tool": "tickets_open",
            "arguments": {"title": "Printer on fire", "request_id": action.idempotency_key},
        }
    ]
    assert json.loads(action.params) == {"title": "Printer on fire"}  # what was hashed


def test_a_lost_answer_is_found_by_its_key_and_not_sent_again(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]
) -> None:
    upstream = mcp_upstream(keyed=True)
    _keyed(tenant_a, upstream)
    upstream.faults(hang=30)  # applies, then answers long after the timeout
    run = _run(tenant_a)
    for _ in range(5):  # unknown → reconciled by the lookup (in the same turn or a later one)
        if Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED:
            break
        advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED, (action.status, action.last_error)
    assert action.external_id == "T-1"
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED
    assert len(upstream.calls("tickets_open")) == 1


def test_a_found_effect_whose_answer_echoes_the_credential_is_stored_masked(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]
) -> None:
    """The finder's answer becomes the action's result: a token it echoes is masked there,
    as in a call's answer (runtime.tools.masked_answer), with the lookup's own secret."""
    secret = "mcp-s3cret/4711"
    credential = ToolCredential(tenant=tenant_a, service="helpdesk")
    credential.set_secret(secret, actor="user:admin")
    credential.save()
    upstream = mcp_upstream(keyed=True)
    McpServer.objects.create(tenant=tenant_a, name="helpdesk", url=upstream.url, timeout_seconds=2)
    tooldefs.define(tenant_a, _definition(credential="helpdesk"), "user:admin")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="opens go", tool=OPEN, required=False)
    upstream.faults(hang=30, echo_token=True)  # the answer is lost; the finder echoes
    run = _run(tenant_a)
    for _ in range(5):
        if Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED:
            break
        advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == S.CONFIRMED and action.external_id == "T-1", action.last_error
    assert action.result["structuredContent"] == {"id": "T-1", "seen": "Bearer ********"}
    assert "s3cret" not in json.dumps(action.result)
    assert len(upstream.calls("tickets_open")) == 1


def test_a_lookup_that_cannot_tell_never_sends_again_and_ends_with_a_person(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream], settings: Any
) -> None:
    settings.HOLDPOINT_RECONCILE_ATTEMPTS = 2
    upstream = mcp_upstream(keyed=True)
    _keyed(tenant_a, upstream)
    upstream.faults(hang=30, find_fails=1)  # the answer is lost, and so is every lookup's
    run = _run(tenant_a)
    outcomes = []
    for _ in range(6):  # HOLDPOINT_RECONCILE_ATTEMPTS lookups, each unable to tell
        Run.objects.filter(pk=run.pk).update(wake_at=None)  # the retry's back-off is over
        outcomes.append(advance_run(run.run_id, "w1").outcome)
        if Action.objects.get(run=run).status == S.MANUAL_REVIEW:
            break
    action = Action.objects.get(run=run)
    assert action.status == S.MANUAL_REVIEW, (outcomes, action.reconcile_attempts)
    assert "the finder is down" in action.last_error
    assert Run.objects.get(pk=run.pk).status == RunStatus.NEEDS_RECONCILIATION
    assert len(upstream.calls("tickets_open")) == 1


@pytest.mark.parametrize(
    "change, field",
    [
        ({"mcp": {"server": "helpdesk", "tool": "tickets_open"}}, "mcp.key_argument"),
        ({"lookup": None}, "lookup"),
        (
            {"lookup": {"tool": "tickets_find", "arguments": {}, "found": "$.id"}},
            "lookup.arguments",
        ),
        (
            {"lookup": {"tool": "tickets_find", "arguments": {"x": "{nope}"}, "found": "$.id"}},
            "lookup.arguments.x",
        ),
        (
            {"lookup": {"arguments": {"request_id": "{idempotency_key}"}, "found": "$.id"}},
            "lookup.tool",
        ),
        (
            {
                "lookup": {
                    "tool": "tickets_find",
                    "arguments": {"request_id": "{idempotency_key}"},
                    "found": "$[",
                }
            },
            "lookup.found",
        ),
        (
            {
                "mcp": {"server": "helpdesk", "tool": "tickets_open", "key_argument": "title"},
            },
            "mcp.key_argument",
        ),
        ({"dedup": {"mode": "key"}}, "dedup.mode"),
    ],
)
def test_a_bad_lookup_declaration_is_refused_with_its_field(
    tenant_a: Tenant, change: dict[str, Any], field: str
) -> None:
    McpServer.objects.create(tenant=tenant_a, name="helpdesk", url="http://127.0.0.1:9/mcp")
    with pytest.raises(tooldefs.InvalidTool) as refused:
        tooldefs.define(tenant_a, _definition(**change), "user:admin")
    assert field in refused.value.extra["errors"], refused.value.extra["errors"]
    assert not ToolDefinition.objects.exists()


def test_a_lookup_answer_in_plain_text_cannot_tell_and_is_never_read_as_absent(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream], settings: Any
) -> None:
    """`found` reads the structured result or the JSON text: a lookup tool that answers in
    plain text ("Ticket T-1 was opened …") gives neither, and that is no answer — as for an
    http lookup without JSON — not "absent", which sent the ticket again once the first
    send could no longer be in flight."""
    settings.HOLDPOINT_RECONCILE_ATTEMPTS = 2
    upstream = mcp_upstream(keyed=True)
    McpServer.objects.create(tenant=tenant_a, name="helpdesk", url=upstream.url, timeout_seconds=2)
    lookup = {"tool": "tickets_find_text", "arguments": {"request_id": "{idempotency_key}"}}
    tooldefs.define(tenant_a, _definition(lookup={**lookup, "found": "$.id"}), "user:admin")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="opens go", tool=OPEN, required=False)
    upstream.faults(hang=30)  # applies, then answers long after the timeout
    run = _run(tenant_a)
    for _ in range(6):
        Run.objects.filter(pk=run.pk).update(wake_at=None)  # the retry's back-off is over
        past = timezone.now() - timedelta(minutes=5)  # the first send can no longer land
        Action.objects.filter(run=run).update(in_flight_until=past)
        advance_run(run.run_id, "w1")
        if Action.objects.get(run=run).status == S.MANUAL_REVIEW:
            break
    action = Action.objects.get(run=run)
    assert len(upstream.calls("tickets_open")) == 1
    assert action.status == S.MANUAL_REVIEW, (action.status, action.last_error)


def test_a_lookup_that_finds_no_id_cannot_tell(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]
) -> None:
    """What `found` matches must be an id: the finder's `{"found": false}` read through
    `$.found` matched `false`, and its text "False" was taken as the ticket's id — an action
    never applied would be confirmed as ticket "False" (and `null` or an object read as
    "absent" let it be sent again). Such an answer cannot tell."""
    import uuid

    from runtime.tools import get_tool

    upstream = mcp_upstream(keyed=True)
    McpServer.objects.create(tenant=tenant_a, name="helpdesk", url=upstream.url, timeout_seconds=2)
    lookup = {"tool": "tickets_find", "arguments": {"request_id": "{idempotency_key}"}}
    tooldefs.define(tenant_a, _definition(lookup={**lookup, "found": "$.found"}), "user:admin")
    run = _run(tenant_a)
    tool = get_tool(OPEN, tenant_a.pk)
    looked = tool.lookup(f"never-sent-{uuid.uuid4()}", '{"title": "x"}', run_id=str(run.run_id))
    assert looked.found is None and "not an id" in looked.detail, looked
    assert upstream.calls("tickets_open") == []


def test_an_answer_without_a_usable_id_is_settled_by_the_lookup(
    tenant_a: Tenant, mcp_upstream: Callable[..., Upstream]
) -> None:
    """The upstream opens the ticket but answers `"id": true`: no proof (before, confirmed
    with external id "True"). The outcome is unknown and the tool's contract settles it:
    its lookup by key finds the ticket's real id; nothing is sent again."""
    upstream = mcp_upstream(keyed=True)
    _keyed(tenant_a, upstream)
    upstream.faults(id=True)
    run = _run(tenant_a)
    for _ in range(5):
        if Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED:
            break
        advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert (action.status, action.external_id) == (S.CONFIRMED, "T-1"), action.last_error
    assert len(upstream.calls("tickets_open")) == 1
