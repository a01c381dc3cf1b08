"""CI's pair of suites runs a test above the database on one of them only.

`.ci/run` runs the whole suite on SQLite and on PostgreSQL at once, on two cores, within 25
minutes. Some of the slowest tests prove behaviour that sits above the database — a framework
adapter driving the API, a page's layout and scripts in Chromium, the tool layer of a tool
defined as data — while the database paths they pass through are proven on both databases by
other tests (the API, ledger and crash-matrix tests). Such a test is marked
`@pytest.mark.ci_database("sqlite")` (or `"postgresql"`): with `HOLDPOINT_CI_PAIR=1`, which
`.ci/run` sets for both suites, the other suite deselects it, so the pair runs it once. Without
it — `make test` on either database — every test runs.

A test with no database in reach is above the database by construction, marked or not:
pytest-django refuses the ORM to a test that neither is marked `django_db` nor asks for a
database fixture, so it gets the same answer on both suites. Under the pair it runs on
SQLite's only (the suite that ends first) — unless it says otherwise: marked `postgres` or
`ci_database(...)`, or skipped by a `skipif` (whose condition might be the database's).
A test whose own subprocess reads DATABASE_URL must ask for a database fixture (as every
worker-process test does, to make its rows) or be marked.
"""

from __future__ import annotations

import os

import pytest

from tests.pg_guard import on_postgres

VENDORS = ("sqlite", "postgresql")
# What gives a test the database: pytest-django's fixtures (a test's `fixturenames` is their
# closure, so a fixture that needs `db` counts). Not its blocker: every test has it (through
# pytest-django's own autouse fixtures), and one that lifts it also asks for the database.
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "live_server",
    }
)


# The modules of the longest tests (CI's `--durations=30`, both suites), longest first, are
# collected before the rest. Under
# pytest-xdist a worker runs what it was handed: the longest tests, at the end of the
# collection (tests/web/ sorts last), left one worker waiting up to two minutes for the other
# at the end of a suite. First, they overlap the rest. The order within each part is kept, so
# a module's tests stay together (its module-scoped fixtures are set up once).
#
# Never across pytest-django's line, though: every transactional test (its flush empties the
# tables, the rows migrations wrote included) runs after every test that rolls back, as Django
# orders them. pytest-django sorts that way first (its hook is tryfirst); this sort keeps it,
# so the longest transactional modules lead the transactional part, not the whole suite.
LONGEST = (
    "tests/security/test_isolation_matrix.py",
    "tests/core/test_run_script.py",
    "tests/web/test_page_fuzzer.py",
    "tests/client/test_openai_agents.py",
    "tests/runtime/test_chaos.py",
    "tests/security/test_admin_isolation.py",
    "tests/web/test_responsive.py",
    "tests/audit/test_pages.py",
    "tests/security/test_no_state_change_through_get.py",
    "tests/api/test_stateful.py",
    "tests/client/test_async_client.py",
)


def no_database(item: pytest.Item) -> bool:
    """Nothing of the database reaches this test, and nothing says it cares which one."""
    if any(item.get_closest_marker(name) for name in ("django_db", "postgres", "skipif")):
        return False
    return not DATABASE_FIXTURES.intersection(getattr(item, "fixturenames", ()))


def transactional(item: pytest.Item) -> bool:
    """pytest-django's own test of "this test flushes the database" (its ordering hook's)."""
    from pytest_django.fixtures import validate_django_db

    marker = item.get_closest_marker("django_db")
    if marker is not None:
        transaction, reset_sequences, *_ = validate_django_db(marker)
        if transaction or reset_sequences:
            return True
    fixtures = getattr(item, "fixturenames", ())
    return "transactional_db" in fixtures or "live_server" in fixtures


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    vendor = "postgresql" if on_postgres() else "sqlite"
    paired = os.environ.get("HOLDPOINT_CI_PAIR") == "1"
    keep: list[pytest.Item] = []
    other: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("ci_database")
        if marker is None:
            if paired and vendor != "sqlite" and no_database(item):
                other.append(item)
            else:
                keep.append(item)
            continue
        if len(marker.args) != 1 or marker.args[0] not in VENDORS:
            raise pytest.UsageError(f"{item.nodeid}: ci_database takes one of {VENDORS}")
        (keep if not paired or marker.args[0] == vendor else other).append(item)
    if other:
        config.hook.pytest_deselected(items=other)
    first = {module: place for place, module in enumerate(LONGEST)}
    items[:] = sorted(
        keep,
        key=lambda item: (
            transactional(item),
            first.get(item.nodeid.split("::")[0], len(first)),
        ),
    )
