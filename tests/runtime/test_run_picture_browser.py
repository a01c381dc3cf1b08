"""The run picture in a real browser (Debian's Chromium, Playwright): the Steps panel moves
while the page is open — the current step leaves `propose_task` once a reviewer decided and
the run completed — and the page does not scroll sideways at 1280 or 390 px. Screenshots
land in var/test/screenshots/run-picture-<width>.png (git-ignored) for a person to look at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from approvals.decisions import decide
from runtime.executor import advance_run
from tests.browser import log_in, screenshot
from tests.conftest import Persona
from tests.runtime.test_run_picture import held  # noqa: F401  (the fixture)

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


def no_sideways_scroll(page: Page) -> tuple[int, int]:
    scroll, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert scroll <= inner, f"scrollWidth {scroll} > innerWidth {inner}"
    return scroll, inner


def test_the_steps_panel_moves_while_the_page_is_open_and_fits_both_widths(
    live_server: Any,
    new_page: Pages,
    reviewer_a: Persona,
    held: Any,  # noqa: F811
) -> None:
    run, request = held
    page = new_page()
    log_in(page, live_server.url, "alice", "pw-alice")
    page.goto(f"{live_server.url}/runs/{run.run_id}/")
    current = page.locator("#run-steps li.step.current")
    expect(current).to_have_attribute("data-step", "propose_task")
    expect(current).to_contain_text("waiting for approval")
    expect(page.locator("#run-flow li.flow-item.decision")).to_contain_text("approval requested")
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 900})
        print(f"run page scrollWidth/innerWidth at {width}:", no_sideways_scroll(page))
        screenshot(page, f"run-picture-{width}.png")

    page.set_viewport_size({"width": 1280, "height": 900})
    page.wait_for_function("window.htmx !== undefined")
    decide(request.pk, reviewer_a.user, "approve", request.action_hash)
    assert advance_run(run.run_id, "w1").outcome == "completed"
    # The next poll (every 2 s) redraws the panel: no step is current any more, all done.
    expect(page.locator("#run-steps li.step.current")).to_have_count(0)
    expect(page.locator("#run-steps li.step.done")).to_have_count(4)
    expect(page.locator("#run-flow")).to_contain_text("approval approved")
    expect(page.locator(".run-header .badge").first).to_have_text("completed")
    no_sideways_scroll(page)
    screenshot(page, "run-picture-1280-completed.png")
