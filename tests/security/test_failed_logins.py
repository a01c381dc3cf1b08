"""Failed logins in the journal (issue 16 M3, L8).

M3: a failed login whose User-Agent held a NUL answered 500 and left no `login_failed` entry
(PostgreSQL cannot store a NUL) while django-axes still counted it. Values a client sends
reach the journal escaped and cut; a journal write in a login signal handler never turns
into a 500, nor is it skipped without an error in the log.

L8: every failed login for an existing username appended an entry to each of the person's
tenant streams, while locked out too. Now the first failure of a window is journalled at
once and the rest counted, the count journalled when the window closes: the counts of the
`login_failed` entries add up to the failed logins, and their number stays bounded.
"""

from __future__ import annotations

import http.client
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
import time_machine
from django.conf import settings
from django.db import DatabaseError, connection
from django.test import Client

from audit.journal import tenant_stream
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime.accounts import close_ended_failed_login_windows
from runtime.models import FailedLoginWindow, Role, Tenant
from tests.conftest import Persona, make_persona

START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
WINDOW = settings.HOLDPOINT_LOGIN_FAILURE_WINDOW
LIMIT = settings.AXES_FAILURE_LIMIT


def failures(tenant: Tenant) -> list[JournalEntry]:
    return list(
        JournalEntry.objects.filter(stream=tenant_stream(tenant.pk), type="login_failed").order_by(
            "seq"
        )
    )


def fail(client: Client, username: str = "alice", **extra: Any) -> int:
    response = client.post("/login/", {"username": username, "password": "wrong"}, **extra)
    return int(response.status_code)


# --- M3: odd header values ------------------------------------------------------------------


def post_login_over_http(base_url: str, username: str, password: str, user_agent: str) -> int:
    """The login form over a real socket: GET for the CSRF cookie and field, then the POST
    carrying `user_agent` byte for byte (http.client sends a NUL in a header as it is)."""
    address = urlsplit(base_url)
    conn = http.client.HTTPConnection(address.hostname or "", address.port)
    try:
        conn.request("GET", "/login/")
        page = conn.getresponse()
        html = page.read().decode()
        cookie = re.search(r"csrftoken=([^;]+)", page.getheader("Set-Cookie") or "")
        field = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
        assert cookie and field, html[:300]
        body = urlencode(
            {"username": username, "password": password, "csrfmiddlewaretoken": field.group(1)}
        ).encode()
        conn.putrequest("POST", "/login/")
        conn.putheader("Content-Type", "application/x-www-form-urlencoded")
        conn.putheader("Content-Length", str(len(body)))
        conn.putheader("Cookie", f"csrftoken={cookie.group(1)}")
        conn.putheader("User-Agent", user_agent)
        conn.endheaders(body)
        answer = conn.getresponse()
        answer.read()
        return answer.status
    finally:
        conn.close()


@pytest.mark.django_db(transaction=True)
def test_a_nul_in_the_user_agent_is_journalled_escaped_not_a_500(
    live_server: Any, reviewer_a: Persona
) -> None:
    status = post_login_over_http(live_server.url, "alice", "wrong", "evil\x00agent\x1b[31m")
    assert status == 200  # the login page again, with its error
    (entry,) = failures(reviewer_a.tenant)
    assert entry.payload["user_agent"] == "evil\\x00agent\\x1b[31m"
    assert entry.payload["count"] == 1 and entry.actor == "user:alice"
    assert verify_stream(tenant_stream(reviewer_a.tenant.pk)) is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    "agent, stored",
    [
        ("line\nbreak\rand\ttab", "line\\nbreak\\rand\\ttab"),
        ("bidi\u202eoverride", "bidi\\u202eoverride"),
        ("x" * 5000, "x" * 200),
    ],
)
def test_other_control_characters_and_over_long_agents_are_escaped_and_cut(
    reviewer_a: Persona, agent: str, stored: str
) -> None:
    assert fail(Client(), HTTP_USER_AGENT=agent) == 200
    (entry,) = failures(reviewer_a.tenant)
    assert entry.payload["user_agent"] == stored


@pytest.mark.django_db
def test_a_nul_in_the_accept_header_is_no_500(reviewer_a: Persona) -> None:
    """django-axes stores the Accept header of a failed login too."""
    assert fail(Client(), HTTP_ACCEPT="text/html\x00") == 200
    assert [e.payload["count"] for e in failures(reviewer_a.tenant)] == [1]


@pytest.mark.django_db
def test_a_control_character_in_an_idempotency_key_is_still_refused(agent_a: Persona) -> None:
    """Only descriptive headers are escaped: a key with a control character stays invalid."""
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {agent_a.token}")
    answer = api.post(
        "/api/v1/runs/",
        {"graph": "api-review", "goal": {}},
        format="json",
        HTTP_IDEMPOTENCY_KEY="key\x01",
    )
    assert answer.status_code == 422 and "Idempotency-Key" in answer.json()["errors"]


@pytest.mark.django_db
def test_a_nul_in_the_username_is_no_500(reviewer_a: Persona) -> None:
    assert fail(Client(), "ali\x00ce") == 200
    assert failures(reviewer_a.tenant) == []  # no account has that name


@pytest.mark.django_db
@pytest.mark.parametrize("forwarded", ["not-an-ip", "1.2.3.4, evil\x00", "x" * 300])
def test_a_forwarded_entry_that_is_no_address_counts_as_the_peer(
    reviewer_a: Persona, settings: Any, forwarded: str
) -> None:
    """One proxy configured, but the entry it would have appended is the client's junk (no
    proxy there): the peer's address is counted and journalled, not a 500."""
    settings.HOLDPOINT_PROXY_COUNT = 1
    peer = {"REMOTE_ADDR": "10.0.0.1", "HTTP_X_FORWARDED_FOR": forwarded}
    assert fail(Client(), **peer) == 200
    (entry,) = failures(reviewer_a.tenant)
    assert entry.payload["ip"] == "10.0.0.1"


