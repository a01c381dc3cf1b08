"""Every reviewer page fits the window, on a laptop (1280 px) and on a phone (390 px).

A page that scrolls sideways hides what is past the edge: the Reconcile page's "Settle it"
buttons sat off-screen at 1280 px, and on a phone the Approve and Reject buttons were three
screens below the history. So each page is loaded at both widths in a real browser with
realistic content (a real api-review run's state, a parked action, decided requests) and
`document.documentElement.scrollWidth` must not exceed the window; the header's bar must hold
all of its contents (at 390 px it once spilled out of it), and content wider than its box
(a long `<pre>`, a table) must scroll inside that box, not be cut off. Screenshots of each
land in var/test/screenshots/ (git-ignored) for a person to look at.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import Group

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest
from approvals.policies import grant
from runtime.compensation import compensate, dispatch_standalone
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Membership, Role, Run, RunStatus, Tenant
from runtime.tools import get_tool
from tests.approvals.conftest import GOAL
from tests.approvals.test_pages import raise_request
from tests.browser import log_in, screenshot
from tests.conftest import Persona
from tests.sandbox import Sandbox

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture fails (CI) or skips (locally) with the reason
    expect = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytest_plugins = ("tests.browser",)  # the browser and new_page fixtures
# A page's layout and scripts in Chromium: CI runs them on SQLite only (tests/ci_pair.py).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.ci_database("sqlite")]
WIDTHS = (1280, 390)


def overflow(page: Page) -> dict[str, Any]:
    """How far the document is wider than the window, and the widest elements past the edge
    (so a failure names what to fix)."""
    return page.evaluate(
        """() => {
          const width = window.innerWidth;
          const culprits = [];
          for (const el of document.querySelectorAll('body *')) {
            const box = el.getBoundingClientRect();
            if (box.right > width + 1 && box.width > 0) {
              culprits.push(el.tagName.toLowerCase() + (el.id ? '#' + el.id : '')
                + (el.className && typeof el.className === 'string'
                   ? '.' + el.className.trim().split(/\\s+/).join('.') : '')
                + ' right=' + Math.round(box.right));
            }
          }
          // The header's bar holds all of it (at 390 px it once spilled out of the bar).
          const bar = document.querySelector('header.top').getBoundingClientRect();
          const spilled = [];
          for (const el of document.querySelectorAll('header.top *')) {
            const box = el.getBoundingClientRect();
            if (box.width > 0 && (box.bottom > bar.bottom + 1 || box.right > bar.right + 1
                                  || box.left < bar.left - 1)) {
              spilled.push(el.tagName.toLowerCase() + ' ' + el.textContent.trim().slice(0, 30));
            }
          }
          // Content wider than its box must be reachable there: scrolled (overflow auto or
          // scroll), never cut off by overflow hidden/clip (unless it says so with an ellipsis).
          const clipped = [];
          for (const el of document.querySelectorAll('body *')) {
            if (el.scrollWidth <= el.clientWidth + 1 || el.clientWidth === 0) continue;
            if (['INPUT', 'TEXTAREA', 'SELECT'].includes(el.tagName)) continue;  // scrolls as typed
            const style = getComputedStyle(el);
            if (['hidden', 'clip'].includes(style.overflowX) && style.textOverflow !== 'ellipsis'
                && style.position !== 'absolute') {
              clipped.push(el.tagName.toLowerCase()
                + (el.className && typeof el.className === 'string' ? '.' + el.className : '')
                + ' ' + el.scrollWidth + '>' + el.clientWidth);
            }
          }
          return {scroll: document.documentElement.scrollWidth, inner: width,
                  culprits: culprits.slice(0, 8), spilled: spilled.slice(0, 8),
                  clipped: clipped.slice(0, 8)};
        }"""
    )


def box_of(page: Page, selector: str) -> dict[str, float]:
    box = page.locator(selector).bounding_box()
    assert box is not None, f"{selector} is not rendered"
    return box


def check_decision_order(page: Page, name: str, width: int) -> None:
    """On a phone the deciding panel comes right after the summary, before the details; on a
    laptop it sits beside them."""
    summary, panel, details = {
        "request": ("#what-title", "#decide-title", "#params-title"),
        "reconcile-detail": ("#known-title", "#resolve-title", "#history-title"),
    }[name]
    first, second, then = (box_of(page, s) for s in (summary, panel, details))
    if width < 800:
        assert first["y"] < second["y"] < then["y"], f"{name} at {width}px: panel not after summary"
        assert second["y"] - first["y"] < 2 * 900, f"{name}: the panel is more than 2 screens down"
    else:
        assert second["x"] > first["x"] + first["width"], f"{name} at {width}px: not side by side"


@pytest.fixture
def world(reviewer_a: Persona, sandbox_factory: Callable[[str], Sandbox]) -> dict[str, Any]:
    """What a reviewer's pages show on an ordinary day: an action nobody can settle (a real
    api-review run against a tracker in mode `none` that dropped the connection), then a
    hold point on a real api-review run, and a decided request for the history."""
    tenant = reviewer_a.tenant
    parked_box = sandbox_factory("none")
    parked_box.faults(drop_after=1)
    parked_run = create_run(tenant, "api-review", GOAL, actor="user:alice")
    assert advance_run(parked_run.run_id, "w1").outcome == "waiting"
    parked = Action.objects.get(run=parked_run)
    assert parked.status == ActionStatus.MANUAL_REVIEW

    sandbox_factory("key")
    held_undo, stuck_undo, undoable = (done_action(tenant) for _ in range(3))
    breaker = get_tool("tasks.close", tenant.pk).breaker
    try:  # its send meets an open circuit: "Compensations not sent", for the admin
        for _ in range(breaker.threshold):
            breaker.record(False)
        stuck = compensate(stuck_undo, "Opened twice by a retry", actor="user:ada")
        assert dispatch_standalone(stuck.action_id).send_failed_at is not None
    finally:
        breaker.record(True)
    closes = ApprovalPolicy.objects.create(tenant=tenant, name="undos", tool="tasks.close")
    grant(closes, Group.objects.get(name="acme-reviewers"))
    held = compensate(held_undo, "The reviewer asked for it twice", actor="user:ada")
    assert held.status == ActionStatus.AWAITING_APPROVAL  # a request in the inbox: "Undoes"
    # An undo asked for and rejected: the run page offers it again, saying what became of it.
    refused = compensate(undoable, "Closed by mistake in the tracker", actor="user:ada")
    no = ApprovalRequest.objects.get(action=refused)
    decide(no.pk, reviewer_a.user, "reject", no.action_hash, reason="The task is still needed")

    policy = ApprovalPolicy.objects.create(
        tenant=tenant, name="tasks need review", tool="tasks.create"
    )
    grant(policy, Group.objects.get(name="acme-reviewers"))
    run = create_run(tenant, "api-review", GOAL, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "waiting"
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING_APPROVAL
    request = ApprovalRequest.objects.get(run=run)
    past = raise_request(tenant, target="shop-v0")
    decide(
        past.pk, reviewer_a.user, "reject", past.action_hash, reason="Duplicate of existing work"
    )
    return {
        "run": run,
        "request": request,
        "parked": parked,
        "undo-request": ApprovalRequest.objects.get(action=held),
        "stuck-run": stuck_undo.run_id,
        "undoable-run": undoable.run_id,
    }


def done_action(tenant: Tenant) -> Action:
    """A completed api-review run's confirmed tasks.create (tasks.close undoes it)."""
    run = create_run(tenant, "api-review", GOAL, actor="agent:agent-a")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED
    return action


