"""A journal time no datetime can hold: PostgreSQL's 'infinity' and '-infinity'.

No writer stores one; someone with database access can. psycopg refuses to read it (a
DataError), and every page that selected the column answered 500: the audit log, its
exports, a run's trail and the run's own page. They must keep working and show the entry
with its time unreadable — the trail and audit_verify name it broken. SQLite stores any
text there, and Django's converter failed on these words the same way.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from audit.journal import run_stream
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime.pages.audit import PAGE_SIZE
from tests.audit.tamper import tampering
from tests.audit.test_pages import (  # noqa: F401  (journal_viewer: a fixture)
    T0,
    body,
    every_page,
    fake_entries,
    journal_viewer,
    login,
    make_run,
)
from tests.conftest import Persona

pytestmark = pytest.mark.tampers_journal


def _set_time(entry_id: int, value: str) -> None:
    cast = "::timestamptz" if connection.vendor == "postgresql" else ""
    with tampering() as cursor:
        cursor.execute(
            f"UPDATE audit_journalentry SET created_at = %s{cast} WHERE id = %s",
            [value, entry_id],
        )


def test_log_exports_trail_and_run_page_show_an_infinite_time_as_unreadable(
    client: Client, reviewer_a: Persona, agent_a: Persona
) -> None:
    run = make_run(reviewer_a.tenant, steps=3)
    stream = run_stream(run.run_id)
    victim = JournalEntry.objects.get(stream=stream, seq=3)
    early = JournalEntry.objects.get(stream=stream, seq=2)
    _set_time(victim.pk, "infinity")
    _set_time(early.pk, "-infinity")
    login(client, reviewer_a)

    page = client.get(reverse("audit-log"))
    assert page.status_code == 200
    shown = {row.entry.pk: row.entry.created_at for row in page.context["rows"]}
    assert shown[victim.pk] is None and shown[early.pk] is None
    assert "time unreadable" in page.content.decode()

    for period in ({"from": "2000-01-01"}, {"to": "2999-12-31"}, {"to": "9999-12-31"}):
        page = client.get(reverse("audit-log"), {**period, "object": f"run:{run.run_id}"})
        assert page.status_code == 200, period

    exported = client.get(reverse("audit-export-csv"), {"object": f"run:{run.run_id}"})
    assert exported.status_code == 200
    rows = {int(r["id"]): r for r in csv.DictReader(io.StringIO(body(exported).decode()))}
    assert rows[victim.pk]["created_at"] == "" and rows[early.pk]["created_at"] == ""
    assert rows[victim.pk]["hash"] == victim.hash

    exported = client.get(reverse("audit-export-jsonl"), {"object": f"run:{run.run_id}"})
    assert exported.status_code == 200
    lines = [json.loads(line) for line in body(exported).decode().splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert by_id[victim.pk]["created_at"] is None and by_id[early.pk]["created_at"] is None
    if connection.vendor == "postgresql":  # SQLite stored the words as a number
        exported = client.get(reverse("audit-export-jsonl"), {"from": "2000-01-01"})
        lines = [json.loads(line) for line in body(exported).decode().splitlines()]
        assert lines[-1]["id"] == victim.pk and early.pk not in {line["id"] for line in lines}

    trail = client.get(reverse("run-trail", args=[run.run_id]))
    assert trail.status_code == 200
    assert trail.context["trail"].chain_break.seq == 2
    assert "time cannot be read" in trail.context["trail"].chain_break.problem
    assert client.get(reverse("run", args=[run.run_id])).status_code == 200
    events = agent_a.api().get(f"/api/v1/runs/{run.run_id}/events/")
    assert events.status_code == 200
    times = {e["seq"]: e["created_at"] for e in events.json()["results"]}
    assert times[3] is None and times[2] is None and times[1]

    found = verify_stream(stream)
    assert found is not None and found.seq == 2 and "time cannot be read" in found.problem


def test_period_pages_continue_across_an_infinite_time(client: Client, reviewer_a: Persona) -> None:
    """With a period, the page's cursor is an entry whose time orders the next page: an
    entry at 'infinity' (first, newest first) is a cursor like any other — no 500, no gap,
    no overlap."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite stores 'infinity' as a number, sorted before every time")
    login(client, reviewer_a)
    made = fake_entries(
        reviewer_a.tenant, [{"created_at": T0 + timedelta(seconds=n)} for n in range(PAGE_SIZE)]
    )
    made += fake_entries(reviewer_a.tenant, [{"stream": "odd"} for _ in range(PAGE_SIZE + 3)])
    infinite = made[-(PAGE_SIZE + 3) :]
    for entry in infinite:
        _set_time(entry.pk, "infinity")
    first = client.get(reverse("audit-log"), {"from": "2026-01-01"})
    assert first.status_code == 200
    cursor = first.context["rows"][-1].entry
    assert cursor.pk in {e.pk for e in infinite} and cursor.created_at is None
    infinite_first = sorted((e.pk for e in infinite), reverse=True)
    finite = (
        JournalEntry.objects.filter(tenant_id=reviewer_a.tenant.pk)
        .exclude(pk__in=infinite_first)
        .order_by("-created_at", "-id")
        .values_list("pk", flat=True)
    )
    assert every_page(client, **{"from": "2026-01-01"}) == infinite_first + list(finite)


def test_the_journal_admin_lists_and_shows_an_entry_whose_time_cannot_be_read(
    client: Client,
    journal_viewer: Persona,  # noqa: F811
) -> None:
    run = make_run(journal_viewer.tenant)
    victim = JournalEntry.objects.get(stream=run_stream(run.run_id), seq=2)
    _set_time(victim.pk, "infinity")
    login(client, journal_viewer)
    assert client.get("/admin/audit/journalentry/").status_code == 200
    assert client.get(f"/admin/audit/journalentry/{victim.pk}/change/").status_code == 200
