"""A gateway in front of Holdpoint answers 502/503/504 for a request that may have applied.

A real reverse proxy (tests.httpservers.Gateway: a socket server forwarding to the API on
`live_server`) answers a planned request itself — before forwarding it, or after Holdpoint
applied it and the answer was lost, as nginx does on an upstream reset or timeout. Such an
answer is the ambiguity of a lost connection: the executor re-reads the ledger and goes on,
dispatching again (after a pause, a bounded number of times) only what is still unsent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import caches

import holdpoint_client.errors as errors
from audit.journal import run_stream
from audit.models import JournalEntry
from holdpoint_client import AsyncClient, AsyncExecutor, Client, Executor, ToolCall, ToolRefused
from runtime.models import Action as ActionRow
from runtime.models import Run as RunRow
from tests.conftest import Persona
from tests.httpservers import Gateway

pytestmark = pytest.mark.django_db(transaction=True)
TOOL = "agent.tasks.create"
TASK = {"title": "Review the API change", "body": "GET /orders: removed"}


@pytest.fixture(autouse=True)
def fresh_throttle() -> None:
    """Request rates are counted in the process cache, which outlives each test's database."""
    caches["default"].clear()


@pytest.fixture
def gateway(live_server: Any, serve: Any) -> Iterator[tuple[Gateway, str]]:
    proxy = Gateway(live_server.url)
    yield proxy, serve(proxy).url
    proxy.close()


@pytest.fixture
def api(gateway: tuple[Gateway, str], agent_a: Persona) -> Iterator[Client]:
    assert agent_a.token is not None
    client = Client(gateway[1], agent_a.token, backoff=0.01)
    yield client
    client.close()


class Service:
    """A `perform` that counts its calls: the effects the service saw."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def __call__(self, call: ToolCall) -> tuple[str, Any]:
        self.calls.append(call)
        return f"T-{len(self.calls)}", {"id": f"T-{len(self.calls)}"}


@pytest.mark.parametrize(("status", "mode"), [(502, "none"), (504, "key"), (0, "none")])
def test_a_dispatch_applied_behind_a_gateway_error_is_performed_once(
    api: Client, gateway: tuple[Gateway, str], settings: Any, status: int, mode: str
) -> None:
    """The dispatch reached Holdpoint (the action is `sent`) and the gateway answered 502
    (504; or hung up). A hang-up was re-read and performed; a 502 raised ServerError out of
    `act` with the action `sent` and nothing performed — the next try finds a sent action
    nobody sent, and a tool without dedup (mode none) then needs a person. Now the 502 is
    read as the lost answer it is: the action is re-read, found sent, performed once."""
    settings.HOLDPOINT_TASKS_DEDUP = mode
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    service = Service()
    proxy.fail("POST", "/dispatch/", status, forwarded=True)

    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        done = ex.act(TOOL, TASK, call="propose", perform=service)

    assert (done.status, done.external_id) == ("confirmed", "T-1")
    assert len(service.calls) == 1 and not service.calls[0].replay
    assert proxy.count("POST", "/dispatch/") == 1  # re-read, not dispatched again
    assert ActionRow.objects.get(pk=done.action_id).status == "confirmed"


@pytest.mark.parametrize("forwarded", [True, False], ids=["after-the-commit", "before-it"])
def test_holdpoints_own_500_to_a_dispatch_is_settled_by_reading_the_action(
    api: Client, gateway: tuple[Gateway, str], forwarded: bool
) -> None:
    """Holdpoint answered its own 500 `server_error` to the dispatch — after committing
    `sent` (a fault later in the request), or before. `act` raised ServerError either way:
    after the commit the action was `sent` with nothing performed, and the agent run again
    had to reconcile a call nobody made. Now, as for a gateway's 502, the action is re-read:
    found sent it is performed once; found unsent it is dispatched again."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    service = Service()
    proxy.fail("POST", "/dispatch/", 500, forwarded=forwarded, code="server_error")

    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        done = ex.act(TOOL, TASK, call="propose", perform=service)

    assert (done.status, done.external_id) == ("confirmed", "T-1")
    assert len(service.calls) == 1 and not service.calls[0].replay
    assert proxy.count("POST", "/dispatch/") == (1 if forwarded else 2)


