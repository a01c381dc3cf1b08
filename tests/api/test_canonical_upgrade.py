"""What was stored before Holdpoint wrote RFC 8785 keeps its meaning after the upgrade.

Actions, approvals, tool definitions and Idempotency-Key records hold hashes of canonical
JSON made when it was Python's `json.dumps(sort_keys=True)`. For params holding a float
below 1e-4 that form is not RFC 8785's (`1e-07` for `1e-7`), so each test stores something
as the earlier version did — rows rewritten in the earlier form (`legacy_bytes`), as
tests/audit/test_columns.py rewrites journal rows — and then asks again as a client after
the upgrade would: a retried prepare or request, a reviewer's repeated decision, an
approval dispatched, a tool defined again, an MCP call retried. None of them may turn into
"different params", a second action, a new version or a lost approval.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import rfc8785

from approvals.hashing import action_hash
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalVote
from audit.canonical import legacy_bytes, sha256_hex
from gateway import calls
from runtime import actionkeys, ledger, mcpimport, tooldefs
from runtime.models import Action, ActionStatus, IdempotencyRecord, Run, ToolDefinition
from tests.api import (
    fresh_throttle,  # noqa: F401
    get,
    grant_policy,
    new_run,
    ok,
    post,
    prepare,
    problem,
    session,
    take_lease,
)
from tests.conftest import Persona
from tests.tooldefs import define_tickets

pytestmark = pytest.mark.django_db

TOOL = "agent.measure"
# Written `1e-07` before RFC 8785, `1e-7` since.
PARAMS: dict[str, Any] = {"title": "Recalibrate", "threshold": 1e-7}


def define_measure(persona: Persona, **changes: Any) -> ToolDefinition:
    """A tenant's own tool, performed by its agent, that takes a number."""
    spec = {
        "name": TOOL,
        "effect": "write",
        "executor": "client",
        "schema": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "threshold": {"type": "number", "minimum": 1e-9},
            },
            "required": ["title"],
        },
        "editable": ["title", "threshold"],
        "dedup": {"mode": "key"},
        **changes,
    }
    return tooldefs.define(persona.tenant, spec, "user:admin").definition


def earlier(text: str) -> str:
    """Canonical JSON text as the version before RFC 8785 wrote it."""
    return legacy_bytes(json.loads(text)).decode() if text else text


def stored_as_before_rfc8785(action_id: str) -> Action:
    """Rewrite an action, and its approval requests and votes, as the version before RFC
    8785 stored them: the params texts in the earlier form, the fingerprints of those texts,
    and every hash made over them."""
    action = Action.objects.get(pk=action_id)
    text = earlier(action.params)
    assert text != action.params  # the forms differ for these params: else nothing is tested
    requests = ApprovalRequest.objects.filter(action_id=action_id).order_by("created_at")
    asked = action.params  # what the step asked for: the first request shows it, if edited
    if action.requested_fingerprint != action.fingerprint:
        asked = requests[0].params
    for request in requests:
        ApprovalRequest.objects.filter(pk=request.pk).update(
            params=earlier(request.params), edited_params=earlier(request.edited_params)
        )
    Action.objects.filter(pk=action_id).update(
        params=text,
        fingerprint=sha256_hex(text.encode()),
        requested_fingerprint=sha256_hex(earlier(asked).encode()),
    )
    action.refresh_from_db()
    requests.update(action_hash=action_hash(action))
    ApprovalVote.objects.filter(request__action_id=action_id).update(
        action_hash=action_hash(action)
    )
    return action


def leased(persona: Persona) -> tuple[Any, str, int]:
    client = persona.api()
    run_id = new_run(client)["run_id"]
    return client, run_id, take_lease(client, run_id)


def decide(client: Any, approval_id: str, action_hash: str, **more: Any) -> Any:
    body = {"decision": "approve", "action_hash": action_hash, "reason": "fine", **more}
    return post(client, f"approvals/{approval_id}/decision/", body)


