"""Sessions and login: what happens to a reviewer's session from login to its end, and how
repeated failed logins are stopped (issue 9, "Sessions and login"; OWASP ASVS V2.2, V3).

Everything goes through the real login form, middleware and session table; the clock is
moved with time-machine (Django's session expiry and django-axes' cool-off both read
Python's clock).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.conf import settings
from django.contrib.sessions.backends.db import SessionStore
from django.contrib.sessions.models import Session
from django.test import Client
from django.utils import timezone

from audit.journal import tenant_stream
from audit.models import JournalEntry
from runtime.accounts import close_ended_failed_login_windows
from tests.conftest import Persona

pytestmark = pytest.mark.django_db
START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
NEW_PASSWORD = "a-much-longer-passphrase-7"
COOKIE = settings.SESSION_COOKIE_NAME


def log_in(client: Client, username: str, password: str, **extra: Any) -> Any:
    return client.post("/login/", {"username": username, "password": password}, **extra)


def logged_in(client: Client) -> bool:
    """What a reviewer sees: the inbox, or the login page it redirects to."""
    response = client.get("/inbox/")
    if response.status_code == 302:
        assert response.url.startswith("/login/?next=/inbox/"), response.url
        return False
    assert response.status_code == 200
    return True


def key_of(client: Client) -> str:
    return client.cookies[COOKIE].value


# --- a new session at login, gone at logout ------------------------------------------------


def test_login_gives_a_new_session_key_and_the_planted_one_is_dead(reviewer_a: Persona) -> None:
    """Session fixation: a key an attacker planted before login never becomes a logged-in
    session."""
    planted = SessionStore()
    planted["theme"] = "dark"
    planted.create()
    victim = Client()
    victim.cookies[COOKIE] = planted.session_key

    response = log_in(victim, "alice", "pw-alice")
    assert response.status_code == 302 and response.url == "/inbox/"
    assert key_of(victim) != planted.session_key
    assert not Session.objects.filter(session_key=planted.session_key).exists()
    assert logged_in(victim)

    attacker = Client()
    attacker.cookies[COOKIE] = planted.session_key
    assert not logged_in(attacker)


def test_logout_deletes_the_session_and_a_replayed_cookie_is_refused(
    reviewer_a: Persona,
) -> None:
    client = Client()
    log_in(client, "alice", "pw-alice")
    stolen = key_of(client)
    assert Session.objects.filter(session_key=stolen).exists()

    assert client.get("/logout/").status_code == 405  # GET never logs out (or changes state)
    assert logged_in(client)
    response = client.post("/logout/")
    assert response.status_code == 302 and response.url == "/login/"
    assert not Session.objects.filter(session_key=stolen).exists()

    replay = Client()
    replay.cookies[COOKIE] = stolen
    assert not logged_in(replay)
    api = replay.get("/api/v1/runs/")
    assert api.status_code in (401, 403)
    assert api["Content-Type"].startswith("application/problem+json")


def test_login_never_redirects_to_another_site(reviewer_a: Persona) -> None:
    for target in ("https://evil.example/", "//evil.example/inbox/", "/inbox/history/"):
        response = Client().post(
            "/login/", {"username": "alice", "password": "pw-alice", "next": target}
        )
        assert response.status_code == 302
        assert response.url == ("/inbox/history/" if target.startswith("/i") else "/inbox/")


# --- inactivity and absolute timeouts --------------------------------------------------------


def test_a_session_ends_after_the_inactivity_timeout_and_activity_renews_it(
    reviewer_a: Persona,
) -> None:
    idle = timedelta(seconds=settings.SESSION_COOKIE_AGE)
    client = Client()
    with time_machine.travel(START, tick=False) as clock:
        log_in(client, "alice", "pw-alice")
        clock.shift(idle - timedelta(seconds=30))
        assert logged_in(client)  # just inside; this request renews the expiry
        clock.shift(idle - timedelta(seconds=30))
        assert logged_in(client)  # twice the timeout since login, never idle that long
        clock.shift(idle + timedelta(seconds=1))
        assert not logged_in(client)


def test_background_polls_keep_the_page_live_but_not_the_session(reviewer_a: Persona) -> None:
    """An inbox left open polls every 5 s; the reviewer may have gone home. Polls do not count
    as activity, and once the session is gone htmx is told to reload the page (which leads to
    the login page) rather than swap a login form into the list."""
    idle = timedelta(seconds=settings.SESSION_COOKIE_AGE)
    client = Client()
    poll = {"HTTP_HX_REQUEST": "true"}
    with time_machine.travel(START, tick=False) as clock:
        log_in(client, "alice", "pw-alice")
        assert logged_in(client)
        clock.shift(idle - timedelta(seconds=30))
        live = client.get("/inbox/list/", **poll)
        assert live.status_code == 200 and 'id="inbox-live"' in live.content.decode()
        assert COOKIE not in live.cookies  # the expiry was not pushed back
        clock.shift(timedelta(seconds=60))  # 30 s after the poll, 30 s past the timeout
        gone = client.get("/inbox/list/", **poll)
        assert gone.status_code == 200
        assert gone["HX-Refresh"] == "true"
        assert gone.content == b""
        assert not logged_in(client)


def test_a_session_ends_at_its_maximum_age_however_active(reviewer_a: Persona) -> None:
    max_age = timedelta(seconds=settings.HOLDPOINT_SESSION_MAX_AGE)
    step = timedelta(seconds=settings.SESSION_COOKIE_AGE) - timedelta(seconds=60)
    client = Client()
    with time_machine.travel(START, tick=False) as clock:
        log_in(client, "alice", "pw-alice")
        elapsed = timedelta(0)
        while elapsed + step < max_age:
            clock.shift(step)
            elapsed += step
            assert logged_in(client), f"logged out after {elapsed}"
        clock.shift(max_age - elapsed)
        assert not logged_in(client)
    assert log_in(client, "alice", "pw-alice").status_code == 302  # a new login is fine


# --- password change ---------------------------------------------------------------------------


def test_changing_the_password_ends_the_other_sessions_and_keeps_this_one(
    reviewer_a: Persona,
) -> None:
    laptop, phone = Client(), Client()
    log_in(laptop, "alice", "pw-alice")
    log_in(phone, "alice", "pw-alice")
    before = key_of(laptop)

    page = laptop.get("/password/")
    assert page.status_code == 200 and "Change password" in page.content.decode()
    response = laptop.post(
        "/password/",
        {"old_password": "pw-alice", "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD},
    )
    assert response.status_code == 302 and response.url == "/password/done/"
    assert logged_in(laptop)
    assert key_of(laptop) != before  # a new key for the new credentials too
    assert not logged_in(phone)

    assert log_in(Client(), "alice", "pw-alice").status_code == 200  # the form again
    assert log_in(Client(), "alice", NEW_PASSWORD).status_code == 302


def test_a_wrong_current_password_changes_nothing(reviewer_a: Persona) -> None:
    client = Client()
    log_in(client, "alice", "pw-alice")
    response = client.post(
        "/password/",
        {"old_password": "guess", "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD},
    )
    assert response.status_code == 200
    assert "incorrect" in response.content.decode()
    reviewer_a.user.refresh_from_db()
    assert reviewer_a.user.check_password("pw-alice")


def test_an_administrators_password_reset_ends_every_session_of_the_user(
    reviewer_a: Persona,
) -> None:
    client = Client()
    log_in(client, "alice", "pw-alice")
    reviewer_a.user.set_password(NEW_PASSWORD)  # what the admin's password form does
    reviewer_a.user.save()
    assert not logged_in(client)


def test_the_password_page_needs_a_login() -> None:
    response = Client().get("/password/")
    assert response.status_code == 302 and response.url.startswith("/login/?next=/password/")


# --- lockout after repeated failures (django-axes) -----------------------------------------------

LIMIT = settings.AXES_FAILURE_LIMIT
COOLOFF = settings.AXES_COOLOFF_TIME


def fail(client: Client, username: str, times: int, **extra: Any) -> list[int]:
    return [log_in(client, username, "wrong", **extra).status_code for _ in range(times)]


def assert_locked(response: Any) -> str:
    body = response.content.decode()
    assert response.status_code == 429, body[:300]
    assert response["Retry-After"] == str(int(COOLOFF.total_seconds()))
    assert "Too many failed logins" in body
    minutes = int(COOLOFF.total_seconds() // 60)
    assert re.search(rf"blocked for {minutes} minutes? after {LIMIT} failed attempts?", body)
    return body


def test_repeated_failures_lock_the_username_from_that_address(reviewer_a: Persona) -> None:
    client = Client()
    assert fail(client, "alice", LIMIT - 1) == [200] * (LIMIT - 1)
    assert_locked(log_in(client, "alice", "wrong"))  # the LIMIT-th failure
    assert_locked(log_in(client, "alice", "pw-alice"))  # now even the right password
    assert not logged_in(client)

    # Journalled once per window with a count (issue 16 L8): the first failure at once, the
    # rest when the window closes — here by the periodic flush after the window.
    entries = JournalEntry.objects.filter(
        stream=tenant_stream(reviewer_a.tenant.pk), type="login_failed"
    ).order_by("seq")
    assert [e.payload["count"] for e in entries] == [1]
    with time_machine.travel(timezone.now() + settings.HOLDPOINT_LOGIN_FAILURE_WINDOW):
        close_ended_failed_login_windows()
    assert [(e.payload["count"], e.payload.get("locked_out", False)) for e in entries.all()] == [
        (1, False),
        (LIMIT, True),
    ]


def test_the_lockout_is_per_username_and_address(reviewer_a: Persona, viewer_a: Persona) -> None:
    here = {"REMOTE_ADDR": "10.0.0.1"}
    fail(Client(), "alice", LIMIT, **here)
    assert_locked(log_in(Client(), "alice", "pw-alice", **here))
    # Nobody can lock alice out from elsewhere, nor everyone out from one address.
    assert log_in(Client(), "alice", "pw-alice", REMOTE_ADDR="10.0.0.2").status_code == 302
    assert log_in(Client(), "victor", "pw-victor", **here).status_code == 302


def test_unknown_usernames_are_locked_the_same_way(reviewer_a: Persona) -> None:
    """The lockout page is the same for a real and an invented username: no account oracle."""
    fail(Client(), "alice", LIMIT)
    fail(Client(), "mallory", LIMIT)
    real = assert_locked(log_in(Client(), "alice", "x"))
    invented = assert_locked(log_in(Client(), "mallory", "x"))
    assert real == invented


def test_a_forged_forwarded_for_header_does_not_reset_the_count(reviewer_a: Persona) -> None:
    codes = [
        log_in(Client(), "alice", "wrong", HTTP_X_FORWARDED_FOR=f"203.0.113.{i}").status_code
        for i in range(LIMIT)
    ]
    assert codes == [200] * (LIMIT - 1) + [429]
    assert_locked(log_in(Client(), "alice", "pw-alice", HTTP_X_FORWARDED_FOR="198.51.100.7"))


def test_behind_a_proxy_the_address_it_saw_is_counted(reviewer_a: Persona, settings: Any) -> None:
    settings.HOLDPOINT_PROXY_COUNT = 1
    proxy = {"REMOTE_ADDR": "10.9.9.9"}
    # What the client put in the header (the first entry) is ignored; the proxy's entry counts.
    for forged in range(LIMIT):
        log_in(Client(), "alice", "wrong", HTTP_X_FORWARDED_FOR=f"6.6.6.{forged}, 1.2.3.4", **proxy)
    assert_locked(log_in(Client(), "alice", "pw-alice", HTTP_X_FORWARDED_FOR="1.2.3.4", **proxy))
    other = log_in(Client(), "alice", "pw-alice", HTTP_X_FORWARDED_FOR="5.6.7.8", **proxy)
    assert other.status_code == 302
    # The audit trail names the same addresses the lockout counted.
    stream = tenant_stream(reviewer_a.tenant.pk)
    entries = JournalEntry.objects.filter(stream=stream).order_by("seq")
    failed = entries.filter(type="login_failed")
    assert {
        ip for e in failed for ip in [e.payload.get("ip"), *e.payload.get("ips", [])] if ip
    } == {"1.2.3.4"}
    assert entries.filter(type="login").last().payload["ip"] == "5.6.7.8"


def test_the_lockout_ends_after_the_cool_off(reviewer_a: Persona) -> None:
    with time_machine.travel(START, tick=False) as clock:
        fail(Client(), "alice", LIMIT)
        clock.shift(COOLOFF - timedelta(seconds=5))
        assert_locked(log_in(Client(), "alice", "pw-alice"))
        # That attempt during the lockout started the wait again.
        clock.shift(COOLOFF - timedelta(seconds=5))
        assert_locked(log_in(Client(), "alice", "pw-alice"))
        clock.shift(COOLOFF + timedelta(seconds=1))
        assert log_in(Client(), "alice", "pw-alice").status_code == 302


def test_a_successful_login_clears_the_count(reviewer_a: Persona) -> None:
    client = Client()
    assert fail(client, "alice", LIMIT - 1) == [200] * (LIMIT - 1)
    assert log_in(client, "alice", "pw-alice").status_code == 302
    client.post("/logout/")
    assert fail(client, "alice", LIMIT - 1) == [200] * (LIMIT - 1)
    assert log_in(client, "alice", "pw-alice").status_code == 302


def test_the_admin_login_is_locked_too(admin_a: Persona) -> None:
    client = Client()

    def admin_login(password: str) -> Any:
        return client.post(
            "/admin/login/?next=/admin/",
            {"username": "ada", "password": password, "next": "/admin/"},
        )

    assert [admin_login("wrong").status_code for _ in range(LIMIT - 1)] == [200] * (LIMIT - 1)
    assert_locked(admin_login("wrong"))
    assert_locked(admin_login("pw-ada"))
    assert client.get("/admin/").status_code == 302  # still the admin's login page