def test_a_dispatch_a_gateway_refused_is_dispatched_again_after_a_pause(
    api: Client, gateway: tuple[Gateway, str]
) -> None:
    """The gateway answered 502 without forwarding: re-read, the action is still
    `prepared` — certainly not sent — so it is dispatched again, once, after a pause."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    service = Service()
    proxy.fail("POST", "/dispatch/", 502, forwarded=False, times=2)

    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        done = ex.act(TOOL, TASK, call="propose", perform=service)

    assert done.status == "confirmed" and len(service.calls) == 1
    assert proxy.count("POST", "/dispatch/") == 3


def test_a_gateway_that_always_fails_the_dispatch_is_given_up_on_not_looped(
    api: Client, gateway: tuple[Gateway, str]
) -> None:
    """A lost answer re-read as `prepared` went back to the act loop, which dispatched at
    once, again and again, for as long as the gateway failed. Now `replay_attempts`
    dispatches, with pauses between, then the TransportError is raised; nothing sent."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    service = Service()
    proxy.fail("POST", "/dispatch/", 0, forwarded=False, times=50)

    with Executor(api, run.run_id, "agent-1", ttl=10, replay_attempts=3, retry_pause=0.01) as ex:
        with pytest.raises(errors.TransportError) as lost:
            ex.act(TOOL, TASK, call="propose", perform=service)

    assert lost.value.may_have_applied
    assert proxy.count("POST", "/dispatch/") == 3 and service.calls == []
    assert ActionRow.objects.get(run_id=run.run_id).status == "prepared"


def test_an_outcome_recorded_behind_a_gateway_error_is_read_back_async(
    gateway: tuple[Gateway, str], agent_a: Persona
) -> None:
    """The outcome reached Holdpoint (the action is `confirmed`) and the gateway answered
    504: `act` raised ServerError after the effect, as if nothing were recorded. Now the
    report is sent again and the server answers the repeat with the confirmed action,
    recorded once (AsyncExecutor: the same flows, the same policy)."""
    proxy, url = gateway
    assert agent_a.token is not None
    service = Service()
    proxy.fail("POST", "/outcome/", 504, forwarded=True)

    async def story() -> Any:
        async with AsyncClient(url, agent_a.token or "", backoff=0.01) as client:
            run = await client.create_run("api-review", {}, external=True)
            async with AsyncExecutor(client, run.run_id, "agent-1", ttl=10) as ex:
                return await ex.act(TOOL, TASK, call="propose", perform=service)

    done = asyncio.run(story())

    assert (done.status, done.external_id) == ("confirmed", "T-1") and len(service.calls) == 1
    assert proxy.count("POST", "/outcome/") == 2  # the repeat, answered 200
    assert confirmed_entries(done.run_id) == 1


def confirmed_entries(run_id: str) -> int:
    """How many times the run's journal says an action became confirmed."""
    entries = JournalEntry.objects.filter(stream=run_stream(run_id), type="action_outcome")
    return sum(
        1
        for p in entries.values_list("payload", flat=True)
        if p.get("action_status") == "confirmed"
    )


