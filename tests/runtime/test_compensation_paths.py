"""Every path that confirms an undo makes its original `compensated`, in the same commit.

Only the undo's sender marked the original, in a commit after the one that confirmed the
undo (`compensation._finish`), and no other path that confirms an undo did it at all: an undo
whose answer was lost and that a person then said had applied was `confirmed`, the tracker's
task was closed, and its original still read `confirmed` — on the run page, over the API —
with nothing left that would ever change it; so did a run executor's reconciliation of an
undo of a run still going, and an external executor's report of one it performed. The
confirmation now writes both (`ledger.transition`), whichever path it comes by: the send, a
reconciliation (the sender's or the run's executor's), a person, an external executor.

And the reverse: an undo that ends without effect (refused by the tracker, or said by a
person not to have applied) leaves the original `confirmed`, its effect in place, and the
undo may be asked for again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest
from django.utils import timezone

from runtime.compensation import compensate, dispatch_standalone
from runtime.errors import InvalidTransition
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Tenant
from tests.approvals.conftest import GOAL
from tests.conftest import Persona
from tests.httpservers import Behaviour, Server, answer_with
from tests.runtime.helpers import payloads
from tests.sandbox import Sandbox

S = ActionStatus
PASSED_ON = ("authorization", "content-type", "idempotency-key", "holdpoint-fence", "holdpoint-run")


def applied_then_error(box: Sandbox) -> Behaviour:
    """A tracker whose answers are lost: each request is passed on to `box`, which applies
    it, and answered 500 — what the sandbox's `error_after` does to a create, for a close."""

    def behaviour(handler: BaseHTTPRequestHandler, server: Server) -> None:
        seen = server.requests[-1]
        headers = {k: v for k, v in seen["headers"].items() if k in PASSED_ON}
        httpx.request(
            seen["method"], box.url + seen["path"], content=seen["body"], headers=headers
        ).raise_for_status()
        answer_with(500, b'{"error": "internal error (after applying)"}')(handler, server)

    return behaviour


