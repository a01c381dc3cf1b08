"""The PostgreSQL run fails, not passes, when its PostgreSQL-only tests skip (issue 16).

A test marked `postgres` skips itself on SQLite. Under DATABASE_URL=postgres… a skip of such
a test means the concurrency, trigger or lease row it proves was never run — a wrong URL, a
missing extension, a fixture that bailed out — so it is reported as a failure with the skip's
reason. Imported by tests/conftest.py; a plain plugin module so a test can load it alone.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest


def on_postgres() -> bool:
    return os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("postgres") is not None and on_postgres():
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"a PostgreSQL-only test skipped on PostgreSQL: {reason}"
