"""Tools as data in the runtime: a tenant's definitions are what workers and the executor
protocol send, held by default, bound by version, and nobody else's (API.md, "Tools as
data"). The tracker is the real sandbox process; the oracle is its own list of tasks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from runtime import actionkeys, protocol, tooldefs
from runtime.compensation import compensate, dispatch_standalone
from runtime.errors import (
    ApprovalRequired,
    InvalidParams,
    NotPermitted,
    StaleFence,
    ToolChanged,
)
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant, ToolDefinition
from runtime.tooldefs import parse
from runtime.tools import get_tool, tracker_definitions
from tests.conftest import Persona
from tests.graphs import BETWEEN_TICKETS
from tests.sandbox import Sandbox
from tests.tooldefs import define_tickets, store_unchecked, tickets

S = ActionStatus


def _exempt(tenant: Tenant, tool: str = "tickets.create") -> None:
    """A policy that names the tool and lets every action of it go."""
    ApprovalPolicy.objects.create(tenant=tenant, name=f"{tool} goes", tool=tool, required=False)


def _ticket_run(tenant: Tenant, title: str = "Fix login", **goal: Any) -> Run:
    return create_run(tenant, "ticketing", {"title": title, **goal}, actor="user:starter")


@pytest.mark.parametrize("mode", ["key", "lookup", "none"])
def test_the_shipped_tracker_definitions_are_valid_definitions(mode: str) -> None:
    items = tracker_definitions("http://127.0.0.1:9", mode)
    names = [item["name"] for item in items]
    modes = {item["name"]: parse(item, known_tools=names)["dedup"]["mode"] for item in items}
    # The tracker's mode is how creating deduplicates; closing a task is always by key.
    assert modes == {"tasks.create": mode, "agent.tasks.create": mode, "tasks.close": "key"}


def test_a_defined_tool_is_sent_by_the_worker_from_its_definition(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    _exempt(tenant_a)
    run = _ticket_run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    [task] = box.tasks()
    assert action.tool == "tickets.create" and action.tool_version == "1"
    assert action.status == S.CONFIRMED and action.external_id == task["id"]
    assert task["idempotency_key"] == action.idempotency_key and task["title"] == "Fix login"
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def test_a_stored_header_named_like_the_key_header_is_never_sent_beside_the_key(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """A definition stored before such headers were refused (`idempotency-key`, the key
    header in another case): the action's key is the only one sent. Sent beside it, the
    sandbox (which reads the first) took the constant for every action's key, and the
    second action came back as the first's task, its own effect never made."""
    box = sandbox_factory("key")
    row = define_tickets(tenant_a, box.url)
    spec = {**row.spec, "request": {**row.spec["request"], "headers": {"idempotency-key": "k"}}}
    store_unchecked(row, spec)
    _exempt(tenant_a)
    runs = [_ticket_run(tenant_a, title) for title in ("First", "Second")]
    for run in runs:
        assert advance_run(run.run_id, "w1").outcome == "completed"
    actions = Action.objects.filter(run__in=runs).order_by("created_at")
    tasks = {task["idempotency_key"]: task for task in box.tasks()}
    assert len(tasks) == 2
    for action, title in zip(actions, ("First", "Second"), strict=True):
        assert action.status == S.CONFIRMED and action.tool_version == "2"
        assert tasks[action.idempotency_key]["title"] == title
        assert action.external_id == tasks[action.idempotency_key]["id"]


