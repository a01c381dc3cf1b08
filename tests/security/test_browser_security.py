"""The Content-Security-Policy, framing and CSRF protections in a real browser (Debian's
Chromium driven by Playwright; issue 9, "Headers").

What only a browser proves: that every page works under the policy with zero violations
(htmx polling and swapping, triage.js, the admin, Swagger UI), that script injected into a
page is not run, that another site cannot frame Holdpoint, and that a form on another site
posting to a decision URL with the reviewer's cookies is refused. The other site is a real
HTTP server on another port (another origin, same site: the session cookie is sent, so the
CSRF check — not SameSite — is what refuses it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, ApprovalVote
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Tenant
from tests.approvals.conftest import policy  # noqa: F401  (fixture)
from tests.approvals.test_pages import raise_request
from tests.browser import log_in, screenshot
from tests.conftest import Persona

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture fails (CI) or skips (locally) with the reason
    expect = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytest_plugins = ("tests.browser",)  # the browser and new_page fixtures
# A page's layout and scripts in Chromium: CI runs them on SQLite only (tests/ci_pair.py).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.ci_database("sqlite")]
Pages = Callable[[], "Page"]
PAYLOAD = '<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2">'

# Records every violation the page reports, from the first byte of each document on.
WATCH = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(e.effectiveDirective + " " + (e.blockedURI || "inline") + " " + e.sample);
});
"""


class Watched:
    """A page with its CSP violations, console errors and script errors collected."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.console: list[str] = []
        self.errors: list[str] = []
        self.failed: list[str] = []
        page.add_init_script(WATCH)
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("response", self._response)

    def _response(self, response: Any) -> None:
        # Chromium asks every site for /favicon.ico; Holdpoint has none.
        if response.status >= 400 and not response.url.endswith("/favicon.ico"):
            self.failed.append(f"{response.status} {response.url}")

    def violations(self) -> list[str]:
        reported = self.page.evaluate("window.__csp || []")
        logged = [m for m in self.console if "Content Security Policy" in m]
        return list(reported) + logged

    def clean(self, where: str) -> None:
        """No violation, no console error, no uncaught script error so far."""
        problems = self.violations() + self.errors + self.failed
        problems += [  # a failed load is in self.failed, with its URL
            m for m in self.console if m.startswith("error:") and "Failed to load resource" not in m
        ]
        assert problems == [], f"{where}: {problems}"


@pytest.fixture
def other_site(tmp_path: Path, live_server: Any) -> Iterator[tuple[str, Path]]:
    """Another origin on the same host (another port): a plain file server."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host = urlsplit(live_server.url).hostname
    try:
        yield f"http://{host}:{server.server_address[1]}", tmp_path
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def world(reviewer_a: Persona, policy: ApprovalPolicy) -> dict[str, Any]:  # noqa: F811
    """A pending request, an action waiting for reconciliation, and a request whose params
    are the attacker's markup (what an agent could put in front of a reviewer)."""
    tenant: Tenant = reviewer_a.tenant
    parked = raise_request(tenant, target="shop-v1")
    Action.objects.filter(pk=parked.action_id).update(status=ActionStatus.MANUAL_REVIEW)
    ApprovalRequest.objects.filter(pk=parked.pk).update(status=ApprovalStatus.CANCELLED)
    hostile = raise_request(tenant, params={"title": PAYLOAD}, target=PAYLOAD)
    run = create_run(tenant, "chain", {"steps": 1, "note": PAYLOAD}, actor="agent:agent-a")
    pending = raise_request(tenant, target="shop-v2")
    return {"pending": pending, "parked": parked, "hostile": hostile, "run": run}


