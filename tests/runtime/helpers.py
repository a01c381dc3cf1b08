"""Small helpers for engine tests: moving data instead of clocks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone

from audit.models import JournalEntry
from runtime.models import Run


def overlaps_commits() -> bool:
    """Whether a worker here runs the next step while a step's commit is on its way
    (HOLDPOINT_OVERLAP_COMMITS, PostgreSQL with its prepared cursor): a worker killed as it
    learns a commit landed had already begun the next step, which then runs again."""
    return (
        connection.vendor == "postgresql"
        and settings.HOLDPOINT_OVERLAP_COMMITS
        and settings.HOLDPOINT_PG_PREPARE
    )


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


def in_other_thread(work: Callable[[], Any]) -> None:
    """`work` on a connection of its own, committed before this returns."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failed.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the other connection hung (a lock this test holds?)"
    if failed:
        raise failed[0]
