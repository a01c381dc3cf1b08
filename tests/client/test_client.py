"""The Python client (holdpoint_client) against a real server over a real socket.

`live_server` serves the API from a thread of this process on a transactional database, so
what the client reads and writes is what the ORM sees. Network faults are made in the
client's own transport (it forwards to a real one and loses a reply or a connection on
cue) — never in the database, the queue or the clock.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.core.cache import caches
from django.test import Client as DjangoClient

import holdpoint_client.errors as errors
from approvals.models import ApprovalPolicy
from holdpoint_client import (
    Action,
    ActionFailed,
    ActionRejected,
    Approval,
    AsyncClient,
    Checkpoint,
    Client,
    Executor,
    Holdpoint,
    LeaseLost,
    OutcomeUnknown,
    Run,
    ToolCall,
    ToolRefused,
)
from runtime.api.problems import CODES
from runtime.lifecycle import create_run, revise_goal
from runtime.models import Action as ActionRow
from runtime.models import Run as RunRow
from runtime.models import Tenant
from tests.client import hold_point  # noqa: F401  (a fixture)
from tests.conftest import Persona, issue_token_for
from tests.httpservers import answer_with
from tests.runtime.helpers import expire_lease

GOAL = {
    "old_spec": "shop-v1",
    "new_spec": "shop-v2",
    "scope": ["/orders", "/users"],
    "create_review_task": True,
}
# The tracker performed by the agent itself (executor `client`): the kind of tool an external
# executor reports outcomes for (tasks.create is sent by Holdpoint; its outcome is refused).
TOOL = "agent.tasks.create"
TASK = {"title": "Review 3 API compatibility risks", "body": "- GET /orders: removed"}


class Faulty(httpx.BaseTransport):
    """The client's transport: forwards to a real one, except for the faults planned.

    `refuse`: the connection fails before anything is sent. `drop`: the request is
    delivered and applied, then the reply is lost. `throttle`: a 429 with Retry-After.
    """

    def __init__(self) -> None:
        self.real = httpx.HTTPTransport()
        self.seen: list[httpx.Request] = []
        self.plan: list[tuple[str, str, str]] = []

    def fail(self, method: str, path_end: str, fault: str) -> None:
        self.plan.append((method, path_end, fault))

    def sent(self, method: str, path_end: str) -> list[httpx.Request]:
        return [r for r in self.seen if r.method == method and r.url.path.endswith(path_end)]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        for index, (method, path_end, fault) in enumerate(self.plan):
            if request.method == method and request.url.path.endswith(path_end):
                del self.plan[index]
                return self._fault(request, fault)
        return self.real.handle_request(request)

    def _fault(self, request: httpx.Request, fault: str) -> httpx.Response:
        if fault == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if fault == "throttle":
            body = {"status": 429, "code": "throttled", "title": "Too many requests"}
            return httpx.Response(
                429, headers={"Retry-After": "7"}, json=body, request=request
            )  # fmt: skip
        response = self.real.handle_request(request)
        response.read()
        response.close()
        raise httpx.ReadError("connection reset after the request was applied", request=request)

    def close(self) -> None:
        self.real.close()


@pytest.fixture(autouse=True)
def fresh_throttle() -> None:
    """Request rates are counted in the process cache, which outlives each test's database."""
    caches["default"].clear()


@pytest.fixture
def transport() -> Faulty:
    return Faulty()


@pytest.fixture
def pauses() -> list[float]:
    return []


def connect(url: str, persona: Persona, **options: Any) -> Client:
    token = persona.token or issue_token_for(persona.user)
    return Client(url, token, backoff=0.01, **options)


@pytest.fixture
def api(
    live_server: Any, agent_a: Persona, transport: Faulty, pauses: list[float]
) -> Iterator[Client]:
    client = connect(live_server.url, agent_a, transport=transport, sleep=pauses.append)
    yield client
    client.close()


@pytest.fixture
def reviewer_api(live_server: Any, reviewer_a: Persona) -> Iterator[Client]:
    """The client on the reviewer's browser session: API tokens are for agent accounts only
    (issue 15, part 5), so a person calls the API with their session cookie and CSRF token,
    as the pages' own scripts do."""
    browser = DjangoClient()
    browser.force_login(reviewer_a.user)
    csrf = httpx.get(live_server.url + "/login/").cookies["csrftoken"]
    client = Client(live_server.url, "", backoff=0.01)
    http = client._http
    del http.headers["Authorization"]
    http.headers["X-CSRFToken"] = csrf
    http.cookies.set(
        settings.SESSION_COOKIE_NAME, browser.cookies[settings.SESSION_COOKIE_NAME].value
    )
    http.cookies.set(settings.CSRF_COOKIE_NAME, csrf)
    yield client
    client.close()


# --- typed results and problem codes ------------------------------------------------------


