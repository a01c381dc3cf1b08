"""The suite's own guards (issue 16, tests that must get teeth): a PostgreSQL run where a
PostgreSQL-only test skips is a failed run, and the same skip on SQLite stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPING = """
import pytest

@pytest.mark.postgres
def test_needs_postgres():
    pytest.skip("concurrency tests run on PostgreSQL")

def test_plain():
    pytest.skip("not PostgreSQL-only")
"""


def run_alone(tmp_path: Path, database_url: str) -> subprocess.CompletedProcess[str]:
    """pytest on a two-test file with only the guard loaded (no Django, no database)."""
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {**os.environ, "DATABASE_URL": database_url, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env["PYTHONPATH"] = str(ROOT)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "tests.pg_guard", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*args, "-c", os.devnull, "-m", "postgres or not postgres", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("url", ["postgres://u@h/db", "postgresql://u@h/db"])
def test_a_postgres_only_skip_fails_the_postgres_run(tmp_path: Path, url: str) -> None:
    done = run_alone(tmp_path, url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 skipped" in done.stdout
    assert "a PostgreSQL-only test skipped on PostgreSQL" in done.stdout


def test_the_same_skip_on_sqlite_is_a_skip(tmp_path: Path) -> None:
    done = run_alone(tmp_path, "")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 skipped" in done.stdout


@pytest.mark.django_db(transaction=True)  # the threads read committed rows
def test_a_connection_an_ended_thread_left_open_is_named_and_closed() -> None:
    """tests.orphans: after each test, the connection of a thread that ended without closing
    it fails that test (on SQLite such a connection kept the test database from leaving WAL:
    "database is locked" in a later test); one closed in its thread is no orphan."""
    from django.db import connection

    from runtime.models import Tenant
    from tests import orphans

    opened: list[Any] = []

    def leaves_it_open() -> None:
        Tenant.objects.count()
        opened.append(connection.connection)

    def closes_it() -> None:
        Tenant.objects.count()
        connection.close()

    for target, name in ((leaves_it_open, "leaky"), (closes_it, "tidy")):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()
    assert orphans._orphans() == ["default in thread 'leaky'"]
    with pytest.raises(Exception, match="closed"):  # closed by the guard
        opened[0].cursor()
    assert orphans._orphans() == []