# --- the side-effect ledger -------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "measure-1"])
def test_a_prepare_retried_after_the_upgrade_is_the_action_prepared_before(
    agent_a: Persona, key: str | None
) -> None:
    """A client whose prepare's answer was lost in the deploy asks again with the same
    params: the action it prepared before is its answer (200, not a second action nor 422
    `idempotency_key_reused`), its stored bytes — what is hashed and sent — unchanged. A
    hosted step that asks again finds it the same way (ledger.find_action)."""
    define_measure(agent_a)
    ApprovalPolicy.objects.create(tenant=agent_a.tenant, name="go", tool=TOOL, required=False)
    client, run_id, fence = leased(agent_a)
    fields = {"idempotency_key": key} if key else {}
    first = ok(prepare(client, run_id, fence, TOOL, PARAMS, **fields), 201)
    stored = Action.objects.get(pk=first["action_id"])
    assert (
        stored.params
        == rfc8785.dumps(PARAMS).decode()
        == '{"threshold":1e-7,"title":"Recalibrate"}'
    )
    before = stored_as_before_rfc8785(first["action_id"]).params
    assert before == '{"threshold":1e-07,"title":"Recalibrate"}'

    again = ok(prepare(client, run_id, fence, TOOL, PARAMS, **fields))
    assert again["action_id"] == first["action_id"]
    assert Action.objects.filter(run_id=run_id).count() == 1
    assert Action.objects.get(pk=first["action_id"]).params == before
    if key is None:
        run = Run.objects.get(pk=run_id)
        found = ledger.find_action(run, stored.step, 1, actionkeys.canonical_params(PARAMS))
        assert found is not None and str(found.pk) == first["action_id"]
    other = {**PARAMS, "threshold": 2e-7}
    if key:
        problem(
            prepare(client, run_id, fence, TOOL, other, **fields), 422, "idempotency_key_reused"
        )
    else:
        assert (
            ok(prepare(client, run_id, fence, TOOL, other), 201)["action_id"] != first["action_id"]
        )