def test_runs_come_back_typed(api: Client) -> None:
    run = api.create_run("api-review", GOAL, thread_id="thread-1")

    assert isinstance(run, Run)
    assert (run.graph, run.status, run.goal, run.thread_id) == (
        "api-review",
        "queued",
        GOAL,
        "thread-1",
    )
    assert (run.goal_rev, run.checkpoint_rev, run.next_step) == (1, 0, "read_specs")
    assert run.created_at is not None and run.created_at.tzinfo is not None
    assert run.lease.fence == 0 and not run.finished
    assert api.get_run(run.run_id) == run
    assert RunRow.objects.get(pk=run.run_id).thread_id == "thread-1"


def test_every_problem_code_has_its_exception_class() -> None:
    for code, status in CODES.items():
        cls = errors.class_for(status, code)
        assert (cls.code, cls.status) == (code, status), code
    assert errors.class_for(409, "a_code_from_a_newer_server") is errors.Conflict
    assert errors.class_for(502, "") is errors.ServerError


def test_refusals_raise_their_classes(api: Client, live_server: Any) -> None:
    with pytest.raises(errors.UnknownGraph) as unknown:
        api.create_run("no-such-graph", {})
    assert (unknown.value.status, unknown.value.code) == (422, "unknown_graph")
    with pytest.raises(errors.NotAuthenticated):
        Client(live_server.url, "not-a-token").get_run("00000000-0000-0000-0000-000000000000")
    run = api.create_run("api-review", GOAL, external=True)
    with pytest.raises(errors.VersionConflict):
        api.revise(run.run_id, GOAL, expected_goal_rev=7)
    grant_ = api.lease(run.run_id, "me", 10)
    with pytest.raises(errors.InvalidParams) as invalid:
        api.prepare_action(run.run_id, fence=grant_.fence, tool=TOOL, params={})
    assert "title" in str(invalid.value.errors)


def test_lease_held_stale_fence_and_version_conflict(api: Client) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    first = api.lease(run.run_id, "first", 30)
    with pytest.raises(errors.LeaseHeld):
        api.lease(run.run_id, "second", 30)
    checkpoint = api.write_checkpoint(
        run.run_id, fence=first.fence, expected_rev=0, state={"a": 1}, next_step="analyse"
    )
    assert isinstance(checkpoint, Checkpoint) and checkpoint.rev == 1
    with pytest.raises(errors.VersionConflict):
        api.write_checkpoint(
            run.run_id, fence=first.fence, expected_rev=0, state={"a": 2}, next_step="analyse"
        )

    expire_lease(run.run_id)
    second = api.lease(run.run_id, "second", 30)
    assert second.fence == first.fence + 1
    with pytest.raises(errors.StaleFence):
        api.heartbeat(run.run_id, first.fence)
    with pytest.raises(errors.StaleFence):
        api.write_checkpoint(
            run.run_id, fence=first.fence, expected_rev=1, state={}, next_step="analyse"
        )
    assert api.heartbeat(run.run_id, second.fence, ttl_seconds=30) is not None