@pytest.mark.django_db(transaction=True)  # commits of their own: PostgreSQL's one statement
def test_a_tool_redefined_after_the_worker_last_sent_it_is_sent_as_the_new_version(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """A worker starts an action from the version it last found current, unread; its
    prepare confirms it (on PostgreSQL a guard part of the one statement) or writes
    nothing and starts again from the current version. A read-only tool is held by no
    default, so its prepare is that one statement."""
    old, new = sandbox_factory("key"), sandbox_factory("key")
    define_tickets(tenant_a, old.url, effect="read")
    first = create_run(tenant_a, "ticketing-later", {"title": "Before"}, actor="t")
    assert advance_run(first.run_id, "w1").outcome == "completed"
    define_tickets(tenant_a, new.url, effect="read")  # version 2: another tracker
    second = create_run(tenant_a, "ticketing-later", {"title": "After"}, actor="t")
    assert advance_run(second.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=second)
    assert action.tool_version == "2" and action.status == S.CONFIRMED
    assert [t["title"] for t in old.tasks()] == ["Before"]
    assert [t["title"] for t in new.tasks()] == ["After"]
    assert [t["idempotency_key"] for t in new.tasks()] == [action.idempotency_key]


@pytest.mark.django_db(transaction=True)
def test_a_redefinition_between_two_actions_of_a_step_loses_neither(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The first action's confirmation is written by the second's prepare commit; when that
    commit finds the tool redefined it writes nothing and the prepare starts again — with the
    confirmation still on it, not dropped (which would leave a confirmed effect `sent`)."""
    old, new = sandbox_factory("key"), sandbox_factory("key")
    define_tickets(tenant_a, old.url, effect="read")
    BETWEEN_TICKETS.append(lambda: define_tickets(tenant_a, new.url, effect="read"))
    run = create_run(tenant_a, "ticketing-later", {"title": "Pair", "tickets": 2}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    first, second = Action.objects.filter(run=run).order_by("created_at")
    assert (first.status, first.tool_version) == (S.CONFIRMED, "1")
    assert (second.status, second.tool_version) == (S.CONFIRMED, "2")
    assert [t["title"] for t in old.tasks()] == ["Pair 1"]
    assert [t["title"] for t in new.tasks()] == ["Pair 2"]


def test_a_tenant_write_tool_no_policy_names_waits_for_any_of_its_reviewers(
    tenant_a: Tenant, reviewer_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    run = _ticket_run(tenant_a)
    advance_run(run.run_id, "w1")
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL
    assert box.tasks() == []
    request = ApprovalRequest.objects.get(run=run)
    assert request.policy.any_reviewer and request.policy.tool == "tickets.create"
    # No grant was given: the tenant's reviewer may decide because the default says so.
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_a_read_tool_is_not_held_by_default(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url, effect="read")
    run = _ticket_run(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert not ApprovalRequest.objects.filter(run=run).exists()


def test_another_tenants_tool_is_unknown_to_a_tenant(
    tenant_a: Tenant, tenant_b: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    _exempt(tenant_b)
    with pytest.raises(InvalidParams):
        get_tool("tickets.create", tenant_b.pk)
    run = _ticket_run(tenant_b)
    advance_run(run.run_id, "w1")
    assert not Action.objects.filter(run=run).exists()
    assert box.tasks() == []
    assert "unknown tool" in Run.objects.get(pk=run.pk).last_error


def test_a_redefined_tool_supersedes_the_approval_given_for_the_old_version(
    tenant_a: Tenant, reviewer_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    run = _ticket_run(tenant_a)
    advance_run(run.run_id, "w1")
    first = ApprovalRequest.objects.get(run=run)
    decide(first.id, reviewer_a.user, "approve", first.action_hash, reason="v1 is fine")
    # The admin changes the tool before the worker sends: a header the approver never saw.
    v2 = define_tickets(
        tenant_a,
        box.url,
        request={"method": "POST", "url": f"{box.url}/tasks", "headers": {"X-Team": "finance"}},
    )
    assert v2.version == 2
    advance_run(run.run_id, "w1")
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL
    assert box.tasks() == []
    first.refresh_from_db()
    assert first.status == ApprovalStatus.SUPERSEDED
    second = ApprovalRequest.objects.get(run=run, status=ApprovalStatus.PENDING)
    assert second.shown["tool_version"] == "2" and second.action_hash != first.action_hash
    assert Action.objects.get(run=run).tool_version == "2"
    decide(second.id, reviewer_a.user, "approve", second.action_hash, reason="v2 is fine")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1


def test_a_tenants_definition_of_a_built_in_name_does_not_inherit_its_approvals(
    tenant_a: Tenant,
    agent_a: Persona,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    """Both were version 1: an action of the built-in tasks.create approved, then the tenant
    defining its own tasks.create (allowed: it takes precedence) sent the action to the
    tenant's URL under the approval given for the built-in — the hash binds (name, version)
    and neither had changed — and a later reconcile would ask the tenant's service."""
    mine = sandbox_factory("key")
    tracker = sandbox_factory("key")  # the last one asked for: the built-in tasks.* use it
    ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tasks held", tool="tasks.create", any_reviewer=True
    )
    run, fence = _external_run(tenant_a, agent_a)
    action, _ = protocol.prepare(
        run, fence, "tasks.create", {"title": "For the tracker"}, reason="r", who="agent:a"
    )
    request = ApprovalRequest.objects.get(run=run)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="tracker: fine")
    create = next(t for t in tracker_definitions(mine.url) if t["name"] == "tasks.create")
    defined = tooldefs.define(tenant_a, create, "user:admin").definition
    assert defined.version == 2  # version 1 of tasks.create is the built-in one

    with pytest.raises(ApprovalRequired):
        protocol.dispatch(Action.objects.get(pk=action.pk), fence, "agent:a")
    assert mine.tasks() == [] and tracker.tasks() == []
    request.refresh_from_db()
    assert request.status == ApprovalStatus.SUPERSEDED
    assert get_tool("tasks.create", tenant_a.pk, "1").builtin  # what version 1 was sent as


