"""An Idempotency-Key whose request died does not block its key for a day, and its retry
never applies the effect twice (runtime.api.idempotency: a claim lease with a fence, the
effect recorded on the claim in the effect's own transaction).

The request dies for real: a web server process SIGKILLed at a named fault point, its
database connection terminated mid-request, a 5xx HoldpointError. Each retry with the same
key and body gets the one run — created by the dead request if its work committed (the
run as it is now), else by the retry. On PostgreSQL: two retries racing for a dead claim
make one run, and a request still running past its lease cannot add a second.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import close_old_connections, connection, connections
from django.utils import timezone
from rest_framework.test import APIClient

from runtime import lifecycle
from runtime.errors import ToolUnavailable
from runtime.faults import FaultPoint
from runtime.models import IdempotencyRecord, Run
from tests import procs
from tests.api import ok, post, problem
from tests.api.live import web_server
from tests.conftest import Persona

BODY = {"graph": "api-review", "goal": {"old_spec": "shop-v1", "new_spec": "shop-v2"}}


def create(client: Any, key: str) -> Any:
    return post(client, "runs/", BODY, HTTP_IDEMPOTENCY_KEY=key)


def lease_passes(key: str) -> None:
    """The claim's lease ends (the data is moved, not the clock): the request holding it
    can no longer be running."""
    past = timezone.now() - timedelta(seconds=1)
    assert IdempotencyRecord.objects.filter(key=key).update(claimed_until=past) == 1


def one_run(persona: Persona, answer: Any) -> dict[str, Any]:
    """The answer is the tenant's only run."""
    data = ok(answer, 201)
    runs = Run.objects.filter(tenant=persona.tenant)
    assert [str(r.run_id) for r in runs] == [data["run_id"]]
    return dict(data)


def answered_again(persona: Persona, client: Any, key: str, first: dict[str, Any]) -> None:
    """A later retry replays the stored answer: the same run, still one."""
    again = create(client, key)
    assert again["Idempotent-Replayed"] == "true"
    assert one_run(persona, again) == first


@contextlib.contextmanager
def seam(monkeypatch: pytest.MonkeyPatch, before: Callable[[], None], after: Callable[[], None]):  # type: ignore[no-untyped-def]
    """`lifecycle.create_run` with something happening just before and just after it."""
    real = lifecycle.create_run

    def wrapped(*args: Any, **kwargs: Any) -> Run:
        before()
        run = real(*args, **kwargs)
        after()
        return run

    monkeypatch.setattr(lifecycle, "create_run", wrapped)
    yield
    monkeypatch.setattr(lifecycle, "create_run", real)


def nothing() -> None:
    pass


# --- a web server killed mid-request --------------------------------------------------------


