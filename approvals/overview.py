"""The tenant overview: how the tenant's work stands, in figures a lead reads in ten seconds.

Runs by status, approvals waiting and how long, how fast reviewers answer (p50/p95 of the
last 7 days), what waits for a person to reconcile, and the runs that need attention. It
lives in `approvals` because it reads both apps' rows (runtime does not import approvals).

Each figure is one aggregate query (the percentiles one row each, by OFFSET in the ordered
turnarounds), so the page runs the same handful of statements for ten requests as for a
million: nothing is loaded row by row to be counted in Python. Every query starts from the
tenancy helpers, so another tenant's rows are never in a figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, DurationField, ExpressionWrapper, F, Min, Q, QuerySet

from approvals.models import ApprovalRequest, ApprovalStatus
from approvals.scoping import approvals_for
from approvals.wording import duration
from runtime.models import ActionStatus, Run, RunStatus
from runtime.tenancy import Principal, actions_for, runs_for

A = ApprovalStatus
TURNAROUND_DAYS = 7
ATTENTION_LIMIT = 10
# What an attention row shows: never the run's goal or state, which may be large.
ATTENTION_FIELDS = (
    "run_id",
    "tenant",
    "graph",
    "thread_id",
    "status",
    "attention_reason",
    "last_error",
    "updated_at",
)
# The ages a waiting approval falls into: (label, younger than); the last bucket is the rest.
AGE_BUCKETS = (
    ("under 1 h", timedelta(hours=1)),
    ("1–4 h", timedelta(hours=4)),
    ("4–24 h", timedelta(hours=24)),
)
OLDEST_BUCKET = "over 24 h"


@dataclass(frozen=True)
class Bar:
    """One bar of a chart: its words, its number, and its length in percent of the chart."""

    label: str
    count: int
    percent: float
    kind: str = ""
    url: str = ""


@dataclass(frozen=True)
class Turnaround:
    """How long human decisions of the last days took, from request to decision."""

    decided: int
    p50: timedelta | None
    p95: timedelta | None

    @property
    def bars(self) -> list[Bar]:
        """p50 and p95 as bars on the p95's scale (the p95 is the full length)."""
        if self.p50 is None or self.p95 is None:
            return []
        longest = self.p95.total_seconds() or 1.0
        return [
            Bar(f"p50 {duration(self.p50.total_seconds())}", 0, _share(self.p50, longest), "p50"),
            Bar(f"p95 {duration(self.p95.total_seconds())}", 0, 100.0, "p95"),
        ]


@dataclass(frozen=True)
class Overview:
    runs: list[Bar]
    runs_total: int
    waiting: list[Bar]
    waiting_total: int
    oldest_waiting: str
    turnaround: Turnaround
    manual_review: int
    unknown: int
    oldest_manual: str
    attention: list[Run]
    attention_total: int


def _share(part: timedelta | int, whole: float) -> float:
    """A bar's length in percent; a non-zero figure is never drawn as nothing."""
    value = part.total_seconds() if isinstance(part, timedelta) else float(part)
    if value <= 0 or whole <= 0:
        return 0.0
    return round(max(1.0, 100.0 * value / whole), 1)


def _age(since: datetime | None, now: datetime) -> str:
    return duration((now - since).total_seconds()) if since is not None else ""


def runs_by_status(principal: Principal) -> tuple[list[Bar], int]:
    """Every status with its count, in the lifecycle's order, zeros included (one query)."""
    counts = {
        row["status"]: row["n"]
        for row in runs_for(principal).order_by().values("status").annotate(n=Count("pk"))
    }
    total = sum(counts.values())
    bars = [
        Bar(s.value, counts.get(s.value, 0), _share(counts.get(s.value, 0), total), s.value)
        for s in RunStatus
    ]
    return bars, total