def _external_run(tenant: Tenant, agent: Persona) -> tuple[Run, int]:
    run = create_run(
        tenant,
        "ticketing",
        {"title": "x"},
        actor="agent:a",
        external=True,
        executor_account=agent.user,
    )
    return Run.objects.get(pk=run.pk), protocol.take(run, "agent-1", 30, who="agent:a").fence


def _prepared_then_refused(tenant: Tenant, agent: Persona, box: Sandbox) -> tuple[Action, int]:
    """An external run's tickets.create action prepared under version 1, then the tool
    redefined (version 2) with a schema that refuses its params; (the action, the fence)."""
    define_tickets(tenant, box.url)
    _exempt(tenant)
    run, fence = _external_run(tenant, agent)
    action, _ = protocol.prepare(
        run, fence, "tickets.create", {"title": "A long title"}, reason="r", who="agent:a"
    )
    assert action.tool_version == "1"
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 5}},
        "required": ["title"],
    }
    define_tickets(tenant, box.url, schema=schema)
    return action, fence


def test_a_redefinition_that_refuses_the_params_fails_the_action_unsent(
    tenant_a: Tenant, agent_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    action, fence = _prepared_then_refused(tenant_a, agent_a, box)
    with pytest.raises(ToolChanged):
        protocol.dispatch(action, fence, "agent:a")
    action.refresh_from_db()
    assert action.status == S.CANCELLED and "version 2" in action.last_error
    assert box.tasks() == []


def test_an_approved_action_a_redefinition_refuses_leaves_no_approval_standing(
    tenant_a: Tenant,
    agent_a: Persona,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
) -> None:
    """Approved under version 1, then the tool redefined with a schema its params fail: the
    action is cancelled unsent — and its approval no longer reads as a usable one (the
    inbox's history, the request page, `GET approvals/`), as when a cancel or a revision
    withdraws an approved action. Before, it stayed `approved` for an action never sent."""
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    ApprovalPolicy.objects.create(
        tenant=tenant_a, name="tickets held", tool="tickets.create", any_reviewer=True
    )
    run, fence = _external_run(tenant_a, agent_a)
    action, _ = protocol.prepare(
        run, fence, "tickets.create", {"title": "A long title"}, reason="r", who="agent:a"
    )
    request = ApprovalRequest.objects.get(run=run)
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="fine")
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 5}},
        "required": ["title"],
    }
    define_tickets(tenant_a, box.url, schema=schema)

    with pytest.raises(ToolChanged):
        protocol.dispatch(Action.objects.get(pk=action.pk), fence, "agent:a")
    assert Action.objects.get(pk=action.pk).status == S.CANCELLED and box.tasks() == []
    request.refresh_from_db()
    assert request.status == ApprovalStatus.CANCELLED
    assert "withdrawn before it was sent" in request.closed_reason
    assert "version 2" in request.closed_reason


