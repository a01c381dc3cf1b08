"""`manage.py doctor`: each setting that would silently break a guarantee gets its line.

These run without a worker, so the worker check fails in each of them too; every test
asserts the line of the setting it breaks. That doctor passes whole — with a real worker —
is tests/core/test_health.py's cluster test, and on `make run`'s setup test_run_script.py's.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import time_machine
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client, override_settings
from django.utils import timezone

from approvals.models import ApprovalPolicy
from runtime.models import Tenant, ToolCredential
from tests.tooldefs import define_tickets

pytestmark = pytest.mark.django_db


def doctor(*args: str) -> tuple[bool, list[str]]:
    """(exit status 0?, output lines) of `manage.py doctor`."""
    out = io.StringIO()
    try:
        call_command("doctor", *args, stdout=out)
    except CommandError:
        return False, out.getvalue().splitlines()
    return True, out.getvalue().splitlines()


def line_of(check: str, lines: list[str]) -> str:
    found = [line for line in lines if line.split(" ", 2)[1] == f"{check}:"]
    assert len(found) == 1, lines
    return found[0]


@pytest.fixture
def sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's PRAGMAs")


@pytest.fixture
def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's settings")


def test_only_the_missing_worker_fails_on_the_test_settings() -> None:
    ok, lines = doctor()
    assert not ok
    assert [line.split(" ", 2)[:2] for line in lines] == [["ERROR", "worker:"]]
    assert "start `python manage.py qcluster`" in lines[0]


@pytest.fixture
def sqlite_init(sqlite_only: None) -> Iterator[Callable[[str, str], None]]:
    """Change the PRAGMAs every new connection runs (settings' init_command), as a changed
    setting would, and reconnect; the settings' own are back (and reapplied) after."""
    options = connection.settings_dict["OPTIONS"]
    saved = options["init_command"]

    def change(old: str, new: str) -> None:
        assert old in saved
        options["init_command"] = saved.replace(old, new)
        connection.close()

    try:
        yield change
    finally:
        options["init_command"] = saved
        connection.close()
        connection.ensure_connection()  # journal_mode is the file's: WAL again


@pytest.mark.django_db(transaction=True)
def test_sqlite_synchronous_normal(sqlite_init: Callable[[str, str], None]) -> None:
    sqlite_init("synchronous=FULL", "synchronous=NORMAL")
    ok, lines = doctor()
    assert not ok
    line = line_of("durability", lines)
    assert "SQLite synchronous is 1 (FULL is 2)" in line and "`sent` mark can vanish" in line


@pytest.fixture
def sqlite_scratch(sqlite_only: None, tmp_path: Path) -> Iterator[Callable[[str, str], None]]:
    """Like sqlite_init, on an empty database file of the test's own. Leaving WAL takes the
    file's only connection: any other one open on the test database (a thread an earlier
    test left behind in this xdist worker) made the change fail with "database is locked"."""
    settings_dict = connection.settings_dict
    saved = settings_dict["NAME"], settings_dict["OPTIONS"]["init_command"]

    def change(old: str, new: str) -> None:
        assert old in saved[1]
        connection.close()
        settings_dict["NAME"] = str(tmp_path / "scratch.sqlite3")
        settings_dict["OPTIONS"]["init_command"] = saved[1].replace(old, new)

    try:
        yield change
    finally:
        connection.close()
        settings_dict["NAME"], settings_dict["OPTIONS"]["init_command"] = saved
        connection.ensure_connection()


@pytest.mark.django_db(transaction=True)
def test_sqlite_without_wal(sqlite_scratch: Callable[[str, str], None]) -> None:
    sqlite_scratch("journal_mode=WAL", "journal_mode=DELETE")
    ok, lines = doctor()
    assert not ok
    assert "SQLite journal_mode is delete, not wal" in line_of("durability", lines)


@pytest.mark.postgres
def test_postgres_synchronous_commit_off(postgres_only: None) -> None:
    with connection.cursor() as cursor:  # this session only: the test's transaction ends it
        cursor.execute("SET LOCAL synchronous_commit = off")
    ok, lines = doctor()
    assert not ok
    line = line_of("durability", lines)
    assert line.startswith("ERROR durability: PostgreSQL synchronous_commit is off — ")
    assert "ALTER SYSTEM SET synchronous_commit = on" in line


@pytest.mark.postgres
def test_postgres_without_persistent_connections(postgres_only: None) -> None:
    with override_settings(HOLDPOINT_WORKER_CONN_MAX_AGE=0):  # DB_CONN_MAX_AGE=0
        ok, lines = doctor()
    assert not ok
    assert "CONN_MAX_AGE is 0 on PostgreSQL" in line_of("connections", lines)


def test_app_clock_ahead_of_the_database() -> None:
    # time-machine moves Python's clock only: the database keeps the real time.
    with time_machine.travel(timezone.now() + timedelta(seconds=30), tick=True):
        ok, lines = doctor()
    assert not ok
    line = line_of("clock", lines)
    # The database's reading is placed at half the round trip: on a loaded machine the
    # estimate is off by up to that much (29.9 s was seen in CI), never by a second.
    found = re.search(
        r"the app's clock is ([\d.]+) s ahead of the database's \(at most 1 s\)", line
    )
    assert found, line
    assert 29.0 < float(found.group(1)) < 31.0


@override_settings(HOLDPOINT_SECRET_KEYS=[])
def test_missing_secret_keys() -> None:
    ok, lines = doctor()
    assert not ok
    assert "HOLDPOINT_SECRET_KEYS is empty" in line_of("secret_keys", lines)


def test_a_credential_no_key_opens(tenant_a: Tenant) -> None:
    credential = ToolCredential(tenant=tenant_a, service="tasks")
    credential.set_secret("s3cret")
    credential.save()
    other = "A" * 43 + "="  # a valid Fernet key, not the one it was stored with
    with override_settings(HOLDPOINT_SECRET_KEYS=[other]):
        ok, lines = doctor()
    assert not ok
    assert "tool credential(s) acme/tasks open with none of the keys" in line_of(
        "secret_keys", lines
    )


def test_a_tool_timeout_above_the_lease(tenant_a: Tenant) -> None:
    define_tickets(tenant_a, "http://127.0.0.1:9", timeout_seconds=10)
    ApprovalPolicy.objects.create(tenant=tenant_a, name="p", tool="tickets.create")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="q", tool="tickets.close")
    ok, lines = doctor()
    assert not ok
    line = line_of("tool_timeouts", lines)
    ttl = settings.HOLDPOINT_LEASE_TTL
    assert f"(HOLDPOINT_LEASE_TTL {ttl} s less one heartbeat interval)" in line
    assert "acme/tickets.create (10 s)" in line and "tickets.close" not in line


