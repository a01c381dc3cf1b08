"""Settings come from the environment and fail loudly; production settings pass --deploy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from config.env import EnvError, env_bool, env_int, env_list, env_str

ROOT = Path(__file__).resolve().parents[2]


def test_typed_helpers_refuse_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_BOOL", "maybe")
    monkeypatch.setenv("X_INT", "12a")
    monkeypatch.setenv("X_SMALL", "1")
    with pytest.raises(EnvError, match="X_BOOL"):
        env_bool("X_BOOL", False)
    with pytest.raises(EnvError, match="X_INT"):
        env_int("X_INT", 3)
    with pytest.raises(EnvError, match="X_SMALL must be >= 5"):
        env_int("X_SMALL", 10, minimum=5)
    with pytest.raises(EnvError, match="X_MISSING is required"):
        env_str("X_MISSING")


def test_typed_helpers_read_good_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_BOOL", "Yes")
    monkeypatch.setenv("X_INT", "42")
    monkeypatch.setenv("X_LIST", "a.example, b.example,,")
    assert env_bool("X_BOOL", False) is True
    assert env_int("X_INT", 0) == 42
    assert env_list("X_LIST", []) == ["a.example", "b.example"]
    assert env_bool("X_UNSET", True) is True


def _manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    # Only the basics: nothing the test settings put into this process may leak in.
    clean = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


PRODUCTION = {
    "DEBUG": "0",
    "SECRET_KEY": "k" * 20 + "-production-secret-with-enough-entropy-" + "z9Q" * 10,
    "ALLOWED_HOSTS": "holdpoint.example.com",
    "HOLDPOINT_SECRET_KEYS": "bGVuZ3RoLW9mLXRoaXMta2V5LWlzLTMyLWJ5dGVzISE=",
    "DJANGO_SETTINGS_MODULE": "config.settings",
}


def test_secret_key_required_outside_debug() -> None:
    env = dict(PRODUCTION, SECRET_KEY="")
    result = _manage(env, "check")
    assert result.returncode != 0
    assert "SECRET_KEY is required" in result.stderr


def test_bad_database_url_names_the_variable() -> None:
    result = _manage(dict(PRODUCTION, DATABASE_URL="notadb://x"), "check")
    assert result.returncode != 0
    assert "DATABASE_URL" in result.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS", "10.1.2.0/24,not-a-network"),
        ("HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS", "10.1.2.3/24"),  # host bits set: a typo
        ("HOLDPOINT_TOOL_PRIVATE_NETWORKS", "fd00::/300"),
        ("HOLDPOINT_TOOL_HOSTS", "*"),
    ],
)
def test_a_bad_outbound_setting_stops_the_start_and_names_itself(name: str, value: str) -> None:
    """Where requests may go is checked at start, by the functions that apply it at send
    time: a bad value is an error naming the variable, never a silently narrower or wider
    reach."""
    result = _manage(dict(PRODUCTION, **{name: value}), "check")
    assert result.returncode != 0
    assert f"{name}:" in result.stderr


def test_an_empty_database_url_is_the_default_sqlite_not_an_error() -> None:
    code = "from django.db import connection as c; print(c.vendor, c.settings_dict['NAME'])"
    result = _manage(dict(PRODUCTION, DATABASE_URL=" "), "shell", "--no-imports", "-c", code)
    assert result.returncode == 0, result.stderr
    vendor, name = result.stdout.split()
    assert vendor == "sqlite" and name.endswith("holdpoint.sqlite3")


def test_sqlite_default_is_wal_full_and_immediate(db: None) -> None:
    from django.conf import settings
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("SQLite defaults only")
    assert settings.DATABASES["default"]["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        assert cursor.fetchone()[0] == "wal"
        cursor.execute("PRAGMA synchronous")
        assert cursor.fetchone()[0] == 2  # FULL


def test_a_metrics_token_read_from_a_secrets_file_matches_its_scrapes() -> None:
    """`HOLDPOINT_METRICS_TOKEN=$(cat file)` keeps no newline, but a secrets manager's file
    mounted as the variable does: the token with its trailing newline could never match, and
    every scrape was refused. The surrounding whitespace is not part of the token; a value of
    whitespace alone is refused at start-up rather than leaving /metrics open."""
    code = (
        "from runtime.metrics import authorized; "
        "print(authorized('Bearer s3cret-token'), authorized('Bearer wrong'))"
    )
    result = _manage(
        dict(PRODUCTION, HOLDPOINT_METRICS_TOKEN="s3cret-token\n"),
        "shell",
        "--no-imports",
        "-c",
        code,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]
    refused = _manage(dict(PRODUCTION, HOLDPOINT_METRICS_TOKEN=" \n"), "check")
    assert refused.returncode != 0
    assert "HOLDPOINT_METRICS_TOKEN" in refused.stderr
