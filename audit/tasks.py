"""django-q2 entry point for the periodic chain verification."""

from __future__ import annotations

from audit.verification import verify_recent


def verify_recent_streams() -> int:
    return verify_recent(hours=2)
