"""/readyz is not ready on a database that answers but takes no writes.

The readiness check asked `SELECT 1`: a PostgreSQL standby (DATABASE_URL left on the old
primary after a failover, or pointed at a replica), a database or role set to read-only
transactions, or an SQLite connection that is query-only all answer it — and then refuse
every run, decision, lease and step commit. The load balancer kept sending traffic to a
process that could do nothing useful, and `manage.py doctor` said all was well.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import RequestFactory

from runtime import health


def _read_only_connection() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # Reverted with the test's transaction; what `ALTER DATABASE … SET
            # default_transaction_read_only = on` gives every new connection.
            cursor.execute("SET SESSION default_transaction_read_only = on")
        else:
            cursor.execute("PRAGMA query_only = ON")


def _writable_again() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET SESSION default_transaction_read_only = off")
        else:
            cursor.execute("PRAGMA query_only = OFF")


@pytest.mark.django_db
def test_a_read_only_database_is_not_ready() -> None:
    assert health.check_database()["ok"] is True
    _read_only_connection()
    try:
        found = health.check_database()
        answer = health.readyz(RequestFactory().get("/readyz"))
    finally:
        _writable_again()
    assert found["ok"] is False and found["kind"] == "read_only", found
    assert "takes no writes" in found["problems"][0], found
    assert answer.status_code == 503
    told = json.loads(answer.content)["checks"]["database"]
    assert told["ok"] is False and "takes no writes" in told["problems"][0], told
    assert "unreachable" not in told["problems"][0]
    assert health.check_database()["ok"] is True  # writable again: ready again
