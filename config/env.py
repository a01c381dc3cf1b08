"""Typed environment readers.

Settings come from the environment so one artefact runs on a laptop (SQLite, no services)
and in production (PostgreSQL, Redis). A bad value must stop the process at start-up with
the variable's name, never fall back silently to a default that changes behaviour.
"""

from __future__ import annotations

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
