"""Every way a hold point ends at expiry is in the run's own stream, with the status change.

A request that expires is closed (`approval_closed`, status `expired`) whether it is asked
again or rejected; one whose policy approves at expiry is decided — by the expirer — and the
run's stream says so as it says a reviewer's decision (`approval_decided`), in the same
transaction. Before, the approval at expiry wrote only the tenant's status entry: the run's
history (its events API, its Flow picture) showed the request open for ever, then an action
approved by nobody it named.
"""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.decisions import decide
from approvals.expiry import SYSTEM, sweep_approvals
from approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus, OnExpiry
from audit.journal import run_stream
from audit.verification import verify_stream
from runtime.errors import Expired
from runtime.executor import advance_run
from runtime.models import ActionStatus, RunStatus
from tests.conftest import Persona
from tests.runtime.helpers import payloads

A = ApprovalStatus


def _expire(request: ApprovalRequest) -> None:
    """The request's window has passed (the data moved, not the database's clock)."""
    ApprovalRequest.objects.filter(pk=request.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )


def _flow(client: Client, run: Any) -> str:
    page = client.get(reverse("run", args=[run.run_id])).content.decode()
    found = re.search(r'<section class="card [^"]*" id="run-flow".*?</section>', page, re.S)
    assert found is not None
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", found.group(0))).split())


def test_an_approval_at_expiry_is_decided_in_the_runs_stream(
    held: Any, policy: ApprovalPolicy, reviewer_a: Persona, client: Client
) -> None:
    run, request, box = held
    ApprovalPolicy.objects.filter(pk=policy.pk).update(on_expiry=OnExpiry.APPROVE)
    _expire(request)
    # The reviewer who comes at the moment of expiry is refused: the expirer decides it.
    with pytest.raises(Expired):
        decide(request.id, reviewer_a.user, "approve", request.action_hash)
    assert sweep_approvals() == 1

    request.refresh_from_db()
    assert request.status == A.APPROVED and request.decided_by is None
    assert request.action.status == ActionStatus.APPROVED
    decided = payloads(run, "approval_decided")
    assert len(decided) == 1, decided
    assert decided[0]["approval_id"] == str(request.id)
    assert decided[0]["action_id"] == str(request.action_id)
    assert decided[0]["decision"] == "approve" and decided[0]["final"] is True
    assert decided[0]["hash_seen"] == request.action_hash
    assert decided[0]["policy"] == policy.name
    assert "at expiry" in decided[0]["reason"]
    assert _run_entries(run, "approval_decided")[0].actor == SYSTEM
    # The run's history reads in order: requested, decided, then woken to go on.
    types = [e.type for e in _run_entries(run)]
    assert types.index("approval_requested") < types.index("approval_decided")
    assert types.index("approval_decided") < len(types) - 1 and types[-1] == "woken"
    assert verify_stream(run_stream(run.run_id)) is None

    assert advance_run(run.run_id, "w1").outcome == "completed" and len(box.tasks()) == 1
    client.force_login(reviewer_a.user)
    flow = _flow(client, run)
    assert "approval approved" in flow and f"approve by {SYSTEM}" in flow
    assert "in progress" not in flow


@pytest.mark.parametrize("on_expiry", [OnExpiry.REREQUEST, OnExpiry.REJECT, OnExpiry.APPROVE])
def test_every_expiry_outcome_names_the_request_in_the_runs_stream(
    held: Any, policy: ApprovalPolicy, on_expiry: str
) -> None:
    run, request, _ = held
    ApprovalPolicy.objects.filter(pk=policy.pk).update(on_expiry=on_expiry)
    _expire(request)
    sweep_approvals()
    request.refresh_from_db()
    named = [e.type for e in _run_entries(run) if e.payload.get("approval_id") == str(request.id)]
    # Requested, then the entry for how it ended.
    ended = {OnExpiry.APPROVE: "approval_decided"}.get(on_expiry, "approval_closed")
    assert named == ["approval_requested", ended], named
    run.refresh_from_db()
    assert run.status in (RunStatus.QUEUED, RunStatus.WAITING_APPROVAL)


def _run_entries(run: Any, type: str | None = None) -> list[Any]:
    from audit.models import JournalEntry

    entries = JournalEntry.objects.filter(stream=run_stream(run.run_id)).order_by("seq")
    return list(entries.filter(type=type) if type else entries)