def test_an_action_approved_before_the_upgrade_is_sent_after_it_as_approved(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """The action hash covers the params as the stored text (a JSON string, escaped alike in
    both forms): an approval of an action stored in the earlier form still binds it, and
    the bytes sent are the ones approved."""
    define_measure(agent_a)
    grant_policy(agent_a.tenant, tool=TOOL)
    client, run_id, fence = leased(agent_a)
    held = ok(prepare(client, run_id, fence, TOOL, PARAMS), 201)
    assert held["status"] == "awaiting_approval"
    action = stored_as_before_rfc8785(held["action_id"])
    alice = session(reviewer_a.user)
    shown = ok(get(alice, f"approvals/{held['approval']}/"))
    assert shown["action_hash"] == action_hash(action) and shown["action"]["params"] == PARAMS
    assert ok(decide(alice, held["approval"], shown["action_hash"]))["status"] == "approved"

    sent = ok(post(client, f"actions/{held['action_id']}/dispatch/", {"fence": fence}))
    assert sent["status"] == "sent"
    stored = Action.objects.get(pk=held["action_id"])
    assert (stored.status, stored.params) == (ActionStatus.SENT, action.params)


def test_a_decision_with_edits_made_before_the_upgrade_repeated_after_it_is_the_same(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """A reviewer's client retries an approval with edits whose answer was lost: the edited
    params, stored in the earlier form, are what the same edits make now in RFC 8785's —
    the same decision (200, the same approval), not 409 `already_decided`."""
    define_measure(agent_a)
    grant_policy(agent_a.tenant, tool=TOOL)
    client, run_id, fence = leased(agent_a)
    held = ok(prepare(client, run_id, fence, TOOL, {"title": "Recalibrate"}), 201)
    alice = session(reviewer_a.user)
    seen = ok(get(alice, f"approvals/{held['approval']}/"))["action_hash"]
    edits = {"threshold": 1e-7}
    ok(decide(alice, held["approval"], seen, edits=edits))
    action = stored_as_before_rfc8785(held["action_id"])
    first = ok(get(alice, f"approvals/{held['approval']}/"))
    assert first["action_hash"] == action_hash(action)

    again = ok(decide(alice, held["approval"], first["action_hash"], edits=edits))
    assert again == first
    assert ApprovalVote.objects.filter(request_id=held["approval"]).count() == 1


def test_an_edit_that_changes_nothing_keeps_the_hash_of_an_action_held_before_the_upgrade(
    agent_a: Persona, reviewer_a: Persona
) -> None:
    """Under a quorum, an edit voids the votes cast on the action before it. An "edit" that
    sets a param to the value it has changed no hash before the upgrade; it must not after
    it either, by rewriting the stored params in the other form."""
    define_measure(agent_a)
    grant_policy(agent_a.tenant, tool=TOOL, quorum=2)
    client, run_id, fence = leased(agent_a)
    held = ok(prepare(client, run_id, fence, TOOL, PARAMS), 201)
    action = stored_as_before_rfc8785(held["action_id"])
    alice = session(reviewer_a.user)
    seen = ok(get(alice, f"approvals/{held['approval']}/"))["action_hash"]

    vote = ok(decide(alice, held["approval"], seen, edits={"threshold": 1e-7}))
    assert vote["action_hash"] == seen == action_hash(action)
    assert Action.objects.get(pk=held["action_id"]).params == action.params
    assert ApprovalVote.objects.filter(request_id=held["approval"]).count() == 1


# --- tool definitions and Idempotency-Key records ----------------------------------------------


def test_a_tool_defined_before_the_upgrade_and_defined_again_is_no_new_version(
    agent_a: Persona,
) -> None:
    """A definition's digest was stored in the earlier form; the same definition imported or
    saved again must be "unchanged", not a new version (which re-stamps the tool's held
    actions and supersedes their approvals)."""
    row = define_measure(agent_a)
    earlier = sha256_hex(legacy_bytes(dict(row.spec)))
    assert earlier != row.digest
    ToolDefinition.objects.filter(pk=row.pk).update(digest=earlier)

    again = tooldefs.define(agent_a.tenant, dict(row.spec), "user:admin")
    assert not again.created and again.definition.version == row.version
    changed = {**row.spec, "description": "changed"}
    assert (
        tooldefs.define(agent_a.tenant, changed, "user:admin").definition.version == row.version + 1
    )


def test_an_idempotent_request_made_before_the_upgrade_is_replayed_after_it(
    agent_a: Persona,
) -> None:
    """The record's fingerprint of the request body was stored in the earlier form; the
    client's retry after the deploy is the same request: the first response again, not 422
    `idempotency_key_reused`."""
    client = agent_a.api()
    body = {"graph": "chain", "goal": {"steps": 2, "threshold": 1e-7}}
    first = post(client, "runs/", body, HTTP_IDEMPOTENCY_KEY="start-1")
    data = ok(first, 201)
    record = IdempotencyRecord.objects.get(tenant=agent_a.tenant, key="start-1")
    earlier = sha256_hex(legacy_bytes({"scope": record.scope, "body": body}))
    assert earlier != record.fingerprint
    IdempotencyRecord.objects.filter(pk=record.pk).update(fingerprint=earlier)

    again = post(client, "runs/", body, HTTP_IDEMPOTENCY_KEY="start-1")
    assert (again.status_code, again.json()) == (201, data)
    assert again["Idempotent-Replayed"] == "true"
    assert Run.objects.filter(tenant=agent_a.tenant).count() == 1


# --- the MCP gateway and MCP imports ---------------------------------------------------------


def test_an_mcp_call_made_before_the_upgrade_is_found_by_its_retry_after_it(
    agent_a: Persona,
) -> None:
    """MCP has no idempotency key: the gateway names a call by its arguments' fingerprint.
    A call held for a reviewer before the upgrade, retried by the host after it, must find
    that action — not prepare a second one, which a reviewer could approve as well."""
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string"}, "weight": {"type": "number"}},
        "required": ["title"],
    }
    define_tickets(agent_a.tenant, "http://127.0.0.1:9", schema=schema)
    assert agent_a.token
    caller = calls.authenticate(f"Bearer {agent_a.token}", agent_a.tenant.slug)
    run_id = calls.open_session(caller, {})
    arguments = {"title": "Milk", "weight": 1e-7}
    call = calls.parse(caller, run_id, "tickets.create", arguments)
    held = calls.drive(caller, call)
    assert held.status == ActionStatus.AWAITING_APPROVAL
    stored = stored_as_before_rfc8785(str(held.pk))
    earlier_hash = hashlib.sha256(f"tickets.create\n{stored.fingerprint}".encode())
    earlier_key = f"mcp:{run_id}:{earlier_hash.hexdigest()[:32]}:1"
    Action.objects.filter(pk=held.pk).update(idempotency_key=earlier_key)

    retried = calls.parse(caller, run_id, "tickets.create", arguments)
    assert retried.key == earlier_key
    assert calls.drive(caller, retried).pk == held.pk
    assert Action.objects.filter(run_id=run_id).count() == 1
    other = calls.parse(caller, run_id, "tickets.create", {"title": "Milk", "weight": 2e-7})
    assert other.key != earlier_key and other.key != call.key


def test_an_mcp_import_keeps_what_it_recorded_before_the_upgrade_for_unchanged_fields() -> None:
    """An import records a short digest of each field the upstream gave (`mcp.imported`) to
    tell the upstream's changes from a person's. One recorded in the earlier form for a
    field the upstream did not change is that field unchanged — kept as recorded, so a
    person's correction of it stays and the definition is not a new version."""
    fresh = {
        "title": "Calibrate",
        "description": "",
        "effect": "write",
        "schema": {"type": "object", "properties": {"x": {"type": "number", "minimum": 1e-7}}},
        "timeout_seconds": 3,
        "credential": "",
    }
    recorded = {f: sha256_hex(legacy_bytes(fresh.get(f, "")))[:16] for f in mcpimport.FROM_UPSTREAM}
    assert recorded != mcpimport.said_by_upstream(fresh)  # the schema's digest differs by form
    assert mcpimport.said_by_upstream(fresh, recorded) == recorded
    moved = {**fresh, "schema": {"type": "object", "properties": {"x": {"minimum": 2e-7}}}}
    said = mcpimport.said_by_upstream(moved, recorded)
    assert said["schema"] != recorded["schema"] and said["title"] == recorded["title"]
