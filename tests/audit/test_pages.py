"""Audit pages: the tenant's log, its exports, a run's trail, and the journal in admin.

What a reviewer sees and downloads, checked against what is stored: another tenant's
entries never appear (invariant 9), nothing but the export record is written (invariant 8),
the filters return exactly the matching entries, keyset pages neither overlap nor skip,
and the export streams instead of loading the journal into memory.
"""

from __future__ import annotations

import csv
import io
import json
import tracemalloc
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from audit.journal import run_stream, tenant_stream
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime.executor import advance_run
from runtime.lifecycle import create_run
from runtime.models import Run, Tenant
from runtime.pages.audit import PAGE_SIZE
from tests.audit.tamper import tampering
from tests.conftest import Persona

LOG = "audit-log"
CSV = "audit-export-csv"
JSONL = "audit-export-jsonl"
ADMIN = "/admin/audit/journalentry/"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


# --- helpers ----------------------------------------------------------------------------


def login(client: Client, persona: Persona) -> Client:
    client.force_login(persona.user)
    return client


def make_run(tenant: Tenant, steps: int = 2, actor: str = "user:alice") -> Run:
    run = create_run(tenant, "chain", {"steps": steps}, actor=actor)
    advance_run(run.run_id, "w1")
    return run


def fake_entries(tenant: Tenant, specs: Iterable[dict[str, Any]]) -> list[JournalEntry]:
    """Journal rows written directly, with fake hashes: the log and the exports read
    entries, they do not verify them. Each spec names fields; the rest get defaults."""
    seqs: dict[str, int] = {}
    rows = []
    for n, spec in enumerate(specs):
        stream = spec.get("stream", f"fake:{tenant.pk}")
        seqs[stream] = seqs.get(stream, 0) + 1
        rows.append(
            JournalEntry(
                stream=stream,
                seq=seqs[stream],
                tenant_id=tenant.pk,
                type=spec.get("type", "step_committed"),
                actor=spec.get("actor", "worker:w1"),
                object_ref=spec.get("object_ref", ""),
                payload=spec.get("payload", {"n": n}),
                created_at=spec.get("created_at", T0 + timedelta(seconds=n)),
                prev_hash="0" * 64,
                hash=f"{n:064x}",
            )
        )
    return JournalEntry.objects.bulk_create(rows, batch_size=2000)


def listed(client: Client, **params: str) -> list[int]:
    """Ids on the log page for these filters (one page)."""
    page = client.get(reverse(LOG), params)
    assert page.status_code == 200, page.content[:500]
    return [row.entry.pk for row in page.context["rows"]]


def every_page(client: Client, **params: str) -> list[int]:
    """Ids of every page, following the page's own "Older" links."""
    ids: list[int] = []
    url = reverse(LOG) + "?" + "&".join(f"{k}={v}" for k, v in params.items())
    for _ in range(100):
        page = client.get(url)
        assert page.status_code == 200
        ids += [row.entry.pk for row in page.context["rows"]]
        url = page.context["older_url"]
        if not url:
            return ids
    raise AssertionError("paging did not end")


def newest_first(entries: Iterable[JournalEntry]) -> list[int]:
    return sorted((e.pk for e in entries), reverse=True)


def body(response: Any) -> bytes:
    assert response.streaming
    return b"".join(response.streaming_content)


# --- access and isolation -----------------------------------------------------------------


def test_log_shows_only_own_tenants_entries(
    client: Client, reviewer_a: Persona, outsider_b: Persona
) -> None:
    mine = make_run(reviewer_a.tenant, actor="user:acme-person")
    theirs = make_run(outsider_b.tenant, actor="user:globex-person")
    page = login(client, reviewer_a).get(reverse(LOG))
    assert page.status_code == 200
    shown = {row.entry.pk for row in page.context["rows"]}
    assert shown == set(
        JournalEntry.objects.filter(tenant_id=reviewer_a.tenant.pk).values_list("pk", flat=True)
    )
    assert str(mine.run_id)[:8].encode() in page.content
    assert str(theirs.run_id)[:8].encode() not in page.content
    assert b"globex-person" not in page.content
    # Filtering by B's run or B's actor finds nothing, it does not reach across.
    assert listed(client, object=f"run:{theirs.run_id}") == []
    assert listed(client, actor="user:globex-person") == []
    # Nor does a cursor taken from B's ids.
    first_b = JournalEntry.objects.filter(tenant_id=outsider_b.tenant.pk).order_by("-id")[0]
    assert set(listed(client, before=str(first_b.pk + 1))) <= shown