@pytest.mark.parametrize("verdict", ["confirmed", "failed"])
def test_a_report_whose_answer_was_lost_is_sent_again_as_it_was_and_answered_200(
    api: Client, gateway: tuple[Gateway, str], verdict: str
) -> None:
    """The server knows a repeat by the whole report — outcome, external id and result — and
    refuses any other report of a settled action (409 invalid_transition). The client's
    repeat after a lost answer sends the report as it was, a result with floats and nested
    keys too, so it is answered 200 with the action the first report settled."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    answer = {"id": "T-1", "score": 0.5, "labels": {"b": [1.0, 2], "a": None}}

    def perform(call: ToolCall) -> tuple[str, Any]:
        if verdict == "failed":
            raise ToolRefused("a task with this title exists")
        return "T-1", answer

    proxy.fail("POST", "/outcome/", 504, forwarded=True)
    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        if verdict == "failed":
            with pytest.raises(errors.ActionFailed):
                ex.act(TOOL, TASK, call="propose", perform=perform)
        else:
            assert ex.act(TOOL, TASK, call="propose", perform=perform).result == answer

    assert proxy.count("POST", "/outcome/") == 2  # the repeat, answered 200
    entries = JournalEntry.objects.filter(stream=run_stream(run.run_id), type="action_outcome")
    said = [p["action_status"] for p in entries.order_by("seq").values_list("payload", flat=True)]
    assert said == ["sent", verdict]


@pytest.mark.parametrize(
    "other",
    [
        {"outcome": "failed", "result": {"error": "x"}},
        {"outcome": "confirmed", "external_id": "T-1", "result": {"id": "T-1", "by": "other"}},
    ],
    ids=["failed", "confirmed-other-result"],
)
def test_a_report_another_report_settled_first_raises_invalid_transition_once(
    api: Client, gateway: tuple[Gateway, str], other: dict[str, Any]
) -> None:
    """Another report settled the action while this executor's tool ran. Its own report
    (`confirmed`, T-1) differing from that one only in its result was answered 200 and
    `act` returned the action as if its report had landed. Now any other report is refused
    409 invalid_transition, and `act` raises that refusal after one POST — it neither loops
    on it nor takes it for its own report — and the ledger keeps the first report."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)

    def perform(call: ToolCall) -> tuple[str, Any]:
        api.record_outcome(call.action.action_id, fence=call.fence, **other)
        return "T-1", {"id": "T-1"}

    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        with pytest.raises(errors.InvalidTransition):
            ex.act(TOOL, TASK, call="propose", perform=perform)

    assert proxy.count("POST", "/outcome/") == 2  # the other report, and ours once
    stored = ActionRow.objects.get(run_id=run.run_id)
    assert (stored.status, stored.result) == (other["outcome"], other["result"])


def test_a_gateway_503_on_a_call_not_safe_to_repeat_is_not_repeated(
    api: Client, gateway: tuple[Gateway, str]
) -> None:
    """A 503 was repeated for every call, as if nobody had done any work — but a gateway
    also answers 503 for a request its upstream dropped after taking it. The revision had
    applied; repeated, it answered version_conflict, telling the caller it had lost. Now a
    gateway's 503 on such a call is a TransportError that says it may have applied."""
    proxy, _ = gateway
    run = api.create_run("api-review", {"v": 1}, external=True)
    proxy.fail("POST", "/revisions/", 503, forwarded=True)

    with pytest.raises(errors.TransportError) as lost:
        api.revise(run.run_id, {"v": 2}, expected_goal_rev=1)

    assert lost.value.may_have_applied and isinstance(lost.value.__cause__, errors.ServerError)
    assert proxy.count("POST", "/revisions/") == 1
    assert RunRow.objects.get(pk=run.run_id).goal_rev == 2


def test_holdpoints_503_for_its_database_is_repeated_only_where_repeating_is_safe(
    api: Client, gateway: tuple[Gateway, str]
) -> None:
    """Holdpoint answers 503 `service_unavailable` when its database went away mid-call —
    perhaps after part of it was committed (TEST-MATRIX A4). The client repeated every
    Holdpoint 503, as if it always came before any work: a revision that had applied was
    sent again (and lost to version_conflict). Now only a call safe to repeat is repeated
    (a run's creation, under its Idempotency-Key); `tool_unavailable` still always is."""
    proxy, _ = gateway
    proxy.fail("POST", "/runs/", 503, forwarded=False, code="service_unavailable")
    run = api.create_run("api-review", {"v": 1}, external=True)
    assert proxy.count("POST", "/runs/") == 2 and RunRow.objects.count() == 1

    proxy.fail("POST", "/revisions/", 503, forwarded=True, code="service_unavailable")
    with pytest.raises(errors.ServiceUnavailable):
        api.revise(run.run_id, {"v": 2}, expected_goal_rev=1)
    assert proxy.count("POST", "/revisions/") == 1
    assert RunRow.objects.get(pk=run.run_id).goal_rev == 2


