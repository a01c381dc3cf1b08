"""CI's pair of suites runs a test above the database on one of them only.

`.ci/run` runs the whole suite on SQLite and on PostgreSQL at once, on two cores, within 25
minutes. Some of the slowest tests prove behaviour that sits above the database — a framework
adapter driving the API, a page's layout and scripts in Chromium, the tool layer of a tool
defined as data — while the database paths they pass through are proven on both databases by
other tests (the API, ledger and crash-matrix tests). Such a test is marked
`@pytest.mark.ci_database("sqlite")` (or `"postgresql"`): with `HOLDPOINT_CI_PAIR=1`, which
`.ci/run` sets for both suites, the other suite deselects it, so the pair runs it once. Without
it — `make test` on either database — every test runs.
"""

from __future__ import annotations

import os

import pytest

from tests.pg_guard import on_postgres

VENDORS = ("sqlite", "postgresql")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    vendor = "postgresql" if on_postgres() else "sqlite"
    paired = os.environ.get("HOLDPOINT_CI_PAIR") == "1"
    keep: list[pytest.Item] = []
    other: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("ci_database")
        if marker is None:
            keep.append(item)
            continue
        if len(marker.args) != 1 or marker.args[0] not in VENDORS:
            raise pytest.UsageError(f"{item.nodeid}: ci_database takes one of {VENDORS}")
        (keep if not paired or marker.args[0] == vendor else other).append(item)
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = keep
