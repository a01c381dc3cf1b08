"""The deployment check: `manage.py check --deploy --fail-level WARNING` is clean with
production settings, and it does fail when a protection is switched off (issue 9,
"Deployment check").

Each run is a fresh process with only the variables a production deployment would set, so
nothing the test settings put into this process leaks in. tests/core/test_settings.py checks
the settings' own validation; this module checks what the deployment ends up with.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.core.test_settings import PRODUCTION, _manage


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """manage.py in a fresh process with the production variables (and `env` on top)."""
    return _manage({**PRODUCTION, **env}, *args)


def test_check_deploy_is_clean_with_production_settings() -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


@pytest.mark.parametrize(
    ("env", "warning"),
    [
        ({"SECURE_HSTS_SECONDS": "0"}, "security.W004"),
        ({"SECURE_SSL_REDIRECT": "0"}, "security.W008"),
    ],
)
def test_check_deploy_fails_when_a_protection_is_off(env: dict[str, str], warning: str) -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", **env)
    assert result.returncode != 0
    assert warning in result.stdout + result.stderr


SHOW = (
    "import json; from django.conf import settings as s; print(json.dumps({k: getattr(s, k) "
    "for k in %r}, default=str))"
)
KEYS = [
    "DEBUG",
    "SESSION_COOKIE_SECURE",
    "SESSION_COOKIE_HTTPONLY",
    "SESSION_COOKIE_SAMESITE",
    "SESSION_COOKIE_AGE",
    "HOLDPOINT_SESSION_MAX_AGE",
    "CSRF_COOKIE_SECURE",
    "CSRF_COOKIE_SAMESITE",
    "SECURE_SSL_REDIRECT",
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_CONTENT_TYPE_NOSNIFF",
    "SECURE_REFERRER_POLICY",
    "SECURE_CROSS_ORIGIN_OPENER_POLICY",
    "X_FRAME_OPTIONS",
    "AXES_ENABLED",
    "AXES_FAILURE_LIMIT",
    "AXES_COOLOFF_TIME",
    "AXES_LOCKOUT_PARAMETERS",
    "CONTENT_SECURITY_POLICY",
]


def production_settings(**env: str) -> dict[str, Any]:
    result = manage("shell", "-c", SHOW % KEYS, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_production_defaults_are_the_hardened_ones() -> None:
    s = production_settings()
    assert s["DEBUG"] is False
    assert s["SESSION_COOKIE_SECURE"] and s["CSRF_COOKIE_SECURE"]
    assert s["SESSION_COOKIE_HTTPONLY"]
    assert s["SESSION_COOKIE_SAMESITE"] == s["CSRF_COOKIE_SAMESITE"] == "Lax"
    assert s["SESSION_COOKIE_AGE"] == 30 * 60
    assert s["HOLDPOINT_SESSION_MAX_AGE"] == 12 * 3600
    assert s["SECURE_SSL_REDIRECT"] is True
    assert s["SECURE_HSTS_SECONDS"] == 31_536_000 and s["SECURE_HSTS_INCLUDE_SUBDOMAINS"]
    assert s["SECURE_CONTENT_TYPE_NOSNIFF"] is True
    assert s["SECURE_REFERRER_POLICY"] == "same-origin"
    assert s["SECURE_CROSS_ORIGIN_OPENER_POLICY"] == "same-origin"
    assert s["X_FRAME_OPTIONS"] == "DENY"
    assert s["AXES_ENABLED"] is True and s["AXES_FAILURE_LIMIT"] == 5
    assert s["AXES_COOLOFF_TIME"] == "0:15:00"
    assert s["AXES_LOCKOUT_PARAMETERS"] == [["username", "ip_address"]]
    directives = s["CONTENT_SECURITY_POLICY"]["DIRECTIVES"]
    assert directives["script-src"] == directives["style-src"] == ["'self'"]
    assert directives["frame-ancestors"] == directives["object-src"] == ["'none'"]


def test_the_login_and_session_limits_follow_the_environment() -> None:
    s = production_settings(
        SESSION_COOKIE_AGE="900",
        HOLDPOINT_SESSION_MAX_AGE="28800",
        HOLDPOINT_LOGIN_FAILURE_LIMIT="10",
        HOLDPOINT_LOGIN_COOLOFF_MINUTES="30",
    )
    assert s["SESSION_COOKIE_AGE"] == 900
    assert s["HOLDPOINT_SESSION_MAX_AGE"] == 28800
    assert s["AXES_FAILURE_LIMIT"] == 10
    assert s["AXES_COOLOFF_TIME"] == "0:30:00"


def test_a_malformed_decision_rate_stops_start_up() -> None:
    result = manage("check", HOLDPOINT_DECISION_RATE="lots")
    assert result.returncode != 0
    assert "HOLDPOINT_DECISION_RATE" in result.stderr