@pytest.mark.parametrize("status", [502, 0], ids=["502", "hang-up"])
def test_a_lease_taken_behind_a_gateway_error_is_waited_out_and_taken_again(
    api: Client, gateway: tuple[Gateway, str], status: int
) -> None:
    """The lease applied and the gateway answered 502 (or hung up): its fence is unknown.
    The POST is asked again (it cannot take a second lease): refused lease_held by the
    lease the first took, which is waited out (it expires after ttl) and taken again."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    proxy.fail("POST", "/lease/", status, forwarded=True)

    with Executor(api, run.run_id, "agent-1", ttl=2, lease_timeout=30) as ex:
        assert ex.fence == 2
        ex.checkpoint({"n": 1}, "next")

    assert RunRow.objects.get(pk=run.run_id).checkpoint_rev == 1


class KeyedService(Service):
    """A `perform` whose service deduplicates by Idempotency-Key: one task per key."""

    def __call__(self, call: ToolCall) -> tuple[str, Any]:
        self.calls.append(call)
        keys = list(dict.fromkeys(c.idempotency_key for c in self.calls))
        task = f"T-{keys.index(call.idempotency_key) + 1}"
        return task, {"id": task}


def test_an_outcome_the_gateway_never_lets_through_is_outcome_unknown_and_settled_later(
    api: Client, gateway: tuple[Gateway, str]
) -> None:
    """The task was created, then every POST of its outcome met a gateway's 503 (no `code`:
    not Holdpoint's answer). `act` raised a bare ExecutorError — the caller could not tell
    "it happened, the server does not know yet: do not redo it" from any other failure.
    Now it is OutcomeUnknown naming what was not recorded; running the agent again (the
    gateway healthy) settles the still-`sent` action from the ledger: one task."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    service = KeyedService()
    proxy.fail("POST", "/outcome/", 503, forwarded=False, times=50)

    with Executor(api, run.run_id, "agent-1", ttl=10, replay_attempts=3, retry_pause=0.01) as ex:
        with pytest.raises(errors.OutcomeUnknown) as unknown:
            ex.act(TOOL, TASK, call="propose", perform=service)

    assert unknown.value.unrecorded == "confirmed"
    assert isinstance(unknown.value.__cause__, errors.TransportError)
    assert proxy.count("POST", "/outcome/") == 3 and len(service.calls) == 1
    assert ActionRow.objects.get(run_id=run.run_id).status == "sent"

    proxy.plan.clear()  # the gateway recovers; the agent runs again
    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        done = ex.act(TOOL, TASK, call="propose", perform=service)

    assert (done.status, done.external_id) == ("confirmed", "T-1")
    assert {c.idempotency_key for c in service.calls} == {done.idempotency_key}
    assert ActionRow.objects.get(run_id=run.run_id).status == "confirmed"


def test_an_outcome_whose_post_never_connects_is_outcome_unknown_async(
    gateway: tuple[Gateway, str], agent_a: Persona
) -> None:
    """The same for a POST that never reached the gateway's upstream (hung up before it was
    forwarded, every attempt), and with AsyncExecutor: the flows are shared."""
    proxy, url = gateway
    assert agent_a.token is not None
    service = KeyedService()
    proxy.fail("POST", "/outcome/", 0, forwarded=False, times=50)

    async def story() -> BaseException:
        async with AsyncClient(url, agent_a.token or "", backoff=0.01) as client:
            run = await client.create_run("api-review", {}, external=True)
            async with AsyncExecutor(
                client, run.run_id, "agent-1", ttl=10, replay_attempts=2, retry_pause=0.01
            ) as ex:
                with pytest.raises(errors.OutcomeUnknown) as unknown:
                    await ex.act(TOOL, TASK, call="propose", perform=service)
                return unknown.value

    unknown = asyncio.run(story())

    assert isinstance(unknown, errors.OutcomeUnknown) and unknown.unrecorded == "confirmed"
    assert len(service.calls) == 1
    assert ActionRow.objects.get().status == "sent"