def test_a_write_tool_no_policy_names(tenant_a: Tenant) -> None:
    define_tickets(tenant_a, "http://127.0.0.1:9")
    ApprovalPolicy.objects.create(tenant=tenant_a, name="p", tool="tickets.create")
    ok, lines = doctor()
    assert not ok
    line = line_of("write_policies", lines)
    assert line.startswith("WARNING write_policies: write tool(s) no approval policy names: ")
    assert "acme/tickets.close" in line and "tickets.create" not in line
    assert "held by default" in line
    # That a warning alone exits 0 unless --fail-level warning: test_health.py's cluster test.


def test_no_worker_heartbeat() -> None:
    ok, lines = doctor()
    assert not ok
    assert "no worker cluster heartbeat" in line_of("worker", lines)


def test_no_tool_hosts_while_http_tools_exist(tenant_a: Tenant) -> None:
    define_tickets(tenant_a, "http://127.0.0.1:9")
    # (A built-in tracker's host must be allowed for the process to start at all.)
    with override_settings(HOLDPOINT_TOOL_HOSTS=[], HOLDPOINT_TASKS_URL=""):
        ok, lines = doctor()
    assert not ok
    line = line_of("tool_hosts", lines)
    assert "HOLDPOINT_TOOL_HOSTS is empty while http tools exist (acme/tickets.close" in line


@override_settings(DEBUG=True, ALLOWED_HOSTS=["testserver", "holdpoint.example.com"])
def test_debug_on_a_reachable_host() -> None:
    ok, lines = doctor()
    assert not ok
    assert "DEBUG is on while ALLOWED_HOSTS names holdpoint.example.com" in line_of("debug", lines)


@override_settings(ALLOWED_HOSTS=["holdpoint.example.com"], HOLDPOINT_METRICS_TOKEN="")
def test_metrics_without_a_token_on_a_reachable_host_is_a_warning() -> None:
    ok, lines = doctor()
    line = line_of("metrics", lines)
    assert line.startswith("WARNING metrics: /metrics needs no token while ALLOWED_HOSTS")
    assert "HOLDPOINT_METRICS_TOKEN" in line
    with override_settings(HOLDPOINT_METRICS_TOKEN="s3cret"):
        _, lines = doctor()
    assert not [line for line in lines if " metrics: " in line]


def test_broker_retry_not_above_the_task_timeout() -> None:
    conf = {**settings.Q_CLUSTER, "retry": settings.Q_CLUSTER["timeout"]}
    with override_settings(Q_CLUSTER=conf):
        ok, lines = doctor()
    assert not ok
    assert "is not above timeout" in line_of("broker", lines)


@override_settings(DEBUG=True, ALLOWED_HOSTS=["testserver", "holdpoint.example.com"])
def test_readyz_details_are_the_doctors_results(client: Client) -> None:
    _, lines = doctor()
    response = client.get("/readyz")
    checks = response.json()["checks"]
    assert response.status_code == 503  # the worker, as before: not the debug setting
    assert checks["debug"]["problems"] == [line_of("debug", lines).split(": ", 1)[1]]
    assert checks["durability"]["ok"] is True and checks["clock"]["ok"] is True
