"""Error pages a person can act on: 403, 404 and 500 in the site's layout, each saying what
to do next; the API keeps answering problem+json on the same errors (issue 20).

A 403 is an ordinary answer (a viewer pressed a reviewer's button): one warning line, no
traceback in the log. A 500 is a fault: its traceback is logged, the page shows none.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.core.exceptions import PermissionDenied
from django.test import Client, RequestFactory

from runtime.api.problems import SERVER_FAULT, permission_denied, server_error
from runtime.lifecycle import create_run
from tests.conftest import Persona

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]


def login(persona: Persona) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(persona.user)
    return client


def in_layout(html: str) -> None:
    """The site's own page: its stylesheet, favicon and header, not Django's bare text."""
    assert 'href="/static/holdpoint/app.css"' in html
    assert 'rel="icon"' in html
    assert '<header class="top">' in html


def test_a_viewer_refused_gets_the_403_page_and_no_traceback_is_logged(
    viewer_a: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    run = create_run(viewer_a.tenant, "chain", {"steps": 1}, actor="agent:agent-a")
    client = login(viewer_a)
    with caplog.at_level(logging.INFO):
        response = client.post(f"/runs/{run.run_id}/cancel/", {"reason": "stop"})
    assert response.status_code == 403
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    in_layout(html)
    assert "You are not allowed to do this" in html
    assert "Viewers may look, not act." in html  # the reason the page gave
    assert "You are logged in as <strong>victor</strong>, viewer in Acme" in html
    assert 'href="/inbox/"' in html and "Go back to the inbox" in html
    assert '<a href="/login/">Log in as someone else</a> who may do it.' in html
    assert "ask a tenant admin of Acme for the reviewer role" in html
    refused = [r for r in caplog.records if r.getMessage().startswith("Forbidden")]
    assert [(r.name, r.levelname) for r in refused] == [("django.request", "WARNING")]
    assert "POST /runs/" in refused[0].getMessage() and "by victor" in refused[0].getMessage()
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []


def test_the_403_page_is_the_same_whatever_was_refused(viewer_a: Persona) -> None:
    """Refusing another tenant's object and a missing one must not differ by a byte (the
    admin's isolation tests compare them): no path on the page, no CSRF token, whose mask
    is random on every render."""

    def refused(path: str) -> bytes:
        request = RequestFactory().get(path)
        request.user = viewer_a.user
        return permission_denied(request, PermissionDenied()).content

    first = refused("/admin/auth/user/4/change/")
    assert first == refused("/admin/auth/user/999/change/")
    assert b"csrfmiddlewaretoken" not in first and b"/999/" not in first


def test_403_under_the_api_is_a_problem(caplog: pytest.LogCaptureFixture) -> None:
    request = RequestFactory().get("/api/v1/runs/")
    with caplog.at_level(logging.INFO):
        response = permission_denied(request, PermissionDenied())
    assert response.status_code == 403
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["code"] == "not_permitted"
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []


def test_404_page_says_where_to_look(reviewer_a: Persona) -> None:
    client = login(reviewer_a)
    response = client.get(f"/runs/{uuid.uuid4()}/")
    assert response.status_code == 404
    html = response.content.decode()
    in_layout(html)
    assert "Nothing here" in html
    assert "belongs to another tenant than Acme" in html
    assert 'href="/inbox/"' in html and 'href="/runs/"' in html
    assert re.search(r'<nav>.*href="/inbox/"', html, re.S)  # the header's sections are there
    # Another tenant's id and a random one get the same bytes (no path, no CSRF token).
    assert client.get(f"/runs/{uuid.uuid4()}/").content == response.content


def test_404_page_for_someone_logged_out_offers_the_login(client: Client) -> None:
    response = client.get("/no/such/page/")
    assert response.status_code == 404
    html = response.content.decode()
    in_layout(html)
    assert 'href="/login/"' in html and "Log in</a> and open the link again" in html


def test_404_under_the_api_stays_a_problem(client: Client) -> None:
    response = client.get("/api/v1/no-such-thing/")
    assert response.status_code == 404
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "not_found"


@pytest.mark.urls("tests.web.urls_boom")
def test_500_page_in_the_layout_and_the_fault_logged(
    reviewer_a: Persona, caplog: pytest.LogCaptureFixture
) -> None:
    client = login(reviewer_a)
    with caplog.at_level(logging.INFO):
        response = client.get("/runs/boom/")
    assert response.status_code == 500
    html = response.content.decode()
    in_layout(html)
    assert "Something went wrong on our side" in html
    assert "open that page again before you retry" in html
    assert "an unexpected bug" not in html and "Traceback" not in html
    faults = [r for r in caplog.records if r.exc_info]
    assert [r.exc_info[0] for r in faults if r.exc_info] == [RuntimeError]

    api = client.get("/api/v1/boom/")
    assert api.status_code == 500
    assert api["Content-Type"] == "application/problem+json"
    assert api.json()["code"] == "server_error"


@pytest.mark.urls("tests.web.urls_boom")
def test_an_api_500_does_not_promise_that_nothing_was_applied(client: Client) -> None:
    """A request is not one transaction: what it committed before a fault stays. The answer
    said "nothing was applied by this call", and an agent that believed it would redo it."""
    from runtime.models import Tenant

    answer = client.post("/api/v1/half-done/", {}, content_type="application/json")
    assert answer.status_code == 500
    assert answer["Content-Type"] == "application/problem+json"
    body = answer.json()
    assert body["code"] == "server_error" and body["request_id"]
    assert Tenant.objects.filter(slug="half-done").exists()  # it was applied, in part
    assert "nothing was applied" not in body["detail"]
    assert "may have been applied" in body["detail"] and "before you retry" in body["detail"]
    # The 500 handler's answer (a fault outside DRF) says the same.
    outside = Client(raise_request_exception=False).get("/api/v1/boom/")
    assert outside.status_code == 500 and outside.json()["detail"] == SERVER_FAULT


def test_500_page_needs_no_database(django_assert_num_queries: object) -> None:
    """Rendered without the request, so even a dead database cannot break the error page."""
    with django_assert_num_queries(0):  # type: ignore[operator]
        response = server_error(RequestFactory().get("/runs/"))
    assert response.status_code == 500
    assert b"Something went wrong on our side" in response.content


def test_every_page_names_a_favicon_that_is_served(client: Client, reviewer_a: Persona) -> None:
    for page in ("/login/", "/admin/login/"):
        html = client.get(page).content.decode()
        icon = re.search(r'<link rel="icon" href="([^"]+)"', html)
        assert icon, f"{page} names no favicon"
        served = client.get(icon.group(1))
        assert served.status_code == 200, icon.group(1)
        assert served["Content-Type"] == "image/svg+xml"
        assert b"<svg" in b"".join(served.streaming_content)


def test_in_debug_a_django_log_line_is_printed_once(tmp_path: Path) -> None:
    """`make run` runs with DEBUG: Django's own console handler used to print every
    django.* line (a refused request's traceback among them) a second time."""
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env.update(DEBUG="1", HOLDPOINT_VAR_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="config.settings")
    code = "import logging; logging.getLogger('django.request').warning('refused-once')"
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout + done.stderr).count("refused-once") == 1


def test_error_pages_leave_waiting_messages_to_the_next_page(reviewer_a: Persona) -> None:
    """A 404 between starting a run and the page that says so neither shows nor swallows
    "Started …" (and so answers the same whichever request comes first)."""
    client = login(reviewer_a)
    started = client.post("/runs/", {"graph": "chain", "goal": '{"steps": 1}'})
    assert started.status_code == 302
    first = client.get(f"/runs/{uuid.uuid4()}/")
    assert b"Started chain@1" not in first.content
    assert client.get(f"/runs/{uuid.uuid4()}/").content == first.content
    assert b"Started chain@1" in client.get("/runs/").content
