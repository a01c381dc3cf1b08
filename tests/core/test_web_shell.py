"""Reviewers log in with a session; pages need login; logout ends the session."""

from __future__ import annotations

from django.test import Client
from django.urls import reverse

from tests.conftest import Persona


def test_login_then_inbox_then_logout(client: Client, reviewer_a: Persona) -> None:
    assert client.get(reverse("inbox")).status_code == 302  # to login
    login_page = client.get(reverse("login"))
    assert login_page.status_code == 200 and b"Log in" in login_page.content

    done = client.post(reverse("login"), {"username": "alice", "password": "pw-alice"})
    assert done.status_code == 302 and done["Location"] == reverse("inbox")
    inbox = client.get(reverse("inbox"))
    assert inbox.status_code == 200
    assert b"Nothing is waiting for you" in inbox.content
    assert b"Acme" in inbox.content

    client.post(reverse("logout"))
    assert client.get(reverse("inbox")).status_code == 302


def test_wrong_password_is_refused(client: Client, reviewer_a: Persona) -> None:
    page = client.post(reverse("login"), {"username": "alice", "password": "nope"})
    assert page.status_code == 200
    assert b"didn't match" in page.content
    assert "_auth_user_id" not in client.session


def test_agent_cannot_log_in_with_a_session(client: Client, agent_a: Persona) -> None:
    """With the account's right password: an empty one is refused for anyone, so it would
    prove nothing about agents (issue 16, tests that must get teeth)."""
    username = agent_a.user.get_username()
    assert agent_a.user.check_password(f"pw-{username}")  # the password is right
    page = client.post(reverse("login"), {"username": username, "password": f"pw-{username}"})
    assert "_auth_user_id" not in client.session
    assert page.status_code == 200
    assert client.get(reverse("inbox")).status_code == 302  # still sent to the login page


def test_healthz(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
