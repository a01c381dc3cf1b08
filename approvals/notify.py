"""Notifications (filled by the notifications work): a no-op hook for now."""

from __future__ import annotations

from typing import Any


def notify_requested(request: Any) -> None:
    """Tell eligible reviewers a request waits (email, webhook)."""


def notify_reminder(request: Any) -> None:
    """Remind eligible reviewers before a request expires."""


def notify_escalated(request: Any) -> None:
    """Tell the escalation group a request now waits for them too."""
