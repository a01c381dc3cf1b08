"""An action's entries in its run's journal, found by the payload's action_id.

The reconcile page's history and the approval page's timeline select them in the database
(`payload__action_id`; the MCP gateway's delivered-result checks do the same), from payloads
the journal stores as the canonical text its hashes cover (audit.journal, fastsql JsonText).
They must find every entry a person reading the payloads counts as the action's — on SQLite
(the stored text, json_extract) as on PostgreSQL (jsonb) — not only its action_prepared.
"""

from __future__ import annotations

from typing import Any

from django.test import Client
from django.urls import reverse

from approvals.decisions import decide
from approvals.models import ApprovalRequest
from audit.journal import run_stream
from audit.models import JournalEntry
from runtime.executor import advance_run
from runtime.models import Action, ActionStatus, Run
from tests.conftest import Persona
from tests.sandbox import Sandbox


def _read_in_python(run: Run, key: str, value: str) -> list[int]:
    """The seqs of the run's entries whose payload names `value` under `key`, read as a
    person reads them: every entry of the stream, payloads decoded in Python."""
    entries = JournalEntry.objects.filter(stream=run_stream(run.run_id)).order_by("seq")
    return [e.seq for e in entries if e.payload.get(key) == value]


def test_an_approved_sent_and_confirmed_action_has_all_its_entries_found_by_its_id(
    client: Client, reviewer_a: Persona, held: tuple[Run, ApprovalRequest, Sandbox]
) -> None:
    run, request, _box = held
    decide(request.id, reviewer_a.user, "approve", request.action_hash, reason="ok")
    assert advance_run(run.run_id, "w1").outcome == "completed"
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED
    action_id = str(action.action_id)

    expected = _read_in_python(run, "action_id", action_id)
    found = JournalEntry.objects.filter(
        stream=run_stream(run.run_id), payload__action_id=action_id
    ).order_by("seq")
    assert [e.seq for e in found] == expected
    outcomes = [e.payload["action_status"] for e in found if e.type == "action_outcome"]
    assert outcomes == ["approved", "sent", "confirmed"]
    # Read back in the database the way runtime.agents.mcp_session reads delivered ids.
    assert set(found.values_list("payload__action_id", flat=True)) == {action_id}
    types = {e.type for e in found}
    assert {"action_prepared", "approval_requested", "approval_decided"} <= types

    client.force_login(reviewer_a.user)
    detail = client.get(reverse("reconcile-detail", args=[action.action_id]))
    assert [row.entry.seq for row in detail.context["history"]] == expected[::-1]

    by_request = expected + _read_in_python(run, "approval_id", str(request.pk))
    page = client.get(reverse("approval-page", args=[request.pk]))
    timeline: list[Any] = page.context["history"]
    assert [row.entry.seq for row in timeline] == sorted(set(by_request), reverse=True)
