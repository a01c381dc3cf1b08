"""Response headers and cookies: a strict Content-Security-Policy, no framing, HSTS, nosniff,
Referrer-Policy, Cross-Origin-Opener-Policy, and Secure/HttpOnly/SameSite cookies (issue 9,
"Headers"; OWASP ASVS V14.4, V3.4).

The test settings are the production settings with the HTTPS redirect switched off
(config/settings_test.py), so what is asserted here is what a deployment sends. The browser
proves the policy holds on every page (test_browser_security.py); this module pins the
policy itself and keeps inline code out of the templates.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import Client

from approvals.models import ApprovalPolicy, ApprovalRequest
from tests.approvals.conftest import policy  # noqa: F401  (fixture)
from tests.approvals.test_pages import raise_request
from tests.conftest import Persona

pytestmark = pytest.mark.django_db
TEMPLATES = Path(settings.BASE_DIR) / "templates"
STRICT = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'"],
    "img-src": ["'self'"],
    "connect-src": ["'self'"],
    "font-src": ["'self'"],
    "object-src": ["'none'"],
    "base-uri": ["'none'"],
    "frame-src": ["'none'"],
    "frame-ancestors": ["'none'"],
    "form-action": ["'self'"],
}


def csp(response: Any) -> dict[str, list[str]]:
    header = response["Content-Security-Policy"]
    found: dict[str, list[str]] = {}
    for directive in filter(None, (d.strip() for d in header.split(";"))):
        name, *values = directive.split()
        assert name not in found, f"{name} twice in {header}"
        found[name] = values
    return found


@pytest.fixture
def pages(reviewer_a: Persona, policy: ApprovalPolicy) -> tuple[Client, list[str]]:  # noqa: F811
    """A logged-in reviewer and the URLs of their pages, each with something on it."""
    request: ApprovalRequest = raise_request(reviewer_a.tenant)
    client = Client()
    client.force_login(reviewer_a.user)
    return client, [
        "/inbox/",
        "/inbox/history/",
        f"/approvals/{request.pk}/",
        "/runs/",
        f"/runs/{request.run_id}/",
        f"/runs/{request.run_id}/trail/",
        "/reconcile/",
        "/audit/",
        "/password/",
    ]


def test_every_page_and_api_answer_carries_the_strict_policy(
    pages: tuple[Client, list[str]],
) -> None:
    client, urls = pages
    anonymous = Client()
    responses = [client.get(url) for url in urls]
    responses += [
        anonymous.get("/login/"),
        anonymous.get("/admin/login/"),
        client.get("/api/v1/runs/"),
        client.get("/api/v1/schema/"),
        client.get("/no-such-page/"),
    ]
    for response in responses:
        url = response.wsgi_request.get_full_path()
        assert response.status_code in (200, 404), url
        assert csp(response) == STRICT, url
        assert response["X-Frame-Options"] == "DENY", url
        assert response["X-Content-Type-Options"] == "nosniff", url
        assert response["Referrer-Policy"] == "same-origin", url
        assert response["Cross-Origin-Opener-Policy"] == "same-origin", url


def test_the_swagger_ui_page_widens_img_src_only() -> None:
    response = Client().get("/api/v1/docs/")
    assert response.status_code == 200
    directives = csp(response)
    assert directives["img-src"] == ["'self'", "data:"]
    assert {k: v for k, v in directives.items() if k != "img-src"} == {
        k: v for k, v in STRICT.items() if k != "img-src"
    }
    html = response.content.decode()
    assert "<style" not in html
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), "an inline script"
    script = Client().get("/api/v1/docs/?script=")
    assert script.status_code == 200
    assert script["Content-Type"].startswith("application/javascript")
    assert '"validatorUrl": null' in script.content.decode()  # no badge from swagger.io


def test_hsts_on_https_answers() -> None:
    response = Client().get("/login/", secure=True)
    assert response["Strict-Transport-Security"] == (
        f"max-age={settings.SECURE_HSTS_SECONDS}; includeSubDomains; preload"
    )
    assert settings.SECURE_HSTS_SECONDS >= 365 * 24 * 3600


def test_session_and_csrf_cookies_are_secure_httponly_and_samesite(reviewer_a: Persona) -> None:
    client = Client()
    page = client.get("/login/", secure=True)
    csrf_cookie = page.cookies[settings.CSRF_COOKIE_NAME]
    assert csrf_cookie["secure"] is True
    assert csrf_cookie["samesite"] == "Lax"
    response = client.post("/login/", {"username": "alice", "password": "pw-alice"}, secure=True)
    assert response.status_code == 302
    session = response.cookies[settings.SESSION_COOKIE_NAME]
    assert session["secure"] is True
    assert session["httponly"] is True
    assert session["samesite"] == "Lax"
    assert int(session["max-age"]) == settings.SESSION_COOKIE_AGE


# --- nothing inline in the templates -------------------------------------------------------

INLINE = {
    "inline script": re.compile(r"<script(?![^>]*\bsrc=)[^>]*>", re.I),
    "event handler attribute": re.compile(r"<[^>]*\son[a-z]+\s*=", re.I),
    "style attribute": re.compile(r"<[^>]*\sstyle\s*=", re.I),
    "style element": re.compile(r"<style[\s>]", re.I),
    "javascript: URL": re.compile(r"javascript:", re.I),
}


def test_no_template_has_inline_script_style_or_handlers() -> None:
    """Inline code is what the policy blocks, so none may be written: a template with it
    would break in the browser, not only be unsafe."""
    found = []
    templates = sorted(TEMPLATES.rglob("*.html"))
    assert len(templates) > 15
    for path in templates:
        text = path.read_text()
        for what, pattern in INLINE.items():
            for match in pattern.finditer(text):
                found.append(f"{path.relative_to(TEMPLATES)}: {what}: {match.group(0)[:60]}")
    assert found == []


def test_htmx_is_configured_for_the_policy(pages: tuple[Client, list[str]]) -> None:
    client, _ = pages
    html = client.get("/inbox/").content.decode()
    meta = re.search(r"""<meta name="htmx-config" content='([^']*)'>""", html)
    assert meta is not None
    import json

    config = json.loads(meta.group(1))
    assert config == {
        "includeIndicatorStyles": False,
        "allowEval": False,
        "allowScriptTags": False,
    }
    assert "/static/django_htmx/htmx-2.min.js" in html
