"""The reviewer's card and the run page in a real browser (Debian's Chromium, Playwright).

What only a browser proves: a hostile reason runs nothing (no dialog opens, no javascript:
link exists to click), the State panel really is swapped by htmx while the page is open,
and the "Waiting for" link takes the reviewer to the request. Screenshots at 1280 px land
in var/test/screenshots/ (git-ignored) for a person to look at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from django.db import transaction

from approvals.decisions import decide
from approvals.models import ApprovalRequest
from runtime import ledger
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Tenant
from runtime.tools import get_tool
from tests.approvals.test_pages import raise_request
from tests.browser import log_in, screenshot
from tests.conftest import Persona

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture fails (CI) or skips (locally) with the reason
    expect = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytest_plugins = ("tests.browser",)
# A page's layout and scripts in Chromium: CI runs them on SQLite only (tests/ci_pair.py).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.ci_database("sqlite")]
Pages = Callable[[], "Page"]


HOSTILE = (
    "Looks fine.\n\n<script>alert('script')</script>\n\n"
    "[click me](javascript:alert('link')) <img src=x onerror=\"alert('img')\">"
)


def test_the_card_in_a_browser_and_a_hostile_reason_runs_nothing(
    live_server: Any, new_page: Pages, reviewer_a: Persona, held: Any, tenant_a: Tenant
) -> None:
    run, request, box = held
    earlier = raise_request(tenant_a, params={"title": "Review 2 API risks", "body": "- old"})
    decide(earlier.pk, reviewer_a.user, "approve", earlier.action_hash)
    page = new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    log_in(page, live_server.url, "alice", "pw-alice")
    page.goto(f"{live_server.url}/approvals/{request.pk}/")
    expect(page.locator("#card-where")).to_contain_text(f"POST {box.url}/tasks")
    expect(page.locator("#card-impact .badge.reversible")).to_have_text("reversible")
    expect(page.locator("#why li")).to_have_count(3)
    expect(page.locator("#baseline")).to_contain_text("Create task: Review 2 API risks")
    expect(page.locator("#baseline ins").first).to_be_visible()
    screenshot(page, "request-1280.png")
    widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    print("request page scrollWidth/innerWidth at 1280:", widths)

    run2 = create_run(tenant_a, "chain", {"steps": 1}, actor="agent:agent-a")
    with transaction.atomic():
        action = ledger.create_action(
            run2,
            run2.fence,
            get_tool("tasks.create"),
            {"title": "hostile"},
            step="tick",
            call_index=0,
            reason=HOSTILE,
            target="t",
            actor="agent:agent-a",
            needs_approval=True,
        )
    hostile = ApprovalRequest.objects.get(action=action)
    page.goto(f"{live_server.url}/approvals/{hostile.pk}/")
    expect(page.locator("#why")).to_contain_text("<script>alert('script')</script>")
    assert page.locator("#why a").count() == 0  # the javascript: link is text, not a link
    assert page.locator("#why img, #why script").count() == 0
    page.get_by_text("[click me]", exact=False).click()
    page.wait_for_timeout(300)
    assert dialogs == []


def test_the_run_page_state_updates_live_and_waiting_links_to_the_request(
    live_server: Any, new_page: Pages, reviewer_a: Persona, held: Any, tenant_a: Tenant
) -> None:
    run, request, box = held
    page = new_page()
    log_in(page, live_server.url, "alice", "pw-alice")
    page.goto(f"{live_server.url}/runs/{run.run_id}/")
    expect(page.locator("#waiting-for")).to_contain_text(
        "Waiting for a reviewer to approve or reject tasks.create."
    )
    screenshot(page, "run-1280.png")
    page.click("#waiting-for a.waiting-link")
    page.wait_for_url(f"{live_server.url}/approvals/{request.pk}/")

    fresh = create_run(tenant_a, "chain", {"steps": 2}, actor="user:bob")
    page.goto(f"{live_server.url}/runs/{fresh.run_id}/")
    expect(page.locator("#run-state")).to_contain_text("No checkpoint yet")
    page.wait_for_function("window.htmx !== undefined")
    advance_run(fresh.run_id, "w1")
    fresh.refresh_from_db()
    # The header and the State panel move together, without a reload.
    expect(page.locator(".run-header .badge").first).to_have_text(fresh.status)
    expect(page.locator("#run-state")).to_contain_text(f"As of checkpoint {fresh.checkpoint_rev}.")
    expect(page.locator("#run-state")).not_to_contain_text("No checkpoint yet")


def test_a_reject_shows_rejected_and_what_next(
    live_server: Any, new_page: Pages, reviewer_a: Persona, held: Any
) -> None:
    run, request, box = held
    page = new_page()
    log_in(page, live_server.url, "alice", "pw-alice")
    page.goto(f"{live_server.url}/approvals/{request.pk}/")
    page.check("input[name=preset][value='Wrong target']")
    page.click("#reject-button")
    page.wait_for_url(f"{live_server.url}/approvals/{request.pk}/")
    expect(page.locator("#outcome h2")).to_contain_text(
        "Rejected — next: the action is cancelled and never sent"
    )
    expect(page.locator("#outcome")).to_contain_text("By alice")
    assert page.locator("#reject-button").count() == 0
    screenshot(page, "request-rejected-1280.png")
