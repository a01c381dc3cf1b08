"""A real browser for page tests: Playwright's sync API driving Debian's Chromium.

Never `playwright install`: nothing outside the package registries can be fetched here, so
the browser is Debian's `chromium` package (`make browser` installs it as root) and
Playwright only drives it. Without the background-networking flags Chromium tries to reach
the outside and those connections are refused, many at a time (NOTES.md, "Browser tests").
`launch` gives every browser a fresh temporary profile (user-data dir) of its own.

Missing Chromium (or Playwright): under CI (CI=true) the tests fail with the fix in the
message — a green CI must never hide skipped browser tests; locally they skip.

Test modules load the fixtures with `pytest_plugins = ("tests.browser",)` after importing
the helpers, so the module opts out of assertion rewriting (it asserts nothing):
PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.conf import settings

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Generous for a shared 2-core machine; a page here renders in well under a second.
TIMEOUT_MS = 15_000
# Beside, not inside, the per-session scratch dir (removed after a green run), so the
# screenshots outlive the run for a person to look at.
SCREENSHOTS = Path(settings.BASE_DIR) / "var" / "test" / "screenshots"


def _unavailable(why: str) -> None:
    """Fail under CI, skip on a developer's machine."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"browser tests cannot run: {why}", pytrace=False)
    pytest.skip(f"browser tests skipped: {why}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One Chromium per test module. Playwright's sync API keeps an event loop in this
    thread, which Django's async-safety check would take for async code calling the ORM
    (the tests set data up and check it between clicks): allowed for this module only."""
    if not CHROMIUM.exists():
        _unavailable(
            f"{CHROMIUM} is missing — run `make browser` as root (apt-get install -y chromium)"
        )
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _unavailable("the playwright package is missing — pip install -e '.[test]'")
    expect.set_options(timeout=TIMEOUT_MS)
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            launched = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000
            )
            try:
                yield launched
            finally:
                launched.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def new_page(browser: Browser, settings: Any) -> Iterator[Callable[[], Page]]:
    """Pages (tabs) of one fresh browser context — own cookies — per test.

    The live server speaks plain HTTP, so the session and CSRF cookies are not marked
    Secure for the test (production keeps them Secure).
    """
    settings.SESSION_COOKIE_SECURE = False
    settings.CSRF_COOKIE_SECURE = False
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)

    def make() -> Page:
        return context.new_page()

    try:
        yield make
    finally:
        context.close()


def log_in(page: Page, base_url: str, username: str, password: str) -> None:
    """Through the login form, as a person would."""
    page.goto(base_url + "/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(base_url + "/inbox/")


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
