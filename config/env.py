"""Typed environment readers.

Settings come from the environment so one artefact runs on a laptop (SQLite, no services)
and in production (PostgreSQL, Redis). A bad value must stop the process at start-up with
the variable's name, never fall back silently to a default that changes behaviour.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
from pathlib import Path


class EnvError(RuntimeError):
    """A setting in the environment is missing or malformed."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise EnvError(f"environment variable {name} is required")
        return default
    return value


def env_token(name: str) -> str:
    """A secret compared byte for byte (a bearer token), empty when unset. The whitespace
    around it is not part of it: a secrets file mounted as the variable ends in a newline,
    and a token kept with it could never match. Whitespace alone is refused, not read as
    "unset" — that would open what the variable was set to close."""
    raw = os.environ.get(name, "")
    value = raw.strip()
    if raw and not value:
        raise EnvError(f"{name} is set but holds only whitespace")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise EnvError(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise EnvError(f"{name} must be >= {minimum}, got {value}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_fernet_keys(name: str, *, derive_from: str | None = None) -> list[str]:
    """Comma-separated Fernet keys, newest first (each 32 url-safe base64-encoded bytes, as
    `Fernet.generate_key()` prints). Unset or empty: derived from `derive_from` when given
    (development and tests only), else an error — production never runs on a guessable key.
    """
    keys = env_list(name, [])
    if not keys:
        if derive_from is None:
            raise EnvError(
                f"{name} is required when DEBUG is off: comma-separated Fernet keys, newest "
                "first (python -c 'from cryptography.fernet import Fernet; "
                "print(Fernet.generate_key().decode())')"
            )
        digest = hashlib.sha256(b"holdpoint.secret-keys:" + derive_from.encode()).digest()
        return [base64.urlsafe_b64encode(digest).decode("ascii")]
    for position, key in enumerate(keys, start=1):
        try:
            raw = base64.urlsafe_b64decode(key.encode("ascii"))
        except (ValueError, UnicodeError):
            raw = b""
        if len(raw) != 32:
            raise EnvError(
                f"{name}: key #{position} is not a Fernet key (32 url-safe base64-encoded bytes)"
            )
    return keys


# --- The local settings file -----------------------------------------------------------
# `make run` writes VAR_DIR/local.env once (DEBUG=1 and a generated SECRET_KEY, mode 600), so
# every README `manage.py` line works in a new shell with no variable to guess. Only
# manage.py reads it — never config.settings itself (the test suite and gunicorn import
# that) — and only for variables the environment does not set.

LOCAL_ENV = "local.env"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def local_env_path(base_dir: Path) -> Path:
    """VAR_DIR/local.env; VAR_DIR comes from the environment alone (the file cannot move
    itself)."""
    return Path(os.environ.get("HOLDPOINT_VAR_DIR") or base_dir / "var") / LOCAL_ENV


def read_env_file(path: Path) -> dict[str, str]:
    """`NAME=value` lines, as a shell would source them without quoting; blank lines and
    `#` comments are skipped. Anything else stops the process with the file and line."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):
            raise EnvError(f"{path}:{number}: expected NAME=value, got {raw!r}")
        values[name] = value.strip()
    return values


def load_local_env(path: Path) -> list[str]:
    """Fill in, from `path`, the variables the environment does not set; the names set.

    Nothing is read when the file is missing, or when the environment sets DEBUG off: a
    process started as production takes its secrets from its environment only, so a
    developer's file in a deployed checkout can neither switch DEBUG on nor lend its
    SECRET_KEY, and a production start without real secrets still fails.
    """
    debug = os.environ.get("DEBUG")
    if debug is not None and debug.strip().lower() in _FALSE:
        return []
    try:
        values = read_env_file(path)
    except FileNotFoundError:
        return []
    added = [name for name in values if name not in os.environ]
    for name in added:
        os.environ[name] = values[name]
    return added


def stderr_is_terminal() -> bool:
    """Whether log lines go to a person's terminal (the default log format follows it)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except ValueError:  # closed
        return False