def measure(page: Page, name: str, width: int, problems: list[str]) -> None:
    """Record a sideways scroll, and save the page for a person to look at."""
    measured = overflow(page)
    if measured["scroll"] > measured["inner"] or measured["spilled"] or measured["clipped"]:
        problems.append(f"{name} at {width}px: {measured}")
    screenshot(page, f"responsive-{name}-{width}.png")


def post_as_the_page_would(page: Page, url: str) -> None:
    """Submit a form the page does not offer (a viewer has no Cancel button), with the
    page's own CSRF token: what a stale tab or a hand-made request does."""
    page.evaluate(
        """(url) => {
          const form = document.createElement('form');
          form.method = 'post';
          form.action = url;
          const token = document.querySelector('input[name=csrfmiddlewaretoken]').cloneNode();
          form.appendChild(token);
          document.body.appendChild(form);
          form.submit();
        }""",
        url,
    )


def test_every_reviewer_page_fits_at_1280_and_390_px(
    live_server: Any,
    new_page: Callable[[], Page],
    reviewer_a: Persona,
    viewer_a: Persona,
    admin_a: Persona,
    tenant_b: Tenant,
    world: dict[str, Any],
) -> None:
    # The widest header: a staff admin (the Admin link) of two tenants (the tenant switcher).
    Membership.objects.create(tenant=tenant_b, user=admin_a.user, role=Role.ADMIN)
    base = live_server.url
    run: Run = world["run"]
    pages = {
        "inbox": "/inbox/",
        "inbox-history": "/inbox/history/",
        "overview": "/overview/",
        "request": f"/approvals/{world['request'].pk}/",
        "request-undo": f"/approvals/{world['undo-request'].pk}/",
        "runs": "/runs/",
        "run": f"/runs/{run.run_id}/",
        "trail": f"/runs/{run.run_id}/trail/",
        "reconcile": "/reconcile/",
        "reconcile-detail": f"/reconcile/{world['parked'].action_id}/",
        "audit": "/audit/",
        "password": "/password/",
        "not-found": f"/runs/{uuid.uuid4()}/",
    }
    page = new_page()
    problems: list[str] = []
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        page.context.clear_cookies()
        page.goto(base + "/login/")
        expect(page.locator("#id_username")).to_be_visible()
        measure(page, "login", width, problems)
        log_in(page, base, "alice", "pw-alice")
        for name, url in pages.items():
            page.goto(base + url)
            expect(page.locator("h1")).to_be_visible()
            measure(page, name, width, problems)
            if name in ("request", "reconcile-detail"):
                check_decision_order(page, name, width)

        page.context.clear_cookies()
        log_in(page, base, "victor", "pw-victor")
        page.goto(f"{base}/runs/{run.run_id}/")
        with page.expect_navigation():
            post_as_the_page_would(page, f"/runs/{run.run_id}/cancel/")
        expect(page.locator("h1")).to_have_text("You are not allowed to do this")
        measure(page, "forbidden", width, problems)

        page.context.clear_cookies()
        log_in(page, base, "ada", "pw-ada")
        page.goto(f"{base}/inbox/")
        expect(page.locator("#tenant-select")).to_be_visible()
        measure(page, "inbox-admin-two-tenants", width, problems)
        for name, box in (("stuck", "Compensations not sent"), ("undoable", "Undo a confirm")):
            page.goto(f"{base}/runs/{world[f'{name}-run']}/")
            expect(page.get_by_text(box).first).to_be_visible()
            if name == "undoable":  # its first undo was rejected: the form says so
                earlier = "An earlier undo did not take effect (cancelled: rejected by"
                expect(page.get_by_text(earlier)).to_be_visible()
            measure(page, f"run-admin-{name}", width, problems)
    assert not problems, "\n".join(problems)
