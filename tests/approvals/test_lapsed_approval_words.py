"""An approval that lapsed before its action was sent says so in words, wherever it is read.

The dispatch re-check supersedes an approval whose window passed before the send and asks
again (runtime.ledger.hold_again). Its closing reason was the sender's error code: the run
page's Flow read "superseded by worker:w1#2: approval_expired", the journal (events API,
audit trail) "approval_expired", and the request page "superseded by alice" — as if the
reviewer who approved it had superseded it. Now the reason is when it expired and what
followed, on the request (REST `closed_reason`), in the journal and on every page; the
status word stays `superseded` (API.md) and the reviewer's own decision stays as given.
"""

from __future__ import annotations

import re
from datetime import UTC, timedelta
from html import unescape
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.decisions import decide
from approvals.models import ApprovalRequest, ApprovalStatus
from runtime.executor import advance_run
from tests.api import get, ok, session
from tests.conftest import Persona

pytestmark = pytest.mark.django_db
A = ApprovalStatus


def _text(html: str) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def _flow(client: Client, run: Any) -> str:
    page = client.get(reverse("run", args=[run.run_id])).content.decode()
    found = re.search(r'<section class="card [^"]*" id="run-flow".*?</section>', page, re.S)
    assert found is not None
    return _text(found.group(0))


def _lapse(held: Any, reviewer: Persona) -> tuple[Any, ApprovalRequest, str]:
    """Approved, then not sent before the approval's window passed: the worker's send finds
    it lapsed. Returns the run, the request and the words it should be closed with."""
    run, request, box = held
    decide(request.id, reviewer.user, "approve", request.action_hash, reason="looks right")
    lapsed = timezone.now() - timedelta(minutes=3)  # the data moves, not the clock
    ApprovalRequest.objects.filter(pk=request.pk).update(
        decided_at=lapsed - timedelta(hours=1), expires_at=lapsed
    )
    assert advance_run(run.run_id, "w1").outcome == "waiting"  # asked again
    assert box.tasks() == []
    at = lapsed.astimezone(UTC).strftime("%Y-%m-%d %H:%M")
    return run, request, f"expired at {at} UTC before it was sent; re-requested"


def test_the_api_and_the_journal_give_the_expiry_not_a_code_word(
    held: Any, reviewer_a: Persona
) -> None:
    run, request, words = _lapse(held, reviewer_a)
    api = session(reviewer_a.user)
    shown = ok(get(api, f"approvals/{request.pk}/"))
    assert shown["status"] == A.SUPERSEDED
    assert shown["closed_reason"] == words
    assert (shown["decided_by"], shown["decision_reason"]) == ("alice", "looks right")
    fresh = ok(get(api, "approvals/?status=pending"))["results"]
    assert [r["closed_reason"] for r in fresh] == [""]  # the new request: open
    events = ok(get(api, f"runs/{run.run_id}/events/"))["results"]
    closed = [e["payload"] for e in events if e["type"] == "approval_closed"]
    assert closed == [
        {
            "approval_id": str(request.pk),
            "approval_status": A.SUPERSEDED,
            "reason": words,
        }
    ]


def test_the_reviewer_pages_and_the_run_page_read_the_expiry(
    held: Any, reviewer_a: Persona, client: Client
) -> None:
    run, request, words = _lapse(held, reviewer_a)
    client.force_login(reviewer_a.user)
    page = _text(client.get(reverse("approval-page", args=[request.pk])).content.decode())
    assert f"superseded — {words}. Approved by alice" in page, page
    assert "looks right" in page
    assert "superseded by" not in page and "approval_expired" not in page
    status = _text(client.get(reverse("approval-page-status", args=[request.pk])).content.decode())
    assert words in status and "superseded by" not in status

    history = _text(client.get(reverse("inbox-history")).content.decode())
    assert f"{words} (approved: “looks right”)" in history

    flow = _flow(client, run)
    assert "approval approved, then superseded" in flow
    assert f"superseded: {words}" in flow
    assert "superseded by" not in flow and "approval_expired" not in flow
