"""Pending hold points for /metrics (runtime.metrics reads this collector on each scrape:
the runtime knows nothing of approvals, so this app adds it at start-up)."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count, Max, Min
from django.db.models.functions import Now
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from approvals.models import ApprovalRequest, ApprovalStatus


class PendingApprovals(Collector):
    """How many requests wait for a reviewer, and for how long the oldest has (one query)."""

    def collect(self) -> Iterator[Metric]:
        # The age by the database's clock, which wrote created_at (approvals.requests): the
        # scraping process's clock may run ahead of it or behind.
        pending = ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING).aggregate(
            n=Count("pk"), oldest=Min("created_at"), now=Max(Now())
        )
        yield GaugeMetricFamily(
            "holdpoint_approvals_pending",
            "Approval requests waiting for a decision.",
            value=pending["n"],
        )
        oldest = pending["oldest"]
        age = (pending["now"] - oldest).total_seconds() if oldest is not None else 0.0
        yield GaugeMetricFamily(
            "holdpoint_oldest_pending_approval_seconds",
            "Age of the oldest pending approval request (0 when none is pending).",
            value=max(age, 0.0),
        )