def test_the_api_answers_409_tool_changed_for_a_redefinition_that_refuses_the_params(
    tenant_a: Tenant, agent_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The same over REST (API.md's code `tool_changed`): the agent's dispatch is refused
    with a problem naming the new version, the action is cancelled and nothing is sent."""
    from tests.api import post, problem

    box = sandbox_factory("key")
    action, fence = _prepared_then_refused(tenant_a, agent_a, box)
    refused = post(agent_a.api(), f"actions/{action.action_id}/dispatch/", {"fence": fence})
    body = problem(refused, 409, "tool_changed")
    assert "version 2" in body["detail"] and "title" in body["detail"]
    action.refresh_from_db()
    assert action.status == S.CANCELLED and box.tasks() == []


def test_an_external_runs_http_tool_is_sent_by_the_server_not_the_agent(
    tenant_a: Tenant, agent_a: Persona, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    _exempt(tenant_a)
    run = create_run(
        tenant_a,
        "ticketing",
        {"title": "x"},
        actor="agent:a",
        external=True,
        executor_account=agent_a.user,
    )
    fence = protocol.take(run, "agent-1", 30, who="agent:a").fence
    action, _ = protocol.prepare(
        Run.objects.get(pk=run.pk),
        fence,
        "tickets.create",
        {"title": "From the agent"},
        reason="asked",
        who="agent:a",
    )
    done = protocol.dispatch(action, fence, "agent:a")
    [task] = box.tasks()
    assert done.status == S.CONFIRMED and done.external_id == task["id"]
    with pytest.raises(NotPermitted):  # what came back is Holdpoint's to say, not the agent's
        protocol.record_outcome(done, fence, "failed", who="agent:a")
    again = protocol.dispatch(Action.objects.get(pk=action.pk), fence, "agent:a")
    assert again.status == S.CONFIRMED and len(box.tasks()) == 1  # a retried dispatch: once
    protocol.release(Run.objects.get(pk=run.pk), fence, "agent:a")
    with pytest.raises(StaleFence):  # not the lease's holder any more: refused as any write
        protocol.dispatch(Action.objects.get(pk=action.pk), fence, "agent:a")


def test_compensation_is_another_defined_tool(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    _exempt(tenant_a)
    _exempt(tenant_a, "tickets.close")
    run = _ticket_run(tenant_a)
    advance_run(run.run_id, "w1")
    original = Action.objects.get(run=run)
    undo = compensate(original, "opened by mistake", actor="user:alice")
    assert undo.tool == "tickets.close" and undo.params == f'{{"ticket":"{original.external_id}"}}'
    assert dispatch_standalone(undo.action_id).status == S.CONFIRMED
    [task] = box.tasks()
    assert task["status"] == "closed"


def test_definitions_are_append_only(tenant_a: Tenant) -> None:
    first = define_tickets(tenant_a, "http://127.0.0.1:9")
    assert define_tickets(tenant_a, "http://127.0.0.1:9").pk == first.pk  # unchanged: no version
    with pytest.raises(ValueError):
        first.save()
    with pytest.raises(ValueError):
        first.delete()
    assert ToolDefinition.objects.filter(tenant=tenant_a, name="tickets.create").count() == 1
    assert tickets("http://x")[1]["name"] == "tickets.create"


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_a_service_answering_json_nested_too_deep_is_unknown_not_a_crash(
    serve: Any, tenant_a: Tenant, depth: int
) -> None:
    """A 2xx whose body is JSON nested deeper than Python's parser goes (RecursionError,
    not ValueError: it escaped the tool as a step failure, leaving the classification to
    chance) is a success without readable proof — `unknown`, settled by the tool's
    contract — and a lookup that answers so is no answer."""
    import uuid

    from tests.httpservers import answer_with

    deep = b"[" * depth + b"]" * depth
    server = serve(answer_with(200, deep))
    define_tickets(tenant_a, server.url)
    tool = get_tool("tickets.create", tenant_a.pk)
    result = tool.call('{"title":"t"}', key="k-deep", fence=1, run_id=str(uuid.uuid4()))
    assert (result.outcome, result.external_id) == ("unknown", "")
    assert "success without JSON" in result.detail
    found = tool.lookup("k-deep", run_id=str(uuid.uuid4()))
    assert found.found is None and "without JSON" in found.detail
    assert [r["method"] for r in server.requests] == ["POST", "GET"]


def _nested(depth: int) -> bytes:
    """A tool service's answer whose id is at the top and whose `x` nests `depth` levels."""
    return b'{"id":"t-1","x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_a_service_answer_may_nest_64_levels_like_any_json_holdpoint_keeps(
    serve: Any, tenant_a: Tenant
) -> None:
    """64 levels (MAX_DEPTH, the API's limit) is an answer like any other; one level more
    is a success without usable proof, with the reason in the detail a reviewer reads."""
    import uuid

    from tests.httpservers import answer_with

    for depth, outcome in ((64, "applied"), (65, "unknown")):
        server = serve(answer_with(200, _nested(depth)))
        define_tickets(tenant_a, server.url)
        tool = get_tool("tickets.create", tenant_a.pk)
        result = tool.call('{"title":"t"}', key=f"k-{depth}", fence=1, run_id=str(uuid.uuid4()))
        assert result.outcome == outcome, depth
    assert "nested deeper than 64 levels" in result.detail