def test_other_tenants_trail_is_not_found_like_a_missing_one(
    client: Client, reviewer_a: Persona, outsider_b: Persona
) -> None:
    theirs = make_run(outsider_b.tenant)
    login(client, reviewer_a)
    foreign = client.get(reverse("run-trail", args=[theirs.run_id]))
    missing = client.get(reverse("run-trail", args=[uuid.uuid4()]))
    assert foreign.status_code == missing.status_code == 404
    assert foreign.content == missing.content


def test_exports_contain_only_own_tenants_entries(
    client: Client, reviewer_a: Persona, outsider_b: Persona
) -> None:
    make_run(reviewer_a.tenant)
    theirs = make_run(outsider_b.tenant)
    login(client, reviewer_a)
    lines = body(client.get(reverse(JSONL))).decode().splitlines()
    ids = {json.loads(line)["id"] for line in lines}
    assert ids and ids <= set(
        JournalEntry.objects.filter(tenant_id=reviewer_a.tenant.pk).values_list("pk", flat=True)
    )
    assert str(theirs.run_id) not in "".join(lines)
    assert body(client.get(reverse(CSV), {"object": f"run:{theirs.run_id}"})).count(b"\n") == 1


def test_viewer_may_read_everything(client: Client, viewer_a: Persona) -> None:
    run = make_run(viewer_a.tenant)
    login(client, viewer_a)
    assert listed(client, object=f"run:{run.run_id}")
    assert client.get(reverse("run-trail", args=[run.run_id])).status_code == 200
    assert client.get(reverse(CSV)).status_code == 200
    assert client.get(reverse(JSONL)).status_code == 200


def test_agents_do_not_use_pages(client: Client, agent_a: Persona) -> None:
    run = make_run(agent_a.tenant)
    login(client, agent_a)
    for url in (reverse(LOG), reverse(CSV), reverse(JSONL), reverse("run-trail", args=[run.pk])):
        assert client.get(url).status_code == 403, url
    assert not JournalEntry.objects.filter(type="audit_exported").exists()


def test_pages_need_login(client: Client, db: None) -> None:
    for url in (reverse(LOG), reverse(CSV), reverse("run-trail", args=[uuid.uuid4()])):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_user_without_tenant_gets_a_friendly_page(client: Client, db: None) -> None:
    user = get_user_model().objects.create_user(username="nomad", password="pw-nomad")
    client.force_login(user)
    page = client.get(reverse(LOG))
    assert page.status_code == 200 and b"not a member of any active tenant" in page.content
    assert client.get(reverse(CSV)).status_code == 404
    assert client.get(reverse("run-trail", args=[uuid.uuid4()])).status_code == 404