def confirmed_task(tenant: Tenant) -> Action:
    """A completed api-review run's confirmed tasks.create, sent to the current tracker."""
    run = create_run(tenant, "api-review", GOAL, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    original = Action.objects.get(run=run)
    assert original.status == S.CONFIRMED
    return original


def undo_answer_lost(
    original: Action, box: Sandbox, serve: Callable[[Behaviour], Server], settings: Any
) -> Action:
    """The undo is asked for and sent through a tracker that loses the answer: it closed the
    task, the undo is `unknown`, and its original — nothing proves it undone — `confirmed`."""
    settings.HOLDPOINT_TASKS_URL = serve(applied_then_error(box)).url
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").action_id)
    assert undo.status == S.UNKNOWN
    assert [t["status"] for t in box.tasks()] == ["closed"]
    original.refresh_from_db()
    assert original.status == S.CONFIRMED
    assert compensate(original, "again", actor="user:ada") == undo  # the one under way
    return undo


def compensated_by(original: Action, undo: Action) -> None:
    """What a user checks: the original reads `compensated`, the journal says by which undo,
    and no further undo can be asked for."""
    original.refresh_from_db()
    assert original.status == S.COMPENSATED
    marked = [
        p
        for p in payloads(original.run_id, "action_outcome")
        if p["action_status"] == S.COMPENSATED
    ]
    assert [(p["action_id"], p["compensated_by"]) for p in marked] == [
        (str(original.action_id), str(undo.action_id))
    ]
    with pytest.raises(InvalidTransition):
        compensate(original, "once more", actor="user:ada")
    assert Action.objects.filter(compensates=original).count() == 1


def resolved(person: Persona, undo: Action, outcome: str, **said: str) -> dict[str, Any]:
    """A person's resolution of the undo over the API: the action as answered."""
    answer = person.api().post(
        f"/api/v1/actions/{undo.action_id}/resolve/", {"outcome": outcome, **said}, format="json"
    )
    assert answer.status_code == 200, answer.content
    action: dict[str, Any] = answer.json()
    return action


def test_the_undos_send_compensates_the_original(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    box = sandbox_factory("key")
    original = confirmed_task(tenant_a)
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").action_id)
    assert undo.status == S.CONFIRMED
    assert [t["status"] for t in box.tasks()] == ["closed"]
    compensated_by(original, undo)


def test_an_undo_whose_answer_was_lost_is_reconciled_and_compensates_the_original(
    tenant_a: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
    settings: Any,
) -> None:
    """The next ring of its sender (the tracker answering again) reconciles the `unknown`
    undo by its contract — a replay with its key — and that confirmation is the original's."""
    box = sandbox_factory("key")
    original = confirmed_task(tenant_a)
    undo = undo_answer_lost(original, box, serve, settings)

    settings.HOLDPOINT_TASKS_URL = box.url  # the tracker answers again
    undo = dispatch_standalone(undo.action_id)
    assert undo.status == S.CONFIRMED and undo.reconcile_attempts == 1
    closes = [r for r in box.requests() if r["path"].endswith("/close")]
    assert {r["idempotency_key"] for r in closes} == {undo.idempotency_key}
    compensated_by(original, undo)


@pytest.fixture
def for_a_person(
    tenant_a: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
    settings: Any,
) -> tuple[Sandbox, Action, Action]:
    """The tracker, a confirmed task and its undo whose answer was lost, then lost again when
    reconciled, with no attempt left: the undo is a person's to settle."""
    box = sandbox_factory("key")
    original = confirmed_task(tenant_a)
    undo = undo_answer_lost(original, box, serve, settings)
    settings.HOLDPOINT_RECONCILE_ATTEMPTS = 1
    undo = dispatch_standalone(undo.action_id)
    assert undo.status == S.MANUAL_REVIEW
    return box, original, undo


def _lossy(box: Sandbox, lose: list[bool]) -> Behaviour:
    """`box` behind a proxy that loses its answers (500, the request applied) while
    `lose[0]`, and passes them on after."""

    def behaviour(handler: BaseHTTPRequestHandler, server: Server) -> None:
        if lose[0]:
            applied_then_error(box)(handler, server)
            return
        seen = server.requests[-1]
        headers = {k: v for k, v in seen["headers"].items() if k in PASSED_ON}
        sent = httpx.request(
            seen["method"], box.url + seen["path"], content=seen["body"], headers=headers
        )
        answer_with(sent.status_code, sent.content)(handler, server)

    return behaviour


def tickets_with_a_lossy_close(
    tenant: Tenant, box: Sandbox, serve: Callable[[Behaviour], Server], close_mode: str = "key"
) -> list[bool]:
    """tickets.create (key) and its undo tickets.close (`close_mode`), held by no policy, the
    close sent through a proxy that loses the tracker's answers while the returned flag's
    first item is True."""
    from approvals.models import ApprovalPolicy
    from runtime.tooldefs import define_many
    from tests.tooldefs import tickets

    lose = [True]
    close, create = tickets(box.url, "key")
    close["dedup"] = {"mode": close_mode}
    close["request"]["url"] = serve(_lossy(box, lose)).url + "/tasks/{ticket}/close"
    define_many(tenant, [close, create], "user:admin")
    for tool in ("tickets.create", "tickets.close"):
        ApprovalPolicy.objects.create(tenant=tenant, name=tool, tool=tool, required=False)
    return lose


TICKET_THEN_ASK = "ticket-then-ask"


@pytest.fixture
def ticket_then_ask() -> Iterator[Any]:
    """A graph that files a ticket and then waits for input: a run still going."""
    from runtime.graphs import Complete, Graph, Wait, register, registry

    graph = Graph(TICKET_THEN_ASK, version="1")

    @graph.step(start=True)
    def file(ctx: Any) -> Any:
        ctx.act("tickets.create", {"title": ctx.goal["title"]}, reason="the goal")
        return Wait("input", then="finish", prompt="Anything else?")

    @graph.step
    def finish(ctx: Any) -> Any:
        return Complete()

    register(graph)
    yield graph
    registry.unregister(graph.name, "1")


def test_the_runs_executor_reconciling_the_undo_compensates_the_original(
    tenant_a: Tenant,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
    ticket_then_ask: Any,
) -> None:
    """An action of a run still going (waiting for input) is undone; the undo's answer is
    lost. The run's next execution reconciles every unsettled action of the run first —
    the undo with them, replayed with its key — and that confirmation is the original's:
    before, the executor's reconciliation left the original `confirmed`."""
    from runtime.lifecycle import provide_input

    box = sandbox_factory("key")
    lose = tickets_with_a_lossy_close(tenant_a, box, serve)
    run = create_run(tenant_a, ticket_then_ask.name, {"title": "probe"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    original = Action.objects.get(run=run)
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").pk)
    assert undo.status == S.UNKNOWN and [t["status"] for t in box.tasks()] == ["closed"]

    lose[0] = False  # the tracker's answers arrive again
    run.refresh_from_db()
    provide_input(run, {"more": "no"}, run.checkpoint_rev, actor="user:t")
    assert advance_run(run.run_id, "w2").outcome == "completed"
    undo.refresh_from_db()
    assert undo.status == S.CONFIRMED and undo.reconcile_attempts == 1
    compensated_by(original, undo)


def test_an_undo_waiting_for_a_person_does_not_stop_the_run_it_undoes_for(
    tenant_a: Tenant,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
    ticket_then_ask: Any,
) -> None:
    """An action of a run still going (waiting for input) is undone by a close that cannot
    deduplicate, and the close's answer is lost: its sender hands the undo to a person. No
    step drives an undo and no run waits for one — the run goes on to its end. Before, the
    run parked in `needs_reconciliation` on the undo, the next time and every time its
    executor ran it, until someone resolved an action that was not its own."""
    from runtime.lifecycle import provide_input
    from runtime.models import Run, RunStatus

    box = sandbox_factory("key")
    tickets_with_a_lossy_close(tenant_a, box, serve, "none")
    run = create_run(tenant_a, ticket_then_ask.name, {"title": "probe"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    original = Action.objects.get(run=run)
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").pk)
    assert undo.status == S.MANUAL_REVIEW and [t["status"] for t in box.tasks()] == ["closed"]

    run.refresh_from_db()
    provide_input(run, {"more": "no"}, run.checkpoint_rev, actor="user:t")
    assert advance_run(run.run_id, "w2").outcome == "completed"
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.waiting_for is None
    undo.refresh_from_db()
    assert undo.status == S.MANUAL_REVIEW  # still a person's, on the Reconcile page
    assert [r["path"].endswith("/close") for r in box.requests()].count(True) == 1  # no replay

    resolved(reviewer_a, undo, "applied", external_id=box.tasks()[0]["id"], note="closed")
    compensated_by(original, undo)
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def test_an_undo_waiting_for_a_person_does_not_hold_a_run_a_person_woke(
    tenant_a: Tenant,
    reviewer_a: Persona,
    sandbox_factory: Callable[[str], Sandbox],
    serve: Callable[[Behaviour], Server],
) -> None:
    """Two things a person must settle on one run still going: its own action (its answer
    lost, a tool with neither key nor lookup: the run waits in `needs_reconciliation`) and
    an undo of an earlier action. Resolving the run's own action wakes the run although the
    undo still waits for a person; before, the undo kept the run parked."""
    from approvals.models import ApprovalPolicy
    from runtime.graphs import Complete, Graph, Wait, register, registry
    from runtime.lifecycle import provide_input
    from runtime.models import Run, RunStatus
    from runtime.tooldefs import define_many
    from tests.tooldefs import tickets

    box = sandbox_factory("key")
    tickets_with_a_lossy_close(tenant_a, box, serve, "none")
    lose_create = [False]
    close, create = tickets(box.url, "key")
    create.update(name="tickets.file", compensation="")
    del create["lookup"], create["compensation_param"]
    create["dedup"] = {"mode": "none"}
    create["request"]["url"] = serve(_lossy(box, lose_create)).url + "/tasks"
    define_many(tenant_a, [create], "user:admin")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="f", tool="tickets.file", required=False)
    graph = Graph("ticket-ask-file", version="1")

    @graph.step(start=True)
    def first(ctx: Any) -> Any:
        ctx.act("tickets.create", {"title": "one"}, reason="the goal")
        return Wait("input", then="second", prompt="More?")

    @graph.step
    def second(ctx: Any) -> Any:
        ctx.act("tickets.file", {"title": "two"}, reason="the goal")
        return Complete()

    register(graph)
    try:
        run = create_run(tenant_a, graph.name, {}, actor="t")
        assert advance_run(run.run_id, "w1").outcome == "waiting"
        original = Action.objects.get(run=run)
        undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").pk)
        assert undo.status == S.MANUAL_REVIEW  # a close that cannot deduplicate, answer lost

        lose_create[0] = True
        run.refresh_from_db()
        provide_input(run, {"more": "yes"}, run.checkpoint_rev, actor="user:t")
        advance_run(run.run_id, "w2")
        own = Action.objects.get(run=run, tool="tickets.file")
        run.refresh_from_db()
        assert own.status == S.MANUAL_REVIEW
        assert run.status == RunStatus.NEEDS_RECONCILIATION
        assert run.waiting_for["action_id"] == str(own.action_id)

        past = timezone.now() - timedelta(minutes=10)
        Action.objects.filter(pk=own.pk).update(in_flight_until=past)  # its sender is done
        filed = [t for t in box.tasks() if t["title"] == "two"][0]
        resolved(reviewer_a, own, "applied", external_id=filed["id"], note="it is there")
        assert Run.objects.get(pk=run.pk).status == RunStatus.QUEUED
        assert advance_run(run.run_id, "w3").outcome == "completed"
        assert Action.objects.get(pk=undo.pk).status == S.MANUAL_REVIEW  # still the person's
    finally:
        registry.unregister(graph.name, "1")


def _agent_tickets() -> list[dict[str, Any]]:
    """A tracker the agent performs itself (executor `client`), with its own undo."""
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    create = {"name": "agent.tickets.create", "effect": "write", "schema": schema}
    close = {"name": "agent.tickets.close", "effect": "write"}
    close["schema"] = {"type": "object", "properties": {"ticket": {"type": "string"}}}
    create.update(compensation="agent.tickets.close", compensation_param="ticket")
    for tool in (close, create):
        tool.update(executor="client", dedup={"mode": "key"}, timeout_seconds=3)
    return [close, create]


def test_an_external_executor_reporting_the_undo_confirmed_compensates_the_original(
    tenant_a: Tenant, agent_a: Persona
) -> None:
    """The run's external executor performs the undo of a tool it performs itself, and
    reports it over the API (dispatch, then outcome): that report is the original's too."""
    from approvals.models import ApprovalPolicy
    from runtime.tooldefs import define_many
    from tests.api import new_run, ok, post, take_lease

    define_many(tenant_a, _agent_tickets(), "user:admin")
    for tool in ("agent.tickets.create", "agent.tickets.close"):
        ApprovalPolicy.objects.create(tenant=tenant_a, name=tool, tool=tool, required=False)
    agent = agent_a.api()
    run_id = new_run(agent)["run_id"]
    fence = take_lease(agent, run_id)

    def performed(action_id: Any, external_id: str) -> dict[str, Any]:
        ok(post(agent, f"actions/{action_id}/dispatch/", {"fence": fence}))
        said = {"fence": fence, "outcome": "confirmed", "external_id": external_id}
        answer: dict[str, Any] = ok(post(agent, f"actions/{action_id}/outcome/", said))
        return answer

    body = {"fence": fence, "tool": "agent.tickets.create", "params": {"title": "t"}}
    created = ok(post(agent, f"runs/{run_id}/actions/", {**body, "reason": "goal"}), 201)
    assert performed(created["action_id"], "T-9")["status"] == "confirmed"
    original = Action.objects.get(pk=created["action_id"])
    undo = compensate(original, "by mistake", actor="user:ada")
    assert performed(undo.action_id, "T-9")["status"] == "confirmed"
    compensated_by(original, undo)


def test_a_person_saying_the_undo_applied_compensates_the_original(
    reviewer_a: Persona, for_a_person: tuple[Sandbox, Action, Action]
) -> None:
    """The reviewer sees the task closed in the tracker and says so over the API; before,
    the undo became `confirmed` and the original stayed `confirmed` for good."""
    box, original, undo = for_a_person

    task = box.tasks()[0]
    said = {"external_id": task["id"], "note": "closed in the tracker"}
    assert resolved(reviewer_a, undo, "applied", **said)["status"] == "confirmed"
    compensated_by(original, undo)
    seen = reviewer_a.api().get(f"/api/v1/actions/{original.action_id}/")
    assert seen.json()["status"] == "compensated"


def test_a_person_saying_the_undo_did_not_apply_leaves_the_effect_and_another_may_be_asked(
    reviewer_a: Persona, for_a_person: tuple[Sandbox, Action, Action]
) -> None:
    """(A person who says so wrongly — the task is closed here — is the person's call; what
    follows from the word is what is checked.) The undo's run is finished, so no step would
    send it again: withdrawn, and the effect stays for a new undo."""
    _, original, undo = for_a_person
    past = timezone.now() - timedelta(seconds=1)
    Action.objects.filter(pk=undo.pk).update(in_flight_until=past)  # its sender is done

    assert resolved(reviewer_a, undo, "not_applied")["status"] == "cancelled"
    original.refresh_from_db()
    assert original.status == S.CONFIRMED
    again = compensate(original, "try again", actor="user:ada")
    assert again.pk != undo.pk and again.idempotency_key == f"{original.idempotency_key}:undo:2"


def test_an_undo_the_tracker_refused_leaves_the_effect_and_another_may_be_asked(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """The tracker no longer has the task (someone deleted it there: 404, refused for good):
    the undo is `failed`, the original `confirmed`, and a new undo may be asked for."""
    box = sandbox_factory("key")
    original = confirmed_task(tenant_a)
    assert box.reset()  # the tracker forgets its tasks
    failed = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").action_id)
    assert failed.status == S.FAILED and "404" in failed.last_error
    original.refresh_from_db()
    assert original.status == S.CONFIRMED

    again = compensate(original, "try again", actor="user:ada")
    assert again.pk != failed.pk and again.status == S.PREPARED
    assert again.idempotency_key == f"{original.idempotency_key}:undo:2"


def test_the_migration_mends_an_original_older_code_left_confirmed_under_its_undo(
    tenant_a: Tenant, sandbox_factory: Callable[[str], Sandbox]
) -> None:
    """What a sender killed between the two commits, or a person's resolution of the undo,
    left behind (made here by moving the row back): runtime 0034 marks the original
    compensated and journals it in the run's stream, whose chain still verifies; run again,
    it finds nothing more to do."""
    from importlib import import_module
    from types import SimpleNamespace

    from django.apps import apps
    from django.db import connection

    from audit.journal import run_stream
    from audit.models import JournalEntry
    from audit.verification import verify_stream

    migration = import_module("runtime.migrations.0034_compensated_originals")
    sandbox_factory("key")
    original = confirmed_task(tenant_a)
    undo = dispatch_standalone(compensate(original, "by mistake", actor="user:ada").action_id)
    assert undo.status == S.CONFIRMED
    Action.objects.filter(pk=original.pk).update(status=S.CONFIRMED)  # as older code left it
    untouched = confirmed_task(tenant_a)  # confirmed, never undone: not the migration's

    stream = run_stream(original.run_id)
    mended = JournalEntry.objects.filter(stream=stream, actor=migration.ACTOR)
    for _ in range(2):  # again: nothing more
        migration.mend(apps, SimpleNamespace(connection=connection))
        original.refresh_from_db()
        assert original.status == S.COMPENSATED
        assert [
            (e.type, e.payload["action_status"], e.payload["compensated_by"]) for e in mended
        ] == [("action_outcome", "compensated", str(undo.action_id))]
    assert verify_stream(stream) is None
    untouched.refresh_from_db()
    assert untouched.status == S.CONFIRMED