def post_to(base: str, token: str, key: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{base}/api/v1/runs/",
        data=json.dumps(BODY).encode(),
        headers={
            "Authorization": f"Token {token}",
            "Content-Type": "application/json",
            "Idempotency-Key": key,
        },
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("point", [FaultPoint.AFTER_KEY_CLAIMED, FaultPoint.BEFORE_KEY_RESPONSE])
def test_a_web_server_killed_mid_post_leaves_a_key_its_retry_can_use(
    agent_a: Persona, django_db_blocker: Any, tmp_path: Path, point: FaultPoint
) -> None:
    """after_key_claimed: nothing was done, the retry makes the run. before_key_response:
    the run committed, its response was never stored — the retry answers with that run."""
    key = f"killed-{uuid.uuid4()}"
    log = tmp_path / "web.log"
    with web_server(django_db_blocker, log, HOLDPOINT_FAULTS=point.value) as (proc, base):
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            post_to(base, agent_a.token, key)
        assert proc.wait(timeout=15) != 0
    assert f"fault point reached: {point}" in log.read_text()
    made = Run.objects.filter(tenant=agent_a.tenant).count()
    assert made == (1 if point == FaultPoint.BEFORE_KEY_RESPONSE else 0)
    client = agent_a.api()
    problem(create(client, key), 409, "idempotency_key_in_flight")  # its lease still holds
    lease_passes(key)
    with web_server(django_db_blocker, tmp_path / "web2.log") as (_, base):
        status, body = post_to(base, agent_a.token, key)
    assert status == 201
    runs = Run.objects.filter(tenant=agent_a.tenant)
    assert [str(r.run_id) for r in runs] == [body["run_id"]]
    answered_again(agent_a, client, key, body)


# --- the database connection lost mid-request -------------------------------------------------


def terminate_own_backend() -> None:
    """End this process's database session from another connection (a server restart, a
    failover): the request's next statement fails, and so would its cleanup on it."""
    pid = connection.connection.info.backend_pid
    with psycopg.connect(procs.test_database_url(), autocommit=True) as killer:
        killer.execute("SELECT pg_terminate_backend(%s)", [pid])


def lose_the_connection() -> None:
    terminate_own_backend()
    Run.objects.exists()  # the request's next statement: OperationalError


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("when", ["before_the_run", "after_the_run"])
def test_a_connection_lost_mid_request_leaves_a_key_its_retry_can_use(
    agent_a: Persona, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("a PostgreSQL backend to terminate")
    client = agent_a.api()
    key = f"lost-{uuid.uuid4()}"
    before, after = (
        (lose_the_connection, nothing)
        if when == "before_the_run"
        else (nothing, lose_the_connection)
    )
    with seam(monkeypatch, before, after):
        problem(create(client, key), 503, "service_unavailable")
    close_old_connections()
    assert Run.objects.filter(tenant=agent_a.tenant).count() == (when == "after_the_run")
    first = one_run(agent_a, create(client, key))  # at once: no lease to wait for
    answered_again(agent_a, client, key, first)


# --- a 5xx HoldpointError ---------------------------------------------------------------------


def unavailable() -> None:
    raise ToolUnavailable("a dependency was out of reach")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("when", ["before_the_run", "after_the_run"])
def test_a_5xx_error_leaves_a_key_its_retry_can_use(
    agent_a: Persona, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A HoldpointError of status >= 500 may come after the effect committed: the retry
    answers with it if so, and makes it if not — either way one run."""
    client = agent_a.api()
    key = f"5xx-{uuid.uuid4()}"
    before, after = (unavailable, nothing) if when == "before_the_run" else (nothing, unavailable)
    with seam(monkeypatch, before, after):
        problem(create(client, key), 503, "tool_unavailable")
    assert Run.objects.filter(tenant=agent_a.tenant).count() == (when == "after_the_run")
    first = one_run(agent_a, create(client, key))
    answered_again(agent_a, client, key, first)


# --- races for a dead claim (PostgreSQL) -----------------------------------------------------


def a_dead_claim(persona: Persona, key: str) -> None:
    """A claim for `key` whose request died before its work (its lease has passed): the
    data a SIGKILL after after_key_claimed leaves."""
    client = persona.api()
    with_key = create(client, "warm-up")
    ok(with_key, 201)
    warm = IdempotencyRecord.objects.get(key="warm-up")
    Run.objects.filter(tenant=persona.tenant).delete()
    IdempotencyRecord.objects.create(
        tenant=persona.tenant,
        key=key,
        scope=warm.scope,
        fingerprint=warm.fingerprint,
        claimed_until=timezone.now() - timedelta(seconds=1),
    )


def in_threads(count: int, work: Callable[[int], Any]) -> list[Any]:
    answers: list[Any] = [None] * count

    def go(index: int) -> None:
        try:
            answers[index] = work(index)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return answers


def agent_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_retries_racing_for_a_dead_claim_make_one_run(agent_a: Persona) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    parallel, rounds = 4, 5
    for attempt in range(rounds):
        key = f"dead-{attempt}"
        a_dead_claim(agent_a, key)
        barrier = threading.Barrier(parallel)

        def retry(_: int, key: str = key, barrier: threading.Barrier = barrier) -> Any:
            client = agent_client(agent_a.token)
            barrier.wait(timeout=10)
            return create(client, key)

        answers = in_threads(parallel, retry)
        made = [a for a in answers if a is not None and a.status_code == 201]
        assert len(made) >= 1, [(a.status_code, a.content[:200]) for a in answers if a]
        for answer in answers:
            if answer.status_code != 201:
                problem(answer, 409, "idempotency_key_in_flight")
        assert len({a.json()["run_id"] for a in made}) == 1
        first = one_run(agent_a, made[0])
        answered_again(agent_a, agent_a.api(), key, first)
        IdempotencyRecord.objects.filter(tenant=agent_a.tenant).delete()
        Run.objects.filter(tenant=agent_a.tenant).delete()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_request_running_past_its_lease_cannot_add_a_second_run(
    agent_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first request stalls before its work (a GC pause, a frozen VM) past its claim's
    lease; a retry takes the claim over and makes the run. When the first wakes, its run
    rolls back (409 idempotency_key_in_flight) and the retry's answer stands."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    key = f"stalled-{uuid.uuid4()}"
    stalled, wake = threading.Event(), threading.Event()

    def stall() -> None:
        if threading.current_thread().name == "first":
            stalled.set()
            assert wake.wait(timeout=30)

    with seam(monkeypatch, stall, nothing):
        answers: list[Any] = []
        first = threading.Thread(
            target=lambda: (
                answers.append(create(agent_client(agent_a.token), key)),
                connections.close_all(),
            ),
            name="first",
        )
        first.start()
        try:
            assert stalled.wait(timeout=30)
            lease_passes(key)
            retried = one_run(agent_a, create(agent_a.api(), key))
        finally:
            wake.set()
            first.join(timeout=60)
    problem(answers[0], 409, "idempotency_key_in_flight")
    assert one_run(agent_a, create(agent_a.api(), key)) == retried