@pytest.mark.parametrize(
    ("status", "code"),
    [(500, "server_error"), (503, "service_unavailable"), (500, "")],
)
def test_holdpoints_own_5xx_to_an_outcome_is_outcome_unknown_and_settled_later(
    api: Client, gateway: tuple[Gateway, str], status: int, code: str
) -> None:
    """The task was created, then every POST of its outcome got a 5xx in Holdpoint's own
    problem format (a fault on its side: 500 `server_error`; 503 `service_unavailable`,
    retried as the client does, then given up). Those escaped `act` as ServerError — after
    the effect, with the outcome unrecorded, so a caller would take the call for failed and
    may do it again. Now, as for a gateway's 5xx (the last case), it is OutcomeUnknown
    naming the outcome not recorded, and running the agent again settles it: one task."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    service = KeyedService()
    proxy.fail("POST", "/outcome/", status, forwarded=False, times=100, code=code)

    with Executor(api, run.run_id, "agent-1", ttl=10, replay_attempts=2, retry_pause=0.01) as ex:
        with pytest.raises(errors.OutcomeUnknown) as unknown:
            ex.act(TOOL, TASK, call="propose", perform=service)

    assert unknown.value.unrecorded == "confirmed" and len(service.calls) == 1
    assert isinstance(unknown.value.__cause__, errors.ServerError | errors.TransportError)
    assert ActionRow.objects.get(run_id=run.run_id).status == "sent"

    proxy.plan.clear()  # Holdpoint answers again; the agent runs again
    with Executor(api, run.run_id, "agent-1", ttl=10, retry_pause=0.01) as ex:
        done = ex.act(TOOL, TASK, call="propose", perform=service)

    assert (done.status, done.external_id) == ("confirmed", "T-1")
    assert {c.idempotency_key for c in service.calls} == {done.idempotency_key}
    assert ActionRow.objects.get(run_id=run.run_id).status == "confirmed"


def test_holdpoints_500_after_recording_the_outcome_is_read_back_async(
    gateway: tuple[Gateway, str], agent_a: Persona
) -> None:
    """Holdpoint recorded the outcome, then answered 500 `server_error` (a fault after the
    commit): `act` raised ServerError although the action was confirmed. Now the report is
    sent again, and its repeat answered with the confirmed action (AsyncExecutor: the same
    flows)."""
    proxy, url = gateway
    assert agent_a.token is not None
    service = Service()
    proxy.fail("POST", "/outcome/", 500, forwarded=True, code="server_error")

    async def story() -> Any:
        async with AsyncClient(url, agent_a.token or "", backoff=0.01) as client:
            run = await client.create_run("api-review", {}, external=True)
            async with AsyncExecutor(client, run.run_id, "agent-1", ttl=10) as ex:
                return await ex.act(TOOL, TASK, call="propose", perform=service)

    done = asyncio.run(story())

    assert (done.status, done.external_id) == ("confirmed", "T-1") and len(service.calls) == 1
    assert proxy.count("POST", "/outcome/") == 2  # the repeat, answered 200
    assert ActionRow.objects.get(pk=done.action_id).status == "confirmed"
    assert confirmed_entries(done.run_id) == 1


@pytest.mark.parametrize("status", [502, 0], ids=["502", "hang-up"])
def test_a_release_repeated_after_its_lost_answer_answers_as_the_first(
    api: Client, gateway: tuple[Gateway, str], status: int
) -> None:
    """The client repeats a release whose answer was lost (it is safe to repeat), but the
    repeat met the fence the first had moved on and answered 409 `stale_fence`: a caller
    saw StaleFence ("another executor took the run") for a release that worked. The repeat
    of a release of the same fence now answers what the first did; a fence released and then
    leased by another executor is still refused."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    fence = api.lease(run.run_id, "agent-1", 10).fence
    proxy.fail("POST", "/lease/release/", status, forwarded=True)

    api.release(run.run_id, fence)

    assert proxy.count("POST", "/lease/release/") == 2
    row = RunRow.objects.get(pk=run.run_id)
    assert (row.status, row.lease_owner, row.fence) == ("queued", "", fence + 1)
    types = list(
        JournalEntry.objects.filter(stream=run_stream(run.run_id)).values_list("type", flat=True)
    )
    assert types.count("lease_released") == 1 and "stale_write_refused" not in types
    api.release(run.run_id, fence)  # asked again later: the same answer

    successor = api.lease(run.run_id, "agent-2", 10).fence
    with pytest.raises(errors.StaleFence):
        api.release(run.run_id, fence)
    api.release(run.run_id, successor)


