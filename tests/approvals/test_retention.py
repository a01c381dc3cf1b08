"""Retention and hold points (runtime reaches approvals only through the `gates` port): a
finished run with an open request is kept; otherwise its requests and votes go with it."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalVote
from runtime.executor import advance_run
from runtime.models import Run, Tenant
from tests.conftest import Persona

pytestmark = pytest.mark.django_db


@pytest.fixture
def finished(held: Any, tenant_a: Tenant, reviewer_a: Persona) -> tuple[Run, ApprovalRequest]:
    """The held run, its request rejected, completed and past its tenant's retention."""
    run, request, _ = held
    Tenant.objects.filter(pk=tenant_a.pk).update(retention_days=1)
    decide(request.id, reviewer_a.user, "reject", request.action_hash, reason="Not needed")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(days=10))
    return run, request


def _purge() -> str:
    out = StringIO()
    call_command("purge", stdout=out)
    return out.getvalue()


def _reopened(request: ApprovalRequest) -> ApprovalRequest:
    """A pending request beside a decided one of the same action (moved data: no real path
    leaves a finished run with an open request, which is why purge must not rely on it)."""
    return ApprovalRequest.objects.create(
        tenant_id=request.tenant_id,
        run_id=request.run_id,
        action_id=request.action_id,
        policy_id=request.policy_id,
        action_hash=request.action_hash,
        title=request.title,
        params=request.params,
        expires_at=timezone.now() + timedelta(hours=1),
        checkpoint_rev=request.checkpoint_rev,
    )


def test_a_finished_run_with_an_open_request_is_not_purged(finished: Any) -> None:
    _, request = finished
    reopened = _reopened(request)
    assert "purged 0 run(s)" in _purge()
    assert ApprovalRequest.objects.filter(pk=reopened.pk, status="pending").exists()
    ApprovalRequest.objects.filter(pk=reopened.pk).update(status="cancelled")
    assert "purged 1 run(s)" in _purge()


def test_a_purged_run_takes_its_requests_and_votes_with_it(finished: Any) -> None:
    run, request = finished
    assert "purged 1 run(s)" in _purge()
    assert not ApprovalRequest.objects.filter(run_id=run.pk).exists()
    assert not ApprovalVote.objects.filter(request_id=request.pk).exists()
    verified = StringIO()
    call_command("audit_verify", stdout=verified)
    assert "0 broken" in verified.getvalue()