def test_get_only(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    login(client, reviewer_a)
    for url in (reverse(LOG), reverse(CSV), reverse(JSONL), reverse("run-trail", args=[run.pk])):
        assert client.post(url).status_code == 405, url
        assert client.delete(url).status_code == 405, url
    assert not JournalEntry.objects.filter(type="audit_exported").exists()


def test_nav_links_to_the_log(client: Client, reviewer_a: Persona) -> None:
    page = login(client, reviewer_a).get(reverse(LOG))
    assert b'href="/audit/" aria-current="page">Audit</a>' in page.content


# --- filters ------------------------------------------------------------------------------


@pytest.fixture
def mixed(reviewer_a: Persona) -> dict[str, Any]:
    """Entries over five days: two actors, three types, two runs, one policy."""
    run_1, run_2 = f"run:{uuid.uuid4()}", f"run:{uuid.uuid4()}"
    specs = []
    for day in range(5):
        for i in range(6):
            specs.append(
                {
                    "created_at": T0 + timedelta(days=day, minutes=i),
                    "actor": "user:carol" if i % 3 == 0 else "worker:w1",
                    "type": ["step_committed", "lease_taken", "approval_decided"][i % 3],
                    "object_ref": [run_1, run_2, "approvalpolicy:7"][i % 2 if i < 5 else 2],
                }
            )
    made = fake_entries(reviewer_a.tenant, specs)
    return {"entries": made, "run_1": run_1, "run_2": run_2}


def test_filters_return_exactly_the_matching_entries(
    client: Client, reviewer_a: Persona, mixed: dict[str, Any]
) -> None:
    login(client, reviewer_a)  # journals a login: the log lists it like any other entry
    stored = list(JournalEntry.objects.filter(tenant_id=reviewer_a.tenant.pk))

    def expect(keep: Any) -> list[int]:
        return newest_first(e for e in stored if keep(e))

    assert listed(client) == expect(lambda e: True)
    assert listed(client, actor="user:carol") == expect(lambda e: e.actor == "user:carol")
    assert len(listed(client, actor="user:carol")) == 10
    assert listed(client, actor="user:car") == []  # exact, not a substring
    assert listed(client, type="lease_taken") == expect(lambda e: e.type == "lease_taken")
    assert listed(client, type="login") == expect(lambda e: e.type == "login") != []
    run_1 = mixed["run_1"]
    assert listed(client, object=run_1) == expect(lambda e: e.object_ref == run_1)
    # A bare run id means that run.
    assert listed(client, object=run_1.removeprefix("run:")) == listed(client, object=run_1)
    assert listed(client, object="approvalpolicy:7") == expect(
        lambda e: e.object_ref == "approvalpolicy:7"
    )
    day_1, day_3 = (T0 + timedelta(days=1)).date(), (T0 + timedelta(days=3)).date()
    # A period is whole UTC days, "to" included.
    in_period = listed(client, **{"from": str(day_1), "to": str(day_3)})
    assert in_period == expect(lambda e: day_1 <= e.created_at.date() <= day_3)
    assert len(in_period) == 18
    assert listed(client, **{"from": str(day_3)}) == expect(lambda e: e.created_at.date() >= day_3)
    assert listed(client, to=str(day_1)) == expect(lambda e: e.created_at.date() <= day_1)
    combined = listed(client, actor="user:carol", type="step_committed", to=str(day_1))
    assert combined == expect(
        lambda e: (
            e.actor == "user:carol" and e.type == "step_committed" and e.created_at.date() <= day_1
        )
    )
    assert len(combined) == 4


def test_filter_form_and_export_links_keep_the_filters(
    client: Client, reviewer_a: Persona, mixed: dict[str, Any]
) -> None:
    page = login(client, reviewer_a).get(
        reverse(LOG), {"actor": "user:alice", "from": "2026-03-02"}
    )
    assert page.context["csv_url"] == "/audit/export.csv?actor=user%3Aalice&from=2026-03-02"
    assert page.context["jsonl_url"] == "/audit/export.jsonl?actor=user%3Aalice&from=2026-03-02"
    assert b'value="user:alice"' in page.content and b'value="2026-03-02"' in page.content


def test_the_page_shows_who_what_when_and_links_runs(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant, actor="user:starter")
    page = login(client, reviewer_a).get(reverse(LOG), {"type": "run_created"})
    html = page.content.decode()
    assert [row.entry.type for row in page.context["rows"]] == ["run_created"]
    assert "user:starter" in html
    assert reverse("run", args=[run.run_id]) in html
    assert reverse("run-trail", args=[run.run_id]) in html
    assert "<details>" in html and "&quot;graph&quot;: &quot;chain&quot;" in html


@pytest.mark.parametrize(
    "params, said",
    [
        ({"actor": "user:\x00alice"}, "Actor contains control characters"),
        ({"actor": "x" * 201}, "Actor is longer than 200 characters"),
        ({"type": "t" * 65}, "Event type is longer than 64 characters"),
        ({"object": "run:not-a-uuid"}, "is not run:&lt;run id&gt;"),
        ({"from": "2026-13-01"}, "is not a date (YYYY-MM-DD)"),
        ({"to": "yesterday"}, "is not a date (YYYY-MM-DD)"),
        ({"from": "2026-03-05", "to": "2026-03-01"}, "The period starts after it ends"),
        ({"before": "abc"}, "That page position is not an entry id"),
        ({"before": "-5"}, "That page position is not an entry id"),
        ({"before": str(2**64)}, "That page position is not an entry id"),
        ({"before": "999999999", "from": "2026-03-01"}, "not an entry of this tenant"),
    ],
)
def test_bad_filters_are_a_message_not_a_500(
    client: Client, reviewer_a: Persona, mixed: dict[str, Any], params: dict[str, str], said: str
) -> None:
    page = login(client, reviewer_a).get(reverse(LOG), params)
    assert page.status_code == 400
    assert said in page.content.decode()
    assert page.context["rows"] == []


def test_bad_filters_refuse_an_export(client: Client, reviewer_a: Persona) -> None:
    login(client, reviewer_a)
    for name in (CSV, JSONL):
        response = client.get(reverse(name), {"from": "2026-02-30"})
        assert response.status_code == 400
        assert b"is not a date" in response.content
    assert not JournalEntry.objects.filter(type="audit_exported").exists()


def test_the_furthest_day_is_a_period_not_an_overflow(
    client: Client, reviewer_a: Persona, mixed: dict[str, Any]
) -> None:
    login(client, reviewer_a)
    assert len(listed(client, **{"from": "0001-01-01", "to": "9999-12-31"})) == 31  # + login


# --- keyset paging ------------------------------------------------------------------------


def test_pages_continue_exactly_where_the_last_one_ended(
    client: Client, reviewer_a: Persona
) -> None:
    login(client, reviewer_a)
    fake_entries(reviewer_a.tenant, [{} for _ in range(2 * PAGE_SIZE + 7)])
    made = JournalEntry.objects.filter(tenant_id=reviewer_a.tenant.pk)
    first = client.get(reverse(LOG))
    ids_1 = [row.entry.pk for row in first.context["rows"]]
    assert len(ids_1) == PAGE_SIZE
    assert first.context["older_url"] == f"/audit/?before={ids_1[-1]}"
    ids_2 = listed(client, before=str(ids_1[-1]))
    assert ids_2[0] == newest_first(made)[PAGE_SIZE]  # no gap
    assert not set(ids_1) & set(ids_2)  # no overlap
    assert every_page(client) == newest_first(made)


def test_period_pages_break_ties_of_equal_times(client: Client, reviewer_a: Persona) -> None:
    """Ordered by (created_at, id) for a period: many entries in the same microsecond must
    still page without overlap or gap, and out-of-order ids (concurrent appends) sort by
    time."""
    specs = [{"created_at": T0 + timedelta(seconds=n // 30)} for n in range(130)]
    specs += [{"created_at": T0 - timedelta(hours=1)} for _ in range(3)]  # later id, earlier
    login(client, reviewer_a)
    made = fake_entries(reviewer_a.tenant, specs)
    expected = [e.pk for e in sorted(made, key=lambda e: (e.created_at, e.pk), reverse=True)]
    assert every_page(client, **{"from": "2026-03-01", "to": "2026-03-01"}) == expected
    assert every_page(client, **{"to": "2026-03-01", "actor": "worker:w1"}) == expected


def test_a_page_costs_the_same_queries_for_10_or_200_entries(
    client: Client, reviewer_a: Persona
) -> None:
    login(client, reviewer_a)

    def queries_for(total: int, **params: str) -> int:
        have = JournalEntry.objects.filter(tenant_id=reviewer_a.tenant.pk).count()
        fake_entries(reviewer_a.tenant, [{"stream": f"fake:{total}"} for _ in range(total - have)])
        with CaptureQueriesContext(connection) as captured:
            page = client.get(reverse(LOG), params)
        assert page.status_code == 200 and len(page.context["rows"]) == min(total, PAGE_SIZE)
        return len(captured)

    assert queries_for(10) == queries_for(200)
    assert queries_for(200, actor="worker:w1", type="step_committed") == queries_for(200)
    newest = JournalEntry.objects.order_by("-id")[0].pk
    with_period = queries_for(200, **{"from": "2026-03-01", "before": str(newest)})
    assert with_period == queries_for(200) + 1  # the cursor entry's time


# --- exports ------------------------------------------------------------------------------


def test_csv_export_of_a_filter(client: Client, reviewer_a: Persona, mixed: dict[str, Any]) -> None:
    response = login(client, reviewer_a).get(reverse(CSV), {"actor": "user:carol"})
    assert response.status_code == 200
    assert response.streaming is True
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    disposition = response["Content-Disposition"]
    assert disposition.startswith('attachment; filename="holdpoint-audit-acme-')
    assert disposition.endswith('.csv"')
    rows = list(csv.DictReader(io.StringIO(body(response).decode())))
    expected = sorted(e.pk for e in mixed["entries"] if e.actor == "user:carol")
    assert [int(r["id"]) for r in rows] == expected  # oldest first
    first = JournalEntry.objects.get(pk=expected[0])
    assert rows[0] == {
        "id": str(first.pk),
        "stream": first.stream,
        "seq": str(first.seq),
        "created_at": first.created_at.isoformat(),
        "type": first.type,
        "actor": "user:carol",
        "object_ref": first.object_ref,
        "payload": json.dumps(first.payload, separators=(",", ":")),
        "redacted": "false",
        "prev_hash": first.prev_hash,
        "hash": first.hash,
    }


def test_csv_cells_that_a_spreadsheet_would_run_are_quoted(
    client: Client, reviewer_a: Persona
) -> None:
    evil = ['=HYPERLINK("https://evil.example","x")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "ok"]
    fake_entries(
        reviewer_a.tenant,
        [{"actor": a, "object_ref": a, "payload": {"note": a}} for a in evil] + [{"payload": -1}],
    )
    response = login(client, reviewer_a).get(reverse(CSV))
    rows = list(csv.DictReader(io.StringIO(body(response).decode())))
    rows = [r for r in rows if r["stream"].startswith("fake:")]
    actors = [r["actor"] for r in rows[:-1]]
    assert actors == ["'" + a for a in evil[:-1]] + ["ok"]
    assert [r["object_ref"] for r in rows[:-1]] == actors
    assert rows[0]["payload"].startswith('{"note":')  # JSON starting with { is harmless
    assert rows[-1]["payload"] == "'-1"


def test_jsonl_export_is_one_object_per_line(
    client: Client, reviewer_a: Persona, mixed: dict[str, Any]
) -> None:
    run_1 = mixed["run_1"]
    response = login(client, reviewer_a).get(reverse(JSONL), {"object": run_1})
    assert response.streaming is True
    assert response["Content-Type"] == "application/jsonl; charset=utf-8"
    assert response["Content-Disposition"].endswith('.jsonl"')
    text = body(response).decode()
    assert text.endswith("\n")
    objects = [json.loads(line) for line in text.splitlines()]
    expected = sorted((e for e in mixed["entries"] if e.object_ref == run_1), key=lambda e: e.pk)
    assert [o["id"] for o in objects] == [e.pk for e in expected]
    assert objects[0] == {
        "id": expected[0].pk,
        "stream": expected[0].stream,
        "seq": expected[0].seq,
        "created_at": expected[0].created_at.isoformat(),
        "type": expected[0].type,
        "actor": expected[0].actor,
        "object_ref": run_1,
        "payload": expected[0].payload,
        "redacted": False,
        "prev_hash": expected[0].prev_hash,
        "hash": expected[0].hash,
    }


def test_an_export_is_journaled_in_the_tenants_stream_before_it_streams(
    client: Client, viewer_a: Persona
) -> None:
    make_run(viewer_a.tenant)
    login(client, viewer_a)
    response = client.get(reverse(CSV), {"type": "run_created", "from": "2020-01-01"})
    # Recorded already, before a single byte was read.
    recorded = JournalEntry.objects.get(type="audit_exported")
    assert recorded.stream == tenant_stream(viewer_a.tenant.pk)
    assert recorded.tenant_id == viewer_a.tenant.pk
    assert recorded.actor == "user:victor"
    assert recorded.payload == {
        "filters": {"type": "run_created", "from": "2020-01-01"},
        "format": "csv",
    }
    body(response)
    client.get(reverse(JSONL))
    exports = JournalEntry.objects.filter(type="audit_exported").order_by("seq")
    assert [e.payload["format"] for e in exports] == ["csv", "jsonl"]
    assert verify_stream(tenant_stream(viewer_a.tenant.pk)) is None
    # The second export lists the first one: an export's record is part of the log.
    assert listed(client, type="audit_exported") == newest_first(exports)


@pytest.mark.slow
def test_exporting_100k_entries_keeps_memory_flat(client: Client, reviewer_a: Persona) -> None:
    total = 100_000
    fake_entries(
        reviewer_a.tenant,
        (
            {"payload": {"step": f"step-{n}", "note": "x" * 120}, "object_ref": f"run:{n}"}
            for n in range(total)
        ),
    )
    login(client, reviewer_a)
    for name in (CSV, JSONL):
        tracemalloc.start()
        try:
            response = client.get(reverse(name))
            assert response.streaming
            # The fakes, the login and the exports' own records (written before streaming).
            expected = JournalEntry.objects.filter(tenant_id=reviewer_a.tenant.pk).count()
            lines = size = chunks = 0
            for chunk in response.streaming_content:
                lines, size, chunks = lines + chunk.count(b"\n"), size + len(chunk), chunks + 1
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert expected > total
        assert lines == expected + (1 if name == CSV else 0)
        assert size > 30_000_000  # the whole file would not fit under the limit below
        assert chunks > 100  # streamed in pieces, not one
        print(f"{name}: {size:,} bytes in {chunks} chunks, peak {peak:,} bytes traced")
        assert peak < 20_000_000, f"{name}: peak {peak:,} bytes traced"


# --- a run's trail --------------------------------------------------------------------------


def test_trail_tells_the_whole_story_in_order_and_verified(
    client: Client, viewer_a: Persona
) -> None:
    run = make_run(viewer_a.tenant, steps=3)
    stored = list(JournalEntry.objects.filter(stream=run_stream(run.run_id)).order_by("seq"))
    page = login(client, viewer_a).get(reverse("run-trail", args=[run.run_id]))
    assert page.status_code == 200
    trail = page.context["trail"]
    assert [row.entry.pk for row in trail.rows] == [e.pk for e in stored]
    assert [row.verdict for row in trail.rows] == ["verified"] * len(stored)
    assert trail.chain_break is None and trail.total == len(stored)
    html = page.content.decode()
    assert f"chain verified · {len(stored)} entries" in html
    assert html.count('<span class="badge verified">verified</span>') == len(stored)
    for entry in stored:
        assert f'title="{entry.hash}">{entry.hash[:12]}</code>' in html
    positions = [html.index(f'id="seq-{e.seq}"') for e in stored]
    assert positions == sorted(positions)
    assert "run_created" in html and "user:alice" in html
    assert b'aria-current="location">Audit</a>' in page.content


def test_trail_shows_where_the_chain_breaks(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant, steps=3)
    entry = JournalEntry.objects.get(stream=run_stream(run.run_id), seq=3)
    original = entry.actor
    with tampering() as cursor:
        cursor.execute(
            "UPDATE audit_journalentry SET actor = %s WHERE id = %s", ["mallory", entry.pk]
        )
    try:
        page = login(client, reviewer_a).get(reverse("run-trail", args=[run.run_id]))
        trail = page.context["trail"]
        verdicts = [(row.entry.seq, row.verdict) for row in trail.rows]
        assert verdicts[:4] == [
            (1, "verified"),
            (2, "verified"),
            (3, "broken"),
            (4, "after a break"),
        ]
        assert {v for _, v in verdicts[4:]} == {"after a break"}
        assert trail.chain_break.seq == 3
        html = page.content.decode()
        assert "chain broken at seq 3" in html
        assert "broken: entry content does not match its hash" in html
        assert "chain verified" not in html
    finally:
        with tampering() as cursor:
            cursor.execute(
                "UPDATE audit_journalentry SET actor = %s WHERE id = %s", [original, entry.pk]
            )


def test_trail_notices_entries_cut_off_at_the_end(client: Client, reviewer_a: Persona) -> None:
    run = make_run(reviewer_a.tenant)
    last = JournalEntry.objects.filter(stream=run_stream(run.run_id)).order_by("-seq")[0]
    kept = {f.attname: getattr(last, f.attname) for f in JournalEntry._meta.concrete_fields}
    with tampering() as cursor:
        cursor.execute("DELETE FROM audit_journalentry WHERE id = %s", [last.pk])
    try:
        page = login(client, reviewer_a).get(reverse("run-trail", args=[run.run_id]))
        assert page.context["trail"].chain_break.seq == last.seq
        assert "entries missing after the last one" in page.content.decode()
        assert {row.verdict for row in page.context["trail"].rows} == {"verified"}
    finally:
        JournalEntry.objects.bulk_create([JournalEntry(**kept)])


def test_trail_pages_a_long_story(
    client: Client, reviewer_a: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("runtime.pages.audit.TRAIL_PAGE", 3)
    run = make_run(reviewer_a.tenant, steps=4)
    total = JournalEntry.objects.filter(stream=run_stream(run.run_id)).count()
    login(client, reviewer_a)
    first = client.get(reverse("run-trail", args=[run.run_id]))
    assert [row.entry.seq for row in first.context["trail"].rows] == [1, 2, 3]
    assert first.context["later_url"].endswith("?after=3")
    second = client.get(first.context["later_url"])
    assert [row.entry.seq for row in second.context["trail"].rows] == [4, 5, 6]
    assert second.context["trail"].total == total
    assert b"chain verified" in second.content


def test_trail_costs_the_same_queries_however_long(client: Client, reviewer_a: Persona) -> None:
    short, long = make_run(reviewer_a.tenant, steps=1), make_run(reviewer_a.tenant, steps=12)
    login(client, reviewer_a)

    def queries(run: Run) -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get(reverse("run-trail", args=[run.run_id])).status_code == 200
        return len(captured)

    assert queries(short) == queries(long)


# --- the journal in admin -------------------------------------------------------------------


@pytest.fixture
def journal_viewer(admin_a: Persona) -> Persona:
    """Tenant A's admin with the view permission on the journal.

    Granted here explicitly: the tenant admin group of seed_demo may or may not carry it."""
    admin_a.user.user_permissions.add(
        Permission.objects.get(content_type__app_label="audit", codename="view_journalentry")
    )
    return admin_a


def test_tenant_admin_sees_only_own_tenants_journal(
    client: Client, journal_viewer: Persona, outsider_b: Persona
) -> None:
    mine = make_run(journal_viewer.tenant)
    theirs = make_run(outsider_b.tenant)
    login(client, journal_viewer)
    page = client.get(ADMIN)
    assert page.status_code == 200
    shown = {e.pk for e in page.context["cl"].result_list}
    assert shown == set(
        JournalEntry.objects.filter(tenant_id=journal_viewer.tenant.pk).values_list("pk", flat=True)
    )
    assert run_stream(mine.run_id).encode() in page.content
    assert run_stream(theirs.run_id).encode() not in page.content
    foreign = JournalEntry.objects.filter(tenant_id=outsider_b.tenant.pk).first()
    assert foreign is not None
    response = client.get(f"{ADMIN}{foreign.pk}/change/")
    assert response.status_code == 302 and response["Location"] == "/admin/"
    # Searching for B's stream finds nothing either.
    found = client.get(ADMIN, {"q": run_stream(theirs.run_id)})
    assert list(found.context["cl"].result_list) == []


def test_admin_journal_is_read_only(client: Client, journal_viewer: Persona) -> None:
    run = make_run(journal_viewer.tenant)
    entry = JournalEntry.objects.filter(tenant_id=journal_viewer.tenant.pk).first()
    assert entry is not None
    login(client, journal_viewer)
    before = list(JournalEntry.objects.values_list("pk", "actor", "hash"))
    assert client.get(f"{ADMIN}add/").status_code == 403
    assert client.get(f"{ADMIN}{entry.pk}/delete/").status_code == 403
    view = client.get(f"{ADMIN}{entry.pk}/change/")
    assert view.status_code == 200
    assert b'name="_save"' not in view.content and entry.hash.encode() in view.content
    assert client.post(f"{ADMIN}{entry.pk}/change/", {"actor": "mallory"}).status_code == 403
    changelist = client.get(ADMIN)
    assert b'name="action"' not in changelist.content  # no bulk actions at all
    client.post(ADMIN, {"action": "delete_selected", "_selected_action": [entry.pk], "index": 0})
    assert list(JournalEntry.objects.values_list("pk", "actor", "hash")) == before
    assert verify_stream(run_stream(run.run_id)) is None


def test_admin_changelist_filters_and_searches_exactly(
    client: Client, journal_viewer: Persona
) -> None:
    run = make_run(journal_viewer.tenant, actor="user:starter")
    login(client, journal_viewer)

    def shown(**params: str) -> set[int]:
        page = client.get(ADMIN, params)
        assert page.status_code == 200
        return {e.pk for e in page.context["cl"].result_list}

    created = JournalEntry.objects.get(stream=run_stream(run.run_id), seq=1)
    assert shown(type="run_created") == {created.pk}
    assert shown(q="user:starter") == {created.pk}
    assert shown(q="user:start") == set()  # exact, not a substring scan
    everything = set(
        JournalEntry.objects.filter(stream=run_stream(run.run_id)).values_list("pk", flat=True)
    )
    assert shown(q=run_stream(run.run_id)) == everything


def test_admin_changelist_never_counts_or_sorts_the_whole_journal(
    client: Client, journal_viewer: Persona, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("runtime.admin.COUNT_CAP", 5)
    monkeypatch.setattr("runtime.admin.JournalEntryAdmin.list_per_page", 3)
    make_run(journal_viewer.tenant, steps=3)
    login(client, journal_viewer)
    newest_first_ids = newest_first(JournalEntry.objects.filter(tenant_id=journal_viewer.tenant.pk))
    assert len(newest_first_ids) > 5
    with CaptureQueriesContext(connection) as captured:
        page = client.get(ADMIN, {"o": "1"})  # a hand-made "sort by seq" link
    cl = page.context["cl"]
    assert cl.result_count == 5 and not cl.show_full_result_count
    assert [e.pk for e in cl.result_list] == newest_first_ids[:3]
    counts = [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT 5" in sql.upper() for sql in counts), counts
    assert b"sortable" not in page.content


def test_superuser_sees_every_tenants_journal(
    client: Client, reviewer_a: Persona, outsider_b: Persona
) -> None:
    make_run(reviewer_a.tenant)
    make_run(outsider_b.tenant)
    root = get_user_model().objects.create_superuser("root", password="pw-root")
    client.force_login(root)
    page = client.get(ADMIN)
    assert page.status_code == 200
    assert {e.tenant_id for e in page.context["cl"].result_list} == {
        reviewer_a.tenant.pk,
        outsider_b.tenant.pk,
    }
    assert client.get(f"{ADMIN}add/").status_code == 403