def test_another_tenants_objects_are_not_found(
    api: Client, live_server: Any, agent_b: Persona
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    grant_ = api.lease(run.run_id, "a", 30)
    action = api.prepare_action(
        run.run_id, fence=grant_.fence, tool=TOOL, params=TASK, idempotency_key="k-1"
    )
    with connect(live_server.url, agent_b) as other:
        with pytest.raises(errors.NotFound):
            other.get_run(run.run_id)
        with pytest.raises(errors.NotFound):
            other.get_action(action.action_id)
        with pytest.raises(errors.NotFound):
            other.dispatch(action.action_id, grant_.fence)
        assert list(other.list_runs()) == []
        assert other.find_actions(idempotency_key="k-1") == []
    assert [a.action_id for a in api.find_actions(idempotency_key="k-1")] == [action.action_id]


# --- idempotency keys and retries ---------------------------------------------------------


def test_a_lost_reply_is_asked_for_again_with_the_same_key(api: Client, transport: Faulty) -> None:
    transport.fail("POST", "/runs/", "drop")

    run = api.create_run("api-review", GOAL, external=True)

    attempts = transport.sent("POST", "/runs/")
    keys = {r.headers["Idempotency-Key"] for r in attempts}
    assert len(attempts) == 2 and len(keys) == 1  # one logical call, one key
    assert RunRow.objects.count() == 1  # the retry got the first run back
    assert str(RunRow.objects.get().run_id) == run.run_id
    api.create_run("api-review", GOAL, external=True)
    assert len({r.headers["Idempotency-Key"] for r in transport.sent("POST", "/runs/")}) == 2


def test_a_checkpoint_whose_reply_was_lost_is_written_once(api: Client, transport: Faulty) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    grant_ = api.lease(run.run_id, "me", 30)
    transport.fail("POST", "/checkpoints/", "drop")

    checkpoint = api.write_checkpoint(
        run.run_id, fence=grant_.fence, expected_rev=0, state={"n": 1}, next_step="analyse"
    )

    assert checkpoint.rev == 1  # not a version_conflict from our own first attempt
    assert [c.rev for c in api.checkpoints(run.run_id)] == [1]


def test_a_call_that_is_not_idempotent_is_not_repeated_after_an_ambiguous_failure(
    api: Client, transport: Faulty
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    transport.fail("POST", "/revisions/", "drop")

    with pytest.raises(errors.TransportError) as lost:
        api.revise(run.run_id, {**GOAL, "scope": ["/orders"]}, expected_goal_rev=1)

    assert lost.value.may_have_applied
    assert len(transport.sent("POST", "/revisions/")) == 1
    assert RunRow.objects.get(pk=run.run_id).goal_rev == 2  # it did apply: re-read, not repeat


def test_a_refused_connection_is_retried_even_for_a_lease(
    api: Client, transport: Faulty, pauses: list[float]
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    transport.fail("POST", "/lease/", "refuse")

    assert api.lease(run.run_id, "me", 30).fence == 1
    assert len(transport.sent("POST", "/lease/")) == 2 and len(pauses) == 1


def test_429_waits_as_told_and_other_409s_are_answers(
    api: Client, transport: Faulty, pauses: list[float]
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    transport.fail("GET", f"/runs/{run.run_id}/", "throttle")

    assert api.get_run(run.run_id).run_id == run.run_id
    assert pauses == [7.0]

    api.lease(run.run_id, "me", 30)
    with pytest.raises(errors.LeaseHeld):
        api.lease(run.run_id, "other", 30)
    assert len(transport.sent("POST", "/lease/")) == 2 and pauses == [7.0]


# --- lists and long polls -----------------------------------------------------------------


def test_list_runs_follows_the_cursors_over_120_runs(
    api: Client, transport: Faulty, tenant_a: Tenant, tenant_b: Tenant
) -> None:
    made = {
        str(create_run(tenant_a, "api-review", GOAL, actor="agent:agent-a").run_id)
        for _ in range(120)
    }
    create_run(tenant_b, "api-review", GOAL, actor="agent:agent-b")

    listed = [run.run_id for run in api.list_runs()]

    assert len(listed) == 120 and set(listed) == made
    assert len(transport.sent("GET", "/runs/")) == 3  # 50 + 50 + 20
    page = api.runs_page()
    assert len(page.results) == 50 and page.next_cursor and page.previous_cursor is None
    following = api.runs_page(cursor=page.next_cursor)
    assert not {r.run_id for r in page.results} & {r.run_id for r in following.results}
    assert list(api.list_runs(status="completed")) == []


def test_get_run_with_wait_returns_when_the_run_changes(api: Client, transport: Faulty) -> None:
    """By what is answered, not by the clock: the writer writes only once the long poll is
    on the wire (seen by the transport), and the poll answers with that write — a poll that
    did not wait for the change would answer rev 0. Nothing changed: the same run back."""
    run = api.create_run("api-review", GOAL, external=True)
    grant_ = api.lease(run.run_id, "me", 30)

    assert api.get_run(run.run_id, wait=1).checkpoint_rev == 0  # waited out: nothing changed

    polls_before = len(transport.sent("GET", f"/runs/{run.run_id}/"))

    def write_once_the_poll_is_sent() -> None:
        for _ in range(2000):  # bounded: the poll is sent within moments of the start
            if len(transport.sent("GET", f"/runs/{run.run_id}/")) > polls_before:
                break
            threading.Event().wait(0.005)
        api.write_checkpoint(
            run.run_id, fence=grant_.fence, expected_rev=0, state={}, next_step="analyse"
        )

    writer = threading.Thread(target=write_once_the_poll_is_sent)
    writer.start()
    try:
        changed = api.get_run(run.run_id, wait=20)
    finally:
        writer.join(timeout=30)
    assert changed.checkpoint_rev == 1 and changed.status == "running"


def test_events_and_checkpoints_are_iterated_in_order(api: Client) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    grant_ = api.lease(run.run_id, "me", 30)
    for rev in range(3):
        api.write_checkpoint(
            run.run_id, fence=grant_.fence, expected_rev=rev, state={"rev": rev}, next_step="x"
        )

    entries = list(api.events(run.run_id))
    assert [e.seq for e in entries] == sorted(e.seq for e in entries)
    assert entries[0].type == "run_created" and entries[1].prev_hash == entries[0].hash
    assert [e.seq for e in api.events(run.run_id, after=entries[1].seq)] == [
        e.seq for e in entries[2:]
    ]
    assert [c.rev for c in api.checkpoints(run.run_id)] == [3, 2, 1]
    assert api.get_checkpoint(run.run_id, 2, inline=True).state == {"rev": 1}


# --- hold points ------------------------------------------------------------------------


def test_approvals_are_read_and_decided_through_the_client(
    api: Client,
    reviewer_api: Client,
    hold_point: ApprovalPolicy,  # noqa: F811
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    grant_ = api.lease(run.run_id, "me", 30)
    action = api.prepare_action(run.run_id, fence=grant_.fence, tool=TOOL, params=TASK)
    assert isinstance(action, Action) and action.status == "awaiting_approval"
    assert action.approval is not None
    with pytest.raises(errors.ApprovalRequired):
        api.dispatch(action.action_id, grant_.fence)

    (pending,) = reviewer_api.approvals(status="pending")
    assert isinstance(pending, Approval) and pending.id == action.approval
    assert (pending.action.action_id, pending.action.params) == (action.action_id, TASK)
    with pytest.raises(errors.HashMismatch):
        reviewer_api.decide(pending.id, "approve", action_hash="0" * 64)
    decided = reviewer_api.decide(pending.id, "approve", action_hash=pending.action_hash)
    again = reviewer_api.decide(pending.id, "approve", action_hash=pending.action_hash)
    assert decided.status == again.status == "approved" and decided.decided_by == "alice"
    with pytest.raises(errors.AlreadyDecided):
        reviewer_api.decide(pending.id, "reject", action_hash=pending.action_hash, reason="no")

    assert api.get_approval(pending.id).status == "approved"
    assert api.dispatch(action.action_id, grant_.fence).status == "sent"


# --- the executor -----------------------------------------------------------------------


class Tracker:
    """A stand-in `perform`: one task per new key, the first task again for a known key —
    what a key-deduplicating service does."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.tasks: dict[str, str] = {}

    def __call__(self, call: ToolCall) -> tuple[str, Any]:
        self.calls.append(call)
        task_id = self.tasks.setdefault(call.idempotency_key, f"task-{len(self.tasks) + 1}")
        return task_id, {"id": task_id, "title": call.params["title"]}


def test_executor_checkpoints_and_acts_exactly_once(api: Client) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()
    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        assert ex.load() == {} and ex.next_step == "read_specs"
        ex.checkpoint({"specs": ["shop-v1", "shop-v2"]}, "propose_task")
        first = ex.act(TOOL, TASK, call="propose_task", perform=tracker)
        again = ex.act(TOOL, TASK, call="propose_task", perform=tracker)
        ex.checkpoint({"task": first.external_id}, "", status="completed")

    assert first.status == "confirmed" and first.external_id == "task-1"
    assert again.action_id == first.action_id and len(tracker.calls) == 1
    assert first.idempotency_key == f"{run.run_id}:1:ext:propose_task"
    stored = RunRow.objects.get(pk=run.run_id)
    assert (stored.status, stored.checkpoint_rev, stored.lease_owner) == ("completed", 2, "")


def test_an_executor_reads_the_input_its_run_was_given(api: Client) -> None:
    """An external agent asks a person for input (the prompt is the run's `waiting_for`),
    leases the run again and finds the answer on the run (`Run.input`), until its next
    checkpoint takes it."""
    run = api.create_run("api-review", GOAL, external=True)
    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        ex.load()
        ex.checkpoint({"asked": True}, "use_answer", status="waiting_input", prompt="Budget?")
    waiting = api.get_run(run.run_id)
    assert waiting.input is None
    assert waiting.waiting_for == {"kind": "input", "prompt": "Budget?"}
    api.provide_input(run.run_id, {"budget": 1200}, expected_rev=1)

    with Executor(api, run.run_id, "agent-2", ttl=10) as ex:
        assert ex.load() == {"asked": True} and ex.next_step == "use_answer"
        assert ex.run.input == {"budget": 1200}
        ex.checkpoint({"budget": ex.run.input["budget"]}, "", status="completed")
    assert api.get_run(run.run_id).input is None


def test_an_answer_the_api_cannot_take_as_json_is_recorded_not_stranded(api: Client) -> None:
    """The service applied the effect and answered with its id, and with a value the API's
    JSON refuses (an integer past ±2**53 such as a 64-bit snowflake id, NaN, a NUL, a lone
    surrogate): recording the outcome was 400 malformed_request, `act` raised after the
    effect and every retry failed the same — the action stayed `sent`. The client sends such
    values as text (U+FFFD for the characters), so the effect is recorded."""
    run = api.create_run("api-review", GOAL, external=True)
    answer = {
        "snowflake": 2**64 - 1,
        "ratio": float("nan"),
        "ids": [-(2**60), 7],
        "note": "a\x00b",
        "k\ud800": 1.5,
    }

    def service(call: ToolCall) -> tuple[str, Any]:
        return "T-64", answer

    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        done = ex.act(TOOL, TASK, call="propose_task", perform=service)

    assert (done.status, done.external_id) == ("confirmed", "T-64")
    stored = ActionRow.objects.get(pk=done.action_id)
    kept = stored.result if isinstance(stored.result, dict) else json.loads(stored.result)
    assert kept == {
        "snowflake": "18446744073709551615",
        "ratio": "NaN",
        "ids": ["-1152921504606846976", 7],
        "note": "a\ufffdb",
        "k\ufffd": 1.5,
    }


def test_executor_continues_a_sent_action_of_a_dead_process_with_the_same_key(
    api: Client,
) -> None:
    """The predecessor leased, prepared, dispatched (sent) and died before recording."""
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()
    dead = api.lease(run.run_id, "agent-1", 30)
    key = f"{run.run_id}:1:ext:propose_task"
    action = api.prepare_action(
        run.run_id, fence=dead.fence, tool=TOOL, params=TASK, idempotency_key=key
    )
    api.dispatch(action.action_id, dead.fence)
    tracker(ToolCall(action=action, run_id=run.run_id, fence=dead.fence, replay=False))
    expire_lease(run.run_id)  # its lease runs out: nobody heartbeats it

    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        done = ex.act(TOOL, TASK, call="propose_task", perform=tracker)

    assert done.action_id == action.action_id and done.status == "confirmed"
    assert [c.idempotency_key for c in tracker.calls] == [key, key]
    assert tracker.calls[1].replay and tracker.calls[1].fence == dead.fence + 1
    assert len(tracker.tasks) == 1 and done.external_id == "task-1"
    assert ActionRow.objects.get(pk=action.action_id).status == "confirmed"


def test_executor_waits_at_the_hold_point_for_the_decision(
    api: Client,
    reviewer_api: Client,
    hold_point: ApprovalPolicy,  # noqa: F811
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()

    def approve_when_asked() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for approval in reviewer_api.approvals(status="pending"):
                edits = {"title": "Edited by the reviewer"}
                reviewer_api.decide(
                    approval.id, "approve", action_hash=approval.action_hash, edits=edits
                )
                return
            time.sleep(0.1)

    reviewer = threading.Thread(target=approve_when_asked)
    reviewer.start()
    try:
        with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
            done = ex.act(TOOL, TASK, call="propose_task", perform=tracker)
    finally:
        reviewer.join(timeout=40)

    assert done.status == "confirmed" and len(tracker.calls) == 1
    assert tracker.calls[0].params["title"] == "Edited by the reviewer"  # what was approved


def test_a_rejection_stops_the_action_before_the_tool(
    api: Client,
    reviewer_api: Client,
    hold_point: ApprovalPolicy,  # noqa: F811
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()
    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        action = api.prepare_action(
            run.run_id,
            fence=ex.fence,
            tool=TOOL,
            params=TASK,
            idempotency_key=ex.key_for("propose_task"),
        )
        (approval,) = reviewer_api.approvals(status="pending")
        reviewer_api.decide(approval.id, "reject", action_hash=approval.action_hash, reason="dup")
        with pytest.raises(ActionRejected) as rejected:
            ex.act(TOOL, TASK, call="propose_task", perform=tracker)
    assert rejected.value.reason == "dup" and tracker.calls == []
    assert ActionRow.objects.get(pk=action.action_id).status == "cancelled"


def test_a_taken_over_executor_stops(api: Client) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    with Executor(api, run.run_id, "agent-1", ttl=3) as ex:
        expire_lease(run.run_id)
        api.lease(run.run_id, "agent-2", 30)  # the successor
        deadline = time.monotonic() + 10
        while not ex.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ex.lost
        with pytest.raises(LeaseLost):
            ex.checkpoint({}, "analyse")
    assert RunRow.objects.get(pk=run.run_id).lease_owner == "agent-2"


def test_an_unanswered_tool_call_is_recorded_unknown_then_replayed_with_its_key(
    api: Client,
) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()

    def reset_once(call: ToolCall) -> tuple[str, Any]:
        effect = tracker(call)  # the service applied it...
        if len(tracker.calls) == 1:
            raise ConnectionResetError("...and the reply was lost")
        return effect

    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        done = ex.act(TOOL, TASK, call="propose_task", perform=reset_once)

    assert done.status == "confirmed" and len(tracker.tasks) == 1
    assert [c.replay for c in tracker.calls] == [False, True]
    assert tracker.calls[0].idempotency_key == tracker.calls[1].idempotency_key
    outcomes = [
        e.payload["action_status"] for e in api.events(run.run_id) if e.type == "action_outcome"
    ]
    assert outcomes == ["sent", "unknown", "sent", "confirmed"]  # the replay is dispatched


def test_a_sent_action_of_a_tool_without_dedup_goes_to_a_person_not_to_the_tool(
    api: Client, reviewer_api: Client, settings: Any
) -> None:
    """The server, not the client, knows the tracker cannot deduplicate (mode none): the
    successor's lease hands the dead process's `sent` action to a person at once, the
    executor never calls the tool again, and waits for the answer."""
    settings.HOLDPOINT_TASKS_DEDUP = "none"
    run = api.create_run("api-review", GOAL, external=True)
    dead = api.lease(run.run_id, "agent-1", 30)
    action = api.prepare_action(
        run.run_id,
        fence=dead.fence,
        tool=TOOL,
        params=TASK,
        idempotency_key=f"{run.run_id}:1:ext:propose_task",
    )
    api.dispatch(action.action_id, dead.fence)
    expire_lease(run.run_id)
    tracker = Tracker()

    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        assert api.get_action(action.action_id).reconcile == "manual_review"
        assert RunRow.objects.get(pk=run.run_id).status == "needs_reconciliation"
        with pytest.raises(OutcomeUnknown):
            ex.act(TOOL, TASK, call="propose_task", perform=tracker, resolution_timeout=0)
        reviewer_api.resolve(action.action_id, "applied", external_id="T-7", note="it is there")
        done = ex.act(TOOL, TASK, call="propose_task", perform=tracker)

    assert tracker.calls == []  # never called again blindly
    assert (done.status, done.external_id) == ("confirmed", "T-7")
    assert ActionRow.objects.get(pk=action.action_id).status == "confirmed"


def test_a_refusal_by_the_service_is_a_failure(api: Client) -> None:
    run = api.create_run("api-review", GOAL, external=True)

    def refuse(call: ToolCall) -> tuple[str, Any]:
        raise ToolRefused("HTTP 400: title too long")

    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        with pytest.raises(ActionFailed):
            ex.act(TOOL, TASK, call="propose_task", perform=refuse)
    assert ActionRow.objects.get(run_id=run.run_id).status == "failed"


def test_the_same_call_label_with_other_params_is_refused(api: Client) -> None:
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()
    with Executor(api, run.run_id, "agent-1", ttl=10) as ex:
        ex.act(TOOL, TASK, call="propose_task", perform=tracker)
        with pytest.raises(errors.IdempotencyKeyReused):
            ex.act(TOOL, {"title": "Something else"}, call="propose_task", perform=tracker)
    assert len(tracker.calls) == 1


def test_a_replay_after_the_goal_was_revised_is_not_sent(api: Client) -> None:
    """A `sent` action whose tool call failed is replayed with its key (mode `key`) — but
    only through the server's dispatch, which refuses an action of an older goal revision
    (DESIGN.md invariant 6). Here the goal is revised while the first call is on its way,
    and that call never reached the tracker: a replay would create the old goal's task
    after the revision. The unknown answer it reports then goes to a person: a key alone
    cannot settle an old revision's action without sending it."""
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()
    refused: list[ToolCall] = []

    def revised_meanwhile(call: ToolCall) -> tuple[str, Any]:
        if not refused:
            refused.append(call)
            api.revise(run.run_id, {**GOAL, "scope": ["/orders"]}, expected_goal_rev=1)
            raise ConnectionRefusedError("the tracker was not reached")
        return tracker(call)

    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        with pytest.raises(errors.OutcomeUnknown, match="still manual_review"):
            ex.act(TOOL, TASK, call="propose_task", perform=revised_meanwhile, resolution_timeout=1)

    assert tracker.tasks == {}  # nothing was sent for the old goal after its revision
    stored = ActionRow.objects.get(run_id=run.run_id)
    assert (stored.goal_rev, stored.status) == (1, "manual_review")
    assert RunRow.objects.get(run_id=run.run_id).status == "needs_reconciliation"


def test_a_call_keyed_under_an_older_goal_revision_is_not_performed_twice(
    api: Client, agent_a: Persona
) -> None:
    """The executor keys a call `<run>:<goal_rev>:ext:<label>` with the goal revision it last
    read. The goal was revised while it held the lease without re-reading the run: it
    prepared under the OLD revision's key, the server made the action under the NEW one,
    and it was dispatched and performed. Restarted, the executor read the new revision,
    keyed the same call under it, found nothing — and performed it a second time. Now
    the prepare carries the revision its key was built with; the server refuses it
    (version_conflict), nothing is prepared, and the executor — having read the run again
    — raises ActionWithdrawn, as for a revision it meets at dispatch. The call is made
    once, under the new revision's key."""
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()
    withdrawn: errors.ActionWithdrawn | None = None
    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        assert ex.goal_rev == 1
        revise_goal(RunRow.objects.get(pk=run.run_id), {**GOAL, "v": 2}, 1, actor="user:u")
        try:
            ex.act(TOOL, TASK, call="propose_task", perform=tracker)
        except errors.ActionWithdrawn as exc:
            withdrawn = exc
        read_again = ex.goal_rev

    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:  # restarted
        done = ex.act(TOOL, TASK, call="propose_task", perform=tracker)

    assert len(tracker.calls) == 1
    assert (done.goal_rev, done.idempotency_key) == (2, f"{run.run_id}:2:ext:propose_task")
    assert ActionRow.objects.filter(run_id=run.run_id).count() == 1
    assert withdrawn is not None and "goal was revised" in str(withdrawn)
    assert read_again == 2  # its next call is keyed under the new goal


def test_an_action_withdrawn_by_a_revision_while_held_rekeys_the_next_call(
    api: Client,
    hold_point: ApprovalPolicy,  # noqa: F811
) -> None:
    """A held action withdrawn by a goal revision (the revision cancels what waits for a
    decision) raised ActionWithdrawn, but the executor kept the goal revision it had read:
    its next call was keyed under the old revision again — prepared as the new goal's
    under the old goal's key (the call-made-twice shape), or refused, one more
    ActionWithdrawn for nothing. It reads the run again on a withdrawal, as on a
    dispatch's stale_goal_rev."""
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()
    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        held = api.prepare_action(
            run.run_id,
            fence=ex.fence,
            tool=TOOL,
            params=TASK,
            idempotency_key=ex.key_for("propose_task"),
        )
        assert held.status == "awaiting_approval"
        revise_goal(RunRow.objects.get(pk=run.run_id), {**GOAL, "v": 2}, 1, actor="user:u")
        with pytest.raises(errors.ActionWithdrawn):
            ex.act(TOOL, TASK, call="propose_task", perform=tracker)
        assert ex.goal_rev == 2
        assert ex.key_for("propose_task") == f"{run.run_id}:2:ext:propose_task"
    assert tracker.calls == []
    assert ActionRow.objects.get(pk=held.action_id).status == "cancelled"


class RevisingAfterUnknown(Faulty):
    """Revises the run's goal right after the executor's `unknown` report has landed, before
    the replay that report leads to is dispatched."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/outcome/") and b'"unknown"' in request.content:
            run = RunRow.objects.get(pk=json.loads(response.read())["run_id"])
            revise_goal(run, {**GOAL, "scope": ["/orders"]}, run.goal_rev, actor="user:u")
        return response


def test_an_unknown_action_whose_goal_was_revised_before_its_replay_waits_for_a_person(
    live_server: Any, agent_a: Persona
) -> None:
    """The call's answer was lost (`unknown`), then the goal was revised before the replay
    went out: the server refuses the replay (stale_goal_rev) and hands the action to a
    person. The executor raised ActionWithdrawn — "cancelled without a rejection", i.e.
    certainly not applied — for an action that may well have applied; it now waits for the
    person's answer (OutcomeUnknown when that does not come in time)."""
    api = connect(live_server.url, agent_a, transport=RevisingAfterUnknown())
    run = api.create_run("api-review", GOAL, external=True)
    tracker = Tracker()

    def lost_answer(call: ToolCall) -> tuple[str, Any]:
        tracker(call)  # applied...
        raise ConnectionResetError("...and the reply was lost")

    try:
        with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
            with pytest.raises(OutcomeUnknown, match="still manual_review"):
                ex.act(TOOL, TASK, call="propose_task", perform=lost_answer, resolution_timeout=0)
    finally:
        api.close()

    assert len(tracker.calls) == 1  # never replayed after the revision
    stored = ActionRow.objects.get(run_id=run.run_id)
    assert (stored.goal_rev, stored.status, stored.attempts) == (1, "manual_review", 1)
    assert RunRow.objects.get(pk=run.run_id).status == "needs_reconciliation"


def test_a_run_that_failed_to_open_does_not_keep_its_lease(
    live_server: Any, agent_a: Persona, transport: Faulty
) -> None:
    """The lease is taken and heartbeated before the run's state is read; when that read
    fails, `with hp.run(...)` raises — and the lease must go with it. Before, the heartbeat
    thread went on renewing it, so every later try in the same process met its own lease
    (LeaseHeld after lease_timeout) for as long as the process lived."""
    token = agent_a.token or issue_token_for(agent_a.user)
    hp = Holdpoint(live_server.url, token, ttl=2, lease_timeout=4, retries=0, transport=transport)
    try:
        with hp.run("t-open", graph="api-review", complete=False) as run:
            assert run.record("summary", lambda: "two risks") == "two risks"
        transport.fail("GET", "/checkpoints/1/", "refuse")  # the state's read fails once

        with pytest.raises(errors.TransportError):
            with hp.run("t-open", graph="api-review", complete=False):
                pass  # not reached

        assert RunRow.objects.get(thread_id="t-open").lease_owner == ""  # handed back
        with hp.run("t-open", graph="api-review", complete=False) as run:
            assert run.record("summary", lambda: "asked again") == "two risks"
    finally:
        hp.close()


class CountingAsync(httpx.AsyncBaseTransport):
    """The async client's transport: a real one, with every request kept."""

    def __init__(self) -> None:
        self.real = httpx.AsyncHTTPTransport()
        self.seen: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return await self.real.handle_async_request(request)

    async def aclose(self) -> None:
        await self.real.aclose()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_following_a_stream_the_server_closes_at_once_is_not_a_busy_loop(
    live_server: Any, agent_a: Persona, transport: Faulty, flavour: str
) -> None:
    """`live_server` is a WSGI server: a stream there sends what is written and closes (the
    server's long-poll fallback, runtime/api/sse.py). `events(follow=True)` reopened it at
    once, with a run read between: hundreds of requests a second while the run lived. It
    now waits (backoff, at most STREAM_IDLE_PAUSE) after a close that brought nothing, and
    still sees every entry once, to the run's last."""
    token = agent_a.token or issue_token_for(agent_a.user)
    api = Client(live_server.url, token, backoff=0.05, transport=transport)
    run = api.create_run("api-review", GOAL, external=True)
    seen: list[int] = []
    counting = CountingAsync()

    async def follow_async() -> None:
        async with AsyncClient(live_server.url, token, backoff=0.05, transport=counting) as aio:
            async for entry in aio.events(run.run_id, follow=True):
                seen.append(entry.seq)

    def follow() -> None:
        if flavour == "async":
            asyncio.run(follow_async())
        else:
            seen.extend(entry.seq for entry in api.events(run.run_id, follow=True))

    follower = threading.Thread(target=follow)
    follower.start()
    try:
        threading.Event().wait(2.0)  # the run lives two seconds with nothing new
        api.cancel(run.run_id, "done")
    finally:
        follower.join(timeout=30)
    requests = transport.seen if flavour == "sync" else counting.seen
    opened = [r for r in requests if r.url.params.get("stream") == "1"]

    assert not follower.is_alive()
    assert len(opened) <= 12, len(opened)
    assert seen == [entry.seq for entry in api.events(run.run_id)]  # each once, in order
    api.close()


class FinishingBeforeTheRead(httpx.BaseTransport):
    """A real transport that cancels the run (through the API) just before the client's
    second plain read of it: the cancel, and its journal entry, land after a stream closed
    empty and before the client looks at the run's status."""

    def __init__(self, url: str, token: str) -> None:
        self.real = httpx.HTTPTransport()
        self.url, self.token = url, token
        self.reads = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path.count("/") == 5 and path.startswith("/api/v1/runs/"):
            self.reads += 1
            if self.reads == 2:
                headers = {"Authorization": f"Token {self.token}"}
                cancel = f"{self.url}{path}cancel/"
                httpx.post(cancel, json={"reason": "done"}, headers=headers).raise_for_status()
        return self.real.handle_request(request)

    def close(self) -> None:
        self.real.close()


def test_following_a_run_that_finishes_between_two_reads_misses_no_entry(
    live_server: Any, agent_a: Persona
) -> None:
    """A stream closed with nothing new, then the run finished, then the client read the
    run: `events(follow=True)` took "finished and nothing new" for the end and stopped
    without the run's final entry (`cancelled`). Only a connection opened after the run
    was seen finished may end the feed."""
    token = agent_a.token or issue_token_for(agent_a.user)
    hook = FinishingBeforeTheRead(live_server.url, token)
    with Client(live_server.url, token, backoff=0.01, transport=hook) as api:
        run = api.create_run("api-review", GOAL, external=True)
        followed = [entry.type for entry in api.events(run.run_id, follow=True)]
        written = [entry.type for entry in api.events(run.run_id)]

    assert hook.reads >= 2  # the run was cancelled at the second look
    assert followed == written and followed[-1] == "cancelled"


def test_a_success_that_is_not_json_is_a_clear_error_not_a_decode_traceback(serve: Any) -> None:
    """A 200 whose body is a web page — a base URL that is the site, not the API; a login
    portal or proxy in the way — raised json's JSONDecodeError out of every call, sync and
    async alike, naming nothing a user could act on. It is a TransportError that says what
    answered and what to check; a write says it may have reached the server."""
    page = b"<!doctype html><title>Sign in to the guest network</title>"
    site = serve(answer_with(200, page, content_type="text/html"))
    with pytest.raises(errors.TransportError, match="text/html, not JSON") as read:
        Client(site.url, "token", backoff=0.01).get_run("00000000-0000-0000-0000-000000000000")
    assert read.value.may_have_applied is False

    async def write() -> None:
        async with AsyncClient(site.url, "token", backoff=0.01) as api:
            await api.create_run("api-review", GOAL, external=True)

    with pytest.raises(errors.TransportError, match="is the base URL Holdpoint's API") as sent:
        asyncio.run(write())
    assert sent.value.may_have_applied is True