def test_an_answer_too_deep_to_store_is_unknown_not_a_step_failure(
    serve: Any, tenant_a: Tenant
) -> None:
    """Python parses JSON a little deeper than it can encode it again: an answer ~940 deep
    was read as proof, then the step's commit raised RecursionError storing it — a step
    failure with the action left `sent`, retried until a person was asked (the window moves
    with the stack's depth, so every depth around it is tried)."""
    from tests.httpservers import answer_with

    _exempt(tenant_a)
    for depth in range(880, 1001, 15):
        server = serve(answer_with(200, _nested(depth)))
        define_tickets(tenant_a, server.url)
        run = _ticket_run(tenant_a, title=f"deep {depth}")
        advance_run(run.run_id, "w1")
        action = Action.objects.get(run=run)
        assert action.status == S.UNKNOWN, (depth, action.status)
        assert "nested deeper than 64 levels" in action.last_error, depth


def test_a_lookup_sends_the_definitions_extra_headers(serve: Any, tenant_a: Tenant) -> None:
    """A service that needs the definition's extra headers (here X-Team) to answer the send
    needs them to answer the lookup: the lookup sent only Holdpoint-Run and the credential,
    so against such a service every lookup failed, and an action whose outcome was unknown
    went to a person though the service could have told."""
    import uuid

    from tests.httpservers import answer_with

    service = serve(answer_with(200, b'[{"id": "t-9"}]'))
    define_tickets(tenant_a, service.url)
    looked = get_tool("tickets.create", tenant_a.pk).lookup("k-1", run_id=str(uuid.uuid4()))
    assert (looked.found, looked.external_id) == (True, "t-9")
    [asked] = service.requests
    assert asked["path"] == "/tasks?key=k-1" and asked["headers"]["x-team"] == "ops"


