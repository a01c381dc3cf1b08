"""CI's pair of suites (tests/ci_pair.py): a test marked `ci_database` runs on its suite's
database only under HOLDPOINT_CI_PAIR=1, and on either database without it — checked by
running pytest itself on a small test file, as CI does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs

TESTS = """
import pytest

@pytest.fixture
def db(): pass  # pytest-django's name: a test that asks for it has the database

@pytest.mark.ci_database("sqlite")
def test_on_sqlite(): pass

@pytest.mark.ci_database("postgresql")
def test_on_postgres(): pass

def test_everywhere(db): pass

@pytest.mark.django_db
def test_marked_everywhere(): pass

def test_no_database(): pass

@pytest.mark.skipif(False, reason="its condition might be the database's")
def test_skipif_without_a_database(): pass
"""


def _collected(tmp_path: Path, database_url: str, pair: bool, body: str = TESTS) -> str:
    (tmp_path / "test_sample.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k not in ("HOLDPOINT_CI_PAIR", "DATABASE_URL")}
    # Only the plugin under test (no pytest-django, no entry-point plugins: a faster start).
    env.update(
        PYTHONPATH=str(procs.ROOT), DATABASE_URL=database_url, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"
    )
    if pair:
        env["HOLDPOINT_CI_PAIR"] = "1"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.ci_pair",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            "-o",
            "markers=ci_database",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


POSTGRES = "postgres://postgres@127.0.0.1:5432/x"


BOTH = ["test_everywhere", "test_marked_everywhere", "test_skipif_without_a_database"]
ALL = ["test_on_sqlite", "test_on_postgres", "test_no_database", *BOTH]


@pytest.mark.parametrize(
    ("url", "pair", "kept", "gone"),
    [
        # The pair: each marked test on its own suite; one with no database on SQLite's.
        ("", True, ["test_on_sqlite", "test_no_database", *BOTH], ["test_on_postgres"]),
        (POSTGRES, True, ["test_on_postgres", *BOTH], ["test_on_sqlite", "test_no_database"]),
        ("", False, ALL, []),
        (POSTGRES, False, ALL, []),
    ],
)
def test_each_suite_of_the_pair_runs_its_own_share(
    tmp_path: Path, url: str, pair: bool, kept: list[str], gone: list[str]
) -> None:
    out = _collected(tmp_path, url, pair)
    for name in kept:
        assert f"test_sample.py::{name}" in out, out
    for name in gone:
        assert f"test_sample.py::{name}" not in out, out
    assert (f"{len(gone)} deselected" in out) == bool(gone), out


def test_a_marker_naming_no_database_is_an_error(tmp_path: Path) -> None:
    body = 'import pytest\n\n@pytest.mark.ci_database("mysql")\ndef test_x(): pass\n'
    out = _collected(tmp_path, "", True, body)
    assert "ci_database takes one of ('sqlite', 'postgresql')" in out, out


def test_the_longest_modules_named_first_exist() -> None:
    """A module renamed or removed would quietly fall back into collection order."""
    from tests.ci_pair import LONGEST

    assert len(set(LONGEST)) == len(LONGEST)
    assert [m for m in LONGEST if not (procs.ROOT / m).is_file()] == []


LONG_MODULE = """
import pytest

@pytest.mark.django_db(transaction=True)
def test_long_and_flushing(): pass

@pytest.mark.django_db
def test_long_and_rolled_back(): pass
"""

ORDINARY = """
import pytest

@pytest.mark.django_db
def test_rolled_back(): pass

def test_no_database(): pass

def test_live(live_server): pass

@pytest.fixture
def live_server(): pass  # pytest-django's name: a live server flushes as transactional_db does
"""


def test_the_longest_modules_lead_but_never_before_a_test_that_rolls_back(tmp_path: Path) -> None:
    """A transactional test's flush deletes the rows migrations wrote (a schedule, the roles);
    one run before a rolled-back test that reads them failed `make test` (Schedule.DoesNotExist).
    The longest modules lead each part; the transactional part still comes last."""
    long_module = tmp_path / "tests" / "runtime" / "test_chaos.py"  # one of LONGEST
    long_module.parent.mkdir(parents=True)
    long_module.write_text(LONG_MODULE)
    out = _collected(tmp_path, "", False, ORDINARY)
    order = [line.split("::")[-1] for line in out.splitlines() if "::" in line]
    assert order == [
        "test_long_and_rolled_back",
        "test_rolled_back",
        "test_no_database",
        "test_long_and_flushing",
        "test_live",
    ], out