@contextmanager
def journal_writes_fail() -> Iterator[None]:
    """The database refuses every write to the journal (a full disk, a lost privilege)."""

    def refuse(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if sql.lstrip().upper().startswith(("INSERT", "UPDATE", "WITH")) and (
            "audit_journalentry" in sql or "audit_streamhead" in sql
        ):
            raise DatabaseError("test: the journal cannot be written")
        return execute(sql, *args)

    with connection.execute_wrapper(refuse):
        yield


@pytest.mark.django_db
def test_a_failing_journal_write_in_a_login_handler_is_logged_and_answered(
    reviewer_a: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client()
    with caplog.at_level(logging.ERROR, logger="holdpoint.accounts"), journal_writes_fail():
        assert fail(client) == 200
        ok = client.post("/login/", {"username": "alice", "password": "pw-alice"})
        assert ok.status_code == 302
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    tenant = reviewer_a.tenant.pk
    assert [r.getMessage() for r in errors] == [
        f"could not journal login_failed in tenant {tenant}; the request was answered",
        f"could not journal login in tenant {tenant}; the request was answered",
    ]
    assert all(r.exc_info for r in errors)  # with the traceback
    assert client.get("/inbox/").status_code == 200  # and the login did happen


# --- L8: bounded growth ---------------------------------------------------------------------


@pytest.mark.django_db
def test_fifteen_failures_make_two_entries_whose_counts_add_up(reviewer_a: Persona) -> None:
    tenant = reviewer_a.tenant
    with time_machine.travel(START, tick=False) as clock:
        codes = []
        for _ in range(15):
            codes.append(fail(Client()))
            clock.shift(timedelta(seconds=10))
        assert codes == [200] * (LIMIT - 1) + [429] * (15 - LIMIT + 1)  # locked after LIMIT
        (first,) = failures(tenant)  # one entry so far, at the first failure
        assert first.payload["count"] == 1 and first.payload["ip"] == "127.0.0.1"

        assert close_ended_failed_login_windows() == 0  # the window is still open
        clock.shift(WINDOW)
        assert close_ended_failed_login_windows() == 1
        first_again, rest = failures(tenant)
        assert rest.payload["count"] == 14 and rest.payload["locked_out"] is True
        assert rest.payload["ips"] == ["127.0.0.1"]
        assert sum(e.payload["count"] for e in failures(tenant)) == 15
        assert not FailedLoginWindow.objects.exists()

        # A failure after the window opens a new one, journalled at once.
        fail(Client(), REMOTE_ADDR="10.0.0.9")
        assert [e.payload["count"] for e in failures(tenant)] == [1, 14, 1]
    assert verify_stream(tenant_stream(tenant.pk)) is None


@pytest.mark.django_db
def test_a_login_journals_the_failures_before_it_first(reviewer_a: Persona) -> None:
    for _ in range(3):
        fail(Client())
    assert (
        Client().post("/login/", {"username": "alice", "password": "pw-alice"}).status_code == 302
    )
    kinds = JournalEntry.objects.filter(stream=tenant_stream(reviewer_a.tenant.pk)).order_by("seq")
    assert [(e.type, e.payload.get("count")) for e in kinds] == [
        ("login_failed", 1),
        ("login_failed", 2),
        ("login", None),
    ]


@pytest.mark.django_db
def test_the_next_failure_after_a_window_closes_it(reviewer_a: Persona) -> None:
    """Without the periodic flush, the person's next attempt closes the old window."""
    with time_machine.travel(START, tick=False) as clock:
        for _ in range(3):
            fail(Client())
        clock.shift(WINDOW + timedelta(seconds=1))
        fail(Client())
    assert [e.payload["count"] for e in failures(reviewer_a.tenant)] == [1, 2, 1]


@pytest.mark.django_db
def test_windows_are_per_person_and_tenant(reviewer_a: Persona, tenant_b: Tenant) -> None:
    from runtime.models import Membership

    Membership.objects.create(tenant=tenant_b, user=reviewer_a.user, role=Role.VIEWER)
    make_persona(reviewer_a.tenant, "victor", Role.VIEWER)
    for username in ("alice", "alice", "victor"):
        fail(Client(), username)
    assert len(failures(reviewer_a.tenant)) == 2  # alice's first, victor's first
    assert len(failures(tenant_b)) == 1
    assert FailedLoginWindow.objects.get(user=reviewer_a.user, tenant=tenant_b).unrecorded == 1


@pytest.mark.django_db
def test_the_flush_is_scheduled_and_its_task_closes_ended_windows(reviewer_a: Persona) -> None:
    from importlib import import_module

    from django.apps import apps
    from django_q.models import Schedule

    from runtime import tasks

    # The schedule is the migration's data. A transactional test run before this one (CI's
    # longest-first order can put one there) flushes every table, the migration's rows too:
    # the migration's own function writes it again (update_or_create: as the migration left
    # it), so what is checked is what the migration schedules, whatever ran before.
    migration = import_module("runtime.migrations.0015_failed_login_windows")
    migration.add_schedule(apps, None)
    schedule = Schedule.objects.get(name="holdpoint-failed-logins")
    assert (schedule.func, schedule.schedule_type, schedule.minutes) == (
        "runtime.tasks.close_failed_logins",
        Schedule.MINUTES,
        15,
    )
    with time_machine.travel(START, tick=False) as clock:
        fail(Client())
        fail(Client())
        clock.shift(WINDOW)
        assert tasks.close_failed_logins() == 1
    assert [e.payload["count"] for e in failures(reviewer_a.tenant)] == [1, 1]
