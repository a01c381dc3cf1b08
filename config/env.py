"""Typed environment readers.

Settings come from the environment so one artefact runs on a laptop (SQLite, no services)
and in production (PostgreSQL, Redis). A bad value must stop the process at start-up with
the variable's name, never fall back silently to a default that changes behaviour.
"""

from __future__ import annotations

import base64
import hashlib
import os


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
