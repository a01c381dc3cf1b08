"""Idempotency-Key on creating POSTs (API.md "Conventions"; TEST-MATRIX B7, D4).

Same key + same body → the first response again (same status, same body, one object);
same key + another body → 422 idempotency_key_reused; a refused request gives its key back;
keys are scoped per tenant; concurrent duplicates (PostgreSQL) make exactly one object and
answer either the first response or 409 idempotency_key_in_flight.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
import time_machine
from django.core.management import call_command
from django.db import connection, connections
from django.utils import timezone

from runtime.models import Action, Checkpoint, IdempotencyRecord, Role, Run, Tenant
from tests.api import (
    fresh_throttle,  # noqa: F401
    new_run,
    ok,
    post,
    problem,
    row_counts,
    take_lease,
)
from tests.conftest import Persona, issue_token_for, make_persona

pytestmark = pytest.mark.django_db


BODY = {"graph": "chain", "goal": {"steps": 2}, "thread_id": "idem"}


def create(client: Any, key: str, body: dict[str, Any] | None = None) -> Any:
    return post(client, "runs/", body or BODY, HTTP_IDEMPOTENCY_KEY=key)


def test_same_key_and_body_answers_the_first_response_again(agent_a: Persona) -> None:
    client = agent_a.api()
    first = create(client, "key-1")
    data = ok(first, 201)
    ok(post(client, f"runs/{data['run_id']}/cancel/", {"reason": "changed my mind"}))
    for _ in range(3):
        again = create(client, "key-1")
        assert again.status_code == 201
        assert again.json() == data  # the stored first response, not the run as it is now
    assert Run.objects.filter(tenant=agent_a.tenant).count() == 1


def test_a_replay_is_byte_identical(agent_a: Persona) -> None:
    client = agent_a.api()
    body = {**BODY, "goal": {"zeta": 1, "alpha": {"b": 2, "a": 1}}}
    first = create(client, "bytes", body)
    again = create(client, "bytes", body)
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again["Content-Type"] == first["Content-Type"]
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first


def test_same_key_with_another_body_is_422_idempotency_key_reused(agent_a: Persona) -> None:
    client = agent_a.api()
    ok(create(client, "key-2"), 201)
    before = row_counts()
    other = {**BODY, "goal": {"steps": 3}}
    data = problem(create(client, "key-2", other), 422, "idempotency_key_reused")
    assert data["detail"]
    assert row_counts() == before


def test_same_key_on_another_endpoint_is_422_idempotency_key_reused(agent_a: Persona) -> None:
    client = agent_a.api()
    run = ok(create(client, "key-3", {**BODY, "external": True}), 201)
    fence = take_lease(client, run["run_id"])
    body = {"fence": fence, "expected_rev": 0, "state": {}, "next_step": "a"}
    response = post(
        client, f"runs/{run['run_id']}/checkpoints/", body, HTTP_IDEMPOTENCY_KEY="key-3"
    )
    problem(response, 422, "idempotency_key_reused")
    assert not Checkpoint.objects.filter(run_id=run["run_id"]).exists()


@pytest.mark.parametrize(
    ("bad", "status", "code"),
    [
        ({"graph": "nope", "goal": {}}, 422, "unknown_graph"),
        ({"graph": "chain"}, 400, "invalid_request"),
        ({"graph": "chain", "goal": {}, "thread_id": "t" * 201}, 400, "invalid_request"),
    ],
    ids=["unknown-graph", "missing-goal", "field-too-long"],
)
def test_a_refused_request_does_not_consume_its_key(
    agent_a: Persona, bad: dict[str, Any], status: int, code: str
) -> None:
    client = agent_a.api()
    before = row_counts()
    problem(create(client, "key-4", bad), status, code)
    assert row_counts() == before  # not even an idempotency record
    data = ok(create(client, "key-4"), 201)
    assert ok(create(client, "key-4"), 201) == data
    assert Run.objects.filter(tenant=agent_a.tenant).count() == 1


def test_a_malformed_body_does_not_consume_the_key(agent_a: Persona) -> None:
    client = agent_a.api()
    response = client.generic(
        "POST",
        "/api/v1/runs/",
        b'{"graph": "chain", "graph": "chain", "goal": {}}',
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="key-5",
    )
    problem(response, 400, "malformed_request")
    ok(create(client, "key-5"), 201)


def test_keys_are_scoped_per_tenant(agent_a: Persona, agent_b: Persona) -> None:
    mine = ok(create(agent_a.api(), "shared-key"), 201)
    theirs = ok(create(agent_b.api(), "shared-key"), 201)
    assert mine["run_id"] != theirs["run_id"]
    assert Run.objects.get(pk=mine["run_id"]).tenant == agent_a.tenant
    assert Run.objects.get(pk=theirs["run_id"]).tenant == agent_b.tenant
    assert IdempotencyRecord.objects.filter(key="shared-key").count() == 2
    # and a different body in the other tenant is no reuse either
    ok(create(agent_b.api(), "only-mine"), 201)
    ok(create(agent_a.api(), "only-mine", {**BODY, "goal": {"steps": 9}}), 201)


def test_a_request_while_the_first_is_in_flight_is_409(agent_a: Persona) -> None:
    """The first request claimed the key and has not finished (its record has no status yet:
    the data is moved, not the clock or a thread)."""
    client = agent_a.api()
    ok(create(client, "warm-up"), 201)
    record = IdempotencyRecord.objects.get(key="warm-up")
    IdempotencyRecord.objects.create(
        tenant=agent_a.tenant,
        key="busy",
        scope=record.scope,
        fingerprint=record.fingerprint,
        claimed_until=timezone.now() + timedelta(minutes=1),  # its claim still holds
    )
    # Same scope and body as "warm-up" had, so the fingerprint matches: in flight, not reuse.
    busy = create(client, "busy")
    problem(busy, 409, "idempotency_key_in_flight")
    assert busy["Retry-After"] == "1"  # the one 409 to retry, and when
    assert Run.objects.filter(tenant=agent_a.tenant).count() == 1


def test_idempotent_checkpoint_and_prepare(agent_a: Persona) -> None:
    client = agent_a.api()
    run = new_run(client)
    fence = take_lease(client, run["run_id"])
    cp = {"fence": fence, "expected_rev": 0, "state": {"a": 1}, "next_step": "b"}
    url = f"runs/{run['run_id']}/checkpoints/"
    first = ok(post(client, url, cp, HTTP_IDEMPOTENCY_KEY="cp-1"), 201)
    assert ok(post(client, url, cp, HTTP_IDEMPOTENCY_KEY="cp-1"), 201) == first
    assert Checkpoint.objects.filter(run_id=run["run_id"]).count() == 1
    act = {"fence": fence, "tool": "tasks.create", "params": {"title": "t"}, "reason": "r"}
    url = f"runs/{run['run_id']}/actions/"
    first = ok(post(client, url, act, HTTP_IDEMPOTENCY_KEY="act-1"), 201)
    assert ok(post(client, url, act, HTTP_IDEMPOTENCY_KEY="act-1"), 201) == first
    other = {**act, "params": {"title": "u"}}
    problem(post(client, url, other, HTTP_IDEMPOTENCY_KEY="act-1"), 422, "idempotency_key_reused")
    assert Action.objects.filter(run_id=run["run_id"]).count() == 1


# --- a key is one caller's ---------------------------------------------------------------------


@pytest.fixture
def agent_a2(tenant_a: Tenant) -> Persona:
    """A second agent account of tenant A, with its own token."""
    return make_persona(tenant_a, "agent-a2", Role.AGENT)


def test_another_callers_same_key_and_body_is_key_reuse_not_a_replay(
    agent_a: Persona, agent_a2: Persona, reviewer_a: Persona, viewer_a: Persona
) -> None:
    """A replay hands over the first caller's response before any of the second caller's
    rights are checked (a viewer got the agent's 201, another agent the run bound to the
    first as its executor). The same key and body from another token's account or a
    person's session of the same tenant is 422 idempotency_key_reused: nothing is made, and
    nothing of the first response is shown."""
    body = {**BODY, "external": True}
    first = ok(create(agent_a.api(), "mine", body), 201)
    others = [other.api() for other in (agent_a2, reviewer_a, viewer_a)]  # logins journalled
    before = row_counts()
    for other in others:
        refused = problem(create(other, "mine", body), 422, "idempotency_key_reused")
        assert "another caller" in refused["detail"]
        assert first["run_id"] not in json.dumps(refused)
    assert row_counts() == before
    again = create(agent_a.api(), "mine", body)  # the first caller's retry still replays
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.json() == first
    assert Run.objects.filter(tenant=agent_a.tenant).count() == 1


def test_the_same_account_with_a_rotated_token_still_replays(agent_a: Persona) -> None:
    """The caller is the account, not the token: a fleet that switched to a new token
    (rotation keeps the old one valid for a window) retries with the same key."""
    first = ok(create(agent_a.api(), "rotating"), 201)
    rotated = Persona(agent_a.user, agent_a.tenant, agent_a.role, issue_token_for(agent_a.user))
    assert rotated.token != agent_a.token
    again = create(rotated.api(), "rotating")
    assert again.status_code == 201 and again.json() == first
    assert Run.objects.filter(tenant=agent_a.tenant).count() == 1


def test_another_callers_dead_claim_is_not_taken_over(agent_a: Persona, agent_a2: Persona) -> None:
    """The first request died after its effect committed (its claim past its lease, no
    response stored): its own retry answers with the effect; another caller's request with
    the same key and body is key reuse — not the effect, not a claim taken over."""
    first = ok(create(agent_a.api(), "died"), 201)
    record = IdempotencyRecord.objects.get(key="died")
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        status=None, content=None, claimed_until=timezone.now() - timedelta(minutes=1)
    )
    problem(create(agent_a2.api(), "died"), 422, "idempotency_key_reused")
    record.refresh_from_db()
    assert (record.claim, record.status) == (1, None)  # not taken over
    again = create(agent_a.api(), "died")
    assert again.status_code == 201 and again.json()["run_id"] == first["run_id"]


def test_another_callers_request_in_flight_is_key_reuse(
    agent_a: Persona, agent_a2: Persona
) -> None:
    ok(create(agent_a.api(), "warm"), 201)
    record = IdempotencyRecord.objects.get(key="warm")
    IdempotencyRecord.objects.create(
        tenant=agent_a.tenant,
        principal=agent_a.user,
        key="busy-mine",
        scope=record.scope,
        fingerprint=record.fingerprint,
        claimed_until=timezone.now() + timedelta(minutes=1),
    )
    problem(create(agent_a2.api(), "busy-mine"), 422, "idempotency_key_reused")
    problem(create(agent_a.api(), "busy-mine"), 409, "idempotency_key_in_flight")


def test_a_record_from_before_principals_replays_as_it_did(
    agent_a: Persona, agent_a2: Persona
) -> None:
    """Records stored before the column have no principal: replayed as they were then, to
    any caller of the tenant with the same body, until HOLDPOINT_IDEMPOTENCY_HOURS forgets
    them (no data migration; the window closes by itself)."""
    first = ok(create(agent_a.api(), "legacy"), 201)
    assert IdempotencyRecord.objects.get(key="legacy").principal == agent_a.user
    IdempotencyRecord.objects.filter(key="legacy").update(principal=None)
    again = create(agent_a2.api(), "legacy")
    assert again.status_code == 201 and again.json() == first
    other = {**BODY, "goal": {"steps": 7}}
    problem(create(agent_a2.api(), "legacy", other), 422, "idempotency_key_reused")


# --- B7 on PostgreSQL --------------------------------------------------------------------------

PARALLEL = 20
BURSTS = 5


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_parallel_identical_posts_make_one_run(agent_a: Persona) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrency tests run on PostgreSQL")
    token = agent_a.token
    tallies: list[dict[str, int]] = []
    for burst in range(BURSTS):
        key = f"burst-{burst}"
        barrier = threading.Barrier(PARALLEL)
        responses: list[Any] = [None] * PARALLEL

        def go(
            index: int,
            key: str = key,
            barrier: threading.Barrier = barrier,
            responses: list[Any] = responses,
        ) -> None:
            from rest_framework.test import APIClient

            client = APIClient()
            client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
            try:
                barrier.wait(timeout=10)
                responses[index] = create(client, key)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=go, args=(i,)) for i in range(PARALLEL)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        created = [r for r in responses if r is not None and r.status_code == 201]
        in_flight = [r for r in responses if r is not None and r.status_code == 409]
        assert len(created) + len(in_flight) == PARALLEL, [
            (r.status_code, r.content[:200]) for r in responses if r is not None
        ]
        assert created, "at least the first request answers 201"
        bodies = {r.content for r in created}
        first = created[0].json()
        assert all(r.json() == first for r in created), bodies
        for response in in_flight:
            problem(response, 409, "idempotency_key_in_flight")
        assert Run.objects.filter(tenant=agent_a.tenant, thread_id="idem").count() == burst + 1
        assert IdempotencyRecord.objects.get(key=key).status == 201
        tallies.append({"201": len(created), "409": len(in_flight)})
    print(f"\nB7: {BURSTS} bursts x {PARALLEL}: runs per key 1.00; responses {tallies}")


def test_purge_forgets_responses_past_the_window(agent_a: Persona) -> None:
    client = agent_a.api()
    first = create(client, "old-key")
    assert first.status_code == 201
    with time_machine.travel(timezone.now() + timedelta(hours=23), tick=False):
        out = StringIO()
        call_command("purge", stdout=out)
        assert "purged 0 expired Idempotency-Key" in out.getvalue()
        assert IdempotencyRecord.objects.filter(key="old-key").exists()
    with time_machine.travel(timezone.now() + timedelta(hours=25), tick=False):
        out = StringIO()
        call_command("purge", "--dry-run", stdout=out)
        assert "would purge 1 expired Idempotency-Key" in out.getvalue()
        call_command("purge", stdout=StringIO())
        assert not IdempotencyRecord.objects.filter(key="old-key").exists()
        again = create(client, "old-key")  # the key is free again: a new run
        assert again.status_code == 201
        assert again.json()["run_id"] != first.json()["run_id"]
