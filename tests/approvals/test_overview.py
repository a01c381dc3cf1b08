"""The tenant overview page (issue 20): the figures a lead reads, right, scoped, and cheap.

Built from requests raised through the ledger's real path and a real decision, with their
times moved (the data, not the clock) so the turnaround's percentiles are known exactly;
another tenant's runs, requests and parked actions sit beside them and must count nowhere.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from approvals.decisions import decide
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Action, ActionStatus, Run, RunStatus, Tenant
from tests.approvals.test_pages import raise_request
from tests.conftest import Persona
from tests.runtime import failing  # noqa: F401  (registers the failing graph)
from tests.runtime.helpers import make_due

pytestmark = pytest.mark.django_db
A = ApprovalStatus


def text_of(html: str) -> str:
    """The page as a person reads it: tags gone, spaces folded."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def decided_after(
    request: ApprovalRequest, reviewer: Persona, took: timedelta, ago: timedelta
) -> None:
    """Decide `request` for real, then place it in time: raised `ago + took` ago, decided
    `ago` ago."""
    decide(request.pk, reviewer.user, "approve", request.action_hash)
    decided_at = timezone.now() - ago
    ApprovalRequest.objects.filter(pk=request.pk).update(
        created_at=decided_at - took, decided_at=decided_at
    )


def stuck(tenant: Tenant) -> Run:
    """A run whose step failed three times: needs_attention, through the executor."""
    run = create_run(tenant, "failing", {"how": "raise"}, actor="user:t")
    for _ in range(3):
        advance_run(run.run_id, "w1")
        run.refresh_from_db()
        if run.status == RunStatus.RETRYING:
            make_due(run)
    assert run.status == RunStatus.NEEDS_ATTENTION
    return run


def park(tenant: Tenant, status: str) -> Action:
    """An action of a fresh request, moved to `status` (what reconciliation would do)."""
    request = raise_request(tenant)
    ApprovalRequest.objects.filter(pk=request.pk).update(status=A.CANCELLED)
    Action.objects.filter(pk=request.action_id).update(status=status)
    return Action.objects.get(pk=request.action_id)


@pytest.fixture
def tenant_b_data(tenant_b: Tenant) -> None:
    """Tenant B has something of everything; none of it may show in A's figures."""
    ApprovalPolicy.objects.create(tenant=tenant_b, name="b holds", tool="tasks.create")
    for _ in range(2):
        raise_request(tenant_b)
    park(tenant_b, ActionStatus.MANUAL_REVIEW)
    stuck(tenant_b)
    Run.objects.filter(tenant=tenant_b).update(thread_id="B-secret-thread")


def test_the_overview_shows_the_tenants_figures(
    client: Client, reviewer_a: Persona, policy: ApprovalPolicy, tenant_b_data: None
) -> None:
    tenant = reviewer_a.tenant
    now = timezone.now()
    # Twenty decisions in the last 7 days taking 1..20 minutes: nearest rank p50 is the
    # 10th (10 min), p95 the 19th (19 min). One older decision and one expiry do not count.
    for minutes in range(1, 21):
        decided_after(
            raise_request(tenant), reviewer_a, timedelta(minutes=minutes), timedelta(hours=1)
        )
    decided_after(raise_request(tenant), reviewer_a, timedelta(days=3), timedelta(days=8))
    expired = raise_request(tenant)
    ApprovalRequest.objects.filter(pk=expired.pk).update(
        status=A.EXPIRED, decided_at=now, created_at=now - timedelta(days=2)
    )
    # Three waiting: 10 minutes, 2 hours and 2 days old.
    for age in (timedelta(minutes=10), timedelta(hours=2), timedelta(days=2)):
        waiting = raise_request(tenant)
        ApprovalRequest.objects.filter(pk=waiting.pk).update(created_at=now - age)
    parked = park(tenant, ActionStatus.MANUAL_REVIEW)
    Action.objects.filter(pk=parked.pk).update(created_at=now - timedelta(hours=5))
    park(tenant, ActionStatus.UNKNOWN)
    attention = stuck(tenant)

    client.force_login(reviewer_a.user)
    page = client.get(reverse("overview"))
    assert page.status_code == 200
    seen = page.context["overview"]
    mine = Run.objects.filter(tenant=tenant)
    assert seen.runs_total == mine.count()
    by_status = {bar.kind: bar.count for bar in seen.runs}
    assert by_status["needs_attention"] == 1
    assert sum(by_status.values()) == mine.count()
    assert [(b.label, b.count) for b in seen.waiting] == [
        ("under 1 h", 1),
        ("1–4 h", 1),
        ("4–24 h", 0),
        ("over 24 h", 1),
    ]
    assert seen.turnaround.decided == 20
    assert seen.turnaround.p50 == timedelta(minutes=10)
    assert seen.turnaround.p95 == timedelta(minutes=19)
    assert (seen.manual_review, seen.unknown) == (1, 1)
    assert [r.run_id for r in seen.attention] == [attention.run_id]

    words = text_of(page.content.decode())
    assert "Approvals waiting 3" in words
    assert "The oldest has waited 2 d" in words
    assert "20 decisions by reviewers" in words
    assert "p50 10 min" in words and "p95 19 min" in words
    assert "1 action waits for a person" in words and "the oldest for 5 h" in words
    assert "3 consecutive failure(s) at step attempt" in words
    assert "RuntimeError: the tracker said no" in words
    assert "B-secret-thread" not in words
    # Each status bar links to the runs list filtered by it; the page links from the nav.
    assert f'href="{reverse("runs")}?status=needs_attention"' in page.content.decode()
    assert f'href="{reverse("overview")}" aria-current="page"' in page.content.decode()


def test_the_overview_of_an_empty_tenant_says_so(client: Client, viewer_a: Persona) -> None:
    client.force_login(viewer_a.user)
    words = text_of(client.get(reverse("overview")).content.decode())
    assert "Nothing waits for a reviewer." in words
    assert "No reviewer decided anything in the last 7 days." in words
    assert "No action waits for a person to reconcile it." in words
    assert "No run needs attention." in words


def test_the_charts_need_no_script_and_no_other_host(client: Client, reviewer_a: Persona) -> None:
    """Bars are inline SVG whose lengths are attributes (the CSP allows no inline style),
    and nothing on the page is loaded from another host."""
    raise_request(reviewer_a.tenant)
    client.force_login(reviewer_a.user)
    html = client.get(reverse("overview")).content.decode()
    assert html.count('<svg class="bar-svg"') >= len(RunStatus) + 4
    assert "style=" not in html
    assert not re.search(r'(src|href)="(https?:)?//', html)


def test_the_overview_runs_the_same_statements_for_more_data(
    client: Client, reviewer_a: Persona, policy: ApprovalPolicy
) -> None:
    tenant = reviewer_a.tenant
    client.force_login(reviewer_a.user)
    decided_after(raise_request(tenant), reviewer_a, timedelta(minutes=3), timedelta(hours=1))
    park(tenant, ActionStatus.MANUAL_REVIEW)

    def statements() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get(reverse("overview")).status_code == 200
        return len(captured)

    few = statements()
    for i in range(15):
        request = raise_request(tenant)
        if i % 3 == 0:
            decided_after(request, reviewer_a, timedelta(minutes=i + 1), timedelta(hours=2))
        elif i % 3 == 1:
            park(tenant, ActionStatus.MANUAL_REVIEW)
    assert statements() == few
