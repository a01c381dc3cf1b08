"""Small helpers for engine tests: moving data instead of clocks."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from audit.models import JournalEntry
from runtime.models import Run


def expire_lease(run: Run | Any) -> None:
    """Make the lease look expired: tests move the data, not the database clock."""
    run_id = getattr(run, "run_id", run)
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(seconds=60))


def make_due(run: Run | Any) -> None:
    run_id = getattr(run, "run_id", run)
    Run.objects.filter(pk=run_id).update(wake_at=timezone.now() - timedelta(seconds=1))


def events(run: Run | Any) -> list[str]:
    run_id = getattr(run, "run_id", run)
    return list(
        JournalEntry.objects.filter(stream=f"run:{run_id}")
        .order_by("seq")
        .values_list("type", flat=True)
    )


def payloads(run: Run | Any, type: str) -> list[dict[str, Any]]:
    run_id = getattr(run, "run_id", run)
    return [
        e.payload
        for e in JournalEntry.objects.filter(stream=f"run:{run_id}", type=type).order_by("seq")
    ]