def test_every_reviewer_page_works_with_no_csp_violation(
    live_server: Any, new_page: Pages, reviewer_a: Persona, world: dict[str, Any]
) -> None:
    base = live_server.url
    pending: ApprovalRequest = world["pending"]
    watched = Watched(new_page())
    page = watched.page

    page.goto(base + "/login/")
    watched.clean("login page")
    log_in(page, base, "alice", "pw-alice")
    expect(page.locator(".approval-card")).to_have_count(2)
    page.wait_for_function("window.htmx !== undefined")
    # One round of the inbox's htmx poll: fetched, swapped in, still no violation.
    with page.expect_response(lambda r: "/inbox/list/" in r.url, timeout=15_000) as polled:
        pass
    assert polled.value.status == 200
    expect(page.locator("#inbox-live .approval-card")).to_have_count(2)
    watched.clean("inbox and its poll")

    visits = {
        "/inbox/history/": "h1",
        "/runs/": "h1",
        f"/runs/{world['run'].run_id}/": "h1",
        f"/runs/{world['run'].run_id}/trail/": "h1",
        "/reconcile/": "h1",
        f"/reconcile/{world['parked'].action_id}/": "h1",
        "/audit/": "h1",
        "/password/": "h1",
        f"/approvals/{world['hostile'].pk}/": "h1",
    }
    for url, selector in visits.items():
        response = page.goto(base + url)
        assert response is not None and response.status == 200, url
        expect(page.locator(selector).first).to_be_visible()
        watched.clean(url)

    # Deciding still works: the approve form, with triage.js's double-submit guard.
    page.goto(f"{base}/approvals/{pending.pk}/")
    expect(page.locator("#approve-form input[name=action_hash]")).to_have_value(pending.action_hash)
    page.click("#approve-button")
    expect(page.locator(".messages li.success")).to_contain_text("Approved")
    assert ApprovalRequest.objects.get(pk=pending.pk).status == ApprovalStatus.APPROVED
    watched.clean("approving")
    screenshot(page, "security-after-approve.png")


def test_the_admin_and_swagger_ui_work_with_no_csp_violation(
    live_server: Any, new_page: Pages, admin_a: Persona, world: dict[str, Any]
) -> None:
    base = live_server.url
    watched = Watched(new_page())
    page = watched.page

    page.goto(base + "/admin/login/?next=/admin/")
    page.fill("#id_username", "ada")
    page.fill("#id_password", "pw-ada")
    page.click("input[type=submit]")
    page.wait_for_url(base + "/admin/")
    watched.clean("admin index")
    links = page.locator("#content-main th[scope=row] a")
    assert links.count() >= 1
    changelists = [links.nth(i).get_attribute("href") for i in range(links.count())]
    for href in changelists:
        response = page.goto(base + str(href))
        assert response is not None and response.status == 200, href
        expect(page.locator("#content h1")).to_be_visible()
        watched.clean(f"admin changelist {href}")
    # One change form with the admin's JavaScript: an approval request of the world —
    # a list that must have a row (an empty one would skip the change form unnoticed).
    page.goto(base + "/admin/approvals/approvalrequest/")
    rows = page.locator("#result_list tbody th a")
    expect(rows.first).to_be_visible()
    rows.first.click()
    expect(page.locator("#content h1")).to_be_visible()
    assert "/change/" in page.url
    watched.clean("admin change form")

    page.goto(base + "/api/v1/docs/")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("Holdpoint API")
    expect(page.locator(".opblock").first).to_be_visible()
    page.locator(".opblock-summary").first.click()  # expands: React renders more UI
    expect(page.locator(".opblock-body").first).to_be_visible()
    watched.clean("Swagger UI")
    screenshot(page, "security-swagger.png")


def test_user_text_is_escaped_and_injected_script_does_not_run(
    live_server: Any, new_page: Pages, reviewer_a: Persona, world: dict[str, Any]
) -> None:
    base = live_server.url
    watched = Watched(new_page())
    page = watched.page
    log_in(page, base, "alice", "pw-alice")

    # The agent's markup in a request's params and a run's goal is shown as text.
    page.goto(f"{base}/approvals/{world['hostile'].pk}/")
    expect(page.locator("main")).to_contain_text("<script>window.__pwned = 1</script>")
    page.goto(f"{base}/runs/{world['run'].run_id}/")
    expect(page.locator("main")).to_contain_text("window.__pwned = 1")
    assert page.evaluate("window.__pwned") is None
    watched.clean("pages showing hostile text")

    # Markup that did reach the DOM (a bug elsewhere, an extension): the policy blocks it.
    page.evaluate(
        """() => {
          const s = document.createElement("script");
          s.textContent = "window.__ran = 'script'";
          document.body.appendChild(s);
          const box = document.createElement("div");
          box.innerHTML =
            '<img src="/static/holdpoint/app.css" onerror="window.__ran = \\'handler\\'">';
          document.body.appendChild(box);
          const a = document.createElement("a");
          a.href = "javascript:window.__ran = 'url'";
          a.id = "js-link";
          a.textContent = "click";
          document.body.appendChild(a);
          const style = document.createElement("style");
          style.textContent = "body { background: rgb(255, 0, 0) !important; }";
          document.head.appendChild(style);
        }"""
    )
    page.click("#js-link")
    page.wait_for_function("window.__csp.length >= 4")
    assert page.evaluate("window.__ran") is None
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background != "rgb(255, 0, 0)"
    blocked = " ".join(page.evaluate("window.__csp"))
    for directive in ("script-src-elem", "script-src-attr", "style-src-elem"):
        assert directive in blocked, blocked