@pytest.mark.parametrize(
    ("answer", "found", "applied"),
    [
        (b"[]", False, False),
        (b'[{"id": 7}]', True, True),
        (b'[{"id": "t-1"}]', True, True),
        # Something is there, but not an id: no answer, never "not found" (which would let
        # the action be sent again) nor an id made of Python's text of it.
        (b'[{"id": null}]', None, False),
        (b'[{"id": ""}]', None, False),
        (b'[{"id": {"inner": 1}}]', None, False),
        (b'[{"id": [1]}]', None, False),
        (b'[{"id": true}]', None, False),
    ],
)
def test_only_a_number_or_a_non_empty_string_is_an_id(
    serve: Any, tenant_a: Tenant, answer: bytes, found: bool | None, applied: bool
) -> None:
    """What the definition's JSONPath finds must identify the external object, in a
    lookup's answer as in a send's (`result.external_id`)."""
    import uuid

    from tests.httpservers import answer_with

    lookup_answer = serve(answer_with(200, answer))
    define_tickets(tenant_a, lookup_answer.url)
    tool = get_tool("tickets.create", tenant_a.pk)
    looked = tool.lookup("k-1", run_id=str(uuid.uuid4()))
    assert looked.found is found
    if found:
        assert looked.external_id == str(json.loads(answer)[0]["id"])
    elif found is None:
        assert "not an id" in looked.detail

    body = json.loads(answer)  # the send's answer: the object alone
    if body:
        send_answer = serve(answer_with(200, json.dumps(body[0]).encode()))
        define_tickets(tenant_a, send_answer.url)
        tool = get_tool("tickets.create", tenant_a.pk)
        sent = tool.call('{"title":"t"}', key="k-2", fence=1, run_id=str(uuid.uuid4()))
        assert sent.outcome == ("applied" if applied else "unknown")


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        # JSON's own values are kept as they came: a 64-bit id (Discord's and Twitter's
        # snowflakes) is past canonical JSON's ±2**53, but the journal holds no result.
        (b'{"id": "t-1", "snowflake": 18446744073709551615}', {"snowflake": 2**64 - 1}),
        # What no column takes: NaN and Infinity as their text, a NUL and a lone surrogate
        # (in a key too) as U+FFFD.
        (b'{"id": "t-1", "ratio": NaN, "max": -Infinity}', {"ratio": "NaN", "max": "-Infinity"}),
        (
            b'{"id": "t-1", "note": "a\\u0000b", "k\\ud800": "\\udc00", "ok": "\\ud83d\\ude00"}',
            {"note": "a\ufffdb", "k\ufffd": "\ufffd", "ok": "\U0001f600"},
        ),
        # A lone low half, with no high half anywhere in the answer.
        (b'{"id": "t-1", "note": "\\udc00 alone"}', {"note": "\ufffd alone"}),
        # An escaped backslash before a "u" starts no escape: kept as it came.
        (b'{"id": "t-1", "path": "C:\\\\u0000\\\\ud800"}', {"path": "C:\\u0000\\ud800"}),
    ],
)
def test_an_answer_holding_what_canonical_json_refuses_is_confirmed_and_kept_storable(
    serve: Any, tenant_a: Tenant, answer: bytes, kept: dict[str, Any]
) -> None:
    """The service applied the effect and answered with its proof, but also with a value no
    column takes (NaN or Infinity, which Python's parser reads; a NUL, which PostgreSQL's
    JSON refuses; a lone surrogate, which UTF-8 cannot hold): the step's commit that stores
    the answer failed after the effect — a step failure with the action left `sent`, its
    replay answered the same, until a person was asked. The proof confirms it now; those
    values are kept as text, everything else exactly."""
    from tests.httpservers import answer_with

    _exempt(tenant_a)
    server = serve(answer_with(200, answer))
    define_tickets(tenant_a, server.url)
    run = _ticket_run(tenant_a, title="big ids")
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert (action.status, action.external_id) == (S.CONFIRMED, "t-1"), action.last_error
    result = action.result if isinstance(action.result, dict) else json.loads(action.result)
    assert {k: result[k] for k in kept} == kept
    assert [r["method"] for r in server.requests] == ["POST"]  # sent once, not replayed


def test_a_jsonpath_regular_expression_reads_a_hostile_answer_at_once(
    serve: Any, tenant_a: Tenant
) -> None:
    """A definition's `search()` over a service's answer (runtime.jsonpaths): on the
    library's backtracking engine it held the worker for days; on RE2 it finds the id at
    once."""
    import uuid

    from tests.httpservers import answer_with
    from tests.runtime.test_jsonpaths import HOSTILE, SLOW, finishes

    server = serve(answer_with(200, json.dumps(HOSTILE).encode()))
    lookup = {"method": "GET", "url": f"{server.url}/t?key={{idempotency_key}}", "found": SLOW}
    define_tickets(tenant_a, server.url, lookup=lookup, result={"external_id": SLOW})
    tool = get_tool("tickets.create", tenant_a.pk)
    looked = finishes(lambda: tool.lookup("k-1", run_id=str(uuid.uuid4())))
    assert (looked.found, looked.external_id) == (True, "2")
    sent = finishes(
        lambda: tool.call('{"title":"t"}', key="k-2", fence=1, run_id=str(uuid.uuid4()))
    )
    assert (sent.outcome, sent.external_id) == ("applied", "2")