def waiting_approvals(principal: Principal, now: datetime) -> tuple[list[Bar], int, str]:
    """Pending requests by age, and how long the oldest has waited (one query)."""
    younger = {
        f"b{i}": Count("pk", filter=Q(created_at__gt=now - age))
        for i, (_, age) in enumerate(AGE_BUCKETS)
    }
    found = (
        approvals_for(principal)
        .filter(status=A.PENDING)
        .aggregate(total=Count("pk"), oldest=Min("created_at"), **younger)
    )
    total = found["total"]
    bars: list[Bar] = []
    below = 0
    for i, (label, _) in enumerate(AGE_BUCKETS):
        count = found[f"b{i}"] - below
        below = found[f"b{i}"]
        bars.append(Bar(label, count, _share(count, total), f"age{i}"))
    rest = total - below
    bars.append(Bar(OLDEST_BUCKET, rest, _share(rest, total), f"age{len(AGE_BUCKETS)}"))
    return bars, total, _age(found["oldest"], now)


def _decided_by_people(principal: Principal, now: datetime) -> QuerySet[ApprovalRequest]:
    since = now - timedelta(days=TURNAROUND_DAYS)
    return approvals_for(principal).filter(
        status__in=(A.APPROVED, A.REJECTED), decided_by__isnull=False, decided_at__gte=since
    )


def turnaround(principal: Principal, now: datetime) -> Turnaround:
    """p50 and p95 (nearest rank) of request → decision over the last 7 days, for decisions
    people made (an expiry or a superseded request is no reviewer's answer): a count and one
    row per percentile, read by OFFSET from the ordered durations in the database."""
    decided = _decided_by_people(principal, now)
    n = decided.count()
    if not n:
        return Turnaround(0, None, None)
    took = ExpressionWrapper(F("decided_at") - F("created_at"), output_field=DurationField())
    ordered = decided.annotate(took=took).order_by("took", "pk").values_list("took", flat=True)

    def at(p: float) -> timedelta:
        value: timedelta = ordered[max(0, math.ceil(p * n) - 1)]
        return value

    return Turnaround(n, at(0.50), at(0.95))


def reconciliation_backlog(principal: Principal, now: datetime) -> tuple[int, int, str]:
    """Actions waiting for a person (manual_review), those the reconciler is still working on
    (unknown), and the age of the oldest waiting for a person (one query)."""
    found = (
        actions_for(principal)
        .filter(status__in=(ActionStatus.MANUAL_REVIEW, ActionStatus.UNKNOWN))
        .aggregate(
            manual=Count("pk", filter=Q(status=ActionStatus.MANUAL_REVIEW)),
            unknown=Count("pk", filter=Q(status=ActionStatus.UNKNOWN)),
            oldest=Min("created_at", filter=Q(status=ActionStatus.MANUAL_REVIEW)),
        )
    )
    return found["manual"], found["unknown"], _age(found["oldest"], now)


def needing_attention(principal: Principal) -> list[Run]:
    """The newest runs a person must look at (needs_attention), with their reason."""
    return list(
        runs_for(principal)
        .filter(status=RunStatus.NEEDS_ATTENTION)
        .only(*ATTENTION_FIELDS)
        .order_by("-updated_at", "-run_id")[:ATTENTION_LIMIT]
    )


def tenant_overview(principal: Principal, now: datetime) -> Overview:
    runs, runs_total = runs_by_status(principal)
    waiting, waiting_total, oldest = waiting_approvals(principal, now)
    manual, unknown, oldest_manual = reconciliation_backlog(principal, now)
    attention_total = next(b.count for b in runs if b.kind == RunStatus.NEEDS_ATTENTION)
    return Overview(
        runs=runs,
        runs_total=runs_total,
        waiting=waiting,
        waiting_total=waiting_total,
        oldest_waiting=oldest,
        turnaround=turnaround(principal, now),
        manual_review=manual,
        unknown=unknown,
        oldest_manual=oldest_manual,
        attention=needing_attention(principal) if attention_total else [],
        attention_total=attention_total,
    )