def wait_until(page: Page, condition: Callable[[], bool], attempts: int = 200) -> bool:
    """Poll a condition a bounded number of times, True as soon as it holds. Between polls
    Playwright's own wait runs its event loop (a plain sleep would not: no console message
    would arrive while it blocks)."""
    for _ in range(attempts):
        if condition():
            return True
        page.wait_for_timeout(50)
    return condition()


def test_another_site_cannot_frame_holdpoint(
    live_server: Any, new_page: Pages, reviewer_a: Persona, other_site: tuple[str, Path]
) -> None:
    origin, root = other_site
    (root / "frame.html").write_text(
        f"<!doctype html><title>evil</title><h1>Totally legit</h1>"
        f'<iframe id="victim" src="{live_server.url}/login/"></iframe>'
    )
    watched = Watched(new_page())
    page = watched.page
    page.goto(origin + "/frame.html")
    expect(page.locator("h1")).to_have_text("Totally legit")
    # Wait for the browser's own refusal (a console message), not for a fixed time: once
    # it is logged the frame's load is over, and what it holds can be checked at once.
    refused = wait_until(
        page, lambda: any("frame-ancestors" in m or "X-Frame-Options" in m for m in watched.console)
    )
    assert refused, watched.console
    frames = [f for f in page.frames if f != page.main_frame]
    assert len(frames) == 1
    frame = frames[0]
    assert not frame.url.startswith(live_server.url) or frame.query_selector("form") is None
    # An error page: nothing of Holdpoint's login form in it.
    assert frame.locator("#id_username").count() == 0
    assert frame.locator("form").count() == 0


def test_a_form_on_another_site_cannot_decide(
    live_server: Any,
    new_page: Pages,
    reviewer_a: Persona,
    world: dict[str, Any],
    other_site: tuple[str, Path],
) -> None:
    """Classic CSRF: the reviewer, logged in, opens the attacker's page, which posts the
    approve form (even with the right action hash) to Holdpoint. Refused; nothing recorded."""
    pending: ApprovalRequest = world["pending"]
    origin, root = other_site
    (root / "csrf.html").write_text(
        "<!doctype html><title>win a prize</title>"
        '<body onload="document.forms[0].submit()">'
        f'<form method="post" action="{live_server.url}/approvals/{pending.pk}/decide/">'
        '<input type="hidden" name="decision" value="approve">'
        f'<input type="hidden" name="action_hash" value="{pending.action_hash}">'
        '<input type="hidden" name="csrfmiddlewaretoken" value="guessed-token-value">'
        "</form></body>"
    )
    page = new_page()
    log_in(page, live_server.url, "alice", "pw-alice")
    with page.expect_navigation(url=f"{live_server.url}/approvals/{pending.pk}/decide/"):
        page.goto(origin + "/csrf.html")
    expect(page.locator("h1")).to_have_text("Nothing was done")
    assert ApprovalRequest.objects.get(pk=pending.pk).status == ApprovalStatus.PENDING
    assert not ApprovalVote.objects.filter(request=pending).exists()
    screenshot(page, "security-csrf-refused.png")
    # The reviewer's session is intact and the real form still works.
    page.goto(f"{live_server.url}/approvals/{pending.pk}/")
    page.click("#approve-button")
    expect(page.locator(".messages li.success")).to_contain_text("Approved")