@pytest.mark.parametrize(
    ("status", "code", "retry_after", "forwarded"),
    [
        (503, "service_unavailable", "2", False),
        (500, "server_error", "", False),
        (500, "server_error", "", True),
    ],
    ids=["503-retry-after", "500-before-the-commit", "500-after-it"],
)
def test_holdpoints_own_5xx_to_a_lease_is_retried(
    gateway: tuple[Gateway, str],
    agent_a: Persona,
    status: int,
    code: str,
    retry_after: str,
    forwarded: bool,
) -> None:
    """Holdpoint answered its own 503 `service_unavailable` (its database away a moment,
    Retry-After 2) or 500 `server_error` to the lease POST. A lost connection was tried
    again, but these escaped `with Executor(...)` as ServerError: the agent did not start.
    Now the POST is repeated as any call that cannot apply twice (a second lease cannot be
    taken: one the first attempt took is held, by us, and waited out), after Retry-After
    when given, else after a backoff pause."""
    proxy, url = gateway
    pauses: list[float] = []
    client = Client(url, agent_a.token or "", backoff=0.01, sleep=pauses.append)
    run = client.create_run("api-review", {}, external=True)
    proxy.fail("POST", "/lease/", status, forwarded=forwarded, code=code, retry_after=retry_after)

    try:
        with Executor(client, run.run_id, "agent-1", ttl=2, lease_timeout=30) as ex:
            ex.checkpoint({"n": 1}, "next")
            fence = ex.fence
    finally:
        client.close()

    assert proxy.count("POST", "/lease/") >= 2
    assert fence == (2 if forwarded else 1)  # a lease the 500 hid is waited out
    if retry_after:
        assert pauses[0] == 2.0
    else:
        assert 0 < pauses[0] <= 0.01  # the client's backoff, not the executor's wait
    assert RunRow.objects.get(pk=run.run_id).checkpoint_rev == 1


def test_holdpoints_503_to_a_lease_is_retried_async(
    gateway: tuple[Gateway, str], agent_a: Persona
) -> None:
    """The same for AsyncExecutor: one retry policy for both faces."""
    proxy, url = gateway
    proxy.fail("POST", "/lease/", 503, forwarded=False, code="service_unavailable")

    async def story() -> int:
        async with AsyncClient(url, agent_a.token or "", backoff=0.01) as client:
            run = await client.create_run("api-review", {}, external=True)
            async with AsyncExecutor(client, run.run_id, "agent-1", ttl=10) as ex:
                return ex.fence

    assert asyncio.run(story()) == 1
    assert proxy.count("POST", "/lease/") == 2


@pytest.mark.parametrize(("status", "code"), [(409, "lease_held"), (404, "not_found")])
def test_a_4xx_to_a_lease_is_not_repeated_by_the_client(
    api: Client, gateway: tuple[Gateway, str], status: int, code: str
) -> None:
    """Only 429 of the 4xx is repeated by the client: a lease held by another executor is
    the executor's to wait out, a missing run is an answer."""
    proxy, _ = gateway
    run = api.create_run("api-review", {}, external=True)
    proxy.fail("POST", "/lease/", status, forwarded=False, code=code)

    with pytest.raises(errors.HoldpointAPIError) as refused:
        api.lease(run.run_id, "agent-1", 10)

    assert (refused.value.status, refused.value.code) == (status, code)
    assert proxy.count("POST", "/lease/") == 1


@pytest.mark.parametrize(("status", "code"), [(503, "service_unavailable"), (500, "server_error")])
def test_holdpoints_own_5xx_to_a_heartbeat_is_retried_within_the_lease(
    gateway: tuple[Gateway, str], agent_a: Persona, status: int, code: str
) -> None:
    """Renewing is bounded by the lease, not by the client's policy: Holdpoint's own 5xx
    to a heartbeat is repeated once, after a Retry-After within ttl/4 (one longer would be
    raised: the next beat, ttl/3 later, tries again)."""
    proxy, url = gateway
    pauses: list[float] = []
    with Client(url, agent_a.token or "", backoff=0.01, sleep=pauses.append) as client:
        run = client.create_run("api-review", {}, external=True)
        fence = client.lease(run.run_id, "agent-1", 10).fence
        proxy.fail("POST", "/lease/heartbeat/", status, forwarded=False, code=code, retry_after="1")

        assert client.heartbeat(run.run_id, fence, ttl_seconds=10) is not None

    assert proxy.count("POST", "/lease/heartbeat/") == 2 and pauses == [1.0]