def test_a_pattern_that_backtracks_refuses_the_agents_params_at_once(
    tenant_a: Tenant, agent_a: Persona
) -> None:
    """The agent's view of tests/runtime/test_paramcheck.py's hang: 422 `invalid_params`
    naming the field, and nothing prepared."""
    from tests.api import post, problem

    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "pattern": "^(a|a)+$"}},
        "required": ["title"],
    }
    define_tickets(tenant_a, "http://127.0.0.1:8765", schema=schema)
    _exempt(tenant_a)
    run = create_run(
        tenant_a, "ticketing", {}, actor="agent:a", external=True, executor_account=agent_a.user
    )
    fence = protocol.take(run, "agent-1", 30, who="agent:a").fence
    body = {"fence": fence, "tool": "tickets.create", "params": {"title": "a" * 60 + "!"}}
    refused = problem(
        post(agent_a.api(), f"runs/{run.run_id}/actions/", body), 422, "invalid_params"
    )
    assert refused["errors"] == {"title": ['"' + "a" * 60 + '!" does not match "^(a|a)+$"']}
    assert not Action.objects.filter(run=run).exists()


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, b"applied\x00, no JSON", S.MANUAL_REVIEW),  # unknown, and none can tell
        (422, b"refused\x00", S.FAILED),  # refused
    ],
)
def test_an_answer_holding_a_nul_byte_outside_json_is_recorded(
    serve: Any, tenant_a: Tenant, status: int, body: bytes, outcome: str
) -> None:
    """An answer that is not JSON is kept as text in the action's last error (what the
    service said). A NUL byte in it — PostgreSQL's text refuses it — failed the write of
    the outcome after the request: a step failure, the action left `sent`, the same again
    on every retry. The text keeps it as U+FFFD."""
    from tests.httpservers import answer_with

    _exempt(tenant_a)
    server = serve(answer_with(status, body))
    define_tickets(tenant_a, server.url, mode="none")
    run = _ticket_run(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == outcome, (action.status, action.last_error)
    assert "\ufffd" in action.last_error


@pytest.mark.parametrize("spelled", ["hosted", "mcp", "undo", "undo again"])
def test_a_client_key_cannot_take_a_key_holdpoint_derives_for_another_run(
    tenant_a: Tenant, agent_a: Persona, sandbox_factory: Callable[[str], Sandbox], spelled: str
) -> None:
    """Keys are unique per tenant. An agent's `idempotency_key` spelled as another run's
    derived key (run id, goal rev, step and visit are all on the API) took it first: the
    other run's own prepare then failed on the unique key, step after step, until the run
    failed. Another run's keys — its steps', its MCP calls', a compensation's — are refused
    (422 `idempotency_key_reused`); nothing is stored."""
    from tests.api import post, problem

    box = sandbox_factory("key")
    define_tickets(tenant_a, box.url)
    _exempt(tenant_a)
    victim = _ticket_run(tenant_a)
    derived = actionkeys.idempotency_key(victim, "file_ticket", 1)
    key = {
        "hosted": derived,
        "mcp": f"mcp:{victim.run_id}:{'0' * 64}:1",
        "undo": "ticket-7:undo",  # a compensation's: the action keyed ticket-7's undo
        "undo again": "ticket-7:undo:2",  # the second asked for, after the first was rejected
    }[spelled]
    run = create_run(
        tenant_a, "ticketing", {}, actor="agent:a", external=True, executor_account=agent_a.user
    )
    fence = protocol.take(run, "agent-1", 30, who="agent:a").fence
    body = {"fence": fence, "tool": "tickets.create", "params": {"title": "x"}}
    refused = post(agent_a.api(), f"runs/{run.run_id}/actions/", {**body, "idempotency_key": key})
    why = "compensations" if spelled.startswith("undo") else "another run"
    assert why in problem(refused, 422, "idempotency_key_reused")["detail"]
    assert not Action.objects.filter(run=run).exists()
    # Its own run's spelling is the agent's to use; the victim files its ticket.
    own = actionkeys.idempotency_key(run, "api", 9)
    assert (
        post(
            agent_a.api(), f"runs/{run.run_id}/actions/", {**body, "idempotency_key": own}
        ).status_code
        == 201
    )
    advance_run(victim.run_id, "w1")
    [ticket] = Action.objects.filter(run=victim)
    assert (ticket.idempotency_key, ticket.status) == (derived, S.CONFIRMED)
