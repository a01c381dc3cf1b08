"""The database out of reach mid-request: a retryable 503, never a 500 (TEST-MATRIX A4).

PostgreSQL: the request's own backend is terminated (`pg_terminate_backend`, what a server
restart, a failover or an operator does to a connection) just before the call. SQLite: another
connection holds the write lock longer than the request's busy timeout ("database is
locked"). Either way the client gets 503 `service_unavailable` in the problem format, with
Retry-After and a request id the log line carries, and the same call once the database is
back does what it was asked, once.
"""

from __future__ import annotations

import logging
import sqlite3
import uuid
from typing import Any

import psycopg
import pytest
from django.db import close_old_connections, connection
from django.test import Client

from runtime.models import Run
from tests import procs
from tests.conftest import Persona
from tests.pg_guard import on_postgres

BODY = {"graph": "api-review", "goal": {"old_spec": "shop-v1", "new_spec": "shop-v2"}}


def lost(response: Any, caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The 503 a client may retry, and the operator's log line that names it."""
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "2"
    body = response.json()
    assert body["code"] == "service_unavailable" and body["status"] == 503
    assert "Idempotency-Key" in body["detail"]  # how to repeat it safely
    assert "Traceback" not in body["detail"]
    said = [r for r in caplog.records if r.name == "holdpoint.api"]
    assert any(body["request_id"] in r.getMessage() for r in said), said
    return dict(body)


def made_once(persona: Persona, api: Any, key: dict[str, str]) -> None:
    """The same call again, once the database is back: the run is made, and a third time
    (same key) it is that run — one run in all."""
    made = api.post("/api/v1/runs/", BODY, format="json", **key)
    assert made.status_code == 201, made.content
    assert api.post("/api/v1/runs/", BODY, format="json", **key).json() == made.json()
    assert Run.objects.filter(tenant=persona.tenant).count() == 1


def terminate_own_backend() -> None:
    """End this process's database session from another connection, as a server restart
    would: the next statement on it fails with OperationalError."""
    if connection.vendor != "postgresql":
        pytest.skip("a PostgreSQL backend; SQLite's lock is the test below")
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    with psycopg.connect(procs.test_database_url(), autocommit=True) as killer:
        killer.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_terminated_postgresql_connection_is_a_retryable_503(
    agent_a: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    api = agent_a.api()
    key = {"HTTP_IDEMPOTENCY_KEY": f"a4-{uuid.uuid4()}"}
    terminate_own_backend()
    with caplog.at_level(logging.ERROR, logger="holdpoint.api"):
        refused = api.post("/api/v1/runs/", BODY, format="json", **key)
    lost(refused, caplog)
    # The server closes an unusable connection when the request ends (the test client
    # leaves that to its caller); the retry, same key, makes the one run.
    close_old_connections()
    made_once(agent_a, api, key)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_lost_connection_in_a_middleware_is_the_same_503(
    reviewer_a: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    """A session user's API call reads the session and membership in middleware, outside
    DRF's view: Django's 500 handler answers there, and it too says 503."""
    client = Client(raise_request_exception=False)
    client.force_login(reviewer_a.user)
    terminate_own_backend()
    with caplog.at_level(logging.ERROR, logger="holdpoint.api"):
        refused = client.get("/api/v1/runs/")
    lost(refused, caplog)
    close_old_connections()
    assert client.get("/api/v1/runs/").status_code == 200


@pytest.mark.skipif(on_postgres(), reason="SQLite's write lock; PostgreSQL's tests are above")
@pytest.mark.django_db(transaction=True)
def test_a_locked_sqlite_database_is_a_retryable_503(
    agent_a: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    api = agent_a.api()
    key = {"HTTP_IDEMPOTENCY_KEY": f"a4-{uuid.uuid4()}"}
    holder = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process's long write
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 50")  # not the 30 s a deployment waits
        with caplog.at_level(logging.ERROR, logger="holdpoint.api"):
            refused = api.post("/api/v1/runs/", BODY, format="json", **key)
        lost(refused, caplog)
        assert not Run.objects.exists()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    made_once(agent_a, api, key)
