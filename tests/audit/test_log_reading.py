"""The audit log reads as a story (issue 20): each decision once, the workers' bookkeeping
(leases, wake-ups, recorded calls, checkpoints) folded into one line per stretch.

Drawn from a real api-review run: held at its hold point,
approved, sent to a real sandbox, completed — every entry written by the real code."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from approvals.decisions import decide
from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.pages.audit import FOLDED_TYPES
from tests.approvals.conftest import held, policy  # noqa: F401  (fixtures)
from tests.conftest import Persona

pytestmark = pytest.mark.django_db


def test_a_decision_shows_once_and_lease_events_fold(
    client: Client,
    held: Any,  # noqa: F811
    reviewer_a: Persona,
) -> None:
    run, request, box = held
    decide(request.pk, reviewer_a.user, "approve", request.action_hash)
    assert advance_run(run.run_id, "w2").outcome == "completed"
    assert len(box.tasks()) == 1
    # The journal holds the decision twice (run stream and tenant stream) and the workers'
    # bookkeeping between the events a reader is after; the exports keep all of it.
    stored = JournalEntry.objects.filter(tenant_id=run.tenant_id)
    assert stored.filter(type="approval_decided").count() == 2
    bookkeeping = stored.filter(type__in=FOLDED_TYPES).count()

    client.force_login(reviewer_a.user)
    page = client.get(reverse("audit-log"))
    assert page.status_code == 200
    html = page.content.decode()
    decided = [r for r in page.context["rows"] if r.entry.type == "approval_decided"]
    assert [r.entry.stream for r in decided] == [f"run:{run.run_id}"]
    assert html.count('<span class="badge">approval_decided</span>') == 1

    lines = page.context["groups"]
    folds = [g for g in lines if g.folded]
    # run_created, [lease, 4 calls, 3 steps, checkpoint], prepared, requested, [parked],
    # decided, outcome, [woken, lease], outcome, [checkpoint], outcome, [step]: the
    # stretches of two or more fold.
    assert len(folds) >= 2
    assert all({r.entry.type for r in g.rows} <= FOLDED_TYPES for g in folds)
    shown_alone = [g.rows[0].entry.type for g in lines if not g.folded]
    for wanted in ("run_created", "action_prepared", "approval_requested", "action_outcome"):
        assert wanted in shown_alone
    assert len(lines) < len(page.context["rows"])
    # Nothing is dropped: every bookkeeping entry is on the page, inside a fold or alone.
    assert sum(1 for r in page.context["rows"] if r.entry.type in FOLDED_TYPES) == bookkeeping
    first = folds[-1]  # the oldest stretch: the first turn's lease, calls and steps
    assert f"{len(first.rows)} worker events: call_recorded ×4" in html
    for row in first.rows:  # each stays reachable by its anchor, inside the <details>
        assert re.search(rf'<li id="entry-{row.entry.pk}"', html)

    # Filtering by type still finds the run's copy of the decision.
    only = client.get(reverse("audit-log"), {"type": "approval_decided"})
    assert [r.entry.stream for r in only.context["rows"]] == [f"run:{run.run_id}"]

    # Asking for one worker event type shows each entry on its own line: nothing folded.
    leases = client.get(reverse("audit-log"), {"type": "lease_taken"})
    assert len(leases.context["rows"]) >= 2
    assert not [g for g in leases.context["groups"] if g.folded]
