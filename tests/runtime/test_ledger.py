"""The side-effect ledger against the real sandbox over a real socket (invariants 1–3)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from runtime.dispatch import reconcile_action
from runtime.errors import InvalidParams, InvalidTransition
from runtime.executor import advance_run
from runtime.gates import _approval_checks, register_approval_check
from runtime.graphs import Complete, Graph, register, registry
from runtime.lifecycle import create_run, revise_goal
from runtime.models import Action, ActionStatus, Checkpoint, Run, RunStatus, Tenant
from runtime.outcomes import resolve
from runtime.tools import get_tool
from tests.runtime.helpers import events, make_due
from tests.sandbox import Sandbox

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
EXPECTED = {
    ("/orders", "POST", "request_field_required_added"),
    ("/orders/{order_id}", "GET", "type_changed"),
    ("/users", "GET", "enum_narrowed"),
}
Factory = Callable[[str], Sandbox]


def _state(run: Run) -> dict[str, Any]:
    from runtime.artifacts import resolve as load

    run.refresh_from_db()
    return load(run.tenant_id, Checkpoint.objects.get(run=run, rev=run.checkpoint_rev).state)


def _review(tenant: Tenant) -> Run:
    return create_run(tenant, "api-review", GOAL, actor="user:alice")


def test_api_review_creates_exactly_one_task_with_the_three_risks(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("key")
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    state = _state(run)
    assert {(r["path"], r["method"], r["kind"]) for r in state["report"]["risks"]} == EXPECTED
    action = Action.objects.get(run=run)
    tasks = box.tasks()
    assert len(tasks) == 1 and tasks[0]["idempotency_key"] == action.idempotency_key
    assert action.status == ActionStatus.CONFIRMED and action.external_id == tasks[0]["id"]
    assert state["review_task"]["id"] == tasks[0]["id"]
    assert "3 API compatibility risk(s)" in tasks[0]["title"]
    assert tasks[0]["fence"] == 1 and tasks[0]["run_id"] == str(run.run_id)


@pytest.fixture
def hold_tasks() -> Iterator[None]:
    """A tenant policy stand-in: tasks.create needs approval (the approvals app's job)."""
    check = lambda tool, params, run: tool.name == "tasks.create"  # noqa: E731
    register_approval_check(check)
    yield
    _approval_checks.remove(check)


def test_revision_reuses_orders_evidence_drops_users_and_cancels_the_task(
    tenant_a: Tenant, sandbox_factory: Factory, hold_tasks: None
) -> None:
    box = sandbox_factory("key")
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    held = Action.objects.get(run=run)
    assert held.status == ActionStatus.AWAITING_APPROVAL
    assert Run.objects.get(pk=run.pk).waiting_for["action_id"] == str(held.action_id)

    narrowed = {**GOAL, "scope": ["/orders"], "create_review_task": False}
    revise_goal(run, narrowed, expected_goal_rev=1, actor="user:alice")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    state = _state(run)
    assert {(r["path"], r["method"], r["kind"]) for r in state["report"]["risks"]} == {
        t for t in EXPECTED if t[0].startswith("/orders")
    }
    assert state["dropped"] == ["shop-v1..shop-v2:/users"]
    held.refresh_from_db()
    assert held.status == ActionStatus.CANCELLED and box.tasks() == []
    keys = sorted(run.recorded_calls.values_list("key", flat=True))
    assert keys == [
        "analysis:shop-v1..shop-v2:/orders",
        "analysis:shop-v1..shop-v2:/users",
        "spec:shop-v1",
        "spec:shop-v2",
    ]


FICKLE: Counter[str] = Counter()
fickle = Graph(
    "fickle", version="1", tools=("tasks.create",), max_failures=3, retry_base=0.01, retry_max=0.02
)


@fickle.step(start=True)
def fickle_step(ctx: Any) -> Any:
    FICKLE[str(ctx.run_id)] += 1
    attempt = FICKLE[str(ctx.run_id)]
    title = ctx.goal.get("title") or f"attempt {attempt}"
    ctx.act("tasks.create", {"title": title, **ctx.goal.get("extra", {})})
    if attempt == 1 and ctx.goal.get("crash_after_act"):
        raise RuntimeError("crashed after the effect")
    return Complete()


register(fickle)


def test_same_key_with_different_params_is_refused_never_sent(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "fickle", {"crash_after_act": True}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "retrying"
    make_due(run)
    assert advance_run(run.run_id, "w1").outcome == "needs_attention"
    run.refresh_from_db()
    assert "different params under the same idempotency key" in run.attention_reason
    assert [t["title"] for t in box.tasks()] == ["attempt 1"]


def test_re_executed_step_gets_the_recorded_outcome_not_a_second_effect(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "fickle", {"crash_after_act": True, "title": "same"}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "retrying"
    make_due(run)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1 and Action.objects.get(run=run).attempts == 1


def test_invalid_params_never_reach_the_service(tenant_a: Tenant, sandbox_factory: Factory) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "fickle", {"title": "", "extra": {"owner": 7}}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "needs_attention"
    run.refresh_from_db()
    assert "do not fit the tasks.create schema" in run.attention_reason
    assert box.tasks() == [] and not Action.objects.filter(run=run).exists()
    with pytest.raises(InvalidParams) as refused:
        get_tool("tasks.create").validate({"title": "", "owner": 7})
    assert set(refused.value.extra["errors"]) == {"title", "params"}


@pytest.mark.parametrize("mode", ["key", "lookup"])
@pytest.mark.parametrize("fault", ["drop_after", "error_after"])
def test_reply_lost_after_applying_is_reconciled_without_duplicate(
    tenant_a: Tenant, sandbox_factory: Factory, mode: str, fault: str
) -> None:
    box = sandbox_factory(mode)
    box.faults(**{fault: 1})
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    tasks = box.tasks()
    assert len(tasks) == 1
    assert action.status == ActionStatus.CONFIRMED and action.external_id == tasks[0]["id"]
    kinds = [p["action_status"] for p in _outcomes(run)]
    assert kinds == ["sent", "unknown", "confirmed"]


def _outcomes(run: Run) -> list[dict[str, Any]]:
    from tests.runtime.helpers import payloads

    return payloads(run, "action_outcome")


def test_mode_none_unknown_goes_to_a_human_never_replayed(
    tenant_a: Tenant, sandbox_factory: Factory, reviewer_a: Any
) -> None:
    box = sandbox_factory("none")
    box.faults(drop_after=1)
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    run.refresh_from_db()
    action = Action.objects.get(run=run)
    assert run.status == RunStatus.NEEDS_RECONCILIATION
    assert action.status == ActionStatus.MANUAL_REVIEW and action.external_id == ""
    assert advance_run(run.run_id, "w1").outcome == "skipped"  # parked for a human
    assert len(box.tasks()) == 1  # applied once, never replayed

    with pytest.raises(InvalidParams):
        resolve(action, "applied", actor="user:alice")  # no proof given
    task_id = box.tasks()[0]["id"]
    resolve(action, "applied", actor="user:alice", external_id=task_id, note="saw it")
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1 and _state(run)["review_task"]["id"] == task_id
    with pytest.raises(InvalidTransition):
        resolve(action, "not_applied", actor="user:alice")
    assert "action_resolved" in events(run)


def test_mode_none_not_applied_is_sent_again_with_the_same_key(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("none")
    box.faults(fail_before=1)
    run = _review(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.MANUAL_REVIEW and box.tasks() == []
    with pytest.raises(InvalidTransition, match="may still be in flight"):
        resolve(action, "not_applied", actor="user:alice")
    Action.objects.filter(pk=action.pk).update(in_flight_until=timezone.now())
    action.refresh_from_db()
    resolve(action, "not_applied", actor="user:alice", note="checked the tracker")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    tasks = box.tasks()
    assert len(tasks) == 1 and tasks[0]["idempotency_key"] == action.idempotency_key


def test_lookup_waits_out_the_in_flight_window_before_concluding_absent(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    """A 503 left nothing behind — but absence is only believed once no sender can land."""
    box = sandbox_factory("lookup")
    box.faults(fail_before=1)
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "retrying"
    run.refresh_from_db()
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.UNKNOWN and box.tasks() == []
    assert run.wake_at is not None and run.wake_at >= action.in_flight_until - timedelta(seconds=1)
    assert advance_run(run.run_id, "w1").outcome == "skipped"  # not before the window ends

    Action.objects.filter(pk=action.pk).update(
        in_flight_until=timezone.now() - timedelta(seconds=1)
    )
    make_due(run)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    tasks = box.tasks()
    assert len(tasks) == 1 and tasks[0]["idempotency_key"] == action.idempotency_key


def test_lookup_finds_a_slow_apply_instead_of_sending_again(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    """The service applies after our timeout: we must find it, not create a second task."""
    from tests import procs

    box = sandbox_factory("lookup")
    box.faults(delay=get_tool("tasks.create").timeout + 1)
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "retrying"  # timed out: unknown, wait
    procs.wait_for(lambda: box.tasks(), timeout=15)  # the slow apply lands
    box.faults(delay=0)
    Action.objects.filter(run=run).update(in_flight_until=timezone.now())
    make_due(run)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    assert len(box.tasks()) == 1
    assert Action.objects.get(run=run).external_id == box.tasks()[0]["id"]


def test_service_down_means_not_sent_and_retry(tenant_a: Tenant, sandbox_factory: Factory) -> None:
    from tests import procs

    box = sandbox_factory("key")
    procs.kill(box.proc)
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "retrying"
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.PREPARED  # certainly not sent
    assert "connect failed" in action.last_error


def test_reconcile_gives_up_after_bounded_attempts(
    tenant_a: Tenant, sandbox_factory: Factory, settings: Any
) -> None:
    from runtime.leases import take_lease
    from tests import procs

    settings.HOLDPOINT_RECONCILE_ATTEMPTS = 3
    box = sandbox_factory("lookup")
    box.faults(fail_before=1)
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "retrying"  # unknown: 503
    procs.kill(box.proc)  # the service is gone: lookups cannot answer
    action = Action.objects.get(run=run)
    lease = take_lease(run.run_id, "w2", ttl=30, runnable_only=False)
    verdicts = [reconcile_action(action, lease.fence, lease.actor).status for _ in range(3)]
    action.refresh_from_db()
    assert verdicts == ["wait", "wait", ActionStatus.MANUAL_REVIEW]
    assert action.status == ActionStatus.MANUAL_REVIEW
    assert "3 reconciliation attempts failed" in action.last_error


def test_sandbox_refuses_a_lower_fence(sandbox_factory: Factory) -> None:
    box = sandbox_factory("key")
    tool = get_tool("tasks.create")
    first = tool.call('{"title":"a"}', key="k1", fence=2, run_id="r")
    stale = tool.call('{"title":"b"}', key="k2", fence=1, run_id="r")
    assert first.outcome == "applied" and stale.outcome == "stale"
    assert [t["idempotency_key"] for t in box.tasks()] == ["k1"]


def test_unknown_tool_and_undeclared_tool_are_refused(tenant_a: Tenant) -> None:
    loose = Graph("loose", version="1", tools=("tasks.close",))

    @loose.step(start=True)
    def go(ctx: Any) -> Any:
        ctx.act("tasks.create", {"title": "x"})
        return Complete()

    register(loose)
    try:
        run = create_run(tenant_a, "loose", {}, actor="t")
        assert advance_run(run.run_id, "w1").outcome == "needs_attention"
        assert "does not declare tasks.create" in Run.objects.get(pk=run.pk).attention_reason
    finally:
        registry.unregister("loose", "1")


looper = Graph("looper", version="1", tools=("tasks.create",))


@looper.step(start=True)
def act_each_visit(ctx: Any) -> Any:
    """The same params on every visit: each visit is a new action, not the first one's proof."""
    ctx.act("tasks.create", {"title": "daily digest"})
    seen = ctx.state.get("visits", 0) + 1
    if seen >= 3:
        return Complete(update={"visits": seen})
    from runtime.graphs import Next

    return Next("act_each_visit", update={"visits": seen})


register(looper)


def test_a_step_that_loops_to_itself_acts_once_per_visit(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    box = sandbox_factory("key")
    run = create_run(tenant_a, "looper", {}, actor="t")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    keys = [t["idempotency_key"] for t in box.tasks()]
    assert len(keys) == 3 and len(set(keys)) == 3
    assert Action.objects.filter(run=run, status=ActionStatus.CONFIRMED).count() == 3


def test_lookup_judges_the_in_flight_window_by_the_database_clock(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    """The window is database time (the sent mark's); a worker whose clock runs ahead of
    the database's must not take "absent now" for "not applied" while the sender may land."""
    import time_machine

    box = sandbox_factory("lookup")
    box.faults(fail_before=1)
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "retrying"
    run.refresh_from_db()
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.UNKNOWN and action.in_flight_until is not None
    with time_machine.travel(action.in_flight_until + timedelta(seconds=60)):
        verdict = reconcile_action(action, run.fence, "worker:w1")
    assert verdict.status == "wait"
    assert Action.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN
    assert box.tasks() == []


@pytest.mark.django_db(transaction=True)
def test_a_resolve_and_a_writer_locking_run_then_action_do_not_deadlock(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    """Every writer of a run's actions locks the run's row, then the action's (a goal
    revision, check_dispatchable, an executor's fenced outcome). A person's resolve locked
    the action first, then the run: with such a writer beside it, each held the row the
    other waited for, and PostgreSQL aborted one of them (deadlock detected) — a reviewer's
    verdict or the writer's work lost to a 500. Both go through now, one after the other."""
    import threading
    import time

    from django.db import connection, connections, transaction

    if connection.vendor != "postgresql":
        pytest.skip("row locks: SQLite has one writer at a time")
    box = sandbox_factory("none")
    box.faults(fail_before=1)
    run = _review(tenant_a)
    advance_run(run.run_id, "w1")
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.MANUAL_REVIEW
    run_locked, errors = threading.Event(), []

    def writer() -> None:  # run, then action, as a revision or a fenced outcome locks them
        try:
            with transaction.atomic():
                Run.objects.select_for_update().get(pk=run.pk)
                run_locked.set()
                deadline = time.monotonic() + 10
                while not _someone_waits() and time.monotonic() < deadline:
                    time.sleep(0.02)
                Action.objects.select_for_update().get(pk=action.pk)
        except Exception as exc:  # noqa: BLE001  (reported by the assertions)
            errors.append(exc)
        finally:
            connections.close_all()

    def _someone_waits() -> bool:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            return bool(cursor.fetchone()[0])

    thread = threading.Thread(target=writer)
    thread.start()
    assert run_locked.wait(timeout=10)
    task_id = "T-by-hand"
    try:
        resolve(action, "applied", actor="user:alice", external_id=task_id)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    thread.join(timeout=30)
    assert errors == []
    action.refresh_from_db()
    assert (action.status, action.external_id) == (ActionStatus.CONFIRMED, task_id)


def test_an_old_revisions_action_found_absent_is_withdrawn_not_left_prepared(
    tenant_a: Tenant, sandbox_factory: Factory
) -> None:
    """A lookup tool's action was left unknown (the tracker answered 503), then the goal
    was revised. The next start applied the revision and reconciled the old action: the
    lookup found nothing, so it went back to `prepared` — for a send no step of the new
    revision would ever make (its keys are the new revision's). It stayed `prepared` for
    ever, counted among the actions waiting to go. Found absent after the run moved on, it
    is withdrawn, as a person's "not applied" and a late not-found withdraw it."""
    box = sandbox_factory("lookup")
    box.faults(fail_before=1)
    run = _review(tenant_a)
    assert advance_run(run.run_id, "w1").outcome == "retrying"  # unknown: 503
    old = Action.objects.get(run=run)
    assert old.status == ActionStatus.UNKNOWN and box.tasks() == []
    revise_goal(Run.objects.get(pk=run.pk), {**GOAL, "scope": ["/orders"]}, 1, actor="user:u")
    Action.objects.filter(pk=old.pk).update(in_flight_until=timezone.now() - timedelta(1))
    make_due(run)
    advance_run(run.run_id, "w1")
    old.refresh_from_db()
    assert old.status == ActionStatus.CANCELLED, (old.status, old.last_error)
    assert "goal was revised" in old.last_error
    assert all(task["idempotency_key"] != old.idempotency_key for task in box.tasks())
