"""CSRF: every form carries a token, every state-changing URL refuses a POST without one, and
a reviewer's session cannot write through the API without the X-CSRFToken header (issue 9,
"Headers"; OWASP ASVS V4.2.2, V13.2.3).

The clients here enforce CSRF checks as a browser's request would meet them (Django's test
client skips them unless told). What "refused" means to the reviewer: a 403 page saying
nothing was done, and nothing in the database changed. The cross-origin form in a real
browser is in test_browser_security.py.
"""

from __future__ import annotations

import re
import uuid
from html.parser import HTMLParser
from typing import Any

import pytest
from django.contrib import admin
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from rest_framework.test import APIClient

from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from runtime.models import Action, ActionStatus, Membership, Role, Tenant
from tests.api import api_routes, row_counts
from tests.approvals.conftest import policy  # noqa: F401  (fixture)
from tests.approvals.test_pages import raise_request
from tests.conftest import Persona

pytestmark = pytest.mark.django_db
REFUSED = "Nothing was done"
TOKEN_FIELD = "csrfmiddlewaretoken"


class Forms(HTMLParser):
    """The POST forms of a page: action and fields, as a browser would submit them."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form" and a.get("method", "get").lower() == "post":
            self._open = {"action": a.get("action", ""), "fields": {}}
            self.forms.append(self._open)
        elif self._open is not None and tag in ("input", "textarea", "select") and a.get("name"):
            if a.get("type") in ("checkbox", "radio") and "checked" not in a:
                return
            self._open["fields"].setdefault(a["name"], a.get("value", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._open = None


def post_forms(html: str) -> list[dict[str, Any]]:
    parser = Forms()
    parser.feed(html)
    return parser.forms


def checking_client(user: Any | None = None) -> Client:
    client = Client(enforce_csrf_checks=True)
    if user is not None:
        client.force_login(user)
    return client


def refused(response: Any) -> None:
    assert response.status_code == 403, response.status_code
    assert REFUSED in response.content.decode()


@pytest.fixture
def world(
    reviewer_a: Persona,
    tenant_b: Tenant,
    policy: ApprovalPolicy,  # noqa: F811
) -> dict[str, Any]:
    """Something behind every form: a pending request, a run, an action waiting for
    reconciliation, and a second tenant so the tenant switcher shows."""
    pending = raise_request(reviewer_a.tenant)
    parked = raise_request(reviewer_a.tenant, target="shop-v1")
    Action.objects.filter(pk=parked.action_id).update(status=ActionStatus.MANUAL_REVIEW)
    ApprovalRequest.objects.filter(pk=parked.pk).update(status=ApprovalStatus.CANCELLED)
    Membership.objects.create(tenant=tenant_b, user=reviewer_a.user, role=Role.VIEWER)
    return {"pending": pending, "parked": parked}


def test_every_post_form_carries_a_token_and_is_refused_without_it(
    reviewer_a: Persona, world: dict[str, Any]
) -> None:
    pending, parked = world["pending"], world["parked"]
    client = checking_client(reviewer_a.user)
    pages = [
        "/inbox/",
        f"/approvals/{pending.pk}/",
        "/runs/",
        f"/runs/{pending.run_id}/",
        f"/reconcile/{parked.action_id}/",
        "/password/",
    ]
    forms: dict[str, dict[str, Any]] = {}
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, page
        for form in post_forms(response.content.decode()):
            assert form["fields"].get(TOKEN_FIELD), f"a form without a token on {page}"
            forms.setdefault(form["action"], form)
    forms["/login/"] = post_forms(Client().get("/login/").content.decode())[0]
    actions = set(forms)
    expected = {
        "/login/",
        "/logout/",
        "/tenant/switch/",
        "/password/",
        "/runs/",
        f"/approvals/{pending.pk}/decide/",
        f"/runs/{pending.run_id}/revise/",
        f"/runs/{pending.run_id}/cancel/",
        f"/reconcile/{parked.action_id}/resolve/",
    }
    assert expected <= actions, expected - actions

    before = row_counts()
    for action, form in sorted(forms.items()):
        fields = {k: v for k, v in form["fields"].items() if k != TOKEN_FIELD}
        refused(client.post(action, fields))
    assert row_counts() == before
    assert ApprovalRequest.objects.get(pk=pending.pk).status == ApprovalStatus.PENDING
    assert client.get("/inbox/").status_code == 200  # the logout form did not log out


def test_the_decision_form_works_with_its_token_and_not_from_another_origin(
    reviewer_a: Persona, world: dict[str, Any]
) -> None:
    """The positive control: the same form with its token decides; with the token but sent
    from another site (the browser says so in Origin) it is refused."""
    pending = world["pending"]
    client = checking_client(reviewer_a.user)
    page = client.get(f"/approvals/{pending.pk}/").content.decode()
    approve = next(f for f in post_forms(page) if f["fields"].get("decision") == "approve")

    foreign = client.post(approve["action"], approve["fields"], HTTP_ORIGIN="http://evil.example")
    refused(foreign)
    assert ApprovalRequest.objects.get(pk=pending.pk).status == ApprovalStatus.PENDING

    response = client.post(approve["action"], approve["fields"])
    assert response.status_code == 302
    assert ApprovalRequest.objects.get(pk=pending.pk).status == ApprovalStatus.APPROVED


def _page_routes() -> list[tuple[str, bool]]:
    """Every URL of the site outside the API and the admin, with placeholders filled in, and
    whether its view is csrf_exempt."""
    fill = {"uuid": str(uuid.uuid4()), "int": "1", "str": "x", "path": "x", "slug": "x"}
    found: list[tuple[str, bool]] = []

    def walk(patterns: list[Any], prefix: str) -> None:
        for entry in patterns:
            route = prefix + str(entry.pattern)
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, route)
            elif isinstance(entry, URLPattern):
                route = re.sub(r"<(?:(\w+):)?\w+>", lambda m: fill[m.group(1) or "str"], route)
                found.append(("/" + route, getattr(entry.callback, "csrf_exempt", False)))

    walk(get_resolver().url_patterns, "")
    return found


def test_no_page_is_csrf_exempt_and_every_url_refuses_a_post_without_a_token(
    reviewer_a: Persona,
) -> None:
    routes = _page_routes()
    exempt = [r for r, ex in routes if ex and not r.startswith("/api/v1/")]
    assert exempt == []  # only DRF's views are exempt, and they check CSRF for sessions

    admin_urls = ["/admin/", reverse("admin:login"), reverse("admin:logout")]
    admin_urls.append(reverse("admin:password_change"))
    for model in admin.site._registry:
        name = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        admin_urls += [reverse(f"{name}_changelist"), reverse(f"{name}_add")]
    pages = [r for r, _ in routes if not r.startswith(("/api/v1/", "/admin/"))]
    assert len(pages) >= 20 and len(admin_urls) >= 10

    client = checking_client(reviewer_a.user)
    before = row_counts()
    for url in pages + admin_urls:
        response = client.post(url, {"decision": "approve", "reason": "x"})
        assert response.status_code == 403, f"{url}: {response.status_code}"
    assert row_counts() == before
    print(f"CSRF: {len(pages)} page URLs and {len(admin_urls)} admin URLs refuse a tokenless POST")


# --- the API with a reviewer's session -----------------------------------------------------


def _session_api(user: Any) -> APIClient:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def test_a_session_api_write_needs_the_csrf_header(
    reviewer_a: Persona, world: dict[str, Any]
) -> None:
    pending: ApprovalRequest = world["pending"]
    client = _session_api(reviewer_a.user)
    url = f"/api/v1/approvals/{pending.pk}/decision/"
    body = {"decision": "approve", "action_hash": pending.action_hash, "reason": "ok"}

    response = client.post(url, body, format="json")
    assert response.status_code == 403
    assert response["Content-Type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["code"] == "not_permitted" and "CSRF" in problem["detail"]
    assert ApprovalRequest.objects.get(pk=pending.pk).status == ApprovalStatus.PENDING

    client.get("/inbox/")  # any page sets the csrftoken cookie, as in the browser
    token = client.cookies["csrftoken"].value
    response = client.post(url, body, format="json", HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "approved"


def test_every_session_api_write_is_refused_without_the_header(reviewer_a: Persona) -> None:
    client = _session_api(reviewer_a.user)
    before = row_counts()
    combos = 0
    for route, names, methods in api_routes():
        url = route
        for name in names:
            url = url.replace("{" + name + "}", "1" if name == "rev" else str(uuid.uuid4()))
        for method in methods:
            if method == "GET":
                continue  # reads need no token
            response = client.generic(method, url, b"{}", content_type="application/json")
            if route.endswith(("/schema/", "/docs/")):
                assert response.status_code == 405  # read-only, public
                continue
            assert response.status_code == 403, f"{method} {url}: {response.status_code}"
            assert "CSRF" in response.json()["detail"]
            combos += 1
    assert combos >= 12
    assert row_counts() == before
    print(f"CSRF: {combos} API write calls refused for a session without X-CSRFToken")


def test_an_agent_token_needs_no_csrf_token(agent_a: Persona) -> None:
    """A token is not an ambient credential a browser attaches by itself, so CSRF does not
    apply: the agent's write goes through under the same checking client."""
    client = agent_a.api()
    client.handler.enforce_csrf_checks = True
    response = client.post(
        "/api/v1/runs/",
        {"graph": "chain", "goal": {"steps": 1}, "external": True},
        format="json",
    )
    assert response.status_code == 201, response.content
